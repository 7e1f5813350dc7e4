"""One role on one worker: its model, its engines, and the calls the dataflow makes on it.

A trained role (actor, critic, cost critic) holds its model in the training layout (a pipeline stage
with pp > 1, tensor parallel over its tp ranks, FSDP2 over its data-parallel ones) and runs its forward
calls there too; an inference-only role (reference, reward, cost) holds a copy (or a stage of one) split
over its inference layout's tp ranks (a whole one at tp = 1). The generating role also holds a rollout
engine, tensor parallel over its generation layout's tp group and batching as that layout says (batching,
max_batch): the actor reaches it through the hybrid engine (the training layout's weights unsharded over its
data-parallel ranks, or, generating at another tp or from pipeline stages, each rank's generation shard by
the per-tensor resharding plan), a separate rollout set through the generation shards the actor's ranks send
it after each actor update.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from hfplan.dataflow.ops import BEHAVIOUR, GENERATED
from hfplan.dataflow.roles import RoleFacts, update_field
from hfplan.executor.engines import reshard
from hfplan.executor.engines.hybrid import HybridEngine, assign
from hfplan.executor.engines.training import RoleModel
from hfplan.executor.generation_order import generation_rank, set_ranks
from hfplan.executor.mesh import TP, WorkerMeshes, compute_dtype
from hfplan.executor.models import build_model
from hfplan.executor.rollout.base import RolloutEngine, SamplingParams
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
from hfplan.executor.tokenizers import build_tokenizer
from hfplan.executor.worker import Timed
from hfplan.hyperparams import Hyperparameters
from hfplan.layout import (
    TensorSpec,
    engine_max_seqs,
    facts_of,
    model_role,
    rank_coords,
    rank_of,
    reshards_by_plan,
)
from hfplan.plan import RESHARD_BACK_OP, RESHARD_OP, Plan, Recompute


def learning_rate(role: str, hyper: Hyperparameters) -> float:
    """The role's `<role>_lr` hyperparameter (actor_lr, critic_lr, cost_critic_lr)."""
    lr = getattr(hyper, f"{role}_lr", None)
    if lr is None:
        raise ValueError(f"no learning rate for trained role {role!r} (hyperparameter {role}_lr)")
    return lr


