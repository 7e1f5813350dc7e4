"""The hybrid engine: the actor switches between its training layout and a generation layout in one process.

`HybridEngine` is the one interface the actor's role uses; layouts differ only in what happens
inside `enter_generation` and `exit_generation`. This module has generation in the training layout:
every rank gathers the weights of its FSDP groups (its data-parallel group in the plan's training
layout), keeps its tensor-parallel shard as it is (DTensors on the tp mesh), and the rollout engine
generates with them over the same tensor-parallel group, with no weights moved between layouts.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hfplan.executor.engines.training import TrainedModel, plain_class


class HybridEngine(Protocol):
    def enter_generation(self) -> nn.Module:
        """A plain module (no FSDP) holding the current weights, in eval mode, for a rollout engine to
        generate with or load weights from: whole tensors, or with tensor parallelism this rank's
        DTensor shards on the tp mesh. Valid until `exit_generation`."""
        ...

    def exit_generation(self) -> None:
        """Back to the training layout; the memory of the generation weights is released."""
        ...


def _assign(target: nn.Module, tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Point every parameter (tied names included) and buffer of `target` at the given tensors, without copies."""
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
    for name, tensor in buffers.items():
        owner, _, leaf = name.rpartition(".")
        target.get_submodule(owner)._buffers[leaf] = tensor


class SameLayoutHybridEngine:
    """Generation in the training layout, over a TrainedModel whose module is an HF model (has a config).

    Entering unshards every FSDP group (all-gathers the data-parallel shards in the compute dtype) with
    reshard-after-forward off, and exposes the gathered tensors (tensor-parallel DTensors stay shards)
    through a second, plain module of the same architecture built once on the meta device, so that it
    shares them instead of copying. Exiting points that module back at its meta tensors, reshards, and
    restores the training settings.
    """

    def __init__(self, trained: TrainedModel) -> None:
        self.trained = trained
        module = trained.module
        with torch.device("meta"):
            self._generation = plain_class(module)(module.config)
        self._generation.eval().requires_grad_(False)
        self._meta = dict(self._generation.named_parameters(remove_duplicate=False))
        self._meta_buffers = dict(self._generation.named_buffers(remove_duplicate=False))
        self._active = False

    def enter_generation(self) -> nn.Module:
        if self._active:
            raise RuntimeError("enter_generation called twice without exit_generation")
        module = self.trained.module
        self.trained.unshard()
        _assign(self._generation, {n: module.get_parameter(n).detach() for n in self._meta},
                {n: module.get_buffer(n) for n in self._meta_buffers})
        self._active = True
        return self._generation

    def exit_generation(self) -> None:
        if not self._active:
            raise RuntimeError("exit_generation called outside generation")
        _assign(self._generation, {n: p.detach() for n, p in self._meta.items()}, self._meta_buffers)
        self.trained.reshard()
        self._active = False
