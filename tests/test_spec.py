"""Workloads (built-in and from files), their validation, and clusters."""

import json

import pytest
import yaml

from hfplan.errors import HfplanError
from hfplan.profiles.hardware import load_hardware
from hfplan.profiles.models import CATALOG, DEMO_MODELS
from hfplan.spec import (
    ALGORITHM_ROLES,
    BUILTIN_WORKLOADS,
    DEFAULT_WORKLOAD,
    Cluster,
    Workload,
    load_workload,
    make_cluster,
    workload_from_dict,
)

PPO_ROLES = {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "tiny"}
SHORT = {"prompt_len": 64, "response_len": 64}  # within tiny's 256-token context
REAL_MODELS = sorted(m for m in CATALOG if m not in DEMO_MODELS)


def _ppo(**fields) -> dict:
    return {"algorithm": "ppo", "models": dict(PPO_ROLES)} | SHORT | fields


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_ROLES))
@pytest.mark.parametrize("model", REAL_MODELS)
def test_builtin_workload_for_every_algorithm_and_model(algorithm, model):
    workload = load_workload(f"{algorithm}-{model}")
    assert workload.algorithm == algorithm
    assert set(workload.models) == set(ALGORITHM_ROLES[algorithm])
    assert set(workload.models.values()) == {model}


def test_builtin_table_is_exactly_algorithms_times_models_plus_the_demos():
    expected = {f"{a}-{m}" for a in ALGORITHM_ROLES for m in REAL_MODELS} | {"demo", "arith-grpo"}
    assert set(BUILTIN_WORKLOADS) == expected


def test_no_builtin_workload_for_tiny():
    with pytest.raises(HfplanError, match="unknown workload"):
        load_workload("ppo-tiny")


def test_demo_workload():
    demo = load_workload("demo")
    assert demo.algorithm == "ppo"
    assert demo.models["actor"] == "tiny"
    assert demo.models["reward"].startswith("rule:")
    assert demo.model_roles == ("actor", "critic", "reference")  # the rule reward needs no GPU


def test_default_workload_is_ppo_llama2_7b():
    assert DEFAULT_WORKLOAD == "ppo-llama2-7b"
    workload = load_workload(DEFAULT_WORKLOAD)
    assert workload.algorithm == "ppo"
    assert workload.roles == ("actor", "critic", "reference", "reward")
    assert workload.arch("actor") is CATALOG["llama2-7b"]


def test_builtin_grpo_samples_several_responses_per_prompt():
    workload = load_workload("grpo-llama2-7b")
    assert workload.samples_per_prompt >= 2
    # 256 prompts x 4 responses keeps 1024 responses per iteration like the other defaults.
    assert workload.sequences == 256 * 4 == load_workload("ppo-llama2-7b").sequences


def test_tokens_per_iteration_by_hand():
    workload = Workload(algorithm="grpo", models={"actor": "tiny", "reference": "tiny", "reward": "tiny"},
                        prompt_len=100, response_len=28, batch_prompts=6, samples_per_prompt=3, mini_batches=9)
    assert workload.sequences == 18
    assert workload.seq_len == 128
    assert workload.tokens_per_iteration == 6 * 3 * (100 + 28)


def test_default_tokens_per_iteration():
    # Defaults: 1024 prompts x 1 response x (1024 + 1024) tokens.
    assert load_workload("ppo-llama2-7b").tokens_per_iteration == 1024 * 2048


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"algorithm": "ppo", "models": {"actor": "tiny", "reference": "tiny", "reward": "tiny"}}, "'critic'"),
        ({"algorithm": "grpo", "models": dict(PPO_ROLES), "samples_per_prompt": 4}, "'critic' is not used by grpo"),
        ({"algorithm": "remax", "models": {"actor": "tiny", "reference": "tiny", "reward": "tiny", "cost": "tiny"}},
         "'cost' is not used by remax"),
        ({"algorithm": "grpo", "models": {"actor": "tiny", "reference": "tiny", "reward": "tiny"}},
         "samples_per_prompt >= 2"),
        (_ppo(batch_prompts=10, mini_batches=4), "mini_batches"),
        (_ppo(models=PPO_ROLES | {"critic": "rule:vowel-fraction"}), "'critic' cannot be a rule"),
    ],
)
def test_role_validation(data, needle):
    with pytest.raises(HfplanError, match="workload test") as caught:
        workload_from_dict(data, "test")
    assert needle in str(caught.value)


