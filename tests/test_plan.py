"""Plan: validation of hand-written plans (each error names its field), atomic writes, JSON round trip."""

import copy
import json
import os
from pathlib import Path

import pytest

from hfplan.errors import HfplanError
from hfplan.files import write_atomically
from hfplan.plan import PLAN_VERSION, Plan, Recompute, load_plan, plan_from_dict

WORKLOAD = {
    "algorithm": "ppo",
    "models": {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "tiny"},
    "prompt_len": 16,
    "response_len": 16,
    "batch_prompts": 8,
    "mini_batches": 2,
}


def valid_plan() -> dict:
    """PPO on 8 GPUs: actor + reference share 4 GPUs, critic + reward the other 4."""
    return {
        "version": 1,
        "workload": copy.deepcopy(WORKLOAD),
        "cluster": {"gpus": 8, "gpus_per_node": 8, "hardware": "a100-80g"},
        "placement": [{"models": ["actor", "reference"], "gpus": 4}, {"models": ["critic", "reward"], "gpus": 4}],
        "parallelism": {
            "actor": {"train": {"tp": 2, "dp": 2, "micro_batch": 2}, "infer": {"tp": 2, "dp": 2},
                      "gen": {"tp": 1, "dp": 4}},
            "reference": {"infer": {"tp": 1, "pp": 2, "dp": 2}},
            "critic": {"train": {"tp": 1, "pp": 1, "dp": 4, "shard": False}, "infer": {"dp": 4}},
            "reward": {"infer": {"tp": 4}},
        },
    }


def with_estimate(data: dict) -> dict:
    data["estimate"] = {
        "iteration_s": 2.5,
        "tokens_per_s": 8 * 32 / 2.5,
        "stages": {"generation": 1.0, "preparation": 0.5, "training": 1.0},
        "peak_memory_gib": [1.5, 0.75],
        "timeline": [
            {"role": "actor", "op": "generate", "phase": "generation", "set": 0, "start": 0.0, "end": 1.0},
            {"role": "actor", "op": "to_gen", "phase": "generation", "set": 0, "start": 0.0, "end": 0.1,
             "kind": "transition"},
            {"role": "controller", "op": "gae", "phase": "preparation", "set": -1, "start": 1.4, "end": 1.5},
        ],
    }
    return data


def test_micro_batch_may_hold_every_sequence_of_a_rank():
    data = valid_plan()
    data["parallelism"]["actor"]["train"]["micro_batch"] = 2  # (8 / 2 mini-batches) / 2 ranks
    data["parallelism"]["critic"]["train"]["micro_batch"] = 1  # (8 / 2) / 4
    assert plan_from_dict(data, "test").parallelism["actor"].train.micro_batch == 2


def test_bad_plan_messages_are_one_line_without_pydantic_noise():
    for change, _ in BAD_PLANS + STRICT_PLANS:
        with pytest.raises(HfplanError) as caught:
            plan_from_dict(_break(change), "test")
        message = str(caught.value)
        assert "\n" not in message and "Value error" not in message and "(top level)" not in message, message


def test_valid_plan_validates():
    plan = plan_from_dict(valid_plan(), "test")
    assert plan.version == PLAN_VERSION == 2  # written as version 1, migrated on read
    assert plan.placed_roles == ["actor", "reference", "critic", "reward"]
    assert plan.set_of("critic") == 1
    assert plan.generation_role == "actor"
    assert plan.parallelism["actor"].train.gpus == 4
    assert plan.parallelism["actor"].train.model_shards == 2
    assert plan.parallelism["actor"].train.shard == "full"  # FSDP (ZeRO-3) by default
    assert plan.parallelism["critic"].train.shard == "replicated"


def test_valid_plan_with_estimate_validates():
    plan = plan_from_dict(with_estimate(valid_plan()), "test")
    assert plan.estimate.timeline[1].kind == "transition"
    assert plan.estimate.timeline[0].kind == "compute"  # the default


def test_plan_may_leave_gpus_unused():
    data = valid_plan()
    data["cluster"]["gpus"] = 16
    assert plan_from_dict(data, "test").cluster.gpus == 16


def test_rule_reward_is_not_placed():
    data = valid_plan()
    data["workload"]["models"]["reward"] = "rule:vowel-fraction"
    data["placement"][1]["models"] = ["critic"]
    del data["parallelism"]["reward"]
    assert plan_from_dict(data, "test").placed_roles == ["actor", "reference", "critic"]


