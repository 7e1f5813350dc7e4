"""Pipeline-parallel roles: torch.distributed.pipelining stages over a (pp, replicate, shard, tp) mesh.

Each rank holds one stage of the model, or with v virtual stages v of the model's pp * v stages
(`pipeline_split`: rank r the stages r, r + pp, ...), tensor parallel over the mesh's tp dim
(`tensor_parallel.apply_tensor_parallel`, applied to the whole model before it is split, so that the
plan reads the HF module names) and FSDP2 over its data-parallel ranks (the (replicate, shard) dims,
each stage a root of its own, as `training.TrainedModel`) when the role trains, a plain (or
tensor-parallel) copy when it only infers. Mesh dims, slowest first: PIPELINE_MESH_DIMS = ("pp",
"replicate", "shard", "tp"), the contract's rank order (hfplan.layout: pp, dp, tp) with dp as
replicate x shard, one of them 1.

The hidden states passed between stages are plain tensors, the same on every rank of a tensor-parallel
group (the row-parallel outputs are all-reduced), and so are their gradients: the pipeline's group is
the mesh's pp dim, the ranks with this rank's (replicate, shard, tp) coordinates, so each stage sends
to and receives from the same tensor-parallel rank of its neighbours (torch.distributed.pipelining
maps a stage to its rank in that group, and that to the global rank, for every send and receive).

Every rank of a replica receives the replica's whole share of the batch; the first stage feeds it
to the pipeline, the last reads the outputs and computes the losses, and the results (outputs and
metrics) are broadcast to every stage, so each rank returns what a TrainedModel rank returns.

Schedules (`schedule_class`): with one stage per rank, 1F1B for training when a mini-batch has at
least as many micro-batches as stages, else GPipe (the same gradients; with fewer micro-batches than
stages it holds no more activations than 1F1B would); forward-only calls run GPipe without a loss.
With v > 1 virtual stages, interleaved 1F1B (Narayanan et al., SC'21) for training wherever torch's
version of it takes the micro-batch count: it runs rounds of up to pp micro-batches, max(1, m // pp) of
them, and needs m to be a multiple of the number of rounds (any m below 2 pp, and every multiple of pp,
qualify). Other counts (m = 5 on pp 2) train breadth-first (ScheduleLoopedBFS: every micro-batch
through a rank's first stage, then its next: the same gradients, with all m micro-batches' activations
held at once, as GPipe's), and so do forward-only calls, which hold no activations. Micro-batches are
equal-sized (the pipeline's buffers have one shape): the fewest that keep each at most the plan's
micro_batch. The loss target is one tensor
packing the per-token fields the loss needs; the losses are token means over the whole mini-batch
on all data-parallel ranks (`losses`), so gradients are summed, never averaged (scale_grads=False).
A stage that fails leaves the others waiting in a point-to-point receive until the process group's
timeout; pipeline_failure names the stage.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor

from hfplan.executor import sequences
from hfplan.executor.engines import losses
from hfplan.executor.engines.pipeline_split import RankStages, Readout, rank_stages, split_model, stage_names
from hfplan.executor.engines.recompute import apply_recompute
from hfplan.executor.engines.tensor_parallel import apply_tensor_parallel
from hfplan.executor.engines.training import FSDP_MESH_DIMS, TP_MESH_DIM, _split, fsdp_modules, plain_class
from hfplan.executor.mesh import fsdp_mesh_shape
from hfplan.hyperparams import Hyperparameters
from hfplan.layout import LayoutLike
from hfplan.plan import Recompute, TrainConfig

logger = logging.getLogger(__name__)

PIPELINE_MESH_DIMS = ("pp", *FSDP_MESH_DIMS, TP_MESH_DIM)
Batch = dict[str, torch.Tensor]


def pipeline_mesh(layout: LayoutLike, device_type: str) -> DeviceMesh:
    """The (pp, replicate, shard, tp) mesh of a layout: a training layout's dp as its FSDP mesh
    (hfplan.executor.mesh), an inference layout's on `replicate` (inference holds unsharded copies)."""
    dp = fsdp_mesh_shape(layout) if isinstance(layout, TrainConfig) else (layout.dp, 1)
    return init_device_mesh(device_type, (layout.pp, *dp, layout.tp), mesh_dim_names=PIPELINE_MESH_DIMS)


