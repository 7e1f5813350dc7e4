"""A plan as verl's `python3 -m verl.trainer.main_ppo` Hydra overrides, and as a YAML config.

Keys are those of verl/trainer/config/_generated_ppo_trainer.yaml (FSDP backend) and
_generated_ppo_megatron_trainer.yaml (Megatron backend, `--config-name=ppo_megatron_trainer`) in the wheel of
the release the verl target names (hfplan.planner.targets.VERL; known/verl-<version>-*.txt); every key written
is checked against them. Batch sizes follow verl's units: data.train_batch_size and ppo_mini_batch_size count
prompts (verl multiplies by rollout.n), micro-batch sizes count sequences per GPU. The reward model is the
reward loop's (`reward.reward_model.*`): vLLM servers of its tensor-parallel size, whatever the training backend.
The rollout's gpu_memory_utilization gives vLLM the KV-cache room the plan was costed with
(hfplan.export.common.vllm_memory_fraction).
"""

from __future__ import annotations

import shlex

import yaml

from hfplan.dataflow.rewards import is_rule
from hfplan.export.common import (
    Env,
    Export,
    check_known,
    checked_target,
    model_path,
    pool_shape,
    vllm_memory_fraction,
)
from hfplan.plan import Plan, RoleParallelism, TrainConfig
from hfplan.planner.targets import VERL, VERL_ALGORITHMS, verl_backends

TRAIN_FILES = Env("TRAIN_FILES", "parquet file(s) of training prompts")
VAL_FILES = Env("VAL_FILES", "parquet file(s) of validation prompts")
REWARD_FN = Env("REWARD_FN", "a Python file whose compute_score is the reward")
CONFIG_NAMES = {"fsdp": "ppo_trainer", "megatron": "ppo_megatron_trainer"}
KNOWN = {backend: f"verl-{VERL.version}-{backend}" for backend in ("fsdp", "megatron")}


def backend_of(plan: Plan) -> str:
    """FSDP when every trained or reference role's layout has it, else Megatron (the target's rules make one of
    them fit all; the reward model is served by the reward loop, outside the training backend)."""
    common = set.intersection(*(verl_backends(par) for role, par in plan.parallelism.items() if role != "reward"))
    return "fsdp" if "fsdp" in common else "megatron"


def _training(prefix: str, train: TrainConfig, backend: str, megatron: str) -> list[tuple[str, object]]:
    """A trained role's layout keys: FSDP's fsdp_size (-1: every rank) and reshard_after_forward (False:
    ZeRO-2), or Megatron's tp, pp, virtual stages and distributed optimizer (ZeRO-1)."""
    if backend == "fsdp":
        size = train.shard_group if train.shard == "hybrid" else -1
        return [(f"{prefix}.fsdp_size", size), (f"{prefix}.reshard_after_forward", train.shard != "zero2")]
    out = [(f"{megatron}.tensor_model_parallel_size", train.tp),
           (f"{megatron}.pipeline_model_parallel_size", train.pp),
           (f"{megatron}.use_distributed_optimizer", train.shard == "zero1")]
    if train.virtual_stages > 1:  # interleaved 1F1B: model chunks per pipeline stage (verl's default null: 1)
        out.append((f"{megatron}.virtual_pipeline_model_parallel_size", train.virtual_stages))
    return out


def _recompute(megatron: str, train: TrainConfig, backend: str) -> list[tuple[str, object]]:
    if backend != "megatron" or not train.recompute:
        return []
    config = f"{megatron}.override_transformer_config"
    if train.recompute == "selective":  # Megatron's selective recomputation: attention's core only
        return [(f"{config}.recompute_granularity", "selective")]
    return [(f"{config}.recompute_granularity", "full"), (f"{config}.recompute_method", "uniform"),
            (f"{config}.recompute_num_layers", 1)]


def _megatron_infer(megatron: str, par: RoleParallelism, backend: str) -> list[tuple[str, object]]:
    if backend != "megatron":
        return []
    return [(f"{megatron}.tensor_model_parallel_size", par.infer.tp),
            (f"{megatron}.pipeline_model_parallel_size", par.infer.pp)]


