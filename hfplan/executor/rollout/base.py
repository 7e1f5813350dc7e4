"""The rollout-engine interface every generation backend implements (torch engine, vLLM).

Tensors follow hfplan.executor.sequences: prompts left-padded, responses right-padded with the pad id
after EOS, `response_mask` 1 on real response tokens (EOS included). However an engine batches (the plan's
`gen.batching` and `gen.max_batch`: static waves or continuously refilled slots), the rollout's rows keep
the order of the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False  # argmax; log-probs are then those of the temperature-1 distribution
    n: int = 1  # samples per prompt, consecutive rows of the rollout

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def logit_temperature(self) -> float:
        """The temperature of the distribution whose log-probs are returned."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Rollout:
    prompts: torch.Tensor  # [B*n, P] long, each prompt repeated n times (consecutive rows)
    responses: torch.Tensor  # [B*n, R] long, R == max_new_tokens, pad id after EOS
    response_mask: torch.Tensor  # [B*n, R] float32, 1 on real tokens (EOS included)
    # [B*n, R] float32, log_softmax(logits / temperature) of each token, 0 where masked (vLLM's with top_p < 1:
    # renormalised over the nucleus)
    log_probs: torch.Tensor


@runtime_checkable
class RolloutEngine(Protocol):
    """What a role's runtime calls on its generation backend (hfplan.executor.runtime): the hybrid engine
    loads the actor's current weights before each generation and releases them after; a rollout set loads
    the weights it receives. Every rank of a tensor-parallel group calls each method together."""

    # True: `load_weights` copies the weights into the engine's own (vLLM), so the caller may free its tensors
    # at once; False: the engine generates from the caller's tensors until `release_weights`.
    copies_weights: bool

    def generate(
        self, prompts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        """Sample `params.n` responses for each row of left-padded `prompts` [B, P]."""
        ...

    def load_weights(self, model: torch.nn.Module, presharded: bool = False) -> None:
        """Take the current weights of an HF causal LM (shared, not copied, where possible); `presharded`:
        its tensors are already this rank's tensor-parallel pieces."""
        ...

    def release_weights(self) -> None:
        """Drop every reference to the loaded weights (the hybrid engine frees its gathered copy); the next
        `generate` needs `load_weights` first."""
        ...

    def close(self) -> None:
        """Free what the engine holds, at the end of its worker (vLLM: its engine and process groups)."""
        ...