def equal_micro_batches(size: int, micro_batch: int) -> int:
    """The fewest equal micro-batches of `size` sequences with at most `micro_batch` each."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    return next(n for n in range(-(-size // micro_batch), size + 1) if size % n == 0)


def interleaved_takes(micro_batches: int, pp: int) -> bool:
    """Whether torch's interleaved 1F1B runs `micro_batches` on `pp` ranks: its rounds of up to pp
    micro-batches, max(1, m // pp) of them, must split m equally."""
    return micro_batches % max(1, micro_batches // pp) == 0


def schedule_class(train: bool, micro_batches: int, pp: int, virtual_stages: int) -> type:
    """The torch schedule of a call (see the module docstring)."""
    if virtual_stages == 1:
        return Schedule1F1B if train and micro_batches >= pp else ScheduleGPipe
    return ScheduleInterleaved1F1B if train and interleaved_takes(micro_batches, pp) else ScheduleLoopedBFS


def pipeline_failure(stage: int, stages: int, what: str, failure: BaseException) -> str:
    return f"pipeline stage {stage} of {stages} failed in {what}: {type(failure).__name__}: {failure}"


class PipelinedModel:
    """One role's pipeline stages on this rank: `.module` (RankStages), `.optimizer` (None when it only infers).

    The public calls mirror TrainedModel: log_probs, values (and scores), update_actor, update_critic,
    unshard / reshard / inference(); every rank of the pipeline must make the same calls."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, hp: Hyperparameters, device: torch.device | str,
                 param_dtype: torch.dtype, *, pad_id: int, lr: float | None = None,
                 recompute: Recompute | str = Recompute.NONE, virtual_stages: int = 1) -> None:
        if mesh.mesh_dim_names != PIPELINE_MESH_DIMS:
            raise ValueError(f"pipeline mesh dims must be {PIPELINE_MESH_DIMS}, got {mesh.mesh_dim_names}")
        self.mesh, self.hp, self.pad_id, self.device = mesh, hp, pad_id, torch.device(device)
        self.stages, self.stage = mesh.size(0), mesh.get_local_rank("pp")  # pipeline ranks, and this one's
        self.total = self.stages * virtual_stages  # model stages: `stage_ids` on this rank
        self.stage_ids = rank_stages(self.stage, self.stages, virtual_stages)
        self.pp_group = mesh.get_group("pp")
        self.dp_mesh = mesh[FSDP_MESH_DIMS]
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.trains = lr is not None
        self.hf_class, self.config = plain_class(model), model.config
        self.param_dtype = param_dtype
        self.tied = self.stages > 1 and getattr(model.config, "tie_word_embeddings", False) and hasattr(
            model, "lm_head")
        model.to(dtype=torch.float32 if self.trains else param_dtype)
        for module in model.modules():  # the losses compare with log-probs and values computed without dropout
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        if self.trains:
            apply_recompute(model, recompute)
        if mesh.size(PIPELINE_MESH_DIMS.index(TP_MESH_DIM)) > 1:  # KV-head copies would drift apart in training
            apply_tensor_parallel(model, mesh[TP_MESH_DIM], copy_kv_heads=not self.trains)
        self.all_names = stage_names(model, self.total)  # every stage's HF parameter names, and (global) shapes
        self.shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
        module, self.names, self.buffer_names = split_model(model, self.stage_ids, self.total)
        module.to(self.device)
        self.module: RankStages = module
        self.optimizer: torch.optim.Optimizer | None = None
        if self.trains:
            policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
            self.layers = module.layers
            for layer in self.layers:
                fully_shard(layer, mesh=self.dp_mesh, mp_policy=policy)
            for stage in module.stages:  # each stage a root of its own: the schedule runs them one by one
                fully_shard(stage, mesh=self.dp_mesh, mp_policy=policy)
            for fsdp in fsdp_modules(module):  # sum the gradients (see training.py)
                fsdp.set_gradient_divide_factor(1.0)
                fsdp.set_force_sum_reduction_for_comms(True)
            self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=hp.weight_decay)
            self.tied_group = self._tied_group() if self.tied else None
            module.train()
        else:
            module.eval().requires_grad_(False)
        self._schedules: dict[tuple, object] = {}
        self._objective: Callable[[object, torch.Tensor], torch.Tensor] | None = None

    # -- groups and collectives ---------------------------------------------------------------------
    def _tied_group(self) -> dist.ProcessGroup | None:
        """The first and last stage of each pipeline, which hold the two copies of tied embeddings
        (every rank creates every group, in the same order)."""
        mine = None
        pipelines = self.mesh.mesh.reshape(self.stages, -1).T.tolist()
        for ranks in pipelines:
            group = dist.new_group([ranks[0], ranks[-1]])
            if dist.get_rank() in (ranks[0], ranks[-1]):
                mine = group
        return mine

    def _dp_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        for name in FSDP_MESH_DIMS:
            if self.dp_mesh[name].size() > 1:
                dist.all_reduce(tensor, op=op, group=self.dp_mesh.get_group(name))
        return tensor

    def _from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's `tensor` on every stage (same shape and dtype on all)."""
        dist.broadcast(tensor, group=self.pp_group, group_src=self.stages - 1)
        return tensor

    def _check_same_size(self, size: int) -> None:
        bounds = self._dp_all_reduce(torch.tensor([size, -size], device=self.device), dist.ReduceOp.MAX)
        if bounds.tolist() != [size, -size]:
            raise ValueError(f"data-parallel ranks hold different batch sizes (this rank {size}, "
                             f"largest {bounds[0].item()}, smallest {-bounds[1].item()})")

    # -- schedules ----------------------------------------------------------------------------------
    def _schedule(self, train: bool, micro_batches: int, readout: Readout, shape: tuple[int, ...]):
        key = (train, micro_batches, readout, shape)
        if key not in self._schedules:
            stages = []
            for index, module in zip(self.stage_ids, self.module.stages, strict=True):
                inputs, outputs = self._stage_io(index, shape[0] // micro_batches, shape[1], readout, train)
                stages.append(PipelineStage(module, index, self.total, self.device, input_args=inputs,
                                            output_args=outputs, group=self.pp_group))
            kind = schedule_class(train, micro_batches, self.stages, len(stages))
            if train and kind is ScheduleLoopedBFS:
                logger.info("interleaved 1F1B does not take %d micro-batches on %d ranks: training breadth-first "
                            "(all micro-batches' activations held at once)", micro_batches, self.stages)
            loss = dict(loss_fn=self._loss, scale_grads=False) if train else {}
            self._schedules[key] = kind(stages[0] if len(stages) == 1 else stages, micro_batches, **loss)
        return self._schedules[key]

    def _stage_io(self, stage: int, rows: int, length: int, readout: Readout, train: bool):
        """Example (meta) inputs and outputs of model stage `stage` for one micro-batch: its buffers are made
        from them (static shapes; shape inference would run the stage on uninitialised token ids)."""
        ids = torch.empty((rows, length), dtype=torch.long, device="meta")
        hidden = torch.empty((rows, length, self.config.hidden_size), dtype=self.param_dtype, device="meta")
        hidden.requires_grad_(train)
        inputs = (ids, ids, ids) if stage == 0 else (hidden, ids, ids, ids)
        if stage < self.total - 1:
            return inputs, (hidden, ids, ids, ids)
        per_token = torch.empty((rows, readout.response_len), dtype=torch.float32, device="meta")
        if readout.kind == "scores":
            return inputs, torch.empty((rows,), dtype=torch.float32, device="meta")
        outputs = per_token.clone().requires_grad_(train)
        if readout.kind == "log_probs" and readout.with_entropy:
            outputs = (outputs, per_token.clone().requires_grad_(train and readout.entropy_grad))
        return inputs, outputs

    def _loss(self, output, target: torch.Tensor) -> torch.Tensor:
        return self._objective(output, target)

    def _run(self, schedule, readout: Readout, joined: sequences.Joined, target: torch.Tensor | None):
        self.module.set_readout(readout)
        args = (joined.input_ids, joined.attention_mask, joined.position_ids) if self.first else ()
        return schedule.step(*args, target=target if self.last else None)

    @contextlib.contextmanager
    def _named(self, what: str) -> Iterator[None]:
        """A failure inside a pipelined call, naming this stage: the other stages wait for it until the
        process group's timeout, and fail naming themselves."""
        try:
            yield
        except Exception as failure:
            raise RuntimeError(pipeline_failure(self.stage, self.stages, what, failure)) from failure

    # -- inference ----------------------------------------------------------------------------------
    def unshard(self) -> None:
        for module in fsdp_modules(self.module):
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()

    def reshard(self) -> None:
        layers = {id(layer) for layer in self.layers}
        for module in fsdp_modules(self.module):
            module.reshard()
            module.set_reshard_after_forward(id(module) in layers, recurse=False)

    @contextlib.contextmanager
    def inference(self) -> Iterator[RankStages]:
        self.module.eval()
        if self.trains:
            self.unshard()
        try:
            with torch.no_grad():
                yield self.module
        finally:
            if self.trains:
                self.reshard()
                self.module.train()

    def _forward(self, readout: Readout, prompts: torch.Tensor, responses: torch.Tensor,
                 response_mask: torch.Tensor, micro_batch: int, out_shape: tuple[int, ...]) -> torch.Tensor:
        prompts, responses, response_mask = (t.to(self.device) for t in (prompts, responses, response_mask))
        joined = sequences.join(prompts, responses, response_mask.long(), self.pad_id)
        micro = equal_micro_batches(prompts.shape[0], micro_batch)
        with self._named(readout.kind), self.inference():
            schedule = self._schedule(False, micro, readout, tuple(joined.input_ids.shape))
            out = self._run(schedule, readout, joined, None)
        result = out.float() if self.last else torch.empty(out_shape, dtype=torch.float32, device=self.device)
        return self._from_last(result.contiguous())

    def log_probs(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
                  micro_batch: int) -> torch.Tensor:
        """The response tokens' log-probs at the sampling temperature, [B, R] float32, 0 where masked."""
        readout = Readout("log_probs", responses.shape[1], self.hp.temperature)
        out = self._forward(readout, prompts, responses, response_mask, micro_batch, tuple(responses.shape))
        return torch.where(response_mask.to(self.device).bool(), out, 0.0)

    def values(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
               micro_batch: int) -> torch.Tensor:
        """The values before each response token, [B, R] float32, 0 where masked."""
        out = self._forward(Readout("values", responses.shape[1]), prompts, responses, response_mask, micro_batch,
                            tuple(responses.shape))
        return torch.where(response_mask.to(self.device).bool(), out, 0.0)

    def scores(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
               micro_batch: int) -> torch.Tensor:
        """Each sequence's score at its last real token, [B] float32."""
        return self._forward(Readout("scores", responses.shape[1]), prompts, responses, response_mask, micro_batch,
                             (responses.shape[0],))

    # -- training -----------------------------------------------------------------------------------
    def _clip_and_step(self) -> float:
        """Clip by the norm of the whole model's gradient (every stage; tied embeddings counted once)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.tied:
            tied = self.module.embedding.weight if self.first else self.module.head.weight
            if self.first or self.last:
                with torch.no_grad():
                    grad = tied.grad.to_local() if isinstance(tied.grad, DTensor) else tied.grad
                    dist.all_reduce(grad, group=self.tied_group)
            if self.last:
                params = [p for p in params if p is not tied]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = (norm.to(self.device, torch.float32) ** 2).reshape(1)
        dist.all_reduce(squared, group=self.pp_group)
        grad_norm = float(squared.sqrt())
        if not math.isfinite(grad_norm):
            logger.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
            return grad_norm
        coef = min(1.0, self.hp.max_grad_norm / (grad_norm + 1e-6))  # torch's clip_grad_norm_ rule
        if coef < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        return grad_norm

    def _step(self, batch: Batch, micro_batch: int, readout: Readout, target_keys: tuple[str, ...],
              objective: Callable[[object, Batch, torch.Tensor], losses.Objective]) -> dict[str, torch.Tensor]:
        mask = batch["response_mask"]
        tokens = self._dp_all_reduce(mask.sum().to(torch.float32)).clamp(min=1.0)
        joined = sequences.join(batch["prompts"], batch["responses"], mask.long(), self.pad_id)
        target = torch.stack([batch[k].to(torch.float32) for k in target_keys], dim=-1)  # one tensor: [B, R, k]

        def unpack(packed: torch.Tensor) -> Batch:
            return {k: packed[..., i] for i, k in enumerate(target_keys)}

        self._objective = lambda output, packed: objective(output, unpack(packed), tokens)[0]
        self.optimizer.zero_grad(set_to_none=True)
        schedule = self._schedule(True, equal_micro_batches(mask.shape[0], micro_batch), readout,
                                  tuple(joined.input_ids.shape))
        outputs = self._run(schedule, readout, joined, target)
        stats: dict[str, torch.Tensor] = {}
        if self.last:  # the statistics over the whole mini-batch, from the outputs the losses saw
            with torch.no_grad():
                detached = tuple(o.detach() for o in outputs) if isinstance(outputs, tuple) else outputs.detach()
                stats = {k: v.detach().to(torch.float32) for k, v in objective(detached, unpack(target),
                                                                                 tokens)[1].items()}
        grad_norm = self._clip_and_step()
        return stats | {"grad_norm": torch.tensor(grad_norm)}

    def _train(self, batch: Batch, *, mini_batches: int, epochs: int, micro_batch: int, readout: Readout,
               target_keys: tuple[str, ...], objective) -> dict[str, float]:
        if not self.trains:
            raise RuntimeError("this pipeline role only infers")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        size = batch["response_mask"].shape[0]
        self._check_same_size(size)
        parts = _split(size, mini_batches, "mini_batches")
        equal_micro_batches(size, micro_batch)  # validates micro_batch before any collective
        self.module.train()
        with self._named("an update"):
            steps = [self._step({k: v[part] for k, v in batch.items()}, micro_batch, readout, target_keys,
                                objective) for _ in range(epochs) for part in parts]
        names = [n for n in steps[0] if n != "grad_norm"]
        summed = torch.zeros((len(steps), len(names)), dtype=torch.float32, device=self.device)
        if self.last and names:
            summed = self._dp_all_reduce(torch.stack([torch.stack([s[n].to(self.device) for n in names])
                                                      for s in steps]))
        names = self._names_from_last(names)
        if not self.last:
            summed = torch.zeros((len(steps), len(names)), dtype=torch.float32, device=self.device)
        summed = self._from_last(summed)
        means = summed.mean(dim=0).tolist()
        grad_norm = sum(float(s["grad_norm"]) for s in steps) / len(steps)
        return dict(zip(names, means, strict=True)) | {"grad_norm": grad_norm}

    def _names_from_last(self, names: list[str]) -> list[str]:
        box = [names]
        dist.broadcast_object_list(box, group=self.pp_group, group_src=self.stages - 1, device=self.device)
        return box[0]

    @staticmethod
    def _require(batch: Batch, keys: tuple[str, ...]) -> None:
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"update is missing batch fields {missing}")

    def update_actor(self, batch: Batch, *, mini_batches: int, epochs: int, micro_batch: int,
                     use_kl_loss: bool) -> dict[str, float]:
        """As TrainedModel.update_actor (the same objective and metrics), through the pipeline."""
        target_keys = ("response_mask", "old_log_probs", "advantages", *(("ref_log_probs",) if use_kl_loss else ()))
        self._require(batch, ("prompts", "responses", *target_keys))
        hp = self.hp
        readout = Readout("log_probs", batch["responses"].shape[1], hp.temperature, with_entropy=True,
                          entropy_grad=hp.entropy_coef > 0)

        def objective(output, mb: Batch, tokens: torch.Tensor) -> losses.Objective:
            log_probs, entropy = output
            return losses.actor_objective(log_probs, entropy, mb, tokens, hp, use_kl_loss)

        metrics = self._train(batch, mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch,
                              readout=readout, target_keys=target_keys, objective=objective)
        return metrics | {"lr": self.optimizer.param_groups[0]["lr"]}

    def update_critic(self, batch: Batch, value_key: str, return_key: str, *, mini_batches: int, epochs: int,
                      micro_batch: int) -> dict[str, float]:
        """As TrainedModel.update_critic, through the pipeline."""
        target_keys = ("response_mask", value_key, return_key)
        self._require(batch, ("prompts", "responses", *target_keys))
        hp = self.hp

        def objective(values, mb: Batch, tokens: torch.Tensor) -> losses.Objective:
            return losses.critic_objective(values, mb, value_key, return_key, tokens, hp)

        return self._train(batch, mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch,
                           readout=Readout("values", batch["responses"].shape[1]), target_keys=target_keys,
                           objective=objective)

    # -- whole-model weights ------------------------------------------------------------------------
    def gathered(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every model stage's full parameters on every rank, by HF name, in `dtype` (a collective over the
        pipeline and its data- and tensor-parallel ranks: DTensors gathered whole within their stage, then
        one broadcast of a flat buffer per stage)."""
        mine = {self.names[name]: p for name, p in self.module.named_parameters(remove_duplicate=False)}
        out: dict[str, torch.Tensor] = {}
        for stage, names in enumerate(self.all_names):
            sizes = [math.prod(self.shapes[n]) for n in names]
            if stage in self.stage_ids:
                flat = torch.cat([(mine[n].full_tensor() if isinstance(mine[n], DTensor) else mine[n]).detach()
                                  .to(dtype).reshape(-1) for n in names])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            dist.broadcast(flat, group=self.pp_group, group_src=stage % self.stages)
            for name, part in zip(names, flat.split(sizes), strict=True):
                out[name] = part.view(self.shapes[name])
        return out

    def stage_buffers(self) -> dict[str, torch.Tensor]:
        """This stage's buffers by HF name (the rotary tables, the same on every stage)."""
        return {hf: self.module.get_buffer(name) for name, hf in self.buffer_names.items()}
