"""`hfplan export`: plans found by `--target` export without refusal; every key or flag written is one the
targeted release defines (hfplan/export/known/*.txt, written by scripts/export_keys.py from the wheels of verl
0.9.1, its generated trainer configs, and openrlhf 0.11.2, its openrlhf/cli/train_ppo_ray.py); GPU counts and
batch sizes in the output match the plan; the YAML says what the command says; refusals and bad input are one
line, exit code 2."""

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

VERL_WHEEL, OPENRLHF_WHEEL = "verl-0.9.1-py3-none-any.whl", "openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl"
SOURCES = {"verl-0.9.1-fsdp": ("verl 0.9.1", "verl/trainer/config/_generated_ppo_trainer.yaml", VERL_WHEEL),
           "verl-0.9.1-megatron": ("verl 0.9.1", "verl/trainer/config/_generated_ppo_megatron_trainer.yaml",
                                   VERL_WHEEL),
           "openrlhf-0.11.2": ("openrlhf 0.11.2", "openrlhf/cli/train_ppo_ray.py", OPENRLHF_WHEEL)}


def known(name: str) -> set[str]:
    text = resources.files("hfplan.export").joinpath("known", f"{name}.txt").read_text()
    header = " ".join(line for line in text.splitlines() if line.startswith("#"))
    assert all(fact in header for fact in SOURCES[name])  # each list names its release, file and wheel
    return {line for line in text.splitlines() if line and not line.startswith("#")}


def test_the_known_lists_are_those_of_the_targeted_releases():
    """Only the targeted releases' lists ship (the source-snapshot lists are gone), and the targets name them."""
    from hfplan.planner.targets import OPENRLHF, VERL

    shipped = {p.name for p in resources.files("hfplan.export").joinpath("known").iterdir()}
    assert shipped == {f"{name}.txt" for name in SOURCES}
    assert (VERL.version, VERL.wheel, OPENRLHF.version, OPENRLHF.wheel) == ("0.9.1", VERL_WHEEL, "0.11.2",
                                                                            OPENRLHF_WHEEL)


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
    backend = "verl-0.9.1-megatron" if config == "ppo_megatron_trainer" else "verl-0.9.1-fsdp"
    # the reward loop's keys only: the legacy top-level ones are in the schema but main_ppo reads none of them
    assert not [k for k in o if k.startswith(("reward_model.", "custom_reward_function."))]
    assert set(o) <= known(backend)
    w, par = plan.workload, plan.parallelism
    assert _pool(o["trainer.nnodes"], o["trainer.n_gpus_per_node"]) == plan.placement[plan.set_of("actor")].gpus
    assert int(o["trainer.n_gpus_per_node"]) <= plan.cluster.gpus_per_node
    reward_own = "reward" in par and plan.set_of("reward") != plan.set_of("actor")
    rm = "reward.reward_model"
    assert (o.get(f"{rm}.enable_resource_pool") == "true") == reward_own
    if reward_own:
        assert _pool(o[f"{rm}.nnodes"], o[f"{rm}.n_gpus_per_node"]) == plan.placement[plan.set_of("reward")].gpus
    if "reward" in par:
        assert o[f"{rm}.enable"] == "true" and o[f"{rm}.rollout.name"] == "vllm"
        assert int(o[f"{rm}.rollout.tensor_model_parallel_size"]) == par["reward"].infer.tp
    else:
        assert o[f"{rm}.enable"] == "false" and o["reward.custom_reward_function.path"] == "$REWARD_FN"
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
        if backend == "verl-0.9.1-megatron":
            assert int(o[f"{prefix}.megatron.tensor_model_parallel_size"]) == train.tp
            assert int(o[f"{prefix}.megatron.pipeline_model_parallel_size"]) == train.pp
        else:
            fsdp = "actor_rollout_ref.actor.fsdp_config" if role == "actor" else "critic.fsdp"
            assert int(o[f"{fsdp}.fsdp_size"]) == (train.shard_group if train.shard == "hybrid" else -1)
            assert (train.tp, train.pp) == (1, 1)


def check_openrlhf_command(plan, command: str) -> None:
    f = openrlhf_flags(command)
    assert set(f) <= known("openrlhf-0.11.2")
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
    assert o["critic.fsdp.fsdp_size"] == "-1"
    assert o["critic.fsdp.reshard_after_forward"] == "false"
    assert (o["trainer.nnodes"], o["trainer.n_gpus_per_node"]) == ("4", "8")


