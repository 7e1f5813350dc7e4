"""Checkpoints without Ray: a trained role's DCP round trip (and into another data-parallel size), the folder
format (commit, keep, latest), safe loading, the refusals of a checkpoint of another run, HF export."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from test_engine_training import HP, LR, actor_batch, full_params

from hfplan.executor import checkpoint, resume
from hfplan.executor.engines.training import RoleModel
from hfplan.executor.export_model import export_checkpoint
from hfplan.executor.local import single_process_world
from hfplan.executor.models import build_model
from hfplan.executor.tokenizers import build_tokenizer
from hfplan.layout import facts_of
from tests.support.cli import assert_user_error, invoke
from tests.support.engine_models import PAD, dp_mesh, llama_actor
from tests.support.executor_runs import cpu_plan, tiny_workload
from tests.support.worlds import run_world

PROMPTS = ["one", "two", "three"]


def trained(model, world: int = 1, shard: bool = True, lr: float = LR) -> RoleModel:
    return RoleModel(model, dp_mesh(world, shard), HP, "cpu", torch.float32, pad_id=PAD, lr=lr)


def step(role: RoleModel, batch: dict) -> None:
    role.update_actor(batch, mini_batches=1, epochs=1, micro_batch=2, use_kl_loss=True)


def optimizer_tensors(role: RoleModel) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(role.module, role.optimizer, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}.{key}": value.detach().clone() for fqn, entry in state["state"].items()
            for key, value in entry.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


def test_a_trained_role_comes_back_exactly_and_keeps_this_runs_learning_rate(tmp_path):
    batch = actor_batch()
    with single_process_world():
        saved = trained(llama_actor(seed=0))
        step(saved, batch)
        checkpoint.save_trained(saved, tmp_path / "actor")
        loaded = trained(llama_actor(seed=1), lr=LR / 2)  # other weights, another learning rate
        checkpoint.load_trained(loaded, tmp_path / "actor")
        assert_same(full_params(saved.module), full_params(loaded.module))
        assert_same(optimizer_tensors(saved), optimizer_tensors(loaded))
        assert loaded.optimizer.param_groups[0]["lr"] == LR / 2
        loaded.optimizer.param_groups[0]["lr"] = LR
        step(saved, batch)
        step(loaded, batch)
        assert_same(full_params(saved.module), full_params(loaded.module))


def _two_rank_run(rank: int, world: int, folder: str, batch: dict) -> dict:
    """Sharded over 2 ranks: one step, a checkpoint, then a second step; the weights after it."""
    role = trained(llama_actor(seed=0), world=world, shard=True)
    local = {k: v.chunk(world)[rank] for k, v in batch.items()}
    step(role, local)
    checkpoint.save_trained(role, checkpoint.role_folder(Path(folder), "actor"))
    step(role, local)
    return full_params(role.module)


@pytest.mark.slow
def test_a_two_rank_checkpoint_continues_on_one_rank(tmp_path):
    """Saved by 2 FSDP ranks, loaded by 1 (sharded or replicated): the next step gives the 2-rank run's weights."""
    batch = actor_batch()
    after_two_ranks = run_world(_two_rank_run, 2, str(tmp_path), batch, timeout=180)[0]
    with single_process_world():
        for shard in (True, False):
            role = trained(llama_actor(seed=1), world=1, shard=shard)
            checkpoint.load_trained(role, checkpoint.role_folder(tmp_path, "actor"))
            step(role, batch)
            assert_same(after_two_ranks, full_params(role.module), atol=1e-6)


# The folder format.
def plan_one_rank(models: dict | None = None, algorithm: str = "ppo"):
    return cpu_plan(tiny_workload(algorithm, models), [(("actor", "critic", "reference"), 1)] if algorithm == "ppo"
                    else [(("actor", "reference"), 1)])


