"""A role's model on this rank: the one engine of every role that holds a model in a layout, trained
(actor, critic, cost critic: FSDP2, AdamW, the PPO updates) or forward-only (reference, reward, cost).

The layout's mesh (hfplan.executor.mesh: (pp, replicate, shard, tp)) decides everything:
- tp > 1: the whole model is first split by `tensor_parallel.apply_tensor_parallel` over the tp dim
  (forward-only models may copy KV heads; trained ones never: copies would drift apart);
- pp > 1: the model runs as pipeline stages (`pipeline.PipelineStages`), else whole (`whole.WholeModel`);
  the mode is the engine's `stages`, the only part that differs;
- trained: FSDP2 over the (replicate, shard) dims: (1, dp) shards parameters, gradients and optimizer
  states (ZeRO-3), (dp, 1) keeps them replicated and all-reduces gradients (DDP-like); the ranks of one
  tensor-parallel group (and of one pipeline) receive the same batch share. With one data-parallel rank and
  compute in the master weights' fp32 (the CPU), FSDP would only copy gradients through collectives of one
  rank (bench/train_engine.py times the difference), so the module trains as it is.

Every rank must pass identical initial weights. Each update receives this rank's share of the global
batch; `mini_batches` is the number of optimizer steps per epoch, the same on every rank, each step
accumulated over the contract's micro-batches (hfplan.layout.micro_batch_sizes). The losses are token
means over a whole mini-batch on all ranks (see `losses`), so FSDP's gradient reduction sums instead of
averaging and a step equals the single-process step on the full mini-batch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hfplan.executor.engines import losses
from hfplan.executor.engines.forward import Readout
from hfplan.executor.engines.modules import fsdp_modules, plain_class
from hfplan.executor.engines.pipeline import PipelineStages
from hfplan.executor.engines.recompute import apply_recompute
from hfplan.executor.engines.stages import Batch, Objective, Stages
from hfplan.executor.engines.tensor_parallel import apply_tensor_parallel
from hfplan.executor.engines.whole import WholeModel
from hfplan.executor.mesh import DP_DIMS, TP, ParallelDims, parallel_dims
from hfplan.hyperparams import Hyperparameters
from hfplan.layout import micro_batch_sizes, trains_through_fsdp, unsupported_layout
from hfplan.plan import Recompute
from hfplan.profiles.models import ModelArch

logger = logging.getLogger(__name__)


class _Layout(NamedTuple):
    """What hfplan.layout.unsupported_layout reads of a layout."""

    pp: int
    dp: int
    tp: int
    virtual_stages: int


def check_layout(config, trains: bool, dims: ParallelDims, virtual_stages: int) -> None:
    """The contract's rule (hfplan.layout.unsupported_layout) for an HF config on a mesh; raises with its reason."""
    arch = ModelArch(name=getattr(config, "name_or_path", "") or config.model_type,
                     layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
                     kv_heads=config.num_key_value_heads, ffn=config.intermediate_size, vocab=config.vocab_size,
                     head_dim=getattr(config, "head_dim", None))
    problem = unsupported_layout(arch, "train" if trains else "infer",
                                 _Layout(dims.pp, dims.dp, dims.tp, virtual_stages))
    if problem:
        raise ValueError(problem)


def _split(size: int, parts: int, what: str) -> list[slice]:
    if size % parts:
        raise ValueError(f"{what}: {size} sequences on this rank do not split into {parts} equal parts")
    step = size // parts
    return [slice(i * step, (i + 1) * step) for i in range(parts)]


class _Step(NamedTuple):
    stats: dict[str, torch.Tensor]  # summed over the mini-batch on this rank (last stage; empty elsewhere)
    grad_norm: float


def _grads_placed_as_params(module: nn.Module) -> None:
    """Tensor parallelism without FSDP leaves some gradients in another placement than their parameter's (a
    vocabulary-split embedding's comes back replicated); each is put in its parameter's, a local slice where the
    gradient is replicated, so that every rank's local gradient is its parameter's shape (the optimizer's and
    the tied embeddings' all-reduce read it)."""
    for param in module.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


