"""Recomputation modes of the engines (hfplan.executor.engines.recompute) on tiny HF models, one process: the
same loss and gradients in every mode, and which kernels the backward pass runs again. The engines' 2-process
runs (FSDP2, tensor parallel, pipeline stages) with each mode are in test_engine_training, _tp and _pp."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from test_engine_training import actor_batch
from torch.utils._python_dispatch import TorchDispatchMode

from hfplan.executor import sequences
from hfplan.executor.engines import forward
from hfplan.executor.engines.forward import Readout
from hfplan.executor.engines.pipeline_split import split_model
from hfplan.executor.engines.recompute import SELECTIVE_PREFIX, apply_recompute
from tests.support.engine_models import PAD, llama_actor, llama_critic, qwen2_actor

MODES = ("none", "selective", "full")
# The core attention's forward kernel, by attention implementation (sdpa on CPU; eager: its softmax).
CORE = {"sdpa": "aten._scaled_dot_product_flash_attention_for_cpu", "eager": "aten._softmax"}
PROJECTIONS = ("aten.mm", "aten.addmm")  # nn.Linear's forward over [batch, seq, hidden]


class OpCount(TorchDispatchMode):
    """How often each aten op runs while the mode is active (on CPU the backward runs in this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _model(make, mode: str, attention: str = "sdpa"):
    model = make()
    model.config._attn_implementation = attention
    apply_recompute(model, mode)
    return model.train()


@functools.cache
def _data() -> dict[str, torch.Tensor]:
    return actor_batch(4)


def _actor_loss(model, data: dict[str, torch.Tensor]) -> torch.Tensor:
    joined = sequences.join(data["prompts"], data["responses"], data["response_mask"], PAD)
    log_probs, entropy = forward.response_log_probs(model, joined, data["responses"], 0.8, with_entropy=True)
    mask = data["response_mask"].bool()
    return -(log_probs * data["advantages"])[mask].mean() - 0.01 * entropy[mask].mean()


def _critic_loss(model, data: dict[str, torch.Tensor]) -> torch.Tensor:
    joined = sequences.join(data["prompts"], data["responses"], data["response_mask"], PAD)
    values = forward.response_values(model, joined, data["responses"].shape[1])
    return ((values - data["advantages"]) ** 2)[data["response_mask"].bool()].mean()


def _gradients(model, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    loss = loss_fn(model, _data())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _counted_step(model) -> tuple[Counter, Counter]:
    """The ops of one forward and of its backward, for a loss that runs no softmax of its own."""
    data, ahead, back = _data(), OpCount(), OpCount()
    joined = sequences.join(data["prompts"], data["responses"], data["response_mask"], PAD)
    with ahead:
        logits = model(input_ids=joined.input_ids, attention_mask=joined.attention_mask,
                       position_ids=joined.position_ids).logits
        loss = (logits[joined.attention_mask.bool()] ** 2).mean()
    with back:
        loss.backward()
    return ahead.calls, back.calls


@pytest.mark.parametrize(("make", "loss_fn", "attention"), [
    (llama_actor, _actor_loss, "sdpa"), (llama_actor, _actor_loss, "eager"), (llama_critic, _critic_loss, "sdpa"),
    (qwen2_actor, _actor_loss, "sdpa"),
])
def test_every_mode_gives_the_same_loss_and_gradients(make, loss_fn, attention):
    ref_loss, ref_grads = _gradients(_model(make, "none", attention), loss_fn)
    assert len(ref_grads) == len(list(make().parameters()))
    for mode in ("selective", "full"):
        loss, grads = _gradients(_model(make, mode, attention), loss_fn)
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=0, msg=f"{mode} {name}")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_selective_recomputes_the_core_attention_and_nothing_else(attention):
    core = CORE[attention]
    runs = {mode: _counted_step(_model(llama_actor, mode, attention)) for mode in MODES}
    layers = llama_actor().config.num_hidden_layers
    assert all(runs[mode][0][core] == layers for mode in MODES)  # one core attention per layer in the forward
    # The backward pass runs the core attention again under selective and full recomputation, never under none.
    assert {mode: runs[mode][1][core] for mode in MODES} == {"none": 0, "selective": layers, "full": layers}
    # Selective keeps the projections' and MLP's activations: its backward runs no more matmuls than none's.
    # Full recomputes each layer's projections but the last (q, k, v, o, gate, up: 6): no backward needs
    # down_proj's output, and torch's checkpoint stops recomputing once it has every saved tensor back.
    matmuls = {mode: sum(runs[mode][1][op] for op in PROJECTIONS) for mode in MODES}
    assert matmuls["none"] == 2 * (7 * layers + 1)  # each linear's input and weight gradients (+ the LM head)
    assert matmuls["selective"] == matmuls["none"]
    assert matmuls["full"] == matmuls["none"] + 6 * layers


def test_pipeline_stages_keep_the_selective_attention():
    model = _model(llama_actor, "selective")
    held, _, _ = split_model(model, [1], 2)  # the last stage: one decoder layer, the norm and the head
    (stage,) = held.stages
    assert stage.backbone.config._attn_implementation == SELECTIVE_PREFIX + "sdpa"
    stage.readout = Readout("log_probs", 3)
    hidden = torch.randn(2, 6, model.config.hidden_size, requires_grad=True)
    ids = torch.randint(1, 100, (2, 6))
    mask, positions = torch.ones_like(ids), torch.arange(6).expand(2, 6)
    back = OpCount()
    out = stage(hidden, ids, mask, positions)
    with back:
        out.sum().backward()
    assert back.calls[CORE["sdpa"]] == 1


def test_modes_are_checked_and_none_changes_nothing():
    model = llama_actor()
    apply_recompute(model, "none")
    assert model.config._attn_implementation == "sdpa" and not model.is_gradient_checkpointing
    apply_recompute(model, "selective")
    apply_recompute(model, "selective")  # idempotent: not a wrapper of the wrapper
    assert model.config._attn_implementation == SELECTIVE_PREFIX + "sdpa"
    with pytest.raises(ValueError, match="sometimes"):
        apply_recompute(model, "sometimes")