def test_separate_rollout_engine():
    data = valid_plan()
    data["cluster"]["gpus"] = 12
    data["placement"].append({"models": ["rollout"], "gpus": 4})
    del data["parallelism"]["actor"]["gen"]
    data["parallelism"]["rollout"] = {"gen": {"tp": 2, "dp": 2}}
    plan = plan_from_dict(data, "test")
    assert plan.generation_role == "rollout"
    assert plan.set_of("rollout") == 2


def _break(change) -> dict:
    data = valid_plan()
    change(data)
    return data


def _set(path: str, value):
    def change(data):
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return change


DELETE = object()

BAD_PLANS = [
    # (change, text the message must hold)
    (_set("parallelism.actor.train.dp", 4), "parallelism.actor.train: tp*pp*dp = 8 but its set has 4 GPUs"),
    (_set("parallelism.reward.infer.tp", 2), "parallelism.reward.infer: tp*pp*dp = 2 but its set has 4 GPUs"),
    (_set("parallelism.actor.gen.dp", 2), "parallelism.actor.gen: tp*pp*dp = 2"),
    (_set("placement.1.models", ["critic", "reward", "actor"]), "placement lists 'actor' in more than one set"),
    (_set("placement.1.models", ["critic"]), "placement leaves out role 'reward'"),
    (_set("placement.1.models", ["critic", "reward", "cost"]), "placement names 'cost'"),
    (_set("parallelism.critic.train", DELETE), "parallelism.critic.train: required for role 'critic'"),
    (_set("parallelism.actor.train", DELETE), "parallelism.actor.train: required for role 'actor'"),
    (_set("parallelism.actor.gen", DELETE), "parallelism.actor.gen: required for role 'actor'"),
    (_set("parallelism.critic.infer", DELETE), "parallelism.critic.infer: required for role 'critic'"),
    (_set("parallelism.reference.train", {"dp": 4}), "parallelism.reference.train: role 'reference' does not train"),
    (_set("parallelism.reward.gen", {"tp": 4}), "parallelism.reward.gen: role 'reward' does not gen"),
    (_set("parallelism.reward", DELETE), "parallelism.reward: missing"),
    (_set("parallelism.cost", {"infer": {"tp": 4}}), "parallelism given for 'cost'"),
    (_set("parallelism.actor.infer", {"tp": 1, "dp": 4}), "parallelism.actor.infer: a trained role runs inference"),
    (_set("placement.1.gpus", 12), "placement uses 16 GPUs but the cluster has 8"),
    (_set("cluster.gpus", 4), "placement uses 8 GPUs but the cluster has 4"),
    (_set("parallelism.actor.train.tp", 0), "field parallelism.actor.train.tp"),
    (_set("parallelism.actor.train.zero", 3), "field parallelism.actor.train.zero"),
    (_set("placement.0.gpus", 0), "field placement.0.gpus"),
    (_set("placement", []), "field placement"),
    (_set("cluster.nodes", 2), "field cluster.nodes"),
    (_set("workload.mini_batches", 3), "mini_batches (3) must divide"),
    (_set("workload.algorithm", "dpo"), "field workload.algorithm"),
]


# Hand-written plans are checked like the CLI's input.
STRICT_PLANS = [
    # strict types: nothing is coerced from a string (or a bool from an int)
    (_set("parallelism.critic.train.shard", "yes"), "field parallelism.critic.train.shard: Input should be "
                                                     "'replicated', 'zero1', 'zero2', 'full' or 'hybrid', got 'yes'"),
    (_set("parallelism.actor.train.recompute", 1), "field parallelism.actor.train.recompute"),
    (_set("parallelism.actor.train.tp", "2"), "field parallelism.actor.train.tp: Input should be a valid integer, "
                                              "got '2'"),
    (_set("cluster.gpus", "8"), "field cluster.gpus"),
    (_set("workload.prompt_len", "16"), "field workload.prompt_len"),
    (_set("placement.0.gpus", 4.0), "field placement.0.gpus"),
    # 8 prompts in 2 mini-batches over the actor's 2 data-parallel ranks: at most 2 sequences per micro-batch
    (_set("parallelism.actor.train.micro_batch", 3), "parallelism.actor.train.micro_batch: 3 is more than the 2 "
                                                     "sequences"),
    (_set("parallelism.actor.train.micro_batch", 512), "parallelism.actor.train.micro_batch: 512"),
    (_set("parallelism.critic.train.micro_batch", 100000), "parallelism.critic.train.micro_batch: 100000 is more "
                                                           "than the 1 sequences"),
    (_set("cluster.gpus_per_node", 3), "field cluster.gpus_per_node: must be a power of two, got 3"),
    (_set("workload.prompt_len", 300), "workload: prompt_len + response_len = 300 + 16 = 316 tokens exceeds the "
                                       "context length of actor model tiny (256 tokens)"),
]