@dataclass
class RoleRuntime:
    role: str
    facts: RoleFacts
    plan: Plan
    hyper: Hyperparameters
    device: torch.device
    model: torch.nn.Module
    pad_id: int
    eos_id: int
    role_model: RoleModel | None = None  # the role's model in its training layout, or its inference layout
    engine: RolloutEngine | None = None
    hybrid: HybridEngine | None = None
    sync_plan: reshard.SyncPlan | None = None  # a trained actor's part in a separate rollout set's weight sync
    generator: torch.Generator | None = None
    synced: _SyncedModel | None = None  # a rollout set's module over the shards its weight syncs fill
    generating: bool = False  # in its generation layout since its last generate call (see leave_generation)

    @property
    def trained(self) -> RoleModel | None:
        """The role's model when the role trains (what checkpoints save)."""
        return self.role_model if self.role_model is not None and self.role_model.trains else None

    def run(self, op: str, fields: dict[str, np.ndarray], options: dict, spans: list[Timed]) -> dict:
        if op == "generate":
            return self._generate(fields, options, spans)
        start = time.time()
        tensors = {name: torch.from_numpy(np.ascontiguousarray(value)).to(self.device)
                   for name, value in fields.items()}
        if op == "update":
            out = {update_field(self.role): self._update(tensors)}
        else:
            out = {self.facts.output: self._forward(op, tensors).float().cpu().numpy()}
        spans.append(Timed(op, "compute", start, time.time()))
        return out

    def _forward(self, op: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """A forward call in the role's layout (a trained role's training layout, its weights gathered once)."""
        model = self.role_model
        calls = {} if model is None else {"log_prob": model.log_probs, "values": model.values, "score": model.scores}
        if op not in calls:
            raise ValueError(f"role {self.role} has no operation {op!r}")
        micro_batch = self.plan.parallelism[self.role].infer.micro_batch
        return calls[op](t["prompts"], t["responses"], t["response_mask"], micro_batch=micro_batch)

    def _update(self, t: dict[str, torch.Tensor]) -> dict[str, float]:
        workload, train = self.plan.workload, self.plan.parallelism[self.role].train
        common = dict(mini_batches=workload.mini_batches, epochs=workload.epochs, micro_batch=train.micro_batch)
        if self.facts.head == "lm":  # a policy: the clipped surrogate, with a KL loss when given the reference's
            return self.trained.update_actor(t, use_kl_loss="ref_log_probs" in t, **common)
        value_key = self.facts.output
        (return_key,) = [name for name in t if name not in GENERATED and name != value_key]
        return self.trained.update_critic(t, value_key, return_key, **common)

    def _generate(self, fields: dict[str, np.ndarray], options: dict, spans: list[Timed]) -> dict:
        greedy = bool(options.get("greedy", False))
        params = SamplingParams(max_new_tokens=self.plan.workload.response_len,
                                temperature=1.0 if greedy else self.hyper.temperature,
                                top_p=1.0 if greedy else self.hyper.top_p, greedy=greedy,
                                n=int(options.get("n", 1)))
        prompts = torch.from_numpy(np.ascontiguousarray(fields["prompts"])).to(self.device)
        if self.hybrid is not None and not self.generating:
            start = time.time()
            self.engine.load_weights(self.hybrid.enter_generation(), presharded=self.hybrid.presharded)
            if self.engine.copies_weights:  # vLLM: the gathered weights are freed once copied in
                self.hybrid.exit_generation()
            self.generating = True
            spans.append(Timed(RESHARD_OP, "transition", start, time.time()))
        start = time.time()
        rollout = self.engine.generate(prompts, params, self.generator)
        spans.append(Timed("generate", "compute", start, time.time()))
        return {"prompts": rollout.prompts.cpu().numpy(), "responses": rollout.responses.cpu().numpy(),
                "response_mask": rollout.response_mask.float().cpu().numpy(),
                BEHAVIOUR: rollout.log_probs.float().cpu().numpy()}

    def leave_generation(self, spans: list[Timed]) -> None:
        """Back to the training layout after the generate calls that ran in a row (ReMax's sampled and greedy
        generations, an evaluation's and the next iteration's) in one switch, as the simulator prices them; a
        no-op outside generation. Nothing changes the weights in between: an update or a checkpoint load leaves
        generation first (leave_generation_before)."""
        if not self.generating:
            return
        start = time.time()
        self.engine.release_weights()
        if not self.engine.copies_weights:
            self.hybrid.exit_generation()
        self.generating = False
        spans.append(Timed(RESHARD_BACK_OP, "transition", start, time.time()))

    def sync_buckets(self, rollout) -> dict[int, list]:
        """What this rank of the trained actor sends each rank of a separate rollout set (layout rollout): only
        the slices of each one's generation shard this rank holds, in buckets (engines.reshard), in the dtype the
        rollout set generates in (the device's compute dtype, as load_shards reads them)."""
        import torch.distributed as dist

        trained, dtype = self.trained, compute_dtype(self.device)
        if self.sync_plan is None:  # pure Python over every tensor of every rank: derived once
            itemsize = torch.empty((), dtype=dtype).element_size()
            self.sync_plan = reshard.sync_plan(reshard.model_specs(trained.hf_class, trained.config),
                                               self.plan.parallelism[self.role].train, rollout,
                                               trained.config.num_hidden_layers, dist.get_rank(), itemsize)
        return reshard.sync_buckets(trained.local_parameters(), self.sync_plan, dtype)

    def load_shards(self, buckets: list) -> None:
        """A rollout rank takes its generation shards from the buckets the actor's ranks sent it, into the
        shards of the last sync (the torch engine generates from them as they are; vLLM copies them in)."""
        gen = self.plan.parallelism[self.role].gen
        if self.synced is None:
            self.synced = _SyncedModel.of(self.model, gen, self.device, self.engine)
            self.model = self.synced.module
        reshard.assemble(self.synced.shards, self.synced.specs, gen, buckets, compute_dtype(self.device))
        self.engine.load_weights(self.synced.module, presharded=True)


@dataclass
class _SyncedModel:
    """A rollout set's module over the generation shards the weight syncs fill, made at the first sync."""

    module: torch.nn.Module
    specs: list[TensorSpec]
    shards: dict[str, torch.Tensor]

    @staticmethod
    def of(model: torch.nn.Module, gen, device: torch.device, engine: RolloutEngine) -> _SyncedModel:
        """Over `model`'s layout (its parameters' names, shapes and ties; its buffers, which the sync does not
        send, are kept). The weights `model` was built with are never generated from (a rollout set's first
        generation waits for a sync): they are let go, and `engine`'s hold on them, before the shards are made,
        so that the set never holds two copies."""
        config = model.config
        specs = reshard.tensor_specs(model, config.num_hidden_layers, config.num_key_value_heads)
        first: dict[int, str] = {}  # a tied parameter's other names point at its one shard
        for name, param in model.named_parameters(remove_duplicate=False):
            first.setdefault(id(param), name)
        names = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        buffers = dict(model.named_buffers(remove_duplicate=False))
        if not engine.copies_weights:
            engine.release_weights()
        for param in model.parameters():  # the parameters only: the buffers above stay where they are
            param.data = torch.empty(0, dtype=param.dtype)
        shards = reshard.empty_shards(specs, gen, compute_dtype(device), device)
        with torch.device("meta"):
            module = type(model)(config)
        module.eval().requires_grad_(False)
        assign(module, {name: shards[source] for name, source in names.items()}, buffers)
        return _SyncedModel(module, specs, shards)


def rollout_generator(device: torch.device, seed: int, gen, rank: int) -> torch.Generator:
    """The sampling generator of one rank of the generating role: one stream per generation replica, so
    every rank of a replica (its tp group) samples the same tokens; at tp = 1 one per rank."""
    replica = rank_coords(gen, rank)[1]
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + replica)


