"""hfplan's lean forward (engines.lean) against HF's own forward of the same model, fp32: at every real position the
outputs are equal to the bit (an actor run through one must match a reference run through the other) and the
gradients agree to 1e-6 relative (autograd may sum a weight's gradient in another order)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForTokenClassification

from hfplan.executor import sequences
from hfplan.executor.engines import forward, lean
from hfplan.executor.engines.forward import Readout
from hfplan.executor.engines.pipeline_split import split_model
from hfplan.executor.models import ATTENTION, build_model

TOL = 1e-6


def _joined(vocab: int, padded: bool) -> sequences.Joined:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (6, 5), generator=gen)
    responses = torch.randint(1, vocab, (6, 4), generator=gen)
    mask = torch.ones(6, 4, dtype=torch.long)
    if padded:
        prompts[:3, :2] = 0  # left padding
        mask[1:4, 2:] = 0  # responses that ended early
        responses[mask == 0] = 0
    return sequences.join(prompts, responses, mask, 0)


def _hf(model, joined, keep):
    kwargs = {"logits_to_keep": keep} if keep else {}
    return model(input_ids=joined.input_ids, attention_mask=joined.attention_mask, position_ids=joined.position_ids,
                 use_cache=False, **kwargs).logits


def _qwen2_scorer():
    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                         classifier_dropout=0.0)
    config._attn_implementation = ATTENTION
    torch.manual_seed(0)
    return Qwen2ForTokenClassification(config)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("kind", ["llama lm", "llama lm, layers checkpointed", "qwen2 scalar"])
def test_lean_forward_equals_hf_outputs_and_gradients(kind, padded):
    model = _qwen2_scorer() if kind == "qwen2 scalar" else build_model("tiny", "lm", seed=0)
    if kind.endswith("checkpointed"):  # its layers are called as modules, HF's checkpointing around them
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert not any(lean._computed_here(layer) for layer in model.model.layers)
    else:
        assert all(lean._computed_here(layer) for layer in model.model.layers)
    joined = _joined(model.config.vocab_size, padded)
    assert lean.runs(model, joined)
    keep = 0 if kind == "qwen2 scalar" else 5
    real = joined.attention_mask[:, -keep:].bool() if keep else joined.attention_mask.bool()

    def outputs_and_grads(fn):
        model.zero_grad(set_to_none=True)
        out = fn(model, joined, keep)
        out[real].square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    hf_out, hf_grads = outputs_and_grads(_hf)
    lean_out, lean_grads = outputs_and_grads(lean.head_output)
    assert lean_out.shape == hf_out.shape
    assert torch.equal(lean_out[real], hf_out[real])
    assert torch.isfinite(lean_out).all()  # padded rows too: a NaN there would poison the gradients
    for name, grad in hf_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=TOL, atol=TOL, msg=name)


def test_lean_mask_is_none_without_padding_and_keeps_padded_rows_nonempty():
    assert lean.attention_mask(_joined(40, padded=False)) is None
    mask = lean.attention_mask(_joined(40, padded=True))
    assert mask.shape == (6, 1, 9, 9)
    assert mask.any(dim=-1).all()  # every query sees at least one key
    assert not mask[0, 0, 4, 0] and mask[0, 0, 4, 2] and not mask[0, 0, 2, 3]  # no pad key, nothing ahead


def test_lean_forward_leaves_other_attention_and_hooked_roots_to_hf():
    model = build_model("tiny", "lm", seed=0)
    joined = _joined(model.config.vocab_size, padded=True)
    hook = model.register_forward_pre_hook(lambda module, args: None)  # a root's hooks run only on its own call
    assert not lean.runs(model, joined)
    hook.remove()
    assert lean.runs(model, joined)
    model.config._attn_implementation = "eager"  # an additive float mask: HF's forward builds it
    assert not lean.runs(model, joined)
    model.config._attn_implementation = ATTENTION
    model.config.sliding_window = joined.input_ids.shape[1] - 1  # a window narrower than the sequence
    assert not lean.runs(model, joined)


def test_scores_from_the_response_window_reach_an_empty_response_prompt_end():
    """sequence_scores reads only the last R + 1 positions: a sequence with no response token is scored at its
    prompt's last column, the window's first."""
    model = _qwen2_scorer().eval()
    joined = _joined(model.config.vocab_size, padded=True)
    prompts, responses = joined.input_ids[:, :5], joined.input_ids[:, 5:]
    mask = joined.attention_mask[:, 5:].clone()
    mask[4] = 0  # row 4 has no response token
    scores = forward.sequence_scores(model, prompts, responses * mask, mask, 0, micro_batch=6)
    with torch.no_grad():
        full = _hf(model, sequences.join(prompts, responses * mask, mask, 0), 0)[..., 0]
    last = sequences.last_token_index(sequences.join(prompts, responses * mask, mask, 0))
    assert last[4] == 4
    torch.testing.assert_close(scores, full.gather(1, last[:, None])[:, 0], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("padded", [True, False])
def test_an_actor_and_its_frozen_reference_agree_to_the_bit(padded):
    """The KL loss compares the actor's log-probs (weights that require grad: HF's forward under FSDP2, or this
    one) with the reference's (a frozen copy, through this one): at the first step, where the weights are equal,
    they must be equal (the actor's with autograd on, as its loss computes them), or the loss has a rounding-sized
    gradient that Adam turns into a full step. aten's matmul multiplies a strided [B, keep, H] slice by a weight
    that requires grad as one matrix product and by a frozen one batched, which rounds otherwise; the head's
    input is made contiguous so both take one product."""
    actor = build_model("tiny-arith", "lm", seed=0)  # shapes whose two products round apart (tiny's do not)
    reference = build_model("tiny-arith", "lm", seed=0).requires_grad_(False).eval()
    joined = _joined(actor.config.vocab_size, padded)
    keep = 5
    real = joined.attention_mask[:, -keep:].bool()
    with torch.no_grad():  # as the reference's log-prob call runs
        frozen = lean.head_output(reference, joined, keep)[real]
    # the actor's as its loss computes them, with autograd on
    assert torch.equal(lean.head_output(actor, joined, keep)[real].detach(), frozen)
    assert torch.equal(_hf(actor, joined, keep)[real].detach(), frozen)


@pytest.mark.parametrize("padded", [True, False])
def test_pipeline_stages_compute_their_layers_here_as_their_backbones_forward_does(padded):
    """A pipeline stage (pipeline_split.Stage) runs its share of the layers through this forward: its outputs
    equal those of its HF backbone's forward (taken where a hook on the backbone sends it there) at every real
    position, to the bit, and the gradients agree."""
    model = build_model("tiny", "lm", seed=0)  # 2 layers: a stage of one layer each
    joined = _joined(model.config.vocab_size, padded)
    response = 4
    rank, _, _ = split_model(model, [0, 1], 2)
    rank.set_readout(Readout("log_probs", response))
    real = joined.attention_mask.bool()

    def outputs_and_grads(through_hf: bool):
        hooks = [stage.backbone.register_forward_pre_hook(lambda module, args: None)
                 for stage in rank.stages] if through_hf else []
        assert all(lean.runs_backbone(stage.backbone, joined) != through_hf for stage in rank.stages)
        rank.zero_grad(set_to_none=True)
        hidden, *passed = rank.stages[0](joined.input_ids, joined.attention_mask, joined.position_ids)
        log_probs = rank.stages[1](hidden, *passed)
        log_probs[real[:, -response:]].square().sum().backward()
        for hook in hooks:
            hook.remove()
        return hidden.detach(), log_probs.detach(), {n: p.grad.clone() for n, p in rank.named_parameters()}

    hf_hidden, hf_log_probs, hf_grads = outputs_and_grads(through_hf=True)
    hidden, log_probs, grads = outputs_and_grads(through_hf=False)
    assert torch.equal(hidden[real], hf_hidden[real])
    assert torch.equal(log_probs[real[:, -response:]], hf_log_probs[real[:, -response:]])
    for name, grad in hf_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=TOL, atol=TOL, msg=name)
