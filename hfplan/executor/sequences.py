"""How prompts and responses are laid out as tensors, on every worker and in every engine.

- `prompts`: [B, P] token ids, LEFT-padded with the tokenizer's pad id (real tokens end at column P-1).
- `responses`: [B, R] token ids, RIGHT-padded with the pad id after the end of each response.
- `response_mask`: [B, R], 1 on real response tokens (the EOS token included), 0 after.
- Per-token fields (log-probs, values, advantages, returns): [B, R] float, 0 where the mask is 0.
- Per-sequence fields (rewards, costs): [B] float.

A forward pass runs over `join(...)`: the prompt and the response side by side, [B, P+R]. The
prediction for response token i (its log-prob, or the critic's value of the state before it) is read
at position P+i-1; a sequence score is read at the position of its last real token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Joined:
    input_ids: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R], 1 on real tokens
    position_ids: torch.Tensor  # [B, P+R], 0 at the first real token
    prompt_len: int


def join(prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, pad_id: int) -> Joined:
    prompt_mask = (prompts != pad_id).to(response_mask.dtype)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.cat([prompts, responses], dim=1)
    return Joined(input_ids, attention_mask, positions(attention_mask), prompts.shape[1])


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Rotary positions that skip left padding: 0 at each sequence's first real token."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def response_predictions(per_position: torch.Tensor, prompt_len: int, response_len: int) -> torch.Tensor:
    """The [B, R, ...] slice of a [B, P+R, ...] output that predicts each response token."""
    return per_position[:, prompt_len - 1: prompt_len - 1 + response_len]


def last_token_index(joined: Joined) -> torch.Tensor:
    """Column of each sequence's last real token in the joined layout (for sequence scores)."""
    length = joined.attention_mask.shape[1]
    flipped = joined.attention_mask.flip(dims=[1]).long().argmax(dim=1)
    return length - 1 - flipped
