"""The hybrid engine: the actor switches between its training layout and a generation layout in one process.

Entering generation asks the role's engine for the whole model's weights by HF name - in the training
layout (pp = 1), every FSDP group unsharded over its data-parallel group, tensor-parallel DTensors kept as
shards, so the rollout engine generates over the same tensor-parallel group with no weights moved; with
pp > 1, every stage's weights gathered whole and broadcast over the pipeline (generation runs one stage) -
and points a plain module of the model's class, built once on the meta device, at them without copies.
Exiting points that module back at its meta tensors and lets the engine release the gathered weights.
"""

from __future__ import annotations

import torch
from torch import nn

from hfplan.executor.engines.training import RoleModel


def _assign(target: nn.Module, tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Point every parameter (tied names included) and buffer of `target` at the given tensors, without copies."""
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
    for name, tensor in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(owner), leaf, tensor)  # a registered buffer's name: replaces the buffer


class HybridEngine:
    """Generation over a trained RoleModel's weights, in whatever layout it trains."""

    def __init__(self, trained: RoleModel) -> None:
        self.trained = trained
        with torch.device("meta"):
            self._generation = trained.hf_class(trained.config)
        self._generation.eval().requires_grad_(False)
        self._meta = {n: p.detach() for n, p in self._generation.named_parameters(remove_duplicate=False)}
        self._meta_buffers = dict(self._generation.named_buffers(remove_duplicate=False))
        self._active = False

    def enter_generation(self) -> nn.Module:
        """A plain module (no FSDP) holding the current weights, in eval mode, for a rollout engine to
        generate with or load weights from: whole tensors, or with tensor parallelism in the training layout
        this rank's DTensor shards on the tp mesh. Valid until `exit_generation`."""
        if self._active:
            raise RuntimeError("enter_generation called twice without exit_generation")
        params, buffers = self.trained.generation_weights()
        _assign(self._generation, params, buffers)
        self._active = True
        return self._generation

    def exit_generation(self) -> None:
        """Back to the training layout; the memory of the generation weights is released."""
        if not self._active:
            raise RuntimeError("exit_generation called outside generation")
        _assign(self._generation, self._meta, self._meta_buffers)
        self.trained.release_generation()
        self._active = False
