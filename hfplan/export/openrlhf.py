"""A plan as OpenRLHF's `python3 -m openrlhf.cli.train_ppo_ray` command line.

Flags are those openrlhf/cli/train_ppo_ray.py defines in the wheel of the release the OpenRLHF target names
(hfplan.planner.targets.OPENRLHF; known/openrlhf-<version>.txt); every flag written is checked against them.
Batch sizes follow OpenRLHF's units: --rollout.batch_size counts prompts, --train.batch_size the samples of one
optimizer step, micro-batch sizes samples per GPU.
"""

from __future__ import annotations

import shlex

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
from hfplan.layout import ROLLOUT
from hfplan.plan import Plan
from hfplan.planner.targets import OPENRLHF, OPENRLHF_ALGORITHMS, ZERO_STAGES

PROMPT_DATA = Env("PROMPT_DATA", "a dataset of prompts (Hugging Face name or path) with a `prompt` column")
REWARD_URL = Env("REWARD_URL", "a remote reward model URL or a Python reward function file (--reward.remote_url)")
KNOWN = f"openrlhf-{OPENRLHF.version}"
_FLAG_PREFIX = {"actor": "actor", "reference": "ref", "critic": "critic", "reward": "reward"}


def flags(plan: Plan) -> list[tuple[str, object]]:
    """[(flag, value)] for `plan`, which the OpenRLHF target must accept; value True is a bare switch."""
    w, hp, par = plan.workload, plan.workload.hyperparameters, plan.parallelism
    per_node = plan.cluster.gpus_per_node
    out: list[tuple[str, object]] = []
    for role, prefix in _FLAG_PREFIX.items():
        if role in par:
            nodes, gpus = pool_shape(plan.placement[plan.set_of(role)].gpus, per_node)
            out += [(f"--{prefix}.num_nodes", nodes), (f"--{prefix}.num_gpus_per_node", gpus)]
    colocate_all = ROLLOUT not in plan.placed_roles
    if colocate_all:
        out += [("--train.colocate_all", True), ("--vllm.enable_sleep", True), ("--ds.enable_sleep", True)]
    else:
        if "reference" in par and plan.set_of("reference") == plan.set_of("actor"):
            out.append(("--train.colocate_actor_ref", True))
        if "critic" in par and "reward" in par and plan.set_of("critic") == plan.set_of("reward"):
            out.append(("--train.colocate_critic_reward", True))
    gen = par[plan.generation_role].gen
    out += [("--vllm.num_engines", gen.dp), ("--vllm.tensor_parallel_size", gen.tp),
            # the KV-cache room the plan was costed with
            ("--vllm.gpu_memory_utilization", vllm_memory_fraction(plan, gen))]
    trained = [p.train for p in par.values() if p.train is not None]
    sharded = [t.shard for t in trained if t.dp > 1]
    out.append(("--ds.zero_stage", ZERO_STAGES[sharded[0]] if sharded else 0))
    out += [("--train.micro_batch_size", trained[0].micro_batch),
            ("--rollout.micro_batch_size", par["actor"].infer.micro_batch)]
    if trained[0].recompute:
        out.append(("--actor.gradient_checkpointing_enable", True))
    out += [("--rollout.batch_size", w.batch_prompts), ("--rollout.n_samples_per_prompt", w.samples_per_prompt),
            ("--train.batch_size", w.sequences // w.mini_batches), ("--train.max_epochs", w.epochs),
            ("--data.max_len", w.prompt_len + w.response_len), ("--rollout.max_new_tokens", w.response_len),
            ("--rollout.temperature", hp.temperature), ("--rollout.top_p", hp.top_p),
            ("--algo.advantage.estimator", OPENRLHF_ALGORITHMS[w.algorithm]),
            ("--actor.model_name_or_path", model_path(w.models["actor"])),
            ("--actor.adam.lr", hp.actor_lr), ("--actor.eps_clip", hp.clip_ratio),
            ("--data.prompt_dataset", PROMPT_DATA), ("--data.input_key", "prompt")]
    if w.algorithm == "grpo":
        out += [("--algo.kl.use_loss", True), ("--algo.kl.init_coef", hp.kl_loss_coef),
                ("--algo.kl.estimator", hp.kl_estimator)]
    else:
        out += [("--algo.kl.init_coef", hp.kl_coef), ("--algo.kl.estimator", hp.kl_estimator)]
    if "critic" in par:
        out += [("--critic.model_name_or_path", model_path(w.models["critic"])), ("--critic.adam.lr", hp.critic_lr),
                ("--critic.value_clip", hp.value_clip), ("--algo.advantage.gamma", hp.gamma),
                ("--algo.advantage.lambd", hp.lam)]
    if is_rule(w.models["reward"]):
        out.append(("--reward.remote_url", REWARD_URL))
    else:
        out.append(("--reward.model_name_or_path", model_path(w.models["reward"])))
    check_known([flag for flag, _ in out], KNOWN)
    return out


def _arg(flag: str, value: object) -> str:
    if value is True:
        return flag
    if isinstance(value, Env):
        return f'{flag} "${value.name}"'
    return f"{flag} {shlex.quote(str(value))}"


def export(plan: Plan, source: str = "the plan") -> Export:
    checked_target(plan, "openrlhf")
    pairs = flags(plan)
    envs = [PROMPT_DATA] + ([REWARD_URL] if is_rule(plan.workload.models["reward"]) else [])
    header = [f"# hfplan export --to openrlhf: written for {OPENRLHF.label}",
              f"# from {source}: {plan.workload.algorithm} on {plan.cluster.gpus} x {plan.cluster.hardware}"
              + (f", {plan.estimate.iteration_s:.2f} s per iteration simulated" if plan.estimate else ""),
              "# run it on the Ray cluster's head node (or under `ray job submit --address ... --`)"]
    header += [f"# set {e.name}: {e.meaning}" for e in envs]
    if is_rule(plan.workload.models["reward"]):
        header.append(f"# the reward is hfplan's {plan.workload.models['reward']}: supply it as {REWARD_URL.name}")
    command = ("\n".join(header) + "\npython3 -m openrlhf.cli.train_ppo_ray \\\n    "
               + " \\\n    ".join(_arg(flag, value) for flag, value in pairs) + "\n")
    script = "#!/usr/bin/env bash\nset -euo pipefail\n" + command
    return Export("OpenRLHF", command, script, tuple(flag for flag, _ in pairs))
