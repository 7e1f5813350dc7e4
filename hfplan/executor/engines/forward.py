"""Forward passes over joined prompt + response sequences (the layout of `hfplan.executor.sequences`).

The differentiable per-micro-batch functions (`response_log_probs`, `response_values`) are what the
training engine's losses are built on; the batched no-grad functions (`token_log_probs`,
`token_values`, `sequence_scores`) are the inference calls, run in micro-batches of the plan's
InferConfig.micro_batch. Outputs are float32 whatever the model's compute dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hfplan.executor import sequences
from hfplan.executor.engines import lean
from hfplan.executor.engines.losses import entropy_from_logits
from hfplan.layout import micro_batch_sizes


@dataclass(frozen=True)
class Readout:
    """What a forward returns: the response tokens' log-probs (and entropies), the values before each
    response token, or each sequence's score at its last real token."""

    kind: Literal["log_probs", "values", "scores"]
    response_len: int
    temperature: float = 1.0
    with_entropy: bool = False
    entropy_grad: bool = True


def _forward(model: nn.Module, joined: sequences.Joined, keep: int) -> torch.Tensor:
    """The head's output at the last `keep` positions: hfplan's lean forward where it runs, else HF's."""
    if lean.runs(model, joined):
        return lean.head_output(model, joined, keep)
    causal_lm = hasattr(model, "lm_head")  # a token classifier's forward takes no logits_to_keep
    out = model(input_ids=joined.input_ids, attention_mask=joined.attention_mask,
                position_ids=joined.position_ids, use_cache=False, **({"logits_to_keep": keep} if causal_lm else {}))
    return out.logits if causal_lm else out.logits[:, -keep:]


def response_log_probs(model: nn.Module, joined: sequences.Joined, responses: torch.Tensor, temperature: float,
                       *, with_entropy: bool = False, entropy_grad: bool = True,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature) of each response token, [B, R] float32 (not masked), and the
    per-token entropy of that distribution when asked. Keeps the graph when grad is enabled (for the
    entropy only with `entropy_grad`: a metric-only entropy need not hold a [B, R, V] graph)."""
    # Only the logits of the last R + 1 positions are computed (see window_log_probs).
    logits = _forward(model, joined, responses.shape[1] + 1)
    return window_log_probs(logits, responses, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)


def window_log_probs(logits: torch.Tensor, responses: torch.Tensor, temperature: float, *,
                     with_entropy: bool = False, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """response_log_probs from the logits of the last R + 1 positions of the joined sequences: that window
    starts at column P - 1, so inside it the response predictions are those of a one-token prompt."""
    logits = sequences.response_predictions(logits, 1, responses.shape[1]).float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = entropy_from_logits(logits)
    return log_probs, entropy


def response_values(model: nn.Module, joined: sequences.Joined, response_len: int) -> torch.Tensor:
    """Scalar-head output at the position predicting each response token, [B, R] float32 (not masked). Only the
    last R + 1 positions are computed, as in response_log_probs."""
    window = _forward(model, joined, response_len + 1).squeeze(-1)
    return sequences.response_predictions(window, 1, response_len).float()


def read(model: nn.Module, readout: Readout, joined: sequences.Joined, responses: torch.Tensor):
    """A whole model's differentiable `readout` of joined sequences (log-probs readouts: (log-probs,
    entropy) with `with_entropy`, else log-probs; values: [B, R])."""
    if readout.kind == "log_probs":
        log_probs, entropy = response_log_probs(model, joined, responses, readout.temperature,
                                                with_entropy=readout.with_entropy, entropy_grad=readout.entropy_grad)
        return (log_probs, entropy) if readout.with_entropy else log_probs
    if readout.kind == "values":
        return response_values(model, joined, readout.response_len)
    raise ValueError(f"no differentiable readout {readout.kind!r}")


def _on_model_device(model: nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    return [t.to(device) for t in tensors]


def micro_batches(size: int, micro_batch: int) -> Iterator[slice]:
    """The rows of each of the contract's micro-batches (hfplan.layout.micro_batch_sizes) of `size` rows."""
    start = 0
    for rows in micro_batch_sizes(size, micro_batch):
        yield slice(start, start + rows)
        start += rows


def _per_micro_batch(model: nn.Module, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
                     pad_id: int, micro_batch: int,
                     output: Callable[[sequences.Joined, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`output(joined, responses, response_mask)` of each micro-batch, on the model's device, concatenated."""
    prompts, responses, response_mask = _on_model_device(model, prompts, responses, response_mask)
    parts = []
    for part in micro_batches(prompts.shape[0], micro_batch):
        joined = sequences.join(prompts[part], responses[part], response_mask[part], pad_id)
        parts.append(output(joined, responses[part], response_mask[part]))
    return torch.cat(parts)


@torch.no_grad()
def token_log_probs(model: nn.Module, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
                    pad_id: int, temperature: float, *, micro_batch: int) -> torch.Tensor:
    """Log-probs of the response tokens at `temperature`, [B, R] float32 on the model's device, 0 where
    the mask is 0."""
    def output(joined, resp, mask):
        return torch.where(mask.bool(), response_log_probs(model, joined, resp, temperature)[0], 0.0)

    return _per_micro_batch(model, prompts, responses, response_mask, pad_id, micro_batch, output)


@torch.no_grad()
def token_values(model: nn.Module, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
                 pad_id: int, *, micro_batch: int) -> torch.Tensor:
    """A critic's value of the state before each response token, [B, R] float32, 0 where the mask is 0."""
    def output(joined, resp, mask):
        return torch.where(mask.bool(), response_values(model, joined, resp.shape[1]), 0.0)

    return _per_micro_batch(model, prompts, responses, response_mask, pad_id, micro_batch, output)


@torch.no_grad()
def sequence_scores(model: nn.Module, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
                    pad_id: int, *, micro_batch: int) -> torch.Tensor:
    """A reward or cost model's score of each sequence: scalar-head output at its last real token, [B]."""
    def output(joined, resp, mask):
        # Only the last R + 1 positions: a prompt's last column is real, so every last real token is among them.
        keep = resp.shape[1] + 1
        window = _forward(model, joined, keep).squeeze(-1).float()
        where = sequences.last_token_index(joined) - (joined.input_ids.shape[1] - keep)
        return window.gather(1, where.unsqueeze(1)).squeeze(1)

    return _per_micro_batch(model, prompts, responses, response_mask, pad_id, micro_batch, output)
