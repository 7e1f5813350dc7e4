"""`hfplan export`: plans found by `--target` export without refusal; every key or flag written is one the
framework defines (hfplan/export/known/*.txt, read from verl's generated trainer configs at b178a3cd5 and
OpenRLHF's openrlhf/cli/train_ppo_ray.py at 3c3be623); GPU counts and batch sizes in the output match the
plan; the YAML says what the command says; refusals and bad input are one line, exit code 2."""

from __future__ import annotations

import json
import shlex
from importlib import resources

import pytest
import yaml

from hfplan.export import export_plan
from hfplan.layout import ROLLOUT
from hfplan.plan import PLAN_VERSION
from hfplan.planner.targets import get_target, search_target
from hfplan.spec import load_workload, make_cluster
from tests.support.cli import assert_user_error, invoke
from tests.support.plans import build_plan

SOURCES = {"verl-fsdp": ("verl/trainer/config/_generated_ppo_trainer.yaml", "b178a3cd5"),
           "verl-megatron": ("verl/trainer/config/_generated_ppo_megatron_trainer.yaml", "b178a3cd5"),
           "openrlhf": ("openrlhf/cli/train_ppo_ray.py", "3c3be623")}


def known(name: str) -> set[str]:
    text = resources.files("hfplan.export").joinpath("known", f"{name}.txt").read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    path, commit = SOURCES[name]
    assert path in " ".join(header) and commit in " ".join(header)  # each list names its source
    return {line for line in text.splitlines() if line and not line.startswith("#")}


def _shell_words(command: str) -> list[str]:
    """The words a shell reads: comment lines dropped, backslash-newline continuations joined."""
    body = "\n".join(line for line in command.splitlines() if not line.startswith("#"))
    return shlex.split(body.replace("\\\n", " "))


