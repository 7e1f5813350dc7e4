"""Model catalog against published parameter counts; loading HF config.json files."""

import json

import pytest

from hfplan.errors import HfplanError
from hfplan.profiles.models import CATALOG, DEMO_MODELS, ModelArch, arch_from_hf_config, resolve_model

# Parameter counts as published for each checkpoint (model cards / safetensors metadata on the HF hub).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-34b": 33_743_970_304,  # CodeLlama-34b
    "llama2-70b": 68_976_648_192,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
}

# The published config.json of meta-llama/Llama-2-7b-hf (fields hfplan reads, plus a few it ignores).
LLAMA2_7B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-05,
    "torch_dtype": "float16",
}

# Qwen/Qwen2.5-0.5B: tied embeddings; q/k/v biases implied by the architecture (no attention_bias key).
QWEN25_05B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}

# mistralai/Mistral-7B-v0.1: published 7,241,732,096 parameters.
MISTRAL_7B_CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED_PARAMS.items()))
def test_catalog_parameter_counts_match_published(name, published):
    assert CATALOG[name].params() == published


def test_catalog_holds_exactly_the_published_models_and_the_demo_models():
    assert set(CATALOG) == set(PUBLISHED_PARAMS) | set(DEMO_MODELS)


def test_small_arch_params_by_hand(small_arch):
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert per_layer == 36992
    assert small_arch.params_per_layer == per_layer
    assert small_arch.params() == 2 * per_layer + 260 * 64 + 64 + 260 * 64
    # A critic / reward model: the LM head becomes a hidden -> 1 projection with a bias.
    assert small_arch.params("scalar") == 2 * per_layer + 260 * 64 + 64 + 64 + 1


def test_scalar_head_of_untied_and_tied_models():
    # Untied: the 32000 x 4096 LM head is replaced by 4096 weights + 1 bias.
    assert CATALOG["llama2-7b"].params("scalar") == 6_738_415_616 - 32000 * 4096 + 4096 + 1
    # Tied: the LM head shares the embedding, so the scalar head only adds.
    assert CATALOG["qwen2.5-0.5b"].params("scalar") == 494_032_768 + 896 + 1


def test_unknown_head_kind_is_refused():
    with pytest.raises(ValueError, match="head"):
        CATALOG["tiny"].params("classifier")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3.1-8b", 2 * 32 * 8 * 128 * 2),  # K and V, 32 layers, 8 KV heads of 128, bf16
        ("llama2-7b", 2 * 32 * 32 * 128 * 2),  # MHA: 32 KV heads
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),  # 3584 / 28 = 128 per head, 4 KV heads
        ("llama2-70b", 2 * 80 * 8 * 128 * 2),
    ],
)
def test_kv_bytes_per_token_by_hand(name, expected):
    assert CATALOG[name].kv_bytes_per_token() == expected


def test_kv_bytes_per_token_llama31_8b_is_128_kib():
    assert CATALOG["llama3.1-8b"].kv_bytes_per_token() == 131072
    assert CATALOG["llama3.1-8b"].kv_bytes_per_token(bytes_per_value=4) == 2 * 131072


def test_explicit_head_dim_overrides_hidden_over_heads():
    # Mistral-Nemo style: hidden 5120, 32 heads of 128 (not 5120 / 32 = 160).
    arch = ModelArch("nemo-like", layers=1, hidden=5120, heads=32, kv_heads=8, ffn=100, vocab=10, head_dim=128)
    assert arch.q_dim == 4096
    assert arch.kv_dim == 1024
    assert arch.params_per_layer == 5120 * 4096 + 2 * 5120 * 1024 + 4096 * 5120 + 3 * 5120 * 100 + 2 * 5120


@pytest.mark.parametrize(
    ("sizes", "needle"),
    [
        ({"heads": 6, "kv_heads": 4}, "kv_heads"),
        ({"hidden": 60, "heads": 8, "kv_heads": 8}, "hidden"),
        ({"layers": 0}, "positive"),
        ({"vocab": -1}, "positive"),
    ],
)
def test_inconsistent_architecture_is_refused(sizes, needle):
    base = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=260)
    with pytest.raises(HfplanError, match=needle):
        ModelArch("bad", **(base | sizes))


def _write(path, data) -> str:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_load_config_json_file(tmp_path):
    ref = _write(tmp_path / "config.json", LLAMA2_7B_CONFIG)
    arch = resolve_model(ref)
    assert arch.name == ref
    assert (arch.layers, arch.hidden, arch.heads, arch.kv_heads, arch.ffn, arch.vocab) == (
        32, 4096, 32, 32, 11008, 32000)
    assert arch.params() == 6_738_415_616


def test_load_config_from_folder(tmp_path):
    _write(tmp_path / "config.json", LLAMA2_7B_CONFIG)
    assert resolve_model(str(tmp_path)).params() == 6_738_415_616


def test_load_config_under_another_file_name(tmp_path):
    ref = _write(tmp_path / "qwen.json", QWEN25_05B_CONFIG)
    arch = resolve_model(ref)
    assert arch.tied_embeddings and arch.attention_bias
    assert arch.params() == 494_032_768


def test_mistral_config_loads_with_published_count(tmp_path):
    assert resolve_model(_write(tmp_path / "config.json", MISTRAL_7B_CONFIG)).params() == 7_241_732_096


def test_missing_kv_heads_means_multi_head_attention():
    config = {k: v for k, v in LLAMA2_7B_CONFIG.items() if k != "num_key_value_heads"}
    assert arch_from_hf_config(config, "x").kv_heads == 32


