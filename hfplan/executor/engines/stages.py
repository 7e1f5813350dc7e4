"""The interface between a RoleModel and its mode: the whole model on every rank (`whole.WholeModel`), or
pipeline stages (`pipeline.PipelineStages`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from hfplan.executor.engines.forward import Readout

Batch = dict[str, torch.Tensor]
# A loss over a readout's output: (output, the batch fields it reads, mini-batch token count) -> (loss, stats).
Objective = Callable[[object, Batch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Stages(Protocol):
    pp: int  # pipeline ranks
    last: bool  # whether this rank holds the last stage (where outputs and statistics are)
    names: dict[str, str] | None  # the module's parameter names -> the HF model's (None: the same)
    buffer_names: dict[str, str] | None  # the module's buffer names -> the HF model's (None: the same)

    def split(self, model: nn.Module, device: torch.device) -> nn.Module:
        """This rank's module of the (tensor-parallel, not yet sharded) model."""
        ...

    def layers(self, module: nn.Module) -> list[nn.Module]: ...

    def roots(self, module: nn.Module) -> list[nn.Module]:
        """The modules FSDP wraps as roots, after the layers."""
        ...

    def named(self, what: str) -> AbstractContextManager[None]:
        """Failures inside a call, named for the operator."""
        ...

    def forward(self, module: nn.Module, readout: Readout, prompts: torch.Tensor, responses: torch.Tensor,
                response_mask: torch.Tensor, micro_batch: int, pad_id: int) -> torch.Tensor:
        """The readout of every sequence on every rank, float32, 0 where masked (per-token readouts)."""
        ...

    def accumulate(self, module: nn.Module, batch: Batch, micro_batch: int, readout: Readout,
                   objective: Objective, tokens: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
        """Forward and backward of a mini-batch's micro-batches (gradients accumulated); the statistics
        over the whole mini-batch on the last stage (empty elsewhere)."""
        ...

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> float:
        """Clip the gradients by the whole model's norm; the norm (the caller skips the step when not finite)."""
        ...

    def names_from_last(self, names: list[str]) -> list[str]: ...

    def from_last(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def full_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter whole by HF name, at least on rank 0 (a collective over the role's ranks)."""
        ...
