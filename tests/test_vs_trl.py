"""bench/vs_trl.py's matched configuration, with hfplan's own dependencies only (TRL is never installed here):
the TRL runner's prompts are the ones hfplan's run hands out, its reward is the registered rule over decoded
text, and the benchmark's plans are 1-process plans of the arith-grpo workload."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.scripts import load_bench


def test_runner_prompts_are_the_runs_batches_in_order():
    pytest.importorskip("torch")  # the runner imports torch (not trl) at its top
    from hfplan.executor.controller import ExecuteOptions, start_progress
    from hfplan.executor.preflight import Inputs
    from hfplan.executor.prompts import builtin_prompts
    from hfplan.spec import load_workload

    runner = load_bench("trl_runner")
    workload = load_workload("arith-grpo")
    prompts = runner.prompts_in_order(workload, seed=3, iterations=4)
    # What the executor's controller hands out: its iteration-0 progress on the built-in prompts.
    inputs = Inputs("cpu", "gloo", workload.hyperparameters, builtin_prompts(workload.models["actor"]), {}, {})
    progress = start_progress(SimpleNamespace(workload=workload), inputs, ExecuteOptions(seed=3))
    assert prompts == [text for _ in range(4) for text in progress.stream.next_batch().prompts]
    assert len(prompts) == 4 * workload.batch_prompts


def test_runner_reward_is_the_rule_on_decoded_text():
    pytest.importorskip("torch")
    import torch

    from hfplan.dataflow.rewards import get_rule
    from hfplan.executor.codec import build_codec
    from hfplan.executor.tokenizers import build_tokenizer

    runner = load_bench("trl_runner")
    reward = runner.reward_function("arith-close")
    tokenizer = build_tokenizer("tiny-arith")
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(["7", "="]), tokenizer.convert_tokens_to_ids(["9", "add"])])
    completions = build_codec("tiny-arith").decode_responses(ids.numpy(), torch.ones_like(ids).numpy())
    prompts = ["add 3 4 =", "sub 20 1 ="]
    assert reward(prompts=prompts, completions=completions) == [get_rule("arith-close")(p, c)
                                                                for p, c in zip(prompts, completions, strict=True)]
    assert reward(prompts=prompts, completions=completions)[0] == 1.0


def test_plans_are_one_process_with_actor_and_reference_colocated(tmp_path):
    from hfplan.plan import load_plan

    bench = load_bench("vs_trl")
    plans = bench.make_plans(tmp_path)
    assert bench.HFPLAN in plans
    for path in plans.values():
        plan = load_plan(path)
        assert [(sorted(group.models), group.gpus) for group in plan.placement] == [(["actor", "reference"], 1)]
        assert plan.workload.models["actor"] == plan.workload.models["reference"] == "tiny-arith"


def test_start_up_stages_are_medians_over_rounds_in_the_first_run_s_order():
    bench = load_bench("vs_trl")
    runs = [bench.Run(bench.HFPLAN, notes={"startup": {"ray start": s, "tokenizer": 1.0}}) for s in (3.0, 1.0, 2.0)]
    assert bench.startup_stages(runs) == "ray start 2.00, tokenizer 1.00"
    assert bench.startup_stages([bench.Run(bench.HFPLAN)]) == "not written by this hfplan"
