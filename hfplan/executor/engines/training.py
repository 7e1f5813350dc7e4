"""A trained role's engine: FSDP2 over a (replicate, shard) mesh, optionally composed with tensor
parallelism on a third mesh dimension "tp"; AdamW; the PPO actor and critic updates.

The mesh decides the data-parallel flavour: (1, dp) shards parameters, gradients and optimizer
states (ZeRO-3), (dp, 1) keeps them replicated and all-reduces gradients (DDP-like). With a "tp"
dimension of size > 1 the model is first split by `tensor_parallel.apply_tensor_parallel` over it,
then FSDP2 shards the resulting DTensors over the data-parallel dims (2-D / 3-D parallelism); the
ranks of one tensor-parallel group receive the same batch share. Every rank must pass identical
initial weights. Each update receives this rank's shard of the global batch;
`mini_batches` is the number of optimizer steps per epoch, the same on every rank. The losses are
token means over a whole mini-batch on all ranks (see `losses`), so FSDP's gradient reduction sums
instead of averaging and a step equals the single-process step on the full mini-batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hfplan.executor import sequences
from hfplan.executor.engines import forward, losses
from hfplan.executor.engines.recompute import apply_recompute
from hfplan.executor.engines.tensor_parallel import apply_tensor_parallel
from hfplan.hyperparams import Hyperparameters
from hfplan.plan import Recompute

logger = logging.getLogger(__name__)

FSDP_MESH_DIMS = ("replicate", "shard")
TP_MESH_DIM = "tp"
Batch = dict[str, torch.Tensor]
# A micro-batch's loss function: (micro-batch, mini-batch token count) -> (loss, stats to sum).
MicroLoss = Callable[[Batch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def plain_class(module: nn.Module) -> type[nn.Module]:
    """A module's own class, under the FSDP subclass that `fully_shard` swaps in."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, by the class names HF lists as never to be split across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if plain_class(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (by _no_split_modules {sorted(names)})")
    return layers


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _split(size: int, parts: int, what: str) -> list[slice]:
    if size % parts:
        raise ValueError(f"{what}: {size} sequences on this rank do not split into {parts} equal parts")
    step = size // parts
    return [slice(i * step, (i + 1) * step) for i in range(parts)]


def _chunks(size: int, micro_batch: int) -> list[slice]:
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    return [slice(s, min(s + micro_batch, size)) for s in range(0, size, micro_batch)]