def test_safe_rlhf_needs_cost_and_cost_critic():
    models = dict(PPO_ROLES)
    with pytest.raises(HfplanError, match="'cost'"):
        workload_from_dict({"algorithm": "safe-rlhf", "models": models} | SHORT, "test")
    full = models | {"cost": "tiny", "cost_critic": "tiny"}
    workload = workload_from_dict({"algorithm": "safe-rlhf", "models": full} | SHORT, "test")
    assert workload.roles[-2:] == ("cost", "cost_critic")


@pytest.mark.parametrize(("algorithm", "shape", "needle"), [
    ("ppo", {"mini_batches": 1}, "outside its loss"), ("remax", {"mini_batches": 1}, "outside its loss"),
    ("grpo", {"mini_batches": 2}, "one optimizer step"),
    ("grpo", {"mini_batches": 1, "epochs": 2}, "one optimizer step")])
def test_reusing_the_policy_log_probs_needs_an_on_policy_step_and_an_algorithm_that_allows_it(algorithm, shape,
                                                                                               needle):
    models = {role: "tiny" for role in ALGORITHM_ROLES[algorithm]}
    data = {"algorithm": algorithm, "models": models, "batch_prompts": 4, "samples_per_prompt": 2,
            "reuse_policy_log_probs": True} | SHORT | shape
    with pytest.raises(HfplanError, match=needle):
        workload_from_dict(data, "test")
    assert workload_from_dict(data | {"reuse_policy_log_probs": False}, "test").mini_batches == shape["mini_batches"]


def test_grpo_mini_batches_divide_responses_not_prompts():
    # 6 prompts x 2 responses = 12 sequences: 4 mini-batches divide 12, though not 6.
    data = {"algorithm": "grpo", "models": {"actor": "tiny", "reference": "tiny", "reward": "tiny"},
            "batch_prompts": 6, "samples_per_prompt": 2, "mini_batches": 4} | SHORT
    assert workload_from_dict(data, "test").sequences == 12


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"prompt_len": 0}, "prompt_len"), ({"epochs": -1}, "epochs"), ({"algorithm": "dpo"}, "algorithm"),
     ({"learning_rate": 1e-6}, "learning_rate")],
)
def test_bad_field_is_named(fields, field):
    with pytest.raises(HfplanError) as caught:
        workload_from_dict(_ppo() | fields, "test")
    assert f"field {field}" in str(caught.value)


def test_unknown_model_in_workload_fails_early():
    with pytest.raises(HfplanError, match="unknown model 'llama9'"):
        workload_from_dict(_ppo(models=PPO_ROLES | {"critic": "llama9"}), "test")


def test_unknown_reward_rule_fails_early():
    with pytest.raises(HfplanError, match="unknown reward rule 'shiny'"):
        workload_from_dict(_ppo(models=PPO_ROLES | {"reward": "rule:shiny"}), "test")


def test_top_level_must_be_a_mapping():
    with pytest.raises(HfplanError, match="mapping"):
        workload_from_dict(["ppo"], "test")


def test_load_yaml_workload_file(tmp_path):
    path = tmp_path / "work.yaml"
    path.write_text(yaml.safe_dump(_ppo(prompt_len=64, response_len=32, batch_prompts=16, mini_batches=4)))
    workload = load_workload(str(path))
    assert (workload.prompt_len, workload.response_len, workload.batch_prompts) == (64, 32, 16)
    assert workload.tokens_per_iteration == 16 * 96


