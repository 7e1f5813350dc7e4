"""The pipeline mode of a RoleModel (pp > 1): torch.distributed.pipelining stages over the mesh's pp dim.

Each rank holds one stage of the model, or with v virtual stages v of the model's pp * v stages
(`pipeline_split`: rank r the stages r, r + pp, ...), tensor parallel over the mesh's tp dim (the
RoleModel applies it to the whole model before it is split, so that the plan reads the HF module names)
and, when the role trains, FSDP2 over its data-parallel ranks (each stage a root of its own).

The hidden states passed between stages are plain tensors, the same on every rank of a tensor-parallel
group (the row-parallel outputs are all-reduced), and so are their gradients: the pipeline's group is
the mesh's pp dim, the ranks with this rank's (replicate, shard, tp) coordinates, so each stage sends
to and receives from the same tensor-parallel rank of its neighbours (torch.distributed.pipelining
maps a stage to its rank in that group, and that to the global rank, for every send and receive).

Every rank of a replica receives the replica's whole share of the batch; the first stage feeds it
to the pipeline, the last reads the outputs and computes the losses, and the results (outputs and
metrics) are broadcast to every stage, so each rank returns what a single-stage rank returns.

Schedules (`schedule_class`): with one stage per rank, 1F1B for training when a mini-batch has at
least as many micro-batches as stages, else GPipe (the same gradients; with fewer micro-batches than
stages it holds no more activations than 1F1B would); forward-only calls run GPipe without a loss.
With v > 1 virtual stages, interleaved 1F1B (Narayanan et al., SC'21) for training wherever torch's
version of it takes the micro-batch count: it runs rounds of up to pp micro-batches, max(1, m // pp) of
them, and needs m to be a multiple of the number of rounds (any m below 2 pp, and every multiple of pp,
qualify). Other counts (m = 5 on pp 2) train breadth-first (ScheduleLoopedBFS: every micro-batch
through a rank's first stage, then its next: the same gradients, with all m micro-batches' activations
held at once, as GPipe's), and so do forward-only calls, which hold no activations. Micro-batches are
the contract's (hfplan.layout.micro_batch_sizes: equal, the pipeline's buffers having one shape). The
loss target is one tensor packing the per-token fields the loss needs; the losses are token means over
the whole mini-batch on all data-parallel ranks (`losses`), so gradients are summed, never averaged (scale_grads=False).
A stage that fails leaves the others waiting in a point-to-point receive until the process group's
timeout; pipeline_failure names the stage.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor

from hfplan.executor import sequences
from hfplan.executor.engines.forward import Readout
from hfplan.executor.engines.grad_norm import clip_by_norm, squared_grad_norm
from hfplan.executor.engines.pipeline_split import RankStages, rank_stages, split_model, stage_names
from hfplan.executor.engines.stages import Batch, Objective
from hfplan.executor.mesh import PP
from hfplan.layout import micro_batch_sizes

logger = logging.getLogger(__name__)


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


class PipelineStages:
    """This rank's stages of a pipeline over the mesh's pp dim; every rank of the pipeline must make the
    same calls."""

    def __init__(self, mesh: DeviceMesh, device: torch.device, param_dtype: torch.dtype, trains: bool,
                 virtual_stages: int) -> None:
        self.mesh, self.device, self.param_dtype, self.trains = mesh, device, param_dtype, trains
        self.pp, self.stage = mesh[PP].size(), mesh.get_local_rank(PP)  # pipeline ranks, and this one's
        self.total = self.pp * virtual_stages  # model stages: `stage_ids` on this rank
        self.stage_ids = rank_stages(self.stage, self.pp, virtual_stages)
        self.pp_group = mesh.get_group(PP)
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        self._schedules: dict[tuple, object] = {}
        self._objective = None

    def split(self, model: nn.Module, device: torch.device) -> RankStages:
        self.hidden_size = model.config.hidden_size
        self.tied = getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head")
        self.all_names = stage_names(model, self.total)  # every stage's HF parameter names, and (global) shapes
        self.shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
        module, self.names, self.buffer_names = split_model(model, self.stage_ids, self.total)
        self.tied_group = self._tied_group() if self.tied and self.trains else None
        return module.to(device)

    def layers(self, module: RankStages) -> list[nn.Module]:
        return module.layers

    def roots(self, module: RankStages) -> list[nn.Module]:
        return list(module.stages)  # each stage a root of its own: the schedule runs them one by one

    def _tied_group(self) -> dist.ProcessGroup | None:
        """The first and last stage of each pipeline, which hold the two copies of tied embeddings
        (every rank creates every group, in the same order)."""
        mine = None
        pipelines = self.mesh.mesh.reshape(self.pp, -1).T.tolist()
        for ranks in pipelines:
            group = dist.new_group([ranks[0], ranks[-1]])
            if dist.get_rank() in (ranks[0], ranks[-1]):
                mine = group
        return mine

    def from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's `tensor` on every stage (same shape and dtype on all)."""
        dist.broadcast(tensor, group=self.pp_group, group_src=self.pp - 1)
        return tensor

    def names_from_last(self, names: list[str]) -> list[str]:
        box = [names]
        dist.broadcast_object_list(box, group=self.pp_group, group_src=self.pp - 1, device=self.device)
        return box[0]

    @contextlib.contextmanager
    def named(self, what: str) -> Iterator[None]:
        """A failure inside a pipelined call, naming this stage: the other stages wait for it until the
        process group's timeout, and fail naming themselves."""
        try:
            yield
        except Exception as failure:
            raise RuntimeError(pipeline_failure(self.stage, self.pp, what, failure)) from failure

    # -- schedules ----------------------------------------------------------------------------------
    def _schedule(self, module: RankStages, train: bool, micro: tuple[int, ...], readout: Readout,
                  length: int):
        key = (train, micro, readout, length)
        if key not in self._schedules:
            stages = []
            for index, stage in zip(self.stage_ids, module.stages, strict=True):
                inputs, outputs = self._stage_io(index, micro[0], length, readout, train)
                stages.append(PipelineStage(stage, index, self.total, self.device, input_args=inputs,
                                            output_args=outputs, group=self.pp_group))
            kind = schedule_class(train, len(micro), self.pp, len(stages))
            if train and kind is ScheduleLoopedBFS:
                logger.info("interleaved 1F1B does not take %d micro-batches on %d ranks: training breadth-first "
                            "(all micro-batches' activations held at once)", len(micro), self.pp)
            loss = dict(loss_fn=self._loss, scale_grads=False) if train else {}
            self._schedules[key] = kind(stages[0] if len(stages) == 1 else stages, len(micro), **loss)
        return self._schedules[key]

    def _stage_io(self, stage: int, rows: int, length: int, readout: Readout, train: bool):
        """Example (meta) inputs and outputs of model stage `stage` for one micro-batch: its buffers are made
        from them (static shapes; shape inference would run the stage on uninitialised token ids)."""
        ids = torch.empty((rows, length), dtype=torch.long, device="meta")
        hidden = torch.empty((rows, length, self.hidden_size), dtype=self.param_dtype, device="meta")
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

    def _run(self, module: RankStages, schedule, readout: Readout, joined: sequences.Joined,
             target: torch.Tensor | None):
        module.set_readout(readout)
        args = (joined.input_ids, joined.attention_mask, joined.position_ids) if self.first else ()
        return schedule.step(*args, target=target if self.last else None)

    # -- calls --------------------------------------------------------------------------------------
    def forward(self, module: RankStages, readout: Readout, prompts: torch.Tensor, responses: torch.Tensor,
                response_mask: torch.Tensor, micro_batch: int, pad_id: int) -> torch.Tensor:
        prompts, responses, response_mask = (t.to(self.device) for t in (prompts, responses, response_mask))
        joined = sequences.join(prompts, responses, response_mask.long(), pad_id)
        micro = micro_batch_sizes(prompts.shape[0], micro_batch)
        schedule = self._schedule(module, False, micro, readout, joined.input_ids.shape[1])
        out = self._run(module, schedule, readout, joined, None)
        shape = (responses.shape[0],) if readout.kind == "scores" else tuple(responses.shape)
        result = out.float() if self.last else torch.empty(shape, dtype=torch.float32, device=self.device)
        result = self.from_last(result.contiguous())
        return result if readout.kind == "scores" else torch.where(response_mask.bool(), result, 0.0)

    def accumulate(self, module: RankStages, batch: Batch, micro_batch: int, readout: Readout,
                   objective: Objective, tokens: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
        mask = batch["response_mask"]
        joined = sequences.join(batch["prompts"], batch["responses"], mask.long(), pad_id)
        target_keys = tuple(k for k in batch if k not in ("prompts", "responses"))
        target = torch.stack([batch[k].to(torch.float32) for k in target_keys], dim=-1)  # one tensor: [B, R, k]

        def unpack(packed: torch.Tensor) -> Batch:
            return {k: packed[..., i] for i, k in enumerate(target_keys)}

        self._objective = lambda output, packed: objective(output, unpack(packed), tokens)[0]
        schedule = self._schedule(module, True, micro_batch_sizes(mask.shape[0], micro_batch), readout,
                                  joined.input_ids.shape[1])
        outputs = self._run(module, schedule, readout, joined, target)
        if not self.last:
            return {}
        with torch.no_grad():  # the statistics over the whole mini-batch, from the outputs the losses saw
            detached = tuple(o.detach() for o in outputs) if isinstance(outputs, tuple) else outputs.detach()
            return {k: v.detach().to(torch.float32) for k, v in objective(detached, unpack(target), tokens)[1].items()}

    def clip_grad_norm(self, module: RankStages, max_norm: float) -> float:
        """Clip by the norm of the whole model's gradient (every stage; tied embeddings counted once)."""
        params = [p for p in module.parameters() if p.grad is not None]
        if self.tied:
            tied = module.embedding.weight if self.first else module.head.weight
            if self.first or self.last:
                with torch.no_grad():
                    grad = tied.grad.to_local() if isinstance(tied.grad, DTensor) else tied.grad
                    dist.all_reduce(grad, group=self.tied_group)
            if self.last:
                params = [p for p in params if p is not tied]
        squared = squared_grad_norm([p.grad for p in params]).to(self.device).reshape(1)
        dist.all_reduce(squared, group=self.pp_group)
        grad_norm = float(squared.sqrt())
        clip_by_norm([p.grad for p in module.parameters() if p.grad is not None], grad_norm, max_norm)
        return grad_norm

    # -- whole-model weights ------------------------------------------------------------------------
    def gathered(self, module: RankStages, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every model stage's full parameters on every rank, by HF name, in `dtype` (a collective over the
        pipeline and its data- and tensor-parallel ranks: DTensors gathered whole within their stage, then
        one broadcast of a flat buffer per stage)."""
        mine = {self.names[name]: p for name, p in module.named_parameters(remove_duplicate=False)}
        out: dict[str, torch.Tensor] = {}
        for stage, names in enumerate(self.all_names):
            sizes = [math.prod(self.shapes[n]) for n in names]
            if stage in self.stage_ids:
                flat = torch.cat([(mine[n].full_tensor() if isinstance(mine[n], DTensor) else mine[n]).detach()
                                  .to(dtype).reshape(-1) for n in names])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            dist.broadcast(flat, group=self.pp_group, group_src=stage % self.pp)
            for name, part in zip(names, flat.split(sizes), strict=True):
                out[name] = part.view(self.shapes[name])
        return out

    def full_weights(self, module: RankStages) -> dict[str, torch.Tensor]:
        return {name: tensor.cpu() for name, tensor in self.gathered(module, torch.float32).items()}