# -- the CLI ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["verl", "openrlhf"])
def test_export_prints_the_command_and_writes_the_file(target_plans, tmp_path, target):
    out = tmp_path / ("run.yaml" if target == "verl" else "run.sh")
    result = invoke("export", target_plans[target], "--to", target, "--out", out)
    assert result.exit_code == 0, result.output
    from hfplan.plan import load_plan

    plan = load_plan(target_plans[target])
    CHECKS[target](plan, result.stdout)
    release = "verl 0.9.1 (pip install verl==0.9.1)" if target == "verl" else \
        "OpenRLHF 0.11.2 (pip install openrlhf==0.11.2)"
    assert f"written for {release}" in result.stdout.splitlines()[0]
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


def test_a_plan_outside_the_target_is_refused_with_the_hint(target_plans):
    result = invoke("export", target_plans["hfplan"], "--to", "openrlhf")
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
def test_bad_input_is_one_line(target_plans, tmp_path, args, needles):
    args = [str(target_plans["verl"]) if a == "PLAN" else str(tmp_path) if a == "FOLDER" else a for a in args]
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
        "reward": RoleParallelism(infer=InferConfig(tp=2, dp=4, micro_batch=2))})  # vLLM servers: one stage
    config, o = verl_overrides(export_plan(plan, "verl").command)
    assert config == "ppo_megatron_trainer"
    megatron = "actor_rollout_ref.actor.megatron"
    assert o[f"{megatron}.virtual_pipeline_model_parallel_size"] == "3"
    assert o[f"{megatron}.override_transformer_config.recompute_granularity"] == "selective"
    assert "critic.megatron.virtual_pipeline_model_parallel_size" not in o
    assert o["critic.megatron.override_transformer_config.recompute_granularity"] == "full"
    assert o["reward.reward_model.rollout.tensor_model_parallel_size"] == "2"
    assert set(o) <= known("verl-0.9.1-megatron")


# -- every key and flag of a range of plans is in the release's list ----------------------------------------
def _rule_reward(algorithm: str):
    from tests.support.plans import small_workload

    models = {"actor": "qwen2.5-0.5b", "reference": "qwen2.5-0.5b", "reward": "rule:vowel-fraction"}
    return small_workload(algorithm, models=models | ({"critic": "qwen2.5-0.5b"} if algorithm == "ppo" else {}))


RULE_CASES = [(target, algorithm) for target in ("verl", "openrlhf") for algorithm in ("ppo", "grpo")] + \
    [("verl", "remax")]


@pytest.mark.parametrize(("target", "algorithm"), RULE_CASES, ids=[f"{t}-{a}" for t, a in RULE_CASES])
def test_rule_reward_plans_write_only_the_releases_keys(target, algorithm):
    workload = _rule_reward(algorithm)
    result = search_target(get_target(target, workload), workload, make_cluster(8, "a100-80g"), top_k=2)
    for plan in result.top:
        out = export_plan(plan, target)
        CHECKS[target](plan, out.command)  # the keys in the list, pools and batches as planned
        if target == "openrlhf":
            assert openrlhf_flags(out.command)["--reward.remote_url"] == "$REWARD_URL"


def test_a_reward_model_in_its_own_pool_is_the_reward_loops_pool():
    """verl 0.9.1: reward.reward_model.enable_resource_pool with its nnodes x n_gpus_per_node, and vLLM servers of
    the reward's tensor-parallel size; the FSDP roles keep FSDP although the reward runs tp=4."""
    from hfplan.plan import InferConfig, RoleParallelism

    workload = load_workload("ppo-llama2-7b")
    plan = build_plan(workload, [(["actor", "critic", "reference"], 32), (["reward"], 16)], tp=1,
                      batching="continuous", kv_cache="paged",
                      overrides={"reward": RoleParallelism(infer=InferConfig(tp=4, dp=4, micro_batch=4))})
    command = export_plan(plan, "verl").command
    check_verl_command(plan, command)
    config, o = verl_overrides(command)
    assert config == "ppo_trainer"
    assert (o["reward.reward_model.nnodes"], o["reward.reward_model.n_gpus_per_node"]) == ("2", "8")
    assert o["reward.reward_model.rollout.tensor_model_parallel_size"] == "4"


