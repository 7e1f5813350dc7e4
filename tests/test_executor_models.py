"""The executor's tokenizers made in code, built-in prompt sets, and HF models of model references."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoTokenizer  # noqa: E402

from hfplan.dataflow.rewards import arith_exact  # noqa: E402
from hfplan.errors import HfplanError  # noqa: E402
from hfplan.executor import models, sequences  # noqa: E402
from hfplan.executor.codec import build_codec  # noqa: E402
from hfplan.executor.models import build_model, model_config_for  # noqa: E402
from hfplan.executor.prompts import builtin_prompts  # noqa: E402
from hfplan.executor.tokenizers import build_tokenizer  # noqa: E402
from hfplan.profiles.models import CATALOG, DEMO_MODELS, LARGER_DEMO_MODELS  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)


def write_config(tmp_path, architecture: str, model_type: str, **extra) -> str:
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"architectures": [architecture], "model_type": model_type, **SMALL, **extra}))
    return str(path)


# ---- tokenizers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("ref", list(DEMO_MODELS))
def test_demo_tokenizers_have_the_catalog_vocabulary_and_all_specials(ref):
    tok = build_tokenizer(ref)
    assert len(tok) == CATALOG[ref].vocab
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}
    assert None not in ids and len(ids) == 4
    assert max(tok.get_vocab().values()) == len(tok) - 1


@pytest.mark.parametrize("ref", list(DEMO_MODELS))
def test_encoding_text_never_yields_the_pad_id(ref):
    tok = build_tokenizer(ref)
    texts = ["<pad>", "add 3 <pad> 5 =", f"{tok.pad_token} {tok.eos_token}", "héllo wörld ✓", "", "sub 40 41 ="]
    for ids in tok(texts)["input_ids"]:
        assert tok.pad_token_id not in ids


def test_each_demo_model_takes_the_tokenizer_and_prompts_of_its_vocabulary():
    """The larger demo models read what their tiny counterparts do: `small` the phrases in bytes, `small-arith`
    the arithmetic in words."""
    assert LARGER_DEMO_MODELS == {"tiny": "small", "tiny-arith": "small-arith"}
    for tiny, ref in LARGER_DEMO_MODELS.items():
        assert DEMO_MODELS[ref] == DEMO_MODELS[tiny]
        assert build_tokenizer(ref).get_vocab() == build_tokenizer(tiny).get_vocab()
        assert builtin_prompts(ref) == builtin_prompts(tiny)
    assert builtin_prompts("llama2-7b") is None


def test_a_catalog_model_is_built_with_another_layer_count_for_the_profiler(tmp_path):
    """build_model(layers=N): the catalog model's config with N decoder layers (every per-layer list of the config
    that long, as a Qwen2 config's layer types); a model given as a file or folder is refused."""
    deeper = build_model("tiny", "lm", seed=0, layers=4)
    assert deeper.config.num_hidden_layers == len(deeper.model.layers) == 4
    qwen = model_config_for("qwen2.5-0.5b", 3)
    assert qwen.num_hidden_layers == 3 and len(qwen.layer_types) == 3
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL}))
    with pytest.raises(HfplanError, match="only a catalog model"):
        model_config_for(str(config), 4)


def test_byte_tokenizer_round_trips_any_text_byte_by_byte():
    tok = build_tokenizer("tiny")
    text = "Hello, wörld! 3+5=8 ✓"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_arith_tokenizer_splits_words_and_knows_every_prompt_word():
    tok = build_tokenizer("tiny-arith")
    ids = tok("add  3 35 =")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "add", "3", "35", "="]
    assert tok("add 41 x")["input_ids"][2:] == [tok.unk_token_id, tok.unk_token_id]
    for prompt in builtin_prompts("tiny-arith"):
        assert tok.unk_token_id not in tok(prompt)["input_ids"], prompt


def test_catalog_models_use_the_byte_tokenizer_and_too_small_vocabularies_are_refused(tmp_path):
    assert len(build_tokenizer("llama2-7b")) == 260
    path = write_config(tmp_path, "LlamaForCausalLM", "llama", vocab_size=100)
    with pytest.raises(HfplanError, match="vocabulary of 100"):
        build_tokenizer(path)


def test_a_saved_tokenizer_folder_is_loaded_as_the_checkpoint_tokenizer(tmp_path):
    made = build_tokenizer("tiny-arith")
    made.save_pretrained(tmp_path)
    loaded = build_tokenizer(str(tmp_path))
    assert type(loaded).__name__ == type(made).__name__
    text = "sub 7 <pad> 2 ="
    assert loaded(text)["input_ids"] == made(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id) == (made.pad_token_id, made.eos_token_id)
    assert AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)(text)["input_ids"] == loaded(text)[
        "input_ids"]