def write_checkpoint(out, plan, iteration: int, seed: int = 0, prompts=PROMPTS, keep: int = 2) -> dict:
    """A complete checkpoint of a one-rank plan, written by the library's own writers, of trained roles whose
    weights were moved off their initial values; returns those weights per role."""
    run = resume.run_identity(plan, seed, list(prompts))
    partial = resume.start_partial(out, iteration)
    weights = {}
    with single_process_world():
        for role in plan.workload.model_roles:
            facts = facts_of(plan.workload, role)
            if not facts.trains:
                continue
            role_state = trained(build_model(plan.workload.models[role], facts.head, seed=seed))
            with torch.no_grad():
                for param in role_state.module.parameters():
                    param.mul_(1.1).add_(0.01)
            checkpoint.save_trained(role_state, checkpoint.role_folder(partial, role))
            weights[role] = full_params(role_state.module)
    generator = torch.Generator().manual_seed(5)
    checkpoint.save_rng(checkpoint.rng_file(partial, 0, 0), {"actor": generator})
    snapshot = resume.controller_snapshot(iteration, 4 * iteration, None, [{"iteration": i} for i in range(iteration)],
                                          [])
    resume.commit(partial, resume.manifest_of(plan, run, iteration), snapshot, keep)
    return weights


def test_commit_renames_keeps_the_newest_and_ignores_partial_folders(tmp_path):
    plan = plan_one_rank()
    run = resume.run_identity(plan, 0, PROMPTS)
    for iteration in (2, 4, 6):
        partial = resume.start_partial(tmp_path, iteration)
        snapshot = resume.controller_snapshot(iteration, iteration, 0.5, [], [])
        resume.commit(partial, resume.manifest_of(plan, run, iteration), snapshot, keep=2)
    resume.start_partial(tmp_path, 8)  # a run stopped while writing its next checkpoint
    names = sorted(p.name for p in resume.checkpoints_folder(tmp_path).iterdir())
    assert names == [".partial-iteration-000008", "iteration-000004", "iteration-000006"]
    assert resume.latest(tmp_path).name == "iteration-000006"
    resume.clear_partial(tmp_path)
    assert sorted(p.name for p in resume.checkpoints_folder(tmp_path).iterdir()) == ["iteration-000004",
                                                                                       "iteration-000006"]


def test_a_checkpoint_reads_back_with_its_controller_state(tmp_path):
    plan = plan_one_rank()
    write_checkpoint(tmp_path, plan, 3)
    found = resume.read_checkpoint(resume.latest(tmp_path))
    assert found.manifest.iteration == found.controller.iteration == 3
    assert found.controller.data_position == 12
    assert found.manifest.trained_roles == ["actor", "critic"]
    assert found.same_layout(plan)
    assert not found.same_layout(cpu_plan(plan.workload, [(("actor", "critic", "reference"), 2)]))
    resume.check_matches(found, resume.run_identity(plan, 0, PROMPTS), iterations=4)


def test_safe_rlhf_multiplier_and_metrics_survive_the_round_trip(tmp_path):
    plan = plan_one_rank()
    run = resume.run_identity(plan, 0, PROMPTS)
    metrics = [{"iteration": 0, "reward": 0.25, "lagrange": 1.0 / 3.0}]
    partial = resume.start_partial(tmp_path, 1)
    resume.commit(partial, resume.manifest_of(plan, run, 1), resume.controller_snapshot(1, 4, 1.0 / 3.0, metrics,
                                                                                        []), keep=1)
    snapshot = resume.ControllerSnapshot.model_validate_json(
        (resume.latest(tmp_path) / resume.CONTROLLER_FILE).read_text())
    assert snapshot.lagrange == 1.0 / 3.0
    assert snapshot.metrics == metrics
    assert isinstance(snapshot.metrics[0]["iteration"], int)


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch EVIL_RAN",))


def test_a_pickled_payload_in_the_metadata_is_refused_unexecuted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "actor"
    folder.mkdir()
    (folder / checkpoint.METADATA_FILE).write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="posix.system|os.system"):
        checkpoint.read_metadata(folder)
    assert not (tmp_path / "EVIL_RAN").exists()


def test_a_pickled_payload_in_an_rng_file_or_a_value_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"torch": _Evil()}, tmp_path / "rng.pt")
    with pytest.raises(checkpoint.UnsafeCheckpoint):
        checkpoint.read_rng(tmp_path / "rng.pt")
    buffer = io.BytesIO()
    torch.save(_Evil(), buffer)
    buffer.seek(0)
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "optim.param_groups.lr"})()})()
    with pytest.raises(checkpoint.UnsafeCheckpoint):
        checkpoint.SafeLoadPlanner().load_bytes(item, buffer)
    assert not (tmp_path / "EVIL_RAN").exists()


