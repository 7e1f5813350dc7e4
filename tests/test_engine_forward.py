"""Batched, padded, micro-batched forward passes against a direct per-sequence computation."""

import pytest
import torch

from hfplan.executor import sequences
from hfplan.executor.engines import forward
from tests.support.engine_models import PAD, llama_actor, llama_critic, qwen2_actor, random_sequences


def _unpadded(prompts, responses, response_mask, b):
    prompt = prompts[b][prompts[b] != PAD]
    response = responses[b][response_mask[b].bool()]
    return prompt, response


@pytest.mark.parametrize("build", [llama_actor, qwen2_actor], ids=["llama", "qwen2"])
@pytest.mark.parametrize("micro_batch", [1, 3, 8])
def test_token_log_probs_match_per_sequence(build, micro_batch):
    model = build().eval()
    prompts, responses, mask = random_sequences(5, 6, 7)
    temperature = 0.7
    log_probs = forward.token_log_probs(model, prompts, responses, mask, PAD, temperature, micro_batch=micro_batch)
    assert log_probs.shape == (5, 7) and log_probs.dtype == torch.float32
    assert not log_probs.requires_grad
    with torch.no_grad():
        joined = sequences.join(prompts, responses, mask, PAD)
        _, entropy = forward.response_log_probs(model, joined, responses, temperature, with_entropy=True)
    for b in range(5):
        prompt, response = _unpadded(prompts, responses, mask, b)
        with torch.no_grad():
            logits = model(torch.cat([prompt, response])[None]).logits[0].float() / temperature
        preds = logits[len(prompt) - 1: len(prompt) - 1 + len(response)]
        dist = torch.log_softmax(preds, dim=-1)
        expected = dist.gather(-1, response[:, None]).squeeze(-1)
        n = len(response)
        torch.testing.assert_close(log_probs[b, :n], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[b, :n], -(dist.exp() * dist).sum(-1), atol=1e-5, rtol=1e-5)
        assert log_probs[b, n:].eq(0).all()
    plain = forward.token_log_probs(model, prompts, responses, mask, PAD, temperature, micro_batch=2)
    torch.testing.assert_close(plain, log_probs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("micro_batch", [1, 4])
def test_token_values_and_sequence_scores_match_per_sequence(micro_batch):
    model = llama_critic().eval()
    prompts, responses, mask = random_sequences(5, 6, 7, seed=1)
    values = forward.token_values(model, prompts, responses, mask, PAD, micro_batch=micro_batch)
    scores = forward.sequence_scores(model, prompts, responses, mask, PAD, micro_batch=micro_batch)
    assert values.shape == (5, 7) and scores.shape == (5,)
    for b in range(5):
        prompt, response = _unpadded(prompts, responses, mask, b)
        with torch.no_grad():
            out = model(torch.cat([prompt, response])[None]).logits[0, :, 0]
        n = len(response)
        torch.testing.assert_close(values[b, :n], out[len(prompt) - 1: len(prompt) - 1 + n], atol=1e-5, rtol=1e-5)
        assert values[b, n:].eq(0).all()
        torch.testing.assert_close(scores[b], out[-1], atol=1e-5, rtol=1e-5)


def test_micro_batch_must_be_positive():
    prompts, responses, mask = random_sequences(2, 3, 3)
    with pytest.raises(ValueError, match="micro_batch"):
        forward.token_values(llama_critic(), prompts, responses, mask, PAD, micro_batch=0)
