"""What makes a run trustworthy: checkpoints verified by checksum before torch or Ray start, a choice of
checkpoint to resume from, a run that stops at a non-finite metric, fast one-line refusals (a cluster that is
not there, an --out without its parent, prompts longer than the workload's), no run folder left by a run that
never ran, progress and summaries that say what they show, and `hfplan cost`'s checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint import _demo_prompts, plan_one_rank, write_checkpoint

from hfplan import cli
from hfplan.dataflow.rewards import get_rule
from hfplan.executor import preflight, resume
from hfplan.executor.controller import ExecuteOptions, IterationReport, RunSummary, check_finite
from hfplan.executor.errors import RunFailed
from tests.support.cli import assert_user_error, invoke
from tests.support.executor_runs import cpu_plan, tiny_workload


def _plan_file(tmp_path: Path, plan) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return path


def _two_checkpoints(tmp_path: Path):
    plan = plan_one_rank()
    out = tmp_path / "run"
    for iteration in (1, 2):
        write_checkpoint(out, plan, iteration, prompts=_demo_prompts(plan))
    return plan, out


def _shard(folder: Path) -> Path:
    return next((folder / "roles" / "actor").glob("*.distcp"))


@pytest.mark.parametrize("harm", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_naming_its_file_and_the_newest_intact_one(tmp_path, harm):
    plan, out = _two_checkpoints(tmp_path)
    shard = _shard(resume.latest(out))
    data = bytearray(shard.read_bytes())
    if harm == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2:]
    shard.write_bytes(bytes(data))
    line = assert_user_error(invoke("execute", _plan_file(tmp_path, plan), "--out", out, "--resume",
                                    "--iterations", 4),
                             f"roles/actor/{shard.name} does not match its checksum", "--resume 1")
    assert "iteration-000002 is damaged" in line
    assert not (out / "workers.json").exists()


def test_the_checksum_refusal_comes_before_torch_and_ray_are_imported(tmp_path):
    plan, out = _two_checkpoints(tmp_path)
    _shard(resume.latest(out)).write_bytes(b"not a shard")
    script = ("import sys; from hfplan.cli import app\n"
              "code = app(sys.argv[1:], standalone_mode=False)\n"
              "print(code, [m for m in ('torch', 'ray', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", script, "execute", str(_plan_file(tmp_path, plan)), "--out",
                           str(out), "--resume", "--iterations", "4"], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent.parent)
    assert done.stdout.strip() == "2 []", (done.stdout, done.stderr)
    assert "is damaged" in done.stderr


def test_resume_takes_latest_an_iteration_or_a_folder(tmp_path):
    _, out = _two_checkpoints(tmp_path)
    assert resume.chosen_checkpoint(out, "latest").name == "iteration-000002"
    assert resume.chosen_checkpoint(out, "1").name == "iteration-000001"
    folder = out / "checkpoints" / "iteration-000001"
    assert resume.chosen_checkpoint(tmp_path / "elsewhere", str(folder)) == folder
    with pytest.raises(resume.HfplanError, match=r"no complete checkpoint of iteration 7 \(complete: 1, 2\)"):
        resume.chosen_checkpoint(out, "7")
    with pytest.raises(resume.HfplanError, match="not latest, an iteration number, or a checkpoint folder"):
        resume.chosen_checkpoint(out, "nowhere")


def test_resume_without_a_value_means_latest_and_takes_one_when_given():
    fill = cli._with_optional_values
    assert fill(["execute", "p.json", "--resume"]) == ["execute", "p.json", "--resume", "latest"]
    assert fill(["execute", "p.json", "--resume", "--iterations", "4"]) == [
        "execute", "p.json", "--resume", "latest", "--iterations", "4"]
    assert fill(["execute", "p.json", "--resume", "3"]) == ["execute", "p.json", "--resume", "3"]


def test_a_format_1_checkpoint_without_checksums_still_reads(tmp_path):
    plan = plan_one_rank()
    write_checkpoint(tmp_path, plan, 1)
    folder = resume.latest(tmp_path)
    manifest = json.loads((folder / resume.MANIFEST_FILE).read_text())
    assert manifest["format"] == 2 and set(manifest["files"]) >= {"controller.json", "rng/set-0-rank-0.pt"}
    manifest["format"] = 1
    del manifest["files"]
    (folder / resume.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert resume.read_checkpoint(folder).manifest.iteration == 1


def _report(**metrics) -> IterationReport:
    return IterationReport(3, {"iteration": 3, "reward": 0.5} | metrics, [])


def test_a_non_finite_metric_stops_the_run_naming_role_and_metric():
    check_finite(_report(**{"actor/policy_loss": 0.1}))
    with pytest.raises(RunFailed, match=r"iteration 3: role actor's grad_norm is nan \(and critic/value_loss\)"):
        check_finite(_report(**{"actor/grad_norm": float("nan"), "critic/value_loss": float("inf")}))
    with pytest.raises(RunFailed, match="iteration 3: reward is inf"):
        check_finite(_report(reward=float("inf")))


def test_a_run_that_diverges_stops_there_with_strict_json_and_its_last_good_checkpoint(tmp_path, ray_cluster,
                                                                                         shared_runs):
    """Five good iterations and their checkpoint (a copy of test_execute's one-process PPO run); resumed at a
    learning rate that blows the weights up in the first mini-batch's step, the second mini-batch's loss is not
    finite: the run stops at that iteration."""
    plan = cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)])
    plan_file = _plan_file(tmp_path, plan)
    out = tmp_path / "run"
    shutil.copytree(shared_runs.get(plan, iterations=5).out, out)
    result = invoke("execute", plan_file, "--out", out, "--iterations", 7, "--resume", "--address", ray_cluster,
                    "--set", "actor_lr=1e30", "--log-every", 1)
    assert result.exit_code == 1, result.output
    assert "resumed from" in result.stderr and "(5 iterations done)" in result.stderr, result.stderr
    assert "run failed: iteration 5: role actor's" in result.stderr, result.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON {name}")) for line in lines]
    assert [row["iteration"] for row in rows] == [0, 1, 2, 3, 4]
    assert [p.name for p in resume.complete_checkpoints(out)] == ["iteration-000005"]
    assert "iteration-000005" in result.stderr  # the hint names the last good checkpoint


def test_an_address_nobody_answers_is_refused_at_once(tmp_path):
    plan = plan_one_rank()
    assert_user_error(invoke("execute", _plan_file(tmp_path, plan), "--out", tmp_path / "run", "--address",
                             "127.0.0.1:1", "--connect-timeout", 2), "--address 127.0.0.1:1: no Ray cluster there")
    assert not (tmp_path / "run").exists()


def test_out_is_made_but_never_its_parents(tmp_path):
    plan = plan_one_rank()
    assert_user_error(invoke("execute", _plan_file(tmp_path, plan), "--out", tmp_path / "a" / "b"),
                      "folder", "does not exist", "never the folders above it")
    assert not (tmp_path / "a").exists()


def test_a_run_refused_after_ray_starts_leaves_no_run_folder(tmp_path, ray_cluster):
    plan = cpu_plan(tiny_workload(batch_prompts=16, mini_batches=1), [(("actor", "critic", "reference"), 16)])
    out = tmp_path / "run"
    assert_user_error(invoke("execute", _plan_file(tmp_path, plan), "--out", out, "--address", ray_cluster),
                      "the plan needs 16 CPU worker slots")
    assert not out.exists()


@pytest.mark.parametrize("choice", ["truncate", "refuse"])
def test_prompts_longer_than_prompt_len_are_counted_and_truncated_or_refused(tmp_path, choice):
    plan = plan_one_rank()  # prompt_len 8: each byte is a token, after <bos>
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["short", "a much longer prompt", "abc"]))
    options = ExecuteOptions(data=str(data), long_prompts=choice, out=tmp_path / "run")
    inputs = preflight.check_inputs(plan, options)
    if choice == "refuse":
        with pytest.raises(preflight.HfplanError, match=r"1 of 3 prompts are longer than .* prompt_len of 8"):
            preflight.with_codecs(plan, inputs, options)
        return
    checked = preflight.with_codecs(plan, inputs, options)
    assert checked.truncated.startswith("1 of 3 prompts are longer than the workload's prompt_len of 8 tokens (the "
                                        "longest has 21): each keeps its last 8 tokens")
    assert checked.encode(["a much longer prompt"]).shape == (1, 8)


def test_the_summary_compares_windows_that_share_no_iteration(capsys):
    plan = plan_one_rank()
    rows = [{"reward": r, "iteration_s": 1.0, "tokens_per_s": 1.0} for r in (0.1, 0.2, 0.3)]
    cli.render_run(RunSummary(Path("run"), iterations=rows), plan)
    shown = capsys.readouterr().out
    assert "last 1 iterations: 0.3000 vs 0.1000 in the first 1" in shown
    cli.render_run(RunSummary(Path("run"), iterations=rows[:1]), plan)
    assert "1 iteration: too few to compare" in capsys.readouterr().out


def test_arith_close_gives_partial_credit_and_full_credit_only_for_the_answer():
    close, exact = get_rule("arith-close"), get_rule("arith-exact")
    assert close("add 3 5 =", "8") == exact("add 3 5 =", "8") == 1.0
    assert close("add 3 5 =", "12 7") == pytest.approx(1 - 4 / 40) and exact("add 3 5 =", "12") == 0.0
    assert close("sub 9 2 =", "=") == 0.0 and close("mul 1 2 =", "2") == 0.0
    assert close("add 0 0 =", "40") == 0.0


@pytest.mark.parametrize(("args", "needle"), [
    (["train", "--tp", "3"], "--tp 3 on llama2-7b: tp=3 does not divide the 32 attention heads"),
    (["forward", "--seq-len", "100000"], "--seq-len = 100,000 tokens exceeds the context length of llama2-7b"),
    (["generate", "--prompt-len", "4000", "--response-len", "1000"], "exceeds the context length"),
])
def test_cost_makes_the_checks_search_makes(args, needle):
    assert_user_error(invoke("cost", *args), needle)


def test_cost_says_when_a_call_does_not_fit():
    result = invoke("cost", "train", "--model", "llama2-70b", "--batch", 64)
    assert result.exit_code == 0, result.output
    assert "does not fit:" in result.stdout
    fitting = json.loads(invoke("cost", "forward", "--json").stdout)
    assert fitting["detail"]["fits"] is True


def test_counts_and_small_memories_read_as_words():
    assert (cli.gpus_text(1), cli.gpus_text(2048)) == ("1 GPU", "2,048 GPUs")
    assert (cli.memory_text(0.004), cli.memory_text(12.34)) == ("4.1 MiB", "12.3 GiB")


def test_the_readme_demo_outputs_are_ignored_by_git():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "check-ignore", "demo.json", "run/metrics.jsonl"], cwd=root, capture_output=True,
                          text=True, timeout=30)
    if done.returncode == 128:
        pytest.skip("not a git checkout")
    assert done.stdout.split() == ["demo.json", "run/metrics.jsonl"]


def test_ctrl_c_while_ray_starts_leaves_no_process_and_no_run_folder(tmp_path):
    """On a Ray of the run's own: once its first processes are up (before any worker), SIGINT to the process
    group, as a terminal's Ctrl-C sends it."""
    import os
    import signal

    from tests.support.processes import start_cli, stop_all, tagged, wait_for

    plan_file = _plan_file(tmp_path, plan_one_rank())
    out = tmp_path / "run"
    cli = start_cli(tmp_path / "log", "execute", plan_file, "--out", out, "--iterations", 50)
    try:
        wait_for(lambda: len(tagged(cli.tag)) > 1, 60, "Ray's first processes")
        os.killpg(cli.proc.pid, signal.SIGINT)
        code = cli.wait(60)
        wait_for(lambda: not tagged(cli.tag), 30, "the end of every process of the run")
    finally:
        stop_all(cli)
    assert code == 130, cli.output()
    assert not out.exists(), sorted(p.name for p in out.iterdir())