def build_runtimes(plan: Plan, hyper: Hyperparameters, set_index: int, seed: int, device_kind: str
                   ) -> dict[str, RoleRuntime]:
    """The set's roles on this rank, over one mesh per layout (shared by the roles with the same layout)."""
    import torch.distributed as dist

    device = torch.device(device_kind)
    rank = dist.get_rank()
    meshes = WorkerMeshes(device.type)
    return {role: _build_role(role, plan, hyper, seed, device, rank, meshes)
            for role in plan.placement[set_index].models}


def _build_role(role: str, plan: Plan, hyper: Hyperparameters, seed: int, device: torch.device, rank: int,
                meshes: WorkerMeshes) -> RoleRuntime:
    """The role's model in its layout (a RoleModel: trained with the role's learning rate, pipelined with
    pp > 1). The generating role also gets a rollout engine over its generation layout's tp group, which a
    trained actor reaches through the hybrid engine."""
    facts = facts_of(plan.workload, role)
    model_ref = plan.workload.models[model_role(plan.workload, role)]
    # Every role is built from the same seed: the reference starts as the actor, the critic from its backbone.
    model = build_model(model_ref, facts.head, seed=seed, dtype=torch.float32).to(device)
    tokenizer = build_tokenizer(model_ref)
    runtime = RoleRuntime(role, facts, plan, hyper, device, model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    par = plan.parallelism[role]
    layout = par.train if facts.trains else par.infer  # None for a rollout engine, which generates only
    generates = role == plan.generation_role
    if generates:
        runtime.generator = rollout_generator(device, seed, par.gen, generation_rank(par.train, par.gen, rank))
    if layout is not None:
        trains = facts.trains
        runtime.role_model = RoleModel(model, meshes.of(layout), hyper, device, compute_dtype(device),
                                       pad_id=runtime.pad_id, lr=learning_rate(role, hyper) if trains else None,
                                       recompute=par.train.recompute if trains else Recompute.NONE,
                                       virtual_stages=par.train.virtual_stages if trains else 1)
        runtime.model = runtime.role_model.module
    else:  # a rollout set's model: generation only, in the device's compute dtype
        model.to(compute_dtype(device)).eval().requires_grad_(False)
    trained = runtime.trained
    by_plan = trained is not None and reshards_by_plan(par.train, par.gen)
    if generates:
        same = trained is not None and not by_plan  # the training layout's tp group generates
        group = trained.mesh[TP].get_group() if same and par.gen.tp > 1 else _tp_group(meshes, par.gen)
        tp_ranks = None
        if by_plan:  # generation in the per-tensor plan's places: their own tensor-parallel groups
            group, tp_ranks = _place_tp_group(par.train, par.gen)
        # The hybrid engine hands the engine its weights at each generation; a rollout set's model holds them.
        runtime.engine = _rollout_engine(runtime, model, trained is None, group, tp_ranks)
    if generates and trained is not None:
        runtime.hybrid = HybridEngine(trained, (par.train, par.gen) if by_plan else None)
    return runtime


def _place_tp_group(train, gen):
    """This rank's generation tensor-parallel group over the set ranks of hfplan.layout's generation places,
    and each set rank's tensor-parallel rank in it (every rank makes every group, in one order)."""
    import torch.distributed as dist

    by_place = set_ranks(train, gen)
    mine = None
    for p, d in itertools.product(range(gen.pp), range(gen.dp)):
        ranks = [by_place[rank_of(gen, p, d, t)] for t in range(gen.tp)]
        group = dist.new_group(ranks) if gen.tp > 1 else None
        if dist.get_rank() in ranks:
            mine = group
    tp_ranks = [rank_coords(gen, generation_rank(train, gen, r))[2] for r in range(len(by_place))]
    return mine, tp_ranks


def _tp_group(meshes: WorkerMeshes, gen):
    return meshes.of(gen)[TP].get_group() if gen.tp > 1 else None


def _rollout_engine(runtime: RoleRuntime, model: torch.nn.Module, holds_weights: bool, group, tp_ranks=None
                    ) -> RolloutEngine:
    """The plan's rollout engine over the generation layout's tp group. `holds_weights`: it starts with `model`'s
    (a rollout set's); a hybrid actor's engine gets them at each generation. vLLM makes its tensor-parallel
    groups itself, from the set's world (rollout.vllm_engine)."""
    plan, gen = runtime.plan, runtime.plan.parallelism[runtime.role].gen
    if gen.engine == "torch":
        return TorchRolloutEngine(model if holds_weights else None, runtime.pad_id, runtime.eos_id, group,
                                  gen.batching, gen.max_batch, tp_ranks)
    from hfplan.executor.rollout.vllm_engine import VllmRolloutEngine

    workload = plan.workload
    engine = VllmRolloutEngine(model.config, runtime.pad_id, runtime.eos_id, tp=gen.tp,
                               max_num_seqs=engine_max_seqs(workload, gen),
                               max_model_len=workload.prompt_len + workload.response_len,
                               dtype=compute_dtype(runtime.device), device=runtime.device,
                               gpu_memory_utilization=gen.gpu_memory_utilization)
    if holds_weights:
        engine.load_weights(model)
    return engine


def leave_generation_before(runtimes: dict[str, RoleRuntime], role: str | None, op: str | None,
                            spans: list[Timed]) -> None:
    """Before a call of `role` (None: any other work on the worker, e.g. a checkpoint): every role in its
    generation layout leaves it, except `role` when the call is one more generate, so a role's generation copy
    never lives beside another call (the memory the simulator counts)."""
    for name, runtime in runtimes.items():
        if not (name == role and op == "generate"):
            runtime.leave_generation(spans)