class TrainedModel:
    """One trained role (actor, critic, cost critic) on this rank: the FSDP2-wrapped module and its optimizer."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, lr: float, hp: Hyperparameters,
                 device: torch.device | str, param_dtype: torch.dtype, *, pad_id: int,
                 recompute: Recompute | str = Recompute.NONE) -> None:
        names = tuple(mesh.mesh_dim_names or ())
        if names not in (FSDP_MESH_DIMS, (*FSDP_MESH_DIMS, TP_MESH_DIM)):
            raise ValueError(f"training mesh dims must be {FSDP_MESH_DIMS}, optionally followed by "
                             f"{TP_MESH_DIM!r}; got {names}")
        self.mesh, self.hp, self.pad_id = mesh, hp, pad_id
        self.device = torch.device(device)
        if mesh.device_type != self.device.type:
            raise ValueError(f"training mesh is on {mesh.device_type} but the device is {self.device}")
        # Master weights in fp32; fully_shard moves each group to the mesh's device as it shards it,
        # so a model built on the CPU never needs its full size on the accelerator. Dropout off: the
        # losses compare against log-probs and values computed without it.
        model.to(dtype=torch.float32)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        apply_recompute(model, recompute)
        self.tp = mesh.size(names.index(TP_MESH_DIM)) if TP_MESH_DIM in names else 1
        if self.tp > 1:
            apply_tensor_parallel(model, mesh[TP_MESH_DIM])
        dp_mesh = mesh[FSDP_MESH_DIMS] if TP_MESH_DIM in names else mesh
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        self.layers = decoder_layers(model)
        for layer in self.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        for module in fsdp_modules(model):  # sum the gradients (plain SUM collectives, gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self.module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=hp.weight_decay)
        self.module.train()

    # Collectives over every data-parallel rank (both FSDP mesh dims; tensor-parallel peers hold the same batch).
    def _all_reduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
        for name in FSDP_MESH_DIMS:
            if self.mesh[name].size() > 1:
                torch.distributed.all_reduce(tensor, op=op, group=self.mesh.get_group(name))
        return tensor

    def _check_same_size(self, size: int) -> None:
        """Every rank must run the same number of micro-batches, or FSDP's collectives would hang."""
        bounds = self._all_reduce(torch.tensor([size, -size], device=self.device), torch.distributed.ReduceOp.MAX)
        if bounds.tolist() != [size, -size]:
            raise ValueError(f"data-parallel ranks hold different batch sizes (this rank {size}, "
                             f"largest {bounds[0].item()}, smallest {-bounds[1].item()})")

    def _to_device(self, batch: Batch, keys: tuple[str, ...]) -> Batch:
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"update is missing batch fields {missing}")
        return {k: batch[k].to(self.device) for k in keys}

    # Full weights on every rank, for inference and generation in the training layout.
    def unshard(self) -> None:
        """Gather every FSDP group's full weights (in the compute dtype) and keep them through forwards."""
        for module in fsdp_modules(self.module):
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()

    def reshard(self) -> None:
        """Free the full weights; back to FSDP's training settings (decoder layers reshard after forward,
        the root keeps its weights for the backward that follows)."""
        layers = {id(layer) for layer in self.layers}
        for module in fsdp_modules(self.module):
            module.reshard()
            module.set_reshard_after_forward(id(module) in layers, recurse=False)

    @contextlib.contextmanager
    def inference(self) -> Iterator[nn.Module]:
        """The wrapped module in eval mode without grad, its weights gathered once for all micro-batches."""
        self.module.eval()
        self.unshard()
        try:
            with torch.no_grad():
                yield self.module
        finally:
            self.reshard()
            self.module.train()

    def log_probs(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
                  micro_batch: int) -> torch.Tensor:
        """The actor's log-probs of the response tokens at the sampling temperature, [B, R] float32."""
        with self.inference() as module:
            return forward.token_log_probs(module, prompts, responses, response_mask, self.pad_id,
                                           self.hp.temperature, micro_batch=micro_batch)

    def values(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
               micro_batch: int) -> torch.Tensor:
        """A critic's values of the response tokens, [B, R] float32."""
        with self.inference() as module:
            return forward.token_values(module, prompts, responses, response_mask, self.pad_id,
                                        micro_batch=micro_batch)

    # Training.
    def _step(self, batch: Batch, micro_batch: int, micro_loss: MicroLoss) -> dict[str, float]:
        """One optimizer step over a mini-batch (this rank's part), accumulated over micro-batches."""
        mask = batch["response_mask"]
        tokens = self._all_reduce(mask.sum().to(torch.float32)).clamp(min=1.0)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        for part in _chunks(mask.shape[0], micro_batch):
            loss, stats = micro_loss({k: v[part] for k, v in batch.items()}, tokens)
            loss.backward()
            for name, value in stats.items():
                totals[name] = totals.get(name, 0.0) + value.detach().to(torch.float32)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.hp.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
        names = list(totals)
        summed = self._all_reduce(torch.stack([totals[n] for n in names])).tolist() if names else []
        return dict(zip(names, summed, strict=True)) | {"grad_norm": grad_norm}

    def _train(self, batch: Batch, *, mini_batches: int, epochs: int, micro_batch: int,
               micro_loss: MicroLoss) -> dict[str, float]:
        size = batch["response_mask"].shape[0]
        self._check_same_size(size)
        parts = _split(size, mini_batches, "mini_batches")
        _chunks(size, micro_batch)  # validates micro_batch before any collective
        self.module.train()
        steps = [self._step({k: v[part] for k, v in batch.items()}, micro_batch, micro_loss)
                 for _ in range(epochs) for part in parts]
        return {name: sum(s[name] for s in steps) / len(steps) for name in steps[0]}

    def update_actor(self, batch: Batch, *, mini_batches: int, epochs: int, micro_batch: int,
                     use_kl_loss: bool) -> dict[str, float]:
        """PPO clipped surrogate - entropy bonus (+ KL loss to the reference when `use_kl_loss`).

        Metrics, averaged over the optimizer steps: policy_loss, entropy, approx_kl (to the old
        policy), clip_frac, kl (to the reference, with use_kl_loss), grad_norm, lr."""
        keys = (*("prompts", "responses", "response_mask", "old_log_probs", "advantages"),
                *(("ref_log_probs",) if use_kl_loss else ()))
        batch = self._to_device(batch, keys)
        hp = self.hp

        def micro_loss(mb: Batch, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            joined = sequences.join(mb["prompts"], mb["responses"], mb["response_mask"], self.pad_id)
            log_probs, entropy = forward.response_log_probs(self.module, joined, mb["responses"], hp.temperature,
                                                            with_entropy=True, entropy_grad=hp.entropy_coef > 0)
            return losses.actor_objective(log_probs, entropy, mb, tokens, hp, use_kl_loss)

        metrics = self._train(batch, mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch,
                              micro_loss=micro_loss)
        return metrics | {"lr": self.optimizer.param_groups[0]["lr"]}

    def update_critic(self, batch: Batch, value_key: str, return_key: str, *, mini_batches: int, epochs: int,
                      micro_batch: int) -> dict[str, float]:
        """Clipped value regression of the values toward the returns.

        Metrics, averaged over the optimizer steps: value_loss, value_clip_frac, grad_norm."""
        batch = self._to_device(batch, ("prompts", "responses", "response_mask", value_key, return_key))
        hp = self.hp

        def micro_loss(mb: Batch, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            mask = mb["response_mask"]
            joined = sequences.join(mb["prompts"], mb["responses"], mask, self.pad_id)
            values = forward.response_values(self.module, joined, mask.shape[1])
            return losses.critic_objective(values, mb, value_key, return_key, tokens, hp)

        return self._train(batch, mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch,
                           micro_loss=micro_loss)
