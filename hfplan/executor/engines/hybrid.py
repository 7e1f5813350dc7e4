"""The hybrid engine: the actor switches between its training layout and a generation layout in one process.

Where generation keeps the training layout (pp = 1, the same tp), entering generation asks the role's engine
for the whole model's weights by HF name - every FSDP group unsharded over its data-parallel group,
tensor-parallel DTensors kept as shards, so the rollout engine generates over the same tensor-parallel group
with no weights moved - and points a plain module of the model's class, built once on the meta device, at
them without copies; exiting points that module back at its meta tensors and lets the engine reshard. An actor
trained as it is (no FSDP, tp = 1: one data-parallel rank computing in its master weights) has nothing gathered to
free: its generation module keeps pointing at the trained tensors between generations (the optimizer steps them in
place), and is pointed again only when the trained module's tensors are other ones (a checkpoint load may swap
them); each switch saved about 1.5 ms of Python on the CPU demo.
Every other actor (another generation tp, or pipelined training) builds only its generation shards
(engines.reshard, by hfplan.layout's per-tensor plan: the slices it lacks arrive from its generation group,
a pipelined rank's other layers from the other stages' ranks; a trained tensor that is already its generation
shard, in the generation dtype, serves as it is, read only); exiting drops the ones it made.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hfplan.executor.engines.modules import fsdp_modules
from hfplan.executor.engines.reshard import SwitchPlan, SwitchStats, generation_shards, switch_plan, tensor_specs
from hfplan.executor.engines.training import RoleModel
from hfplan.layout import SWITCH_BUCKET_BYTES
from hfplan.plan import GenConfig, TrainConfig


def assign(target: nn.Module, tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Point every parameter (tied names included) and buffer of `target` at the given tensors, without copies."""
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
    for name, tensor in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(owner), leaf, tensor)  # a registered buffer's name: replaces the buffer


class HybridEngine:
    """Generation over a trained RoleModel's weights, in whatever layout it trains. Given `layouts` (training,
    generation: an actor generating at another tp, or a pipelined one), entering generation builds this rank's
    generation shards by the per-tensor plan instead (engines.reshard: only the missing slices move, nothing is gathered
    whole); the module then holds plain tensors that are already this rank's pieces (`presharded`)."""

    def __init__(self, trained: RoleModel, layouts: tuple[TrainConfig, GenConfig] | None = None,
                 bucket_bytes: int = SWITCH_BUCKET_BYTES, keep_trained: bool = True) -> None:
        """keep_trained: an actor trained as it is keeps its generation module on the trained tensors (False: it
        is pointed at them at every switch, as `hfplan profile` times a switch that hands over weights)."""
        self.trained, self.layouts, self.bucket_bytes = trained, layouts, bucket_bytes
        if layouts is not None:
            stages = len(trained.module.stages) if trained.dims.pp > 1 else 1
            train = layouts[0]
            if (train.pp, train.virtual_stages) != (trained.dims.pp, stages):
                raise ValueError(f"the training layout pp={train.pp} virtual_stages={train.virtual_stages} is not "
                                 f"the model's (pp={trained.dims.pp}, {stages} stages a rank)")
        self.presharded = layouts is not None
        self.last_switch: SwitchStats | None = None  # what the latest plan-driven switch moved
        self._plan: SwitchPlan | None = None  # this rank's switch plan, derived at the first switch
        with torch.device("meta"):
            self._generation = trained.hf_class(trained.config)
        self._generation.eval().requires_grad_(False)
        self._meta = {n: p.detach() for n, p in self._generation.named_parameters(remove_duplicate=False)}
        self._meta_buffers = dict(self._generation.named_buffers(remove_duplicate=False))
        config = trained.config
        self._specs = tensor_specs(self._generation, config.num_hidden_layers, config.num_key_value_heads)
        first: dict[int, str] = {}  # a tied parameter's names, each to the one the specs know it by
        self._spec_of = {name: first.setdefault(id(p), name)
                         for name, p in self._generation.named_parameters(remove_duplicate=False)}
        self._active = False
        # Trained as it is: the generation module may keep the trained tensors (see the module's docstring; the
        # simulator's rule for the same case is hfplan.layout.keeps_trained_tensors).
        self._keeps = (keep_trained and layouts is None and trained.dims.tp == 1
                       and not fsdp_modules(trained.module))
        self._pointed_at: list[tuple[int, int]] | None = None  # the trained tensors it points at (_keeps only)

    def _trained_tensors(self) -> list[tuple[int, int]]:
        return [(id(t), t.data_ptr()) for t in (*self.trained.module.parameters(), *self.trained.module.buffers())]

    def enter_generation(self) -> nn.Module:
        """A plain module (no FSDP) holding the current weights, in eval mode, for a rollout engine to
        generate with or load weights from: whole tensors, or with tensor parallelism in the training layout
        this rank's DTensor shards on the tp mesh. Valid until `exit_generation`."""
        if self._active:
            raise RuntimeError("enter_generation called twice without exit_generation")
        self._active = True
        if self._keeps:
            tensors = self._trained_tensors()
            if tensors != self._pointed_at:
                assign(self._generation, *self.trained.generation_weights())
                self._pointed_at = tensors
            return self._generation
        if self.layouts is None:
            params, buffers = self.trained.generation_weights()
        else:
            params, buffers = self._shards()
        assign(self._generation, params, buffers)
        return self._generation

    def exit_generation(self) -> None:
        """Back to the training layout; the memory of the generation weights is released (an actor trained as it
        is has none of its own: its module keeps pointing at the trained tensors)."""
        if not self._active:
            raise RuntimeError("exit_generation called outside generation")
        self._active = False
        if self._keeps:
            return
        assign(self._generation, self._meta, self._meta_buffers)
        if self.layouts is None:
            self.trained.release_generation()

    def _shards(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        trained = self.trained
        if self._plan is None:
            train, gen = self.layouts
            itemsize = torch.empty((), dtype=trained.param_dtype).element_size()
            self._plan = switch_plan(self._specs, train, gen, trained.config.num_hidden_layers, dist.get_rank(),
                                     itemsize, self.bucket_bytes)
        shards, self.last_switch = generation_shards(trained.local_parameters(), self._plan, trained.param_dtype)
        return {name: shards[spec] for name, spec in self._spec_of.items()}, trained.local_buffers()