def test_a_checkpoint_tokenizer_without_pad_pads_with_an_existing_token(tmp_path):
    from transformers import PreTrainedTokenizerFast

    backend = build_tokenizer("tiny").backend_tokenizer
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>").save_pretrained(tmp_path)
    loaded = build_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id == backend.token_to_id("<eos>")  # no unk either: eos
    assert len(loaded) == 260 and loaded.padding_side == "left"


def test_encode_left_pads_and_keeps_the_last_tokens():
    tok, codec = build_tokenizer("tiny-arith"), build_codec("tiny-arith")
    word = tok.convert_tokens_to_ids
    pad, bos = tok.pad_token_id, tok.bos_token_id
    out = codec.encode(["add 3 5 =", "="], prompt_len=7)  # as wide as the longest prompt, within prompt_len
    assert out.dtype == np.int64 and out.shape == (2, 5)
    assert out[0].tolist() == [bos, word("add"), word("3"), word("5"), word("=")]
    assert out[1].tolist() == [pad, pad, pad, bos, word("=")]
    short = codec.encode(["add 3 5 =", "="], prompt_len=3)
    assert short.shape == (2, 3) and short[1].tolist() == [pad, bos, word("=")]
    assert short[0].tolist() == [word("3"), word("5"), word("=")]
    with pytest.raises(HfplanError, match="prompt length must be positive"):
        codec.encode(["add 3 5 ="], prompt_len=0)


def test_decode_responses_reads_only_masked_tokens_and_skips_specials():
    tok, codec = build_tokenizer("tiny-arith"), build_codec("tiny-arith")
    word = tok.convert_tokens_to_ids
    responses = np.array([[word("8"), tok.eos_token_id, tok.pad_token_id],
                          [word("1"), word("2"), word("3")]])
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert codec.decode_responses(responses, mask) == ["8", "1 2"]


TEXTS = ["add 3 5 =", "sub 40 41 =", "<pad> <bos> <eos> <unk>", "add <pad>3 =", "", "  ", "héllo wörld ✓",
         "Hello, world! 3+5=8", "a , b . c ' d n't", "\x00\x7f tabs\tand\nlines"]


@pytest.mark.parametrize("ref", list(DEMO_MODELS))
def test_the_controllers_codec_encodes_and_decodes_as_the_transformers_tokenizer(ref):
    """The controller encodes with the bare backend, the workers and exported folders use the transformers
    object: the two must agree on every text, special-token look-alikes and random ids included."""
    tok, codec = build_tokenizer(ref), build_codec(ref)
    assert codec.encode_batch(TEXTS) == tok(TEXTS, add_special_tokens=True)["input_ids"]
    assert codec.pad_id == tok.pad_token_id
    rows = np.random.default_rng(0).integers(0, len(tok), size=(64, 12)).tolist()
    rows += [[tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id]]
    assert codec.decode_batch(rows) == tok.batch_decode(rows, skip_special_tokens=True)


def test_a_checkpoint_folders_codec_reads_its_own_tokenizer(tmp_path):
    made = build_tokenizer("tiny-arith")
    made.save_pretrained(tmp_path)
    codec = build_codec(str(tmp_path))
    assert codec.encode_batch(TEXTS) == made(TEXTS)["input_ids"]
    assert codec.decode(codec.encode(["add 3 5 ="], prompt_len=6)) == ["add 3 5 ="]


def test_arith_prompts_are_every_allowed_sum_and_difference_once_in_a_fixed_order():
    prompts = builtin_prompts("tiny-arith")
    assert prompts == builtin_prompts("tiny-arith")
    assert len(prompts) == len(set(prompts))
    # By hand: pairs with a + b <= 40 number 41 + 40 + ... + 1 = 861, and so do pairs with a >= b.
    assert sum(p.startswith("add ") for p in prompts) == 861
    assert sum(p.startswith("sub ") for p in prompts) == 861
    for prompt in prompts:
        op, a, b, eq = prompt.split()
        a, b = int(a), int(b)
        assert eq == "=" and 0 <= a <= 40 and 0 <= b <= 40
        answer = a + b if op == "add" else a - b
        assert 0 <= answer <= 40  # every answer is a word of the vocabulary
        assert arith_exact(prompt, f"{answer}") == 1.0


def test_tiny_prompts_are_a_few_dozen_distinct_phrases_that_fit_the_demo_prompt_length():
    prompts = builtin_prompts("tiny")
    assert prompts == builtin_prompts("tiny")
    assert 24 <= len(prompts) == len(set(prompts))
    tok = build_tokenizer("tiny")
    assert max(len(ids) for ids in tok(prompts)["input_ids"]) <= 16  # the demo workload's prompt_len
    assert builtin_prompts("llama2-7b") is None