def test_explicit_attention_bias_flag_is_read():
    arch = arch_from_hf_config(LLAMA2_7B_CONFIG | {"attention_bias": True}, "x")
    # q, k and v biases: 4096 + 2 * 4096 more per layer.
    assert arch.params() == 6_738_415_616 + 32 * 3 * 4096


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (LLAMA2_7B_CONFIG | {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "MixtralForCausalLM"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 12, "n_embd": 768},
         "GPT2LMHeadModel"),
        ({"model_type": "gpt2", "n_layer": 12}, "gpt2"),
        (LLAMA2_7B_CONFIG | {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60}, "Qwen2MoeForCausalLM"),
    ],
)
def test_unsupported_architecture_is_named(tmp_path, config, needle):
    ref = _write(tmp_path / "config.json", config)
    with pytest.raises(HfplanError, match="unsupported architecture") as caught:
        resolve_model(ref)
    assert needle in str(caught.value)


@pytest.mark.parametrize(
    "config",
    [
        MISTRAL_7B_CONFIG | {"num_local_experts": 8, "num_experts_per_tok": 2},
        QWEN25_05B_CONFIG | {"num_experts": 60},
    ],
)
def test_mixture_of_experts_is_refused(tmp_path, config):
    ref = _write(tmp_path / "config.json", config)
    with pytest.raises(HfplanError, match="mixture-of-experts"):
        resolve_model(ref)


def test_malformed_json_is_an_hfplan_error(tmp_path):
    ref = _write(tmp_path / "config.json", '{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(HfplanError, match="not valid JSON"):
        resolve_model(ref)


def test_json_that_is_not_an_object(tmp_path):
    ref = _write(tmp_path / "config.json", "[1, 2, 3]")
    with pytest.raises(HfplanError, match="JSON object"):
        resolve_model(ref)


def test_missing_field_is_named(tmp_path):
    config = {k: v for k, v in LLAMA2_7B_CONFIG.items() if k != "num_hidden_layers"}
    with pytest.raises(HfplanError, match="num_hidden_layers"):
        resolve_model(_write(tmp_path / "config.json", config))


def test_malformed_size(tmp_path):
    with pytest.raises(HfplanError, match="malformed"):
        resolve_model(_write(tmp_path / "config.json", LLAMA2_7B_CONFIG | {"hidden_size": "big"}))


def test_missing_config_file(tmp_path):
    with pytest.raises(HfplanError, match="not found"):
        resolve_model(str(tmp_path / "absent.json"))
    with pytest.raises(HfplanError, match="not found"):
        resolve_model(str(tmp_path))  # a folder without config.json


def test_catalog_name_resolves_to_catalog_entry():
    assert resolve_model("llama3.1-8b") is CATALOG["llama3.1-8b"]


def test_unknown_catalog_name_lists_known_names():
    with pytest.raises(HfplanError, match="unknown model 'llama9-1t'") as caught:
        resolve_model("llama9-1t")
    for name in CATALOG:
        assert name in str(caught.value)


# The published max_position_embeddings of each catalog model's config.json.
PUBLISHED_CONTEXT = {"llama2-7b": 4096, "llama2-13b": 4096, "llama2-34b": 16384, "llama2-70b": 4096,
                     "llama3.1-8b": 131072, "llama3.1-70b": 131072, "qwen2.5-0.5b": 32768, "qwen2.5-1.5b": 131072,
                     "qwen2.5-7b": 131072, "qwen2.5-14b": 131072, "qwen2.5-32b": 131072, "qwen2.5-72b": 131072}


def test_every_catalog_model_has_its_context_length():
    assert {name: CATALOG[name].context_len for name in PUBLISHED_CONTEXT} == PUBLISHED_CONTEXT
    for name in DEMO_MODELS:
        assert CATALOG[name].context_len is not None


def test_config_json_context_length_is_read():
    assert arch_from_hf_config(LLAMA2_7B_CONFIG | {"max_position_embeddings": 4096}, "x").context_len == 4096
    assert arch_from_hf_config(LLAMA2_7B_CONFIG, "x").context_len is None  # not given: unknown, not checked
    with pytest.raises(HfplanError, match="malformed size"):
        arch_from_hf_config(LLAMA2_7B_CONFIG | {"max_position_embeddings": "long"}, "x")
    with pytest.raises(HfplanError, match="context length"):
        arch_from_hf_config(LLAMA2_7B_CONFIG | {"max_position_embeddings": -1}, "x")


def test_a_gelu_mlp_and_partial_rotary_by_hand(small_arch):
    from dataclasses import replace

    gelu = replace(small_arch, mlp="gelu", rotary_dim=4)
    # attention 12288 + up and down 2 * 64 * 128 + two norms 128 (small_arch's by-hand count, one MLP matrix less)
    assert gelu.params_per_layer == 12288 + 2 * 64 * 128 + 128
    assert gelu.mlp_matrices == 2 and small_arch.mlp_matrices == 3
    assert gelu.rotary_share == 4 / 16 and small_arch.rotary_share == 1.0
    assert replace(small_arch, rotary_dim=0).rotary_share == 0.0


@pytest.mark.parametrize(("field", "value"), [("mlp", "relu2"), ("rotary_dim", 17), ("rotary_dim", -1)])
def test_unknown_mlp_or_rotary_beyond_the_head_is_refused(small_arch, field, value):
    from dataclasses import replace

    with pytest.raises(HfplanError):
        replace(small_arch, **{field: value})
