"""The hybrid engine of a pipelined actor: generation in a layout of one stage (gen pp = 1).

Rollout engines run whole models (a tensor-parallel engine cuts its own shards), so an actor trained
with pp > 1 generates with every rank holding the full weights: entering generation gathers each stage's
weights (DTensors made whole over the stage's data- and tensor-parallel ranks; with virtual stages, each
of a rank's stages) and broadcasts them over the pipeline, into a plain module of the model's class
built once on the meta device; exiting points that module back at meta tensors, which frees the
gathered copies.
"""

from __future__ import annotations

import torch
from torch import nn

from hfplan.executor.engines.hybrid import _assign
from hfplan.executor.engines.pipeline import PipelinedModel


class PipelineHybridEngine:
    def __init__(self, pipelined: PipelinedModel) -> None:
        self.pipelined = pipelined
        with torch.device("meta"):
            self._generation = pipelined.hf_class(pipelined.config)
        self._generation.eval().requires_grad_(False)
        self._active = False

    def enter_generation(self) -> nn.Module:
        if self._active:
            raise RuntimeError("enter_generation called twice without exit_generation")
        weights = self.pipelined.gathered(self.pipelined.param_dtype)
        _assign(self._generation, weights, self.pipelined.stage_buffers())
        self._active = True
        return self._generation

    def exit_generation(self) -> None:
        if not self._active:
            raise RuntimeError("exit_generation called outside generation")
        plain = self._generation
        _assign(plain, {n: torch.empty_like(p, device="meta") for n, p in plain.named_parameters(
            remove_duplicate=False)}, {n: torch.empty_like(b, device="meta") for n, b in plain.named_buffers()})
        self._active = False