def test_load_json_workload_file(tmp_path):
    path = tmp_path / "work.json"
    data = _ppo(batch_prompts=8, mini_batches=2)
    path.write_text(json.dumps(data))
    workload = load_workload(str(path))
    assert workload.to_dict()["models"] == PPO_ROLES
    assert workload.mini_batches == 2


def test_to_dict_round_trips(tmp_path):
    workload = load_workload("grpo-qwen2.5-7b")
    path = tmp_path / "again.json"
    path.write_text(json.dumps(workload.to_dict()))
    assert load_workload(str(path)) == workload


def test_malformed_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm: ppo\nmodels: {actor: tiny\n")
    with pytest.raises(HfplanError, match="not valid YAML"):
        load_workload(str(path))


def test_malformed_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"algorithm": "ppo", ')
    with pytest.raises(HfplanError, match="not valid JSON"):
        load_workload(str(path))


def test_workload_file_with_bad_role_names_the_file(tmp_path):
    path = tmp_path / "bad-role.yaml"
    path.write_text(yaml.safe_dump(_ppo(models=PPO_ROLES | {"cost": "tiny"})))
    with pytest.raises(HfplanError, match="'cost' is not used by ppo") as caught:
        load_workload(str(path))
    assert str(path) in str(caught.value)


def test_missing_workload_file(tmp_path):
    with pytest.raises(HfplanError, match="not found"):
        load_workload(str(tmp_path / "absent.yaml"))


def test_unknown_workload_name_lists_algorithms_and_models():
    with pytest.raises(HfplanError, match="unknown workload 'dpo-llama2-7b'") as caught:
        load_workload("dpo-llama2-7b")
    message = str(caught.value)
    for name in list(ALGORITHM_ROLES) + REAL_MODELS + ["demo"]:
        assert name in message


@pytest.mark.parametrize("gpus", [0, -8])
def test_make_cluster_refuses_non_positive_gpus(gpus):
    with pytest.raises(HfplanError, match="--gpus must be positive"):
        make_cluster(gpus)


@pytest.mark.parametrize("per_node", [3, 6, 12, -4])
def test_make_cluster_refuses_node_size_not_power_of_two(per_node):
    with pytest.raises(HfplanError, match="power of two"):
        make_cluster(16, gpus_per_node=per_node)


def test_make_cluster_refuses_zero_gpus_per_node():
    with pytest.raises(HfplanError, match="gpus-per-node"):
        make_cluster(16, gpus_per_node=0)


def test_make_cluster_takes_node_size_from_profile():
    assert make_cluster(16, "a100-80g").gpus_per_node == 8
    assert make_cluster(4, "cpu").gpus_per_node == load_hardware("cpu").gpus_per_node
    assert make_cluster(16, "a100-80g", gpus_per_node=4).gpus_per_node == 4


def test_make_cluster_unknown_hardware():
    with pytest.raises(HfplanError, match="unknown hardware"):
        make_cluster(8, "tpu-v9")


def test_make_cluster_keeps_the_loaded_profile():
    cluster = make_cluster(8, "h100-80g")
    assert cluster.profile.name == "h100-80g"
    assert cluster.model_dump() == {"gpus": 8, "gpus_per_node": 8, "hardware": "h100-80g"}


@pytest.mark.parametrize(("gpus", "per_node", "nodes"), [(1, 8, 1), (8, 8, 1), (12, 8, 2), (16, 8, 2), (17, 8, 3),
                                                         (6, 4, 2)])
def test_nodes_count_a_partial_last_node(gpus, per_node, nodes):
    assert Cluster(gpus=gpus, gpus_per_node=per_node, hardware="a100-80g").nodes == nodes


def test_explicit_node_size_above_the_gpus_is_refused():
    with pytest.raises(HfplanError, match="--gpus-per-node 8 is more than --gpus 4"):
        make_cluster(4, gpus_per_node=8)
    # the profile's node size larger than the cluster: one partial node
    cluster = make_cluster(4, "a100-80g")
    assert (cluster.gpus_per_node, cluster.nodes) == (8, 1)


# -- context length ------------------------------------------------------------------------------------
def test_sequences_beyond_the_context_length_are_refused():
    with pytest.raises(HfplanError, match=r"prompt_len \+ response_len = 4096 \+ 1024 = 5120 tokens exceeds the "
                                          r"context length of actor model llama2-7b \(4,096 tokens\)"):
        workload_from_dict({"algorithm": "ppo", "models": dict.fromkeys(PPO_ROLES, "llama2-7b"),
                            "prompt_len": 4096, "response_len": 1024}, "test")
    # exactly the context length is fine
    workload_from_dict({"algorithm": "ppo", "models": dict.fromkeys(PPO_ROLES, "llama2-7b"),
                        "prompt_len": 3072, "response_len": 1024}, "test")


def test_the_demo_workloads_fit_the_demo_models():
    for name in ("demo", "arith-grpo"):
        workload = load_workload(name)
        assert all(workload.seq_len <= workload.arch(role).context_len for role in workload.model_roles)


def test_context_length_of_a_config_json(tmp_path):
    (tmp_path / "short").mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 96}
    (tmp_path / "short" / "config.json").write_text(json.dumps(config))
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(_ppo(models=dict.fromkeys(PPO_ROLES, "short"))))  # 64 + 64 > 96
    with pytest.raises(HfplanError, match=f"workload {path}: .*128 tokens exceeds .* \\(96 tokens\\)"):
        load_workload(str(path))