class RoleModel:
    """One role's model on this rank: `.module` (the HF model, or with pp > 1 this rank's RankStages) and
    `.optimizer` (None when it only infers; `lr` None). Every rank of the layout makes the same calls.
    `fsdp`: whether a trained model is wrapped in FSDP2; None, as `layout.trains_through_fsdp` says (True on one
    rank measures the wrapped engine's costs there)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, hp: Hyperparameters, device: torch.device | str,
                 param_dtype: torch.dtype, *, pad_id: int, lr: float | None = None,
                 recompute: Recompute | str = Recompute.NONE, virtual_stages: int = 1,
                 fsdp: bool | None = None) -> None:
        self.mesh, self.dims, self.hp, self.pad_id = mesh, parallel_dims(mesh), hp, pad_id
        self.device, self.param_dtype, self.trains = torch.device(device), param_dtype, lr is not None
        if mesh.device_type != self.device.type:
            raise ValueError(f"mesh is on {mesh.device_type} but the device is {self.device}")
        check_layout(model.config, self.trains, self.dims, virtual_stages)
        self.hf_class, self.config = plain_class(model), model.config
        # Trained: master weights in fp32; fully_shard moves each group to the mesh's device as it shards it,
        # so a model built on the CPU never needs its full size on the accelerator. Dropout off: the losses
        # compare against log-probs and values computed without it.
        model.to(dtype=torch.float32 if self.trains else param_dtype)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        if self.trains:
            apply_recompute(model, recompute)
        if self.dims.tp > 1:
            apply_tensor_parallel(model, mesh[TP], copy_kv_heads=not self.trains)
        self.stages: Stages = (PipelineStages(mesh, self.device, param_dtype, self.trains, virtual_stages)
                               if self.dims.pp > 1 else WholeModel())
        self.module = self.stages.split(model, self.device)
        self.names = self.stages.names  # this rank's parameter names -> the HF model's (None: the same)
        self.layers = self.stages.layers(self.module)
        self.optimizer: torch.optim.Optimizer | None = None
        if not self.trains:
            self.module.to(self.device).eval().requires_grad_(False)
            return
        if fsdp is None:
            fsdp = trains_through_fsdp(self.dims.dp, param_dtype.itemsize)
        if fsdp:
            self._shard(param_dtype)
        else:
            self.module.to(self.device)
        # The fused kernel updates every tensor in one pass (CPU and CUDA): torch's default on CPU is a Python loop
        # over the tensors, each op dispatched through DTensor under FSDP2 (5.6x slower on the demo model there).
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr, weight_decay=hp.weight_decay, fused=True)
        self.module.train()

    def _shard(self, param_dtype: torch.dtype) -> None:
        """FSDP2 over the data-parallel dims: every decoder layer and each root a group of its own."""
        dp_mesh = self.mesh[DP_DIMS]
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer in self.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
        for root in self.stages.roots(self.module):
            fully_shard(root, mesh=dp_mesh, mp_policy=policy)
        for fsdp in fsdp_modules(self.module):  # sum the gradients (plain SUM collectives, gloo has no PREMUL_SUM)
            fsdp.set_gradient_divide_factor(1.0)
            fsdp.set_force_sum_reduction_for_comms(True)

    # Collectives over every data-parallel rank (tensor-parallel peers and pipeline stages hold the same batch).
    def _dp_all_reduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
        for group in self._dp_groups:
            torch.distributed.all_reduce(tensor, op=op, group=group)
        return tensor

    @functools.cached_property
    def _dp_groups(self) -> list[torch.distributed.ProcessGroup]:
        """The data-parallel dims' groups of more than one rank, looked up once: slicing the mesh builds a new
        DeviceMesh each time, a cost every optimizer step would pay."""
        return [self.mesh.get_group(name) for name in DP_DIMS if self.mesh[name].size() > 1]

    def _check_same_size(self, size: int) -> None:
        """Every rank must run the same number of micro-batches, or FSDP's collectives would hang."""
        bounds = self._dp_all_reduce(torch.tensor([size, -size], device=self.device), torch.distributed.ReduceOp.MAX)
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
        the roots keep their weights for the backward that follows)."""
        layers = {id(layer) for layer in self.layers}
        for module in fsdp_modules(self.module):
            module.reshard()
            module.set_reshard_after_forward(id(module) in layers, recurse=False)

    def _mode(self, training: bool) -> None:
        """The module in train or eval mode. Only this engine sets modes, always on the whole module, so the root's
        flag is every submodule's: a call in the mode already is skipped (each walk over the modules cost about a
        tenth of a millisecond of Python per call on the CPU demo)."""
        if self.module.training != training:
            self.module.train(training)

    @contextlib.contextmanager
    def inference(self) -> Iterator[nn.Module]:
        """The module in eval mode without grad, a trained one's weights gathered once for all micro-batches."""
        self._mode(False)
        if self.trains:
            self.unshard()
        try:
            with torch.no_grad():
                yield self.module
        finally:
            if self.trains:
                self.reshard()
                self._mode(True)

    def _forward(self, readout: Readout, prompts: torch.Tensor, responses: torch.Tensor,
                 response_mask: torch.Tensor, micro_batch: int) -> torch.Tensor:
        with self.stages.named(readout.kind), self.inference() as module:
            return self.stages.forward(module, readout, prompts, responses, response_mask, micro_batch, self.pad_id)

    def log_probs(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
                  micro_batch: int) -> torch.Tensor:
        """The response tokens' log-probs at the sampling temperature, [B, R] float32, 0 where masked."""
        readout = Readout("log_probs", responses.shape[1], self.hp.temperature)
        return self._forward(readout, prompts, responses, response_mask, micro_batch)

    def values(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
               micro_batch: int) -> torch.Tensor:
        """A critic's values before each response token, [B, R] float32, 0 where masked."""
        return self._forward(Readout("values", responses.shape[1]), prompts, responses, response_mask, micro_batch)

    def scores(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
               micro_batch: int) -> torch.Tensor:
        """A reward or cost model's score of each sequence at its last real token, [B] float32."""
        return self._forward(Readout("scores", responses.shape[1]), prompts, responses, response_mask, micro_batch)

    # Training.
    def _step(self, batch: Batch, micro_batch: int, readout: Readout, objective: Objective) -> _Step:
        """One optimizer step over a mini-batch (this rank's part), accumulated over micro-batches."""
        tokens = self._dp_all_reduce(batch["response_mask"].sum().to(torch.float32)).clamp(min=1.0)
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.stages.accumulate(self.module, batch, micro_batch, readout, objective, tokens, self.pad_id)
        if self.dims.tp > 1:  # only tensor parallelism leaves gradients placed otherwise (one walk saved elsewhere)
            _grads_placed_as_params(self.module)
        grad_norm = self.stages.clip_grad_norm(self.module, self.hp.max_grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
        return _Step(stats, grad_norm)

    def _metrics(self, steps: list[_Step]) -> dict[str, float]:
        """Each statistic summed over the data-parallel ranks, then averaged over the steps; the mean gradient norm."""
        names = self.stages.names_from_last(list(steps[0].stats))
        table = torch.zeros((len(steps), len(names)), dtype=torch.float32, device=self.device)
        if self.stages.last and names:
            table = self._dp_all_reduce(torch.stack([torch.stack([s.stats[n].to(self.device) for n in names])
                                                     for s in steps]))
        columns = self.stages.from_last(table).T.tolist()
        means = [sum(column) / len(steps) for column in columns]
        return dict(zip(names, means, strict=True)) | {"grad_norm": sum(s.grad_norm for s in steps) / len(steps)}

    def _train(self, batch: Batch, keys: tuple[str, ...], *, mini_batches: int, epochs: int, micro_batch: int,
               readout: Readout, objective: Objective) -> dict[str, float]:
        if not self.trains:
            raise RuntimeError("this role only infers")
        batch = self._to_device(batch, keys)
        size = batch["response_mask"].shape[0]
        self._check_same_size(size)
        parts = _split(size, mini_batches, "mini_batches")
        micro_batch_sizes(size, micro_batch)  # validates micro_batch before any collective
        self._mode(True)
        with self.stages.named("an update"):
            steps = [self._step({k: v[part] for k, v in batch.items()}, micro_batch, readout, objective)
                     for _ in range(epochs) for part in parts]
        return self._metrics(steps)

    def update_actor(self, batch: Batch, *, mini_batches: int, epochs: int, micro_batch: int,
                     use_kl_loss: bool) -> dict[str, float]:
        """PPO clipped surrogate - entropy bonus (+ KL loss to the reference when `use_kl_loss`); without
        old_log_probs in the batch, one on-policy step against the current log-probs; with behaviour_log_probs
        (an asynchronous run), each token weighed by its truncated importance ratio (losses.actor_objective).

        Metrics, averaged over the optimizer steps: policy_loss, entropy, approx_kl (to the old
        policy), clip_frac, kl (to the reference, with use_kl_loss), behaviour_weight (the mean importance
        weight, asynchronous runs), grad_norm, lr."""
        if "old_log_probs" not in batch and (mini_batches, epochs) != (1, 1):
            raise ValueError("an update without old log-probs must be one optimizer step (on-policy)")
        keys = ("prompts", "responses", "response_mask", *(("old_log_probs",) if "old_log_probs" in batch else ()),
                "advantages", *(("ref_log_probs",) if use_kl_loss else ()),
                *((losses.BEHAVIOUR,) if losses.BEHAVIOUR in batch else ()))
        hp = self.hp
        readout = Readout("log_probs", batch["responses"].shape[1], hp.temperature, with_entropy=True,
                          entropy_grad=hp.entropy_coef > 0)

        def objective(output, mb: Batch, tokens: torch.Tensor) -> losses.Objective:
            log_probs, entropy = output
            return losses.actor_objective(log_probs, entropy, mb, tokens, hp, use_kl_loss)

        metrics = self._train(batch, keys, mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch,
                              readout=readout, objective=objective)
        return metrics | {"lr": self.optimizer.param_groups[0]["lr"]}

    def update_critic(self, batch: Batch, value_key: str, return_key: str, *, mini_batches: int, epochs: int,
                      micro_batch: int) -> dict[str, float]:
        """Clipped value regression of the values toward the returns.

        Metrics, averaged over the optimizer steps: value_loss, value_clip_frac, grad_norm."""
        keys = ("prompts", "responses", "response_mask", value_key, return_key)
        hp = self.hp

        def objective(values, mb: Batch, tokens: torch.Tensor) -> losses.Objective:
            return losses.critic_objective(values, mb, value_key, return_key, tokens, hp)

        return self._train(batch, keys, mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch,
                           readout=Readout("values", batch["responses"].shape[1]), objective=objective)

    # Weights for generation and export.
    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by HF name (tensor parallelism's and FSDP's DTensors, or plain tensors; tied
        ones once; a pipelined rank's stages only): what the resharding plan (engines.reshard) reads."""
        names = self.names or {}
        return {names.get(n, n): p for n, p in self.module.named_parameters()}

    def local_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's buffers (the rotary tables) by HF name."""
        names = self.stages.buffer_names or {}
        return {names.get(n, n): b for n, b in self.module.named_buffers(remove_duplicate=False)}

    def generation_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The whole model's parameters and buffers by HF name, for generation in the training layout (until
        `release_generation`). A pipelined model has none: it generates from the resharding plan's shards."""
        if not isinstance(self.stages, WholeModel):
            raise ValueError("a pipelined model generates from the resharding plan's shards (engines.reshard)")
        return self.stages.generation_weights(self)

    def release_generation(self) -> None:
        if isinstance(self.stages, WholeModel):
            self.stages.release_generation(self)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter whole by HF name on the CPU, at least on rank 0 (a collective over the layout)."""
        return self.stages.full_weights(self.module)