def _reward(plan: Plan) -> list[tuple[str, object]]:
    """The reward loop's keys (`reward.*`; the top-level reward_model.* and custom_reward_function.* keys are
    legacy ones main_ppo does not read): a rule reward is a function file; a reward model is served by vLLM
    replicas of its tensor-parallel size over its pool, the actor's or one of its own."""
    w, rm = plan.workload, "reward.reward_model"
    if is_rule(w.models["reward"]):
        return [(f"{rm}.enable", False), ("reward.custom_reward_function.path", REWARD_FN)]
    out: list[tuple[str, object]] = [
        (f"{rm}.enable", True), (f"{rm}.model_path", model_path(w.models["reward"])),
        (f"{rm}.rollout.name", "vllm"),
        (f"{rm}.rollout.tensor_model_parallel_size", plan.parallelism["reward"].infer.tp)]
    index = plan.set_of("reward")
    if index != plan.set_of("actor"):
        nodes, gpus = pool_shape(plan.placement[index].gpus, plan.cluster.gpus_per_node)
        out += [(f"{rm}.enable_resource_pool", True), (f"{rm}.nnodes", nodes), (f"{rm}.n_gpus_per_node", gpus)]
    return out


def overrides(plan: Plan) -> tuple[str, list[tuple[str, object]]]:
    """(backend, [(dotted key, value)]) for `plan`, which the verl target must accept."""
    w, hp, par = plan.workload, plan.workload.hyperparameters, plan.parallelism
    backend = backend_of(plan)
    per_node = plan.cluster.gpus_per_node
    pool = plan.placement[plan.set_of("actor")].gpus
    nodes, gpus = pool_shape(pool, per_node)
    actor = par["actor"]
    aro = "actor_rollout_ref"
    out: list[tuple[str, object]] = [
        ("trainer.nnodes", nodes), ("trainer.n_gpus_per_node", gpus), ("trainer.logger", ["console"]),
        ("data.train_files", TRAIN_FILES), ("data.val_files", VAL_FILES),
        ("data.train_batch_size", w.batch_prompts), ("data.max_prompt_length", w.prompt_len),
        ("data.max_response_length", w.response_len),
        ("algorithm.adv_estimator", VERL_ALGORITHMS[w.algorithm]),
        (f"{aro}.hybrid_engine", True), (f"{aro}.model.path", model_path(w.models["actor"])),
        (f"{aro}.model.enable_gradient_checkpointing", bool(actor.train.recompute)),
        (f"{aro}.rollout.name", "vllm"), (f"{aro}.rollout.n", w.samples_per_prompt),
        (f"{aro}.rollout.tensor_model_parallel_size", actor.gen.tp),
        *([(f"{aro}.rollout.max_num_seqs", actor.gen.max_batch)] if actor.gen.max_batch is not None else []),
        (f"{aro}.rollout.gpu_memory_utilization", vllm_memory_fraction(plan, actor.gen)),
        (f"{aro}.rollout.log_prob_micro_batch_size_per_gpu", actor.infer.micro_batch),
        (f"{aro}.rollout.temperature", hp.temperature), (f"{aro}.rollout.top_p", hp.top_p),
        (f"{aro}.actor.ppo_mini_batch_size", w.batch_prompts // w.mini_batches),
        (f"{aro}.actor.ppo_micro_batch_size_per_gpu", actor.train.micro_batch),
        (f"{aro}.actor.ppo_epochs", w.epochs), (f"{aro}.actor.optim.lr", hp.actor_lr),
        (f"{aro}.actor.clip_ratio", hp.clip_ratio),
        *_training(f"{aro}.actor.fsdp_config", actor.train, backend, f"{aro}.actor.megatron"),
        *_recompute(f"{aro}.actor.megatron", actor.train, backend),
    ]
    if w.algorithm == "grpo":
        out += [(f"{aro}.actor.use_kl_loss", True), (f"{aro}.actor.kl_loss_coef", hp.kl_loss_coef),
                ("algorithm.use_kl_in_reward", False)]
    else:
        out += [(f"{aro}.actor.use_kl_loss", False), ("algorithm.use_kl_in_reward", True),
                ("algorithm.kl_ctrl.kl_coef", hp.kl_coef)]
    if "reference" in par:
        out += [(f"{aro}.ref.log_prob_micro_batch_size_per_gpu", par["reference"].infer.micro_batch),
                *_megatron_infer(f"{aro}.ref.megatron", par["reference"], backend)]
    if "critic" in par:
        critic = par["critic"]
        out += [("algorithm.gamma", hp.gamma), ("algorithm.lam", hp.lam),
                ("critic.model.path", model_path(w.models["critic"])),
                ("critic.ppo_mini_batch_size", w.batch_prompts // w.mini_batches),
                ("critic.ppo_micro_batch_size_per_gpu", critic.train.micro_batch),
                ("critic.ppo_epochs", w.epochs), ("critic.optim.lr", hp.critic_lr),
                ("critic.cliprange_value", hp.value_clip),
                *_training("critic.fsdp", critic.train, backend, "critic.megatron"),
                *_recompute("critic.megatron", critic.train, backend)]
        if backend == "fsdp":  # Megatron's critic computes values with its ppo micro-batch
            out += [("critic.forward_micro_batch_size_per_gpu", critic.infer.micro_batch),
                    ("critic.model.enable_gradient_checkpointing", bool(critic.train.recompute))]
    out += _reward(plan)
    check_known([key for key, _ in out], KNOWN[backend])
    return backend, out


def _cli_value(value: object) -> str:
    if isinstance(value, Env):
        return f'"${value.name}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return shlex.quote("[" + ",".join(str(v) for v in value) + "]")
    return shlex.quote(str(value))


def _yaml_value(value: object) -> object:
    return f"${{oc.env:{value.name}}}" if isinstance(value, Env) else value


def _header(plan: Plan, backend: str, source: str) -> list[str]:
    envs = [e for e in (TRAIN_FILES, VAL_FILES, REWARD_FN)
            if e is not REWARD_FN or is_rule(plan.workload.models["reward"])]
    lines = [f"# hfplan export --to verl: written for {VERL.label}, its {backend.upper()} backend",
             f"# from {source}: {plan.workload.algorithm} on {plan.cluster.gpus} x {plan.cluster.hardware}"
             + (f", {plan.estimate.iteration_s:.2f} s per iteration simulated" if plan.estimate else "")]
    lines += [f"# set {e.name}: {e.meaning}" for e in envs]
    if is_rule(plan.workload.models["reward"]):
        lines.append(f"# the reward is hfplan's {plan.workload.models['reward']}: supply it as {REWARD_FN.name}")
    return lines


def export(plan: Plan, source: str = "the plan") -> Export:
    checked_target(plan, "verl")
    backend, pairs = overrides(plan)
    args = ([f"--config-name={CONFIG_NAMES[backend]}"] if backend == "megatron" else [])
    args += [f"{key}={_cli_value(value)}" for key, value in pairs]
    header = _header(plan, backend, source)
    command = "\n".join(header) + "\npython3 -m verl.trainer.main_ppo \\\n    " + " \\\n    ".join(args) + "\n"
    tree: dict = {"defaults": [CONFIG_NAMES[backend], "_self_"],
                  "hydra": {"searchpath": ["pkg://verl.trainer.config"]}}
    for key, value in pairs:
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _yaml_value(value)
    usage = ["# run: python3 -m verl.trainer.main_ppo --config-path=\"$PWD\" --config-name=<this file's name "
             "without .yaml>", "# (its defaults take verl's own config; the keys below override it)"]
    text = "\n".join(header + usage) + "\n" + yaml.safe_dump(tree, sort_keys=False)
    return Export("verl", command, text, tuple(key for key, _ in pairs))
