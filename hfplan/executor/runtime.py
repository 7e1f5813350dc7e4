"""One role on one worker: its model, its engines, and the calls the dataflow makes on it.

A trained role (actor, critic, cost critic) holds its model in the training layout (a pipeline stage
with pp > 1, tensor parallel over its tp ranks, FSDP2 over its data-parallel ones) and runs its forward
calls there too; an inference-only role (reference, reward, cost) holds a copy (or a stage of one) split
over its inference layout's tp ranks (a whole one at tp = 1). The generating role also holds a rollout
engine, tensor parallel over its generation layout's tp group and batching as that layout says (batching,
max_batch): the actor reaches it through the hybrid engine (the training layout's weights, gathered over
data-parallel ranks, and over pipeline stages with pp > 1, for generation), a separate rollout set
through weights the controller sends it after each actor update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hfplan.dataflow.ops import GENERATED
from hfplan.dataflow.roles import RoleFacts, update_field
from hfplan.executor.engines.forward import sequence_scores, token_log_probs, token_values
from hfplan.executor.engines.hybrid import SameLayoutHybridEngine
from hfplan.executor.engines.pipeline import PipelinedModel, pipeline_mesh
from hfplan.executor.engines.pipeline_hybrid import PipelineHybridEngine
from hfplan.executor.engines.tensor_parallel import apply_tensor_parallel
from hfplan.executor.engines.training import TP_MESH_DIM, TrainedModel
from hfplan.executor.mesh import parallel_training_mesh, tensor_parallel_mesh
from hfplan.executor.models import build_model
from hfplan.executor.rollout.base import SamplingParams
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
from hfplan.executor.tokenizers import build_tokenizer
from hfplan.executor.worker import Timed
from hfplan.hyperparams import Hyperparameters
from hfplan.layout import facts_of, model_role, rank_coords
from hfplan.plan import Plan, Recompute


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
    trained: TrainedModel | None = None
    engine: TorchRolloutEngine | None = None
    hybrid: SameLayoutHybridEngine | PipelineHybridEngine | None = None
    generator: torch.Generator | None = None
    pipeline: PipelinedModel | None = None  # a role with pp > 1 (trained or not): this rank's stage

    @property
    def forward_module(self) -> torch.nn.Module:
        return self.trained.module if self.trained is not None else self.model

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
        par = self.plan.parallelism[self.role].infer
        sequence = (t["prompts"], t["responses"], t["response_mask"])
        if self.pipeline is not None:
            calls = {"log_prob": self.pipeline.log_probs, "values": self.pipeline.values, "score": self.pipeline.scores}
            if op not in calls:
                raise ValueError(f"role {self.role} has no operation {op!r}")
            return calls[op](*sequence, micro_batch=par.micro_batch)
        if self.trained is not None:  # a trained role infers in its training layout, weights gathered once
            if op == "log_prob":
                return self.trained.log_probs(*sequence, micro_batch=par.micro_batch)
            if op == "values":
                return self.trained.values(*sequence, micro_batch=par.micro_batch)
        args = (self.model, *sequence, self.pad_id)
        if op == "log_prob":
            return token_log_probs(*args, temperature=self.hyper.temperature, micro_batch=par.micro_batch)
        if op == "values":
            return token_values(*args, micro_batch=par.micro_batch)
        if op == "score":
            return sequence_scores(*args, micro_batch=par.micro_batch)
        raise ValueError(f"role {self.role} has no operation {op!r}")

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
        if self.hybrid is not None:
            start = time.time()
            self.engine.load_weights(self.hybrid.enter_generation())
            spans.append(Timed("generate", "transition", start, time.time()))
        start = time.time()
        rollout = self.engine.generate(prompts, params, self.generator)
        spans.append(Timed("generate", "compute", start, time.time()))
        if self.hybrid is not None:
            start = time.time()
            self.engine.release_weights()
            self.hybrid.exit_generation()
            spans.append(Timed("generate", "transition", start, time.time()))
        return {"prompts": rollout.prompts.cpu().numpy(), "responses": rollout.responses.cpu().numpy(),
                "response_mask": rollout.response_mask.float().cpu().numpy()}

    def full_weights(self, is_rank0: bool) -> dict[str, np.ndarray] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.pipeline is not None:  # every stage's weights, gathered over the pipeline
            state = self.pipeline.gathered(torch.float32)
            return {name: tensor.cpu().numpy() for name, tensor in state.items()} if is_rank0 else None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.forward_module, options=options)
        if not is_rank0:
            return None
        return {name: tensor.float().numpy() for name, tensor in state.items()}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        state = {name: torch.from_numpy(value) for name, value in weights.items()}
        self.model.load_state_dict(state)
        self.engine.load_weights(self.model)


def rollout_generator(device: torch.device, seed: int, gen, rank: int) -> torch.Generator:
    """The sampling generator of one rank of the generating role: one stream per generation replica, so
    every rank of a replica (its tp group) samples the same tokens; at tp = 1 one per rank."""
    replica = rank_coords(gen, rank)[1]
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + replica)


def build_runtimes(plan: Plan, hyper: Hyperparameters, set_index: int, seed: int, device_kind: str
                   ) -> dict[str, RoleRuntime]:
    import torch.distributed as dist

    device = torch.device(device_kind)
    rank = dist.get_rank()
    runtimes = {}
    for role in plan.placement[set_index].models:
        runtimes[role] = _build_role(role, plan, hyper, seed, device, rank)
    return runtimes


def _build_role(role: str, plan: Plan, hyper: Hyperparameters, seed: int, device: torch.device,
                rank: int) -> RoleRuntime:
    facts = facts_of(plan.workload, role)
    model_ref = plan.workload.models[model_role(plan.workload, role)]
    head = facts.head
    on_gpu = device.type == "cuda"
    # Every role is built from the same seed: the reference starts as the actor, the critic from its backbone.
    model = build_model(model_ref, head, seed=seed, dtype=torch.float32).to(device)
    tokenizer = build_tokenizer(model_ref)
    runtime = RoleRuntime(role, facts, plan, hyper, device, model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    par = plan.parallelism[role]
    staged = par.train if facts.trains else par.infer  # None for a rollout engine, which generates only
    if staged is not None and staged.pp > 1:
        return _build_pipelined(runtime, par, learning_rate(role, hyper) if facts.trains else None, seed, rank)
    if facts.trains:
        runtime.trained = TrainedModel(model, parallel_training_mesh(par.train, device.type),
                                       learning_rate(role, hyper), hyper, device,
                                       torch.bfloat16 if on_gpu else torch.float32,
                                       pad_id=tokenizer.pad_token_id, recompute=par.train.recompute)
    else:
        model.eval()
        if on_gpu:
            model.to(torch.bfloat16)
        if par.infer is not None and par.infer.tp > 1:
            apply_tensor_parallel(model, tensor_parallel_mesh(par.infer, device.type), copy_kv_heads=True)
    if role == plan.generation_role:
        gen = par.gen
        runtime.generator = rollout_generator(device, seed, gen, rank)
        group = None
        if gen.tp > 1:
            same = runtime.trained is not None and gen.tp == par.train.tp
            group = (runtime.trained.mesh[TP_MESH_DIM] if same else tensor_parallel_mesh(gen, device.type)).get_group()
        # The hybrid engine hands the engine its weights at each generation; a rollout set's model holds them.
        runtime.engine = TorchRolloutEngine(None if runtime.trained is not None else model, tokenizer.pad_token_id,
                                            tokenizer.eos_token_id, group, gen.batching, gen.max_batch)
        if runtime.trained is not None:
            runtime.hybrid = SameLayoutHybridEngine(runtime.trained)
    return runtime


def _build_pipelined(runtime: RoleRuntime, par, lr: float | None, seed: int, rank: int) -> RoleRuntime:
    """A role with pp > 1: this rank's stage (hfplan.executor.engines.pipeline), tensor parallel over the
    layout's tp ranks, trained when `lr` is given. A generating actor generates in a one-stage layout
    (gen pp = 1) through the pipeline's hybrid engine, which gathers the whole weights; the rollout engine
    cuts its own shards of them for the generation layout's tp group."""
    device, model = runtime.device, runtime.model
    layout = par.train if lr is not None else par.infer
    generates = runtime.role == runtime.plan.generation_role
    if generates:  # built over the whole model before it is split; generation loads the gathered weights
        runtime.generator = rollout_generator(device, seed, par.gen, rank)
        group = tensor_parallel_mesh(par.gen, device.type).get_group() if par.gen.tp > 1 else None
        runtime.engine = TorchRolloutEngine(model, runtime.pad_id, runtime.eos_id, group, par.gen.batching,
                                            par.gen.max_batch)
        runtime.engine.release_weights()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    runtime.pipeline = PipelinedModel(model, pipeline_mesh(layout, device.type),
                                      runtime.hyper, device, dtype, pad_id=runtime.pad_id, lr=lr,
                                      recompute=par.train.recompute if lr is not None else Recompute.NONE,
                                      virtual_stages=par.train.virtual_stages if lr is not None else 1)
    runtime.model = runtime.pipeline.module
    if lr is not None:
        runtime.trained = runtime.pipeline
        if generates:
            runtime.hybrid = PipelineHybridEngine(runtime.pipeline)
    return runtime
