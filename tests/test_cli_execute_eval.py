"""`hfplan execute --eval-data PATH --eval-every 1` end to end on the session's Ray cluster: the evaluation's fields
in every iteration's row of metrics.jsonl and metrics.csv, its answers in samples.jsonl, its spans apart in
timeline.json, its keys in run_config.json; and every training metric (but the clocks) equal to those of the same
run without evaluation."""

from __future__ import annotations

import csv
import json

import pytest

from hfplan.dataflow.rewards import get_rule
from tests.support.cli import invoke
from tests.support.executor_runs import cpu_plan, tiny_workload

pytest.importorskip("torch", reason="hfplan execute needs the execute extra")

REWARD = f"{__name__}:held_out_reward"
TIMING = ("_s", "tokens_per_s")  # metric names that are clocks, different in any two runs
HELD_OUT = [{"prompt": f"held-out {i}", "value": 0.25 * i} for i in range(5)]  # 5: a chunk of 4 and one filled up


def held_out_reward(prompts: list[str], responses: list[str], columns: dict[str, list]) -> list[float]:
    """The training prompts (no columns): the demo's vowel fraction; the held-out ones: their `value` column, so the
    evaluation's reward says which column values reached which answers."""
    values = columns.get("value") or [None] * len(prompts)
    rule = get_rule("vowel-fraction")
    return [rule(p, r) if v is None else float(v) for p, r, v in zip(prompts, responses, values, strict=True)]


def _run(plan_file, out, address, *more) -> list[dict]:
    result = invoke("execute", plan_file, "--iterations", 2, "--out", out, "--seed", 3, "--logger", "jsonl,csv",
                    "--address", address, *more)
    assert result.exit_code == 0, result.output
    assert ("eval/reward after the last iteration" in result.stdout) == bool(more)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _training(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("eval") and not k.endswith(TIMING)}


@pytest.mark.slow
def test_eval_rows_and_training_unchanged(tmp_path, ray_driver):
    plan = cpu_plan(tiny_workload(models={"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": REWARD}),
                    [(("actor", "critic", "reference"), 1)])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in HELD_OUT))

    run = tmp_path / "eval"
    rows = _run(plan_file, run, ray_driver, "--eval-data", held_out, "--eval-every", 1, "--samples", 5)
    plain = _run(plan_file, tmp_path / "plain", ray_driver)

    assert [r["iteration"] for r in rows] == [0, 1]  # one row per iteration, the evaluation's fields in it
    assert [_training(r) for r in rows] == [_training(r) for r in plain]
    assert {k for k in rows[0] if k.startswith("eval")} == {"eval/reward", "eval/response_len", "eval_s"}
    assert all(not k.startswith("eval") for k in plain[0])
    mean = sum(row["value"] for row in HELD_OUT) / len(HELD_OUT)
    for row in rows:
        assert row["eval/reward"] == pytest.approx(mean, rel=1e-6)  # each answer scored with its own prompt's value
        assert 0 < row["eval/response_len"] <= plan.workload.response_len
        assert row["eval_s"] > 0 and row["iteration_s"] > 0
    with (run / "metrics.csv").open(newline="") as stream:
        table = list(csv.DictReader(stream))
    assert list(table[0]) == list(rows[0])
    assert [float(r["eval/reward"]) for r in table] == [r["eval/reward"] for r in rows]

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    answers = [s for s in samples if s.get("eval")]
    assert [(s["iteration"], s["row"]) for s in answers] == [(i, row) for i in (0, 1) for row in range(5)]
    assert [s["reward"] for s in answers[:5]] == pytest.approx([row["value"] for row in HELD_OUT])
    assert len([s for s in samples if "eval" not in s]) == 2 * 4  # the training samples as without evaluation

    timeline = json.loads((run / "timeline.json").read_text())["iterations"]
    plain_timeline = json.loads((tmp_path / "plain" / "timeline.json").read_text())["iterations"]
    def calls(spans: list[dict]) -> list[tuple[str, str]]:
        return sorted((s["role"], s["op"]) for s in spans)

    for entry, other in zip(timeline, plain_timeline, strict=True):
        assert calls(entry["spans"]) == calls(other["spans"])  # the evaluation's are apart
        assert "eval_spans" not in other
        assert {(s["role"], s["op"]) for s in entry["eval_spans"] if s["kind"] == "compute"} == {
            ("actor", "generate"), ("reward", "score")}
    config = json.loads((run / "run_config.json").read_text())
    assert (config["eval_data"], config["eval_every"]) == (str(held_out), 1)


@pytest.mark.slow
def test_eval_with_a_reward_model_on_a_separate_rollout_set(tmp_path, ray_driver):
    """The reward's forward pass scores the answers; the rollout set is synced for each evaluation and again for the
    next training generation, so every training iteration keeps its weight sync."""
    from hfplan.executor.controller import ExecuteOptions, execute
    from hfplan.layout import ROLLOUT
    from hfplan.plan import WEIGHT_SYNC_OP

    plan = cpu_plan(tiny_workload(models={"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "tiny"}),
                    [(("actor", "critic", "reference", "reward"), 1), ((ROLLOUT,), 1)])
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": row["prompt"]}) + "\n" for row in HELD_OUT[:3]))
    run = tmp_path / "run"
    summary = execute(plan, ExecuteOptions(iterations=2, out=run, eval_data=str(held_out), eval_every=1, samples=1,
                                           call_timeout_s=120, start_timeout_s=120))
    assert all({"eval/reward", "eval/response_len", "eval_s"} <= set(row) for row in summary.iterations)
    for entry in json.loads((run / "timeline.json").read_text())["iterations"]:
        for key in ("spans", "eval_spans"):
            syncs = [s for s in entry[key] if s["role"] == ROLLOUT and s["op"] == WEIGHT_SYNC_OP]
            assert len(syncs) == 1, (entry["iteration"], key)
        assert ("reward", "score") in {(s["role"], s["op"]) for s in entry["eval_spans"]}
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    answers = [s for s in samples if s.get("eval")]
    assert [(s["iteration"], s["row"]) for s in answers] == [(0, 0), (1, 0)]
    assert answers[0]["prompt"] == HELD_OUT[0]["prompt"][-8:]  # decoded from the ids: the last prompt_len bytes