def test_a_tampered_checkpoint_is_refused_in_one_line_before_any_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = plan_one_rank()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    out = tmp_path / "run"
    write_checkpoint(out, plan, 1, prompts=_demo_prompts(plan))
    folder = resume.latest(out)
    torch.save({"torch": _Evil()}, checkpoint.rng_file(folder, 0, 0))
    assert_user_error(invoke("execute", plan_file, "--out", out, "--resume", "--iterations", 2),
                      "is damaged", "rng/set-0-rank-0.pt does not match its checksum")
    # A manifest rewritten with the new file's checksum passes that check; the safe loader still refuses it.
    manifest = json.loads((folder / resume.MANIFEST_FILE).read_text())
    manifest["files"] = resume.folder_digests(folder)
    (folder / resume.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert_user_error(invoke("execute", plan_file, "--out", out, "--resume", "--iterations", 2),
                      "checkpoint refused")
    assert not (out / "workers.json").exists()
    assert not (tmp_path / "EVIL_RAN").exists()


def _demo_prompts(plan) -> list[str]:
    from hfplan.executor.prompts import builtin_prompts

    return builtin_prompts(plan.workload.models["actor"])


@pytest.mark.parametrize(("other", "args", "needle"), [
    ({"models": {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "rule:distinct-chars"}}, [],
     "reward model rule:vowel-fraction"),
    ({"algorithm": "grpo", "models": {"actor": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"}}, [],
     "ppo run"),
    ({}, ["--seed", 3], "--seed 0"),
    ({}, ["--iterations", 2], "has done 2 iterations"),
])
def test_a_checkpoint_of_another_run_is_refused_in_one_line(tmp_path, other, args, needle):
    plan = plan_one_rank()
    out = tmp_path / "run"
    write_checkpoint(out, plan, 2, prompts=_demo_prompts(plan))
    resumed = plan_one_rank(other.get("models"), other.get("algorithm", "ppo"))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(resumed.to_json())
    assert_user_error(invoke("execute", plan_file, "--out", out, "--resume", "--iterations", 4, *args), needle)
    assert not (out / "workers.json").exists()


def test_resume_needs_a_checkpoint_and_a_fresh_run_needs_a_folder_without_one(tmp_path):
    plan = plan_one_rank()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    assert_user_error(invoke("execute", plan_file, "--out", tmp_path / "empty", "--resume"), "no complete checkpoint")
    write_checkpoint(tmp_path / "run", plan, 1, prompts=_demo_prompts(plan))
    assert_user_error(invoke("execute", plan_file, "--out", tmp_path / "run"), "--resume")


def test_export_writes_hugging_face_folders_that_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    plan = plan_one_rank()
    weights = write_checkpoint(tmp_path / "run", plan, 1)
    folders = export_checkpoint(resume.latest(tmp_path / "run"), tmp_path / "hf")
    assert set(folders) == {"actor", "critic"}
    for role, loader in (("actor", AutoModelForCausalLM), ("critic", AutoModelForTokenClassification)):
        assert (folders[role] / "model.safetensors").is_file()
        assert json.loads((folders[role] / "config.json").read_text())["architectures"]
        model = loader.from_pretrained(folders[role])
        assert_same(weights[role], {n: p.detach() for n, p in model.named_parameters()})
    tokenizer = AutoTokenizer.from_pretrained(folders["actor"])
    assert tokenizer("hello").input_ids == build_tokenizer("tiny")("hello").input_ids


def test_export_model_command(tmp_path):
    plan = plan_one_rank()
    write_checkpoint(tmp_path / "run", plan, 1)
    result = invoke("export-model", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "hf" / "actor" / "model.safetensors").is_file()
    assert str(tmp_path / "run" / "hf" / "critic") in result.output
    assert_user_error(invoke("export-model", tmp_path / "nothing"), "not a run folder")


def test_a_resumed_controller_continues_the_data_order_and_the_multiplier():
    from hfplan.executor import preflight
    from hfplan.executor.controller import ExecuteOptions, start_progress

    plan = plan_one_rank()
    options = ExecuteOptions(iterations=10, seed=4)
    checked = preflight.check(plan, options)
    whole = start_progress(plan, checked, options)
    batches = [whole.stream.next_batch() for _ in range(15)]  # past the end of the data: a second shuffle
    assert len(checked.prompts) < 15 * plan.workload.batch_prompts
    snapshot = resume.controller_snapshot(5, 5 * plan.workload.batch_prompts, 0.125, [], [])
    resumed = start_progress(plan, checked, options, snapshot)
    assert (resumed.iteration, resumed.state.lagrange) == (5, 0.125)
    assert [resumed.stream.next_batch() for _ in range(10)] == batches[5:]