@pytest.mark.parametrize(("change", "needle"), BAD_PLANS + STRICT_PLANS)
def test_bad_plan_names_the_problem(change, needle):
    with pytest.raises(HfplanError, match="plan test") as caught:
        plan_from_dict(_break(change), "test")
    assert needle in str(caught.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [(_set("workload.models.critic", "llama9"), "unknown model 'llama9'"),
     (_set("cluster.hardware", "tpu-v9"), "unknown hardware 'tpu-v9'")],
)
def test_bad_reference_in_plan_fails_at_load(change, needle):
    # The plan's names are resolved when it is read, not later in the simulator or executor.
    with pytest.raises(HfplanError, match=needle):
        plan_from_dict(_break(change), "test")


def test_rollout_with_actor_generating_too():
    data = valid_plan()
    data["cluster"]["gpus"] = 12
    data["placement"].append({"models": ["rollout"], "gpus": 4})
    data["parallelism"]["rollout"] = {"gen": {"tp": 4}}
    with pytest.raises(HfplanError, match="parallelism.actor.gen: role 'actor' does not gen"):
        plan_from_dict(data, "test")


def test_rollout_cannot_train():
    data = valid_plan()
    data["cluster"]["gpus"] = 12
    data["placement"].append({"models": ["rollout"], "gpus": 4})
    del data["parallelism"]["actor"]["gen"]
    data["parallelism"]["rollout"] = {"gen": {"tp": 4}, "train": {"tp": 4}}
    with pytest.raises(HfplanError, match="parallelism.rollout.train: role 'rollout' does not train"):
        plan_from_dict(data, "test")


@pytest.mark.parametrize("version", [0, 3, "1", None, True])
def test_wrong_version(version):
    data = valid_plan()
    data["version"] = version
    with pytest.raises(HfplanError, match=f"unsupported version {version!r}"):
        plan_from_dict(data, "test")


def test_missing_version():
    data = valid_plan()
    del data["version"]
    with pytest.raises(HfplanError, match="unsupported version None"):
        plan_from_dict(data, "test")


def test_top_level_must_be_an_object():
    with pytest.raises(HfplanError, match="expected a JSON object"):
        plan_from_dict([valid_plan()], "test")


def test_load_plan_reports_the_path(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_break(_set("placement.1.models", ["critic"]))))
    with pytest.raises(HfplanError, match="leaves out role 'reward'") as caught:
        load_plan(path)
    assert str(path) in str(caught.value)