# ---- models -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ref", list(DEMO_MODELS))
def test_catalog_models_have_the_catalog_parameter_counts(ref):
    arch = CATALOG[ref]
    lm = build_model(ref, "lm", seed=0)
    scalar = build_model(ref, "scalar", seed=0)
    assert type(lm).__name__ == "LlamaForCausalLM"
    assert type(scalar).__name__ == "LlamaForTokenClassification"
    assert sum(p.numel() for p in lm.parameters()) == arch.params("lm")
    assert sum(p.numel() for p in scalar.parameters()) == arch.params("scalar")
    assert lm.config.vocab_size == len(build_tokenizer(ref))
    assert lm.config.use_cache is False and lm.config._attn_implementation == models.ATTENTION


def test_attention_bias_catalog_arch_becomes_qwen2():
    config = model_config_for("qwen2.5-0.5b")
    assert config.model_type == "qwen2" and config.tie_word_embeddings


def test_same_seed_same_weights_and_the_scalar_backbone_is_the_lm_backbone():
    actor = build_model("tiny", "lm", seed=7).state_dict()
    reference = build_model("tiny", "lm", seed=7).state_dict()
    other = build_model("tiny", "lm", seed=8).state_dict()
    critic = build_model("tiny", "scalar", seed=7).state_dict()
    assert actor.keys() == reference.keys()
    assert all(torch.equal(actor[k], reference[k]) for k in actor)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(actor[q], other[q])
    backbone = [k for k in critic if k.startswith("model.")]
    assert len(backbone) == len([k for k in actor if k.startswith("model.")])
    assert all(torch.equal(critic[k], actor[k]) for k in backbone)
    assert critic["score.weight"].shape == (1, CATALOG["tiny"].hidden)


def test_building_a_model_leaves_the_global_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny", "lm", seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(("architecture", "model_type", "lm_class"), [
    ("LlamaForCausalLM", "llama", "LlamaForCausalLM"),
    ("Qwen2ForCausalLM", "qwen2", "Qwen2ForCausalLM"),
    ("MistralForCausalLM", "mistral", "MistralForCausalLM"),
])
def test_config_json_files_build_their_own_architecture(tmp_path, architecture, model_type, lm_class):
    path = write_config(tmp_path, architecture, model_type, rope_theta=500.0)
    lm = build_model(path, "lm", seed=0)
    assert type(lm).__name__ == lm_class
    assert lm.config.rope_parameters["rope_theta"] == 500.0
    assert type(build_model(path, "scalar", seed=0)).__name__ == lm_class.replace("CausalLM", "TokenClassification")


def test_unsupported_config_is_one_clear_error(tmp_path):
    path = write_config(tmp_path, "GPT2LMHeadModel", "gpt2")
    with pytest.raises(HfplanError, match="unsupported architecture"):
        build_model(path, "lm", seed=0)
    with pytest.raises(HfplanError, match="unknown model head"):
        build_model("tiny", "value", seed=0)


def test_a_checkpoint_folder_loads_its_weights_and_a_scalar_head_over_them(tmp_path):
    saved = build_model("tiny", "lm", seed=3)
    saved.save_pretrained(tmp_path)
    weights = saved.state_dict()
    loaded = build_model(str(tmp_path), "lm", seed=99).state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    critic = build_model(str(tmp_path), "scalar", seed=5).state_dict()
    again = build_model(str(tmp_path), "scalar", seed=5).state_dict()
    assert all(torch.equal(critic[k], weights[k]) for k in critic if k.startswith("model."))
    assert torch.equal(critic["score.weight"], again["score.weight"])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_left_padded_forward_with_positions_matches_unpadded_and_has_no_nan(attention):
    model = build_model("tiny", "lm", seed=0)
    model.config._attn_implementation = attention
    pad = model.config.pad_token_id
    rows = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55], [1, 60]]
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = (ids != pad).long()
    out = model(input_ids=ids, attention_mask=mask, position_ids=sequences.positions(mask)).logits
    assert not torch.isnan(out).any()
    for i, row in enumerate(rows):
        alone = model(input_ids=torch.tensor([row])).logits[0]
        torch.testing.assert_close(out[i, width - len(row):], alone, atol=1e-5, rtol=1e-5)
    # A loss over real tokens only must give finite gradients (NaN in padded rows would leak through 0 * NaN).
    (out.log_softmax(-1)[..., 5] * mask).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_byte_decoding_replaces_only_the_invalid_bytes():
    from hfplan.executor.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("tiny")
    # 'a' 'b' 'c', a lone continuation byte 0xC4, 'd': byte b is id 4 + b.
    assert tokenizer.decode([4 + 97, 4 + 98, 4 + 99, 4 + 0xC4, 4 + 100]) == "abc\ufffdd"