# -- model paths in workload files ---------------------------------------------------------------------
def _model_folder(folder) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": True, "max_position_embeddings": 32768}))


def test_relative_model_paths_resolve_against_the_workload_file(tmp_path, monkeypatch):
    project = tmp_path / "project"
    _model_folder(project / "myqwen")
    _model_folder(project / "models" / "reward")
    path = project / "wl.yaml"
    path.write_text(yaml.safe_dump(_ppo(models={"actor": "myqwen", "critic": "myqwen/config.json",
                                                "reference": "./myqwen", "reward": "models/reward"})))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    workload = load_workload(str(path))
    assert workload.models == {"actor": str(project / "myqwen"), "critic": str(project / "myqwen" / "config.json"),
                               "reference": str(project / "myqwen"), "reward": str(project / "models" / "reward")}
    assert workload.arch("actor").layers == 24
    # the stored (absolute) paths work from any folder: a plan made from it loads anywhere
    monkeypatch.chdir(tmp_path)
    assert load_workload(_write_json(tmp_path / "again.json", workload.to_dict())) == workload


def test_catalog_names_and_rules_are_not_paths(tmp_path):
    (tmp_path / "tiny").mkdir()  # a folder named like a catalog model does not shadow it
    path = tmp_path / "wl.yaml"
    path.write_text(yaml.safe_dump(_ppo(models=PPO_ROLES | {"reward": "rule:vowel-fraction"})))
    assert load_workload(str(path)).models == PPO_ROLES | {"reward": "rule:vowel-fraction"}


def test_a_missing_relative_model_names_the_resolved_path(tmp_path, monkeypatch):
    path = tmp_path / "wl.yaml"
    path.write_text(yaml.safe_dump(_ppo(models=PPO_ROLES | {"critic": "gone/config.json"})))
    monkeypatch.chdir("/")
    with pytest.raises(HfplanError, match=f"model config not found: {tmp_path / 'gone' / 'config.json'}"):
        load_workload(str(path))


def _write_json(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


# -- strict types ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "needle"), [
    ({"prompt_len": "64"}, "field prompt_len: Input should be a valid integer, got '64'"),
    ({"batch_prompts": 8.0}, "field batch_prompts"),
    ({"epochs": True}, "field epochs"),
])
def test_workload_numbers_are_not_coerced(fields, needle):
    with pytest.raises(HfplanError, match="workload test") as caught:
        workload_from_dict(_ppo() | fields, "test")
    assert needle in str(caught.value)
