"""`hfplan execute` of an asynchronous plan (staleness 1): generation on the rollout set overlaps training, each
rollout uses the weights of the update before last, one weight sync per update, and a seed gives the same run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hfplan.executor.controller import METRICS_FILE, TIMELINE_FILE, ExecuteOptions, execute
from hfplan.executor.export_model import export_checkpoint
from hfplan.executor.resume import CHECKPOINTS_FOLDER
from hfplan.executor.sequences import join, response_predictions
from hfplan.executor.tokenizers import build_tokenizer
from hfplan.plan import ROLLOUT, WEIGHT_SYNC_OP
from tests.support.executor_runs import ARITH_GRPO, cpu_plan, tiny_workload

pytestmark = pytest.mark.slow

ITERATIONS = 4


@pytest.fixture(autouse=True)
def on_the_session_cluster(ray_driver):
    """Every run of this module on the session's Ray cluster."""


def _run(plan, out, **options):
    reports = []
    execute(plan, ExecuteOptions(iterations=ITERATIONS, out=out, call_timeout_s=120, start_timeout_s=120, seed=3,
                                 **options), on_iteration=reports.append)
    return reports


def _log_probs(folder, sampled) -> np.ndarray:
    """Each response token's log-prob under the weights of the Hugging Face model at `folder`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    prompts, responses = (torch.from_numpy(sampled[name]) for name in ("prompts", "responses"))
    mask = torch.from_numpy(sampled["response_mask"])
    joined = join(prompts, responses, mask, build_tokenizer("tiny-arith").pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=joined.input_ids, attention_mask=joined.attention_mask,
                       position_ids=joined.position_ids).logits
    predicted = torch.log_softmax(response_predictions(logits, joined.prompt_len, responses.shape[1]), dim=-1)
    return (predicted.gather(-1, responses[..., None]).squeeze(-1) * mask).numpy()


def test_staleness_one_overlaps_and_generates_with_the_weights_of_the_update_before_last(tmp_path):
    """The reference shares the rollout set's process (it reads the generations sent ahead where they were made),
    and an evaluation runs between windows."""
    workload = tiny_workload("grpo", ARITH_GRPO, staleness=1)
    plan = cpu_plan(workload, [(("actor",), 1), (("reference", ROLLOUT), 1)])
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("add 3 4 =", "sub 9 2 =", "add 10 5 =")))
    evaluate = {"eval_data": str(held_out), "eval_every": 2}
    reports = _run(plan, tmp_path / "a", checkpoint_every=1, keep=ITERATIONS, **evaluate)
    timeline = json.loads((tmp_path / "a" / TIMELINE_FILE).read_text())["iterations"]

    # one weight sync per update, the initial one before the first generation besides
    syncs = [sum(s["op"] == WEIGHT_SYNC_OP for s in window["spans"]) for window in timeline]
    assert syncs == [2, 1, 1, 0]
    # the rollout set generates (the next iteration's responses) while the actor's set prepares and trains
    overlapping = 0
    for window in timeline[1:-1]:  # the last window generates nothing (no iteration follows)
        gen = [s for s in window["spans"] if s["op"] == "generate" and s["kind"] == "compute"]
        busy = [s for s in window["spans"] if s["set"] == 0 and s["phase"] in ("preparation", "training")
                and s["kind"] == "compute"]
        assert gen and all(s["set"] == 1 for s in gen)
        overlapping += any(g["start"] < b["end"] and b["start"] < g["end"] for g in gen for b in busy)
    assert overlapping >= 1

    # iteration i's rollout used the weights after update i - 2: those of the checkpoint after i - 1 iterations
    folders = {i: tmp_path / "hf" / str(i) for i in range(1, ITERATIONS + 1)}
    for i, folder in folders.items():
        export_checkpoint(tmp_path / "a" / CHECKPOINTS_FOLDER / f"iteration-{i:06d}", folder)
    for i in (2, 3):
        sampled = reports[i].sampled
        behaviour = sampled["behaviour_log_probs"]
        assert np.abs(_log_probs(folders[i - 1] / "actor", sampled) - behaviour).max() < 1e-4, i
        assert np.abs(_log_probs(folders[i] / "actor", sampled) - behaviour).max() > 1e-3, i
        assert reports[i].metrics["actor/behaviour_weight"] != pytest.approx(1.0, abs=1e-6)

    assert "eval/reward" in reports[1].metrics and "eval/reward" in reports[3].metrics
    # the same seed, the same run
    again = _run(plan, tmp_path / "b", **evaluate)
    first = [json.loads(line) for line in (tmp_path / "a" / METRICS_FILE).read_text().splitlines()]
    second = [json.loads(line) for line in (tmp_path / "b" / METRICS_FILE).read_text().splitlines()]
    for a, b in zip(first, second, strict=True):
        for key in ("reward", "response_len", "actor/policy_loss", "actor/grad_norm", "actor/behaviour_weight",
                    *(("eval/reward",) if "eval/reward" in a else ())):
            assert a[key] == b[key], key
    assert len(again) == ITERATIONS