def test_keys_the_releases_dropped_are_refused_by_the_exporters_check():
    """The guard every export runs: verl 0.9.1 has no reward-model micro-batch or Megatron reward keys (the reward
    loop replaced them) and no critic.model.fsdp_config; the check names what is missing."""
    from hfplan.export.common import check_known

    gone = ["reward_model.micro_batch_size_per_gpu", "reward_model.megatron.tensor_model_parallel_size",
            "critic.model.fsdp_config.fsdp_size"]
    for name in ("verl-0.9.1-fsdp", "verl-0.9.1-megatron"):
        with pytest.raises(AssertionError, match="reward_model.micro_batch_size_per_gpu"):
            check_known(gone, name)
        assert not set(gone) & known(name)
    check_known(["--actor.adam.lr", "--critic.adam.lr"], "openrlhf-0.11.2")  # flags made in a loop over roles


# -- scripts/export_keys.py ------------------------------------------------------------------------------
def _script():
    from tests.support.scripts import ROOT, load_script

    return load_script(ROOT / "scripts" / "export_keys.py", "export_keys")


def test_the_script_reads_leaf_keys_from_yaml():
    script = _script()
    text = "a:\n  b: 1\n  c:\n    d: null\n  e: {}\n  f: [1, 2]\nlast: ???\n"
    assert script.yaml_keys(text) == ["a.b", "a.c.d", "a.e", "a.f", "last"]
    with pytest.raises(script.ExtractError, match="not a mapping"):
        script.yaml_keys("- a\n- b\n")


def test_the_script_reads_argparse_flags_without_running_the_code():
    script = _script()
    source = '''
import argparse
raise SystemExit("never run")
parser = argparse.ArgumentParser()
parser.add_argument("--train.batch_size", type=int)
parser.add_argument("-v", "--verbose", action="store_true")
parser.add_argument("data")  # positional: not a flag
for role in ("actor", "critic"):
    parser.add_argument(f"--{role}.adam.lr", type=float)
    parser.add_argument(f"--{role}.no_x", dest=f"{role}.x", action="store_false")
'''
    assert script.argparse_flags(source) == ["--actor.adam.lr", "--actor.no_x", "--critic.adam.lr",
                                             "--critic.no_x", "--train.batch_size", "--verbose", "-v"]
    for unreadable in ('for r in roles():\n    p.add_argument(f"--{r}.lr")\n', 'p.add_argument(FLAG)\n',
                       'p.add_argument(f"--{x!r}")\n'):
        with pytest.raises(script.ExtractError, match="line"):
            script.argparse_flags(unreadable)


def test_the_script_writes_lists_that_name_the_release_and_wheel(tmp_path):
    """A wheel made here (a zip: the platform wheel's purelib layout) -> the list with its header; a wheel of
    another release, or one without the file, is one line and exit 2."""
    import hashlib
    import zipfile

    script = _script()
    wheel = tmp_path / "openrlhf-9.9-cp311-cp311-manylinux1_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("openrlhf-9.9.data/purelib/openrlhf/cli/train_ppo_ray.py", 'p.add_argument("--a.b")\n')
    out = tmp_path / "known"
    out.mkdir()
    assert script.main(["openrlhf", "9.9", "--wheel", str(wheel), "--out", str(out)]) == 0
    lines = (out / "openrlhf-9.9.txt").read_text().splitlines()
    assert lines[-1] == "--a.b" and all(line.startswith("#") for line in lines[:-1])
    header = " ".join(lines[:-1])
    assert "openrlhf 9.9" in header and wheel.name in header and "openrlhf/cli/train_ppo_ray.py" in header
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() in header
    assert script.main(["openrlhf", "9.8", "--wheel", str(wheel), "--out", str(out)]) == 2
    assert script.main(["verl", "9.9", "--wheel", str(tmp_path / "verl-9.9-py3-none-any.whl"), "--out",
                        str(out)]) == 2  # no such file
    with zipfile.ZipFile(tmp_path / "verl-9.9-py3-none-any.whl", "w") as z:
        z.writestr("verl/other.yaml", "a: 1\n")
    assert script.main(["verl", "9.9", "--wheel", str(tmp_path / "verl-9.9-py3-none-any.whl"), "--out",
                        str(out)]) == 2