def verl_overrides(command: str) -> tuple[str, dict[str, str]]:
    """(config name, {key: value}) of a printed verl command."""
    tokens = _shell_words(command)
    assert tokens[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    config, pairs = "ppo_trainer", {}
    for token in tokens[3:]:
        if token.startswith("--config-name="):
            config = token.split("=", 1)[1]
            continue
        key, value = token.split("=", 1)
        assert key not in pairs, key
        pairs[key] = value
    return config, pairs


def openrlhf_flags(command: str) -> dict[str, str | bool]:
    tokens = _shell_words(command)
    assert tokens[:3] == ["python3", "-m", "openrlhf.cli.train_ppo_ray"]
    flags: dict[str, str | bool] = {}
    rest = tokens[3:]
    while rest:
        flag = rest.pop(0)
        assert flag.startswith("--") and flag not in flags, flag
        flags[flag] = rest.pop(0) if rest and not rest[0].startswith("--") else True
    return flags


def _pool(nodes: str, per_node: str) -> int:
    return int(nodes) * int(per_node)


def check_verl_command(plan, command: str) -> None:
    config, o = verl_overrides(command)
    backend = "verl-megatron" if config == "ppo_megatron_trainer" else "verl-fsdp"
    assert set(o) <= known(backend)
    w, par = plan.workload, plan.parallelism
    assert _pool(o["trainer.nnodes"], o["trainer.n_gpus_per_node"]) == plan.placement[plan.set_of("actor")].gpus
    assert int(o["trainer.n_gpus_per_node"]) <= plan.cluster.gpus_per_node
    reward_own = "reward" in par and plan.set_of("reward") != plan.set_of("actor")
    assert (o.get("reward_model.enable_resource_pool") == "true") == reward_own
    if reward_own:
        assert _pool(o["reward_model.nnodes"], o["reward_model.n_gpus_per_node"]) == \
            plan.placement[plan.set_of("reward")].gpus
    assert int(o["data.train_batch_size"]) == w.batch_prompts
    assert int(o["actor_rollout_ref.rollout.n"]) == w.samples_per_prompt
    assert int(o["actor_rollout_ref.actor.ppo_mini_batch_size"]) * w.mini_batches == w.batch_prompts
    assert int(o["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]) == par["actor"].train.micro_batch
    assert int(o["actor_rollout_ref.rollout.tensor_model_parallel_size"]) == par["actor"].gen.tp
    cap = par["actor"].gen.max_batch  # the search sets it: vLLM's concurrent sequences per engine
    assert (int(o["actor_rollout_ref.rollout.max_num_seqs"]) if "actor_rollout_ref.rollout.max_num_seqs" in o
            else None) == cap
    assert int(o["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"]) == par["actor"].infer.micro_batch
    assert int(o["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"]) == par["reference"].infer.micro_batch
    assert int(o["data.max_response_length"]) == w.response_len
    if "critic" in par:
        assert int(o["critic.ppo_micro_batch_size_per_gpu"]) == par["critic"].train.micro_batch
    for role, prefix in (("actor", "actor_rollout_ref.actor"), ("critic", "critic")):
        if role not in par:
            continue
        train = par[role].train
        if backend == "verl-megatron":
            assert int(o[f"{prefix}.megatron.tensor_model_parallel_size"]) == train.tp
            assert int(o[f"{prefix}.megatron.pipeline_model_parallel_size"]) == train.pp
        else:
            fsdp = "actor_rollout_ref.actor.fsdp_config" if role == "actor" else "critic.model.fsdp_config"
            assert int(o[f"{fsdp}.fsdp_size"]) == (train.shard_group if train.shard == "hybrid" else -1)
            assert (train.tp, train.pp) == (1, 1)


def check_openrlhf_command(plan, command: str) -> None:
    f = openrlhf_flags(command)
    assert set(f) <= known("openrlhf")
    w, par = plan.workload, plan.parallelism
    used = {}
    for role, prefix in (("actor", "actor"), ("reference", "ref"), ("critic", "critic"), ("reward", "reward")):
        if role in par:
            gpus = _pool(f[f"--{prefix}.num_nodes"], f[f"--{prefix}.num_gpus_per_node"])
            assert gpus == plan.placement[plan.set_of(role)].gpus, role
            used[plan.set_of(role)] = gpus
    engines = int(f["--vllm.num_engines"]) * int(f["--vllm.tensor_parallel_size"])
    if ROLLOUT in plan.placed_roles:
        assert "--train.colocate_all" not in f
        used[plan.set_of(ROLLOUT)] = engines
    else:
        assert f["--train.colocate_all"] is True and engines == plan.placement[0].gpus
    assert sum(used.values()) == sum(g.gpus for g in plan.placement)
    assert int(f["--rollout.batch_size"]) == w.batch_prompts
    assert int(f["--rollout.n_samples_per_prompt"]) == w.samples_per_prompt
    assert int(f["--train.batch_size"]) * w.mini_batches == w.sequences
    trained = [p.train for p in par.values() if p.train is not None]
    assert {int(f["--train.micro_batch_size"])} == {t.micro_batch for t in trained}
    assert {int(f["--rollout.micro_batch_size"])} == {p.infer.micro_batch for p in par.values() if p.infer}
    stages = {"replicated": 0, "zero1": 1, "zero2": 2, "full": 3}
    assert {stages[t.shard] for t in trained if t.dp > 1} <= {int(f["--ds.zero_stage"])}


CHECKS = {"verl": check_verl_command, "openrlhf": check_openrlhf_command}
CASES = [(target, name, gpus) for target in ("verl", "openrlhf")
         for name, gpus in (("ppo-llama2-7b", 64), ("ppo-llama2-7b", 16), ("grpo-qwen2.5-7b", 16))] + \
    [("verl", "remax-llama2-7b", 32)]  # OpenRLHF has no ReMax (refused up front: test_targets)


@pytest.mark.parametrize(("target", "name", "gpus"), CASES, ids=[f"{t}-{n}-{g}" for t, n, g in CASES])
def test_plans_found_by_target_export_consistently(target, name, gpus):
    workload, cluster = load_workload(name), make_cluster(gpus, "a100-80g")
    result = search_target(get_target(target, workload), workload, cluster, top_k=3)
    for plan in result.top:
        out = export_plan(plan, target, "test.json")
        CHECKS[target](plan, out.command)
        assert set(out.keys) == ({k for k in verl_overrides(out.command)[1]} if target == "verl"
                                 else set(openrlhf_flags(out.command)))


def test_hybrid_and_zero2_fsdp_plans_write_fsdp_size_and_reshard(tmp_path):
    """verl's FSDP keys by hand: hybrid sharding of 8 -> fsdp_size 8; ZeRO-2 -> reshard_after_forward false."""
    from hfplan.plan import GenConfig, InferConfig, RoleParallelism, TrainConfig

    workload = load_workload("ppo-llama2-7b")
    actor = RoleParallelism(train=TrainConfig(dp=32, micro_batch=2, shard="hybrid", shard_group=8),
                            infer=InferConfig(dp=32, micro_batch=4),
                            gen=GenConfig(tp=4, dp=8, batching="continuous", kv_cache="paged"))
    critic = RoleParallelism(train=TrainConfig(dp=32, micro_batch=4, shard="zero2"), infer=InferConfig(dp=32))
    plan = build_plan(workload, [(["actor", "critic", "reference", "reward"], 32)], tp=1,
                      overrides={"actor": actor, "critic": critic})
    config, o = verl_overrides(export_plan(plan, "verl").command)
    assert config == "ppo_trainer"
    assert o["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == "8"
    assert o["actor_rollout_ref.actor.fsdp_config.reshard_after_forward"] == "true"
    assert o["critic.model.fsdp_config.fsdp_size"] == "-1"
    assert o["critic.model.fsdp_config.reshard_after_forward"] == "false"
    assert (o["trainer.nnodes"], o["trainer.n_gpus_per_node"]) == ("4", "8")


# -- the CLI ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """`hfplan search --target X --out X.json` for both targets, and hfplan's own plan."""
    folder = tmp_path_factory.mktemp("export")
    plans = {}
    for target in ("verl", "openrlhf", "hfplan"):
        path = folder / f"{target}.json"
        result = invoke("search", "--gpus", 16, "--target", target, "--out", path, "--no-compare", "--jobs", 1)
        assert result.exit_code == 0, result.output
        if target != "hfplan":
            assert f"hfplan export {path} --to {target}" in " ".join(result.stdout.split())
        plans[target] = path
    return plans


@pytest.mark.parametrize("target", ["verl", "openrlhf"])
def test_export_prints_the_command_and_writes_the_file(searched, tmp_path, target):
    out = tmp_path / ("run.yaml" if target == "verl" else "run.sh")
    result = invoke("export", searched[target], "--to", target, "--out", out)
    assert result.exit_code == 0, result.output
    from hfplan.plan import load_plan

    plan = load_plan(searched[target])
    CHECKS[target](plan, result.stdout)
    version = "b178a3cd5" if target == "verl" else "3c3be623"
    assert version in result.stdout.splitlines()[0]
    text = out.read_text()
    if target == "verl":
        config = yaml.safe_load(text)
        assert config["defaults"][-1] == "_self_" and config["hydra"]["searchpath"] == ["pkg://verl.trainer.config"]
        _, pairs = verl_overrides(result.stdout)
        flat = dict(_flatten({k: v for k, v in config.items() if k not in ("defaults", "hydra")}))
        assert set(flat) == set(pairs)
        for key, value in flat.items():
            if isinstance(value, str) and value.startswith("${oc.env:"):
                assert pairs[key] == "$" + value[len("${oc.env:"):-1]  # the shell's variable, unexpanded by shlex
            elif isinstance(value, float):  # Hydra reads 1e-06 as a float; YAML 1.1 would not
                assert float(pairs[key]) == value, key
            else:
                assert yaml.safe_load(pairs[key]) == value, key
    else:
        assert text.startswith("#!/usr/bin/env bash\n") and result.stdout in text


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_a_plan_outside_the_target_is_refused_with_the_hint(searched):
    result = invoke("export", searched["hfplan"], "--to", "openrlhf")
    assert_user_error(result, "OpenRLHF cannot run this plan:", "hfplan search --target openrlhf")


def test_critic_on_its_own_gpus_is_refused_for_verl(tmp_path):
    plan = build_plan(load_workload("ppo-llama2-7b"), [(["actor", "reference", "reward"], 32), (["critic"], 32)],
                      cluster=make_cluster(64, "a100-80g"))
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    assert_user_error(invoke("export", path, "--to", "verl"), "verl runs the critic in the actor's pool",
                      "this plan puts it on its own 32 GPUs", "hfplan search --target verl")


@pytest.mark.parametrize(("args", "needles"), [
    (["export", "missing.json", "--to", "verl"], ["plan file not found"]),
    (["export", "PLAN", "--to", "nemo"], ["unknown export target 'nemo'"]),
    (["export", "PLAN"], ["Missing option", "--to"]),
    (["export", "PLAN", "--to", "verl", "--out", "FOLDER"], ["--out", "it is a folder"]),
])
def test_bad_input_is_one_line(searched, tmp_path, args, needles):
    args = [str(searched["verl"]) if a == "PLAN" else str(tmp_path) if a == "FOLDER" else a for a in args]
    assert_user_error(invoke(*args), *needles)


def test_demo_models_have_no_checkpoint_to_export(tmp_path):
    result = invoke("search", "--workload", "demo", "--hardware", "cpu", "--gpus", 2, "--target", "verl",
                    "--out", tmp_path / "demo.json", "--no-compare", "--jobs", 1)
    assert result.exit_code == 0, result.output
    assert_user_error(invoke("export", tmp_path / "demo.json", "--to", "verl"), "demo model")
    assert json.loads((tmp_path / "demo.json").read_text())["version"] == PLAN_VERSION


@pytest.mark.parametrize(("target", "name"), [("verl", "v.json"), ("openrlhf", "o.json")])
def test_readme_worked_examples_are_what_export_prints(tmp_path, monkeypatch, target, name):
    """The README's worked example for each target is the command of `hfplan search --gpus 64 --target ...`."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    monkeypatch.chdir(tmp_path)
    assert invoke("search", "--gpus", 64, "--target", target, "--out", name, "--no-compare").exit_code == 0
    result = invoke("export", name, "--to", target)
    assert result.exit_code == 0
    assert f"```bash\n{result.stdout}```" in readme


def test_megatron_plans_write_virtual_stages_and_selective_recomputation():
    """verl's Megatron keys by hand: 3 chunks a stage -> virtual_pipeline_model_parallel_size 3 (written only above
    1, verl's default null); selective -> recompute_granularity selective; plain stages write no such key."""
    from hfplan.plan import GenConfig, InferConfig, RoleParallelism, TrainConfig
    from tests.support.plans import small_workload

    workload = small_workload()  # qwen2.5-0.5b, 24 layers: 12 a stage at pp 2
    interleaved = TrainConfig(pp=2, dp=4, micro_batch=2, shard="zero1", recompute="selective", virtual_stages=3)
    plain = interleaved.model_copy(update={"recompute": "full", "virtual_stages": 1})
    infer = InferConfig(pp=2, dp=4, micro_batch=2)
    plan = build_plan(workload, [(["actor", "critic", "reference", "reward"], 8)], overrides={
        "actor": RoleParallelism(train=interleaved, infer=infer, gen=GenConfig(tp=2, dp=4, batching="continuous",
                                                                              kv_cache="paged")),
        "critic": RoleParallelism(train=plain, infer=infer), "reference": RoleParallelism(infer=infer),
        "reward": RoleParallelism(infer=infer)})
    config, o = verl_overrides(export_plan(plan, "verl").command)
    assert config == "ppo_megatron_trainer"
    megatron = "actor_rollout_ref.actor.megatron"
    assert o[f"{megatron}.virtual_pipeline_model_parallel_size"] == "3"
    assert o[f"{megatron}.override_transformer_config.recompute_granularity"] == "selective"
    assert "critic.megatron.virtual_pipeline_model_parallel_size" not in o
    assert o["critic.megatron.override_transformer_config.recompute_granularity"] == "full"
    assert set(o) <= known("verl-megatron")