def test_load_plan_malformed_json(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"version": 1,')
    with pytest.raises(HfplanError, match="not valid JSON"):
        load_plan(path)


def test_load_plan_missing_file(tmp_path):
    with pytest.raises(HfplanError, match="not found"):
        load_plan(tmp_path / "absent.json")


def test_json_round_trip(tmp_path):
    plan = plan_from_dict(with_estimate(valid_plan()), "test")
    path = tmp_path / "best.json"
    write_atomically(path, plan.to_json())
    again = load_plan(path)
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert json.loads(path.read_text())["version"] == 2


def test_to_json_is_the_model_dump():
    plan = plan_from_dict(valid_plan(), "test")
    assert Plan.model_validate(json.loads(plan.to_json())) == plan
    assert plan.to_json().endswith("}\n")


def test_write_atomically_writes_the_text_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "out.json"
    write_atomically(path, "first\n")
    write_atomically(path, "second ünïcode\n")  # overwrites in place
    assert path.read_text() == "second ünïcode\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_write_atomically_uses_ordinary_permissions(tmp_path):
    path = tmp_path / "out.json"
    umask = os.umask(0o022)
    try:
        write_atomically(path, "x")
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0o600


def test_write_atomically_into_missing_folder(tmp_path):
    with pytest.raises(HfplanError, match="does not exist"):
        write_atomically(tmp_path / "nope" / "out.json", "x")
    assert list(tmp_path.iterdir()) == []


def test_write_atomically_cleans_up_after_a_failed_write(tmp_path):
    path = tmp_path / "out.json"
    with pytest.raises(TypeError):
        write_atomically(path, 123)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# -- version 2 and the migration of version 1 ----------------------------------------------------------


def test_version_1_recompute_flags_become_modes():
    data = valid_plan()
    data["parallelism"]["actor"]["train"]["recompute"] = True
    data["parallelism"]["critic"]["train"]["recompute"] = False
    plan = plan_from_dict(data, "test")
    assert plan.parallelism["actor"].train.recompute is Recompute.FULL
    assert plan.parallelism["critic"].train.recompute is Recompute.NONE
    assert not plan.parallelism["critic"].train.recompute and plan.parallelism["actor"].train.recompute
    assert plan.parallelism["actor"].train.virtual_stages == 1
    assert plan.parallelism["actor"].gen.batching == "static"
    dumped = json.loads(plan.to_json())
    assert dumped["version"] == 2 and dumped["parallelism"]["actor"]["train"]["recompute"] == "full"


def test_kept_version_1_plan_loads_migrated():
    """tests/data/plan_v1.json: the tests' sample plan as the version-1 hfplan wrote it."""
    path = Path(__file__).parent / "data" / "plan_v1.json"
    raw = json.loads(path.read_text())
    assert raw["version"] == 1
    plan = load_plan(path)
    assert plan.version == 2
    for role, par in raw["parallelism"].items():
        if par.get("train") is not None:
            assert plan.parallelism[role].train.recompute is (Recompute.FULL if par["train"]["recompute"]
                                                              else Recompute.NONE)
    assert plan.placed_roles == [r for group in raw["placement"] for r in group["models"]]
    assert load_plan_text(plan.to_json()) == plan  # and reads back as version 2


def load_plan_text(text: str):
    return plan_from_dict(json.loads(text), "text")


def test_version_2_fields_validate():
    data = valid_plan()
    data["version"] = 2
    data["parallelism"]["actor"]["train"] |= {"recompute": "selective", "virtual_stages": 2}
    data["parallelism"]["actor"]["gen"]["batching"] = "continuous"
    plan = plan_from_dict(data, "test")
    assert plan.parallelism["actor"].train.recompute is Recompute.SELECTIVE
    assert plan.parallelism["actor"].train.virtual_stages == 2
    assert plan.parallelism["actor"].gen.batching == "continuous"
    data["parallelism"]["actor"]["train"]["recompute"] = "sometimes"
    with pytest.raises(HfplanError, match="recompute: must be one of none, selective, full"):
        plan_from_dict(data, "test")


def test_gen_max_batch_is_optional_and_at_least_one():
    data = valid_plan()
    assert plan_from_dict(data, "test").parallelism["actor"].gen.max_batch is None  # absent: all at once
    data["parallelism"]["actor"]["gen"] |= {"batching": "continuous", "max_batch": 3}
    plan = plan_from_dict(data, "test")
    assert plan.parallelism["actor"].gen.max_batch == 3
    assert load_plan_text(plan.to_json()) == plan
    for bad in (0, "3"):
        data["parallelism"]["actor"]["gen"]["max_batch"] = bad
        with pytest.raises(HfplanError, match="max_batch"):
            plan_from_dict(data, "test")


def test_gen_kv_cache_is_reserved_unless_a_paged_engine_batches_continuously():
    data = valid_plan()
    assert plan_from_dict(data, "test").parallelism["actor"].gen.kv_cache == "reserved"  # absent: reserved
    data["parallelism"]["actor"]["gen"] |= {"batching": "continuous", "kv_cache": "paged"}
    plan = plan_from_dict(data, "test")
    assert plan.parallelism["actor"].gen.kv_cache == "paged" and load_plan_text(plan.to_json()) == plan
    data["parallelism"]["actor"]["gen"]["batching"] = "static"
    with pytest.raises(HfplanError, match="kv_cache=paged needs batching=continuous") as err:
        plan_from_dict(data, "test")
    assert "\n" not in str(err.value)
    data["parallelism"]["actor"]["gen"]["kv_cache"] = "virtual"
    with pytest.raises(HfplanError, match="kv_cache"):
        plan_from_dict(data, "test")
