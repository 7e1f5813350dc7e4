"""TRL's GRPOTrainer on an hfplan workload, timed step by step: the TRL side of bench/vs_trl.py.

Runs under the TRL environment's python (bench/.venv-trl, which bench/vs_trl.py makes), one process, one torch
thread. The model, tokenizer, prompts and reward are hfplan's own (hfplan.executor.models.build_model,
hfplan.executor.tokenizers.build_tokenizer, hfplan.executor.data.PromptStream over the built-in prompt set, the
registered rule), so that only the trainer differs. Writes one JSON file of wall-clock (time.time()) stamps: the
process start, the trainer ready, and per step its begin and end, the generation's (`_generate`, and the model's
`generate` call inside it, `_generate_single_turn`), the end of `_generate_and_score_completions`, and the
response tokens (the completion mask's sum); with TRL's logged metrics per step.

    bench/.venv-trl/bin/python bench/trl_runner.py --workload arith-grpo --iterations 20 --out result.json
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: they are start-up too

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hfplan, even without an install

import torch  # noqa: E402


def prompts_in_order(workload, seed: int, iterations: int) -> list[str]:
    """The prompts hfplan's run hands out, iteration after iteration (the same stream, seed and batch)."""
    from hfplan.executor.data import PromptStream
    from hfplan.executor.prompts import builtin_prompts

    prompts = builtin_prompts(workload.models["actor"])
    if prompts is None:
        raise SystemExit(f"model {workload.models['actor']} has no built-in prompt set")
    stream = PromptStream(prompts, workload.batch_prompts, seed)
    return [text for _ in range(iterations) for text in stream.next_batch().prompts]


def reward_function(rule_name: str):
    """hfplan's registered rule as a TRL reward function over the decoded prompt and completion texts."""
    from hfplan.dataflow.rewards import get_rule

    rule = get_rule(rule_name)

    def reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        return [float(rule(p, c)) for p, c in zip(prompts, completions, strict=True)]

    reward.__name__ = rule_name.replace("-", "_")
    return reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="arith-grpo")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file of timings to write")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each hfplan worker does: one core per "GPU"

    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hfplan.executor.models import build_model
    from hfplan.executor.tokenizers import build_tokenizer
    from hfplan.spec import RULE_PREFIX, load_workload

    marks: dict[str, float] = {"imported": time.time()}
    workload = load_workload(args.workload)
    if workload.algorithm != "grpo":
        raise SystemExit(f"workload {args.workload} is {workload.algorithm}, not grpo")
    if workload.models["reference"] != workload.models["actor"]:
        raise SystemExit("the reference must be the actor's model (TRL builds its reference from the actor's)")
    reward_ref = workload.models["reward"]
    if not reward_ref.startswith(RULE_PREFIX):
        raise SystemExit(f"the reward must be a rule, not {reward_ref}")
    hp = workload.hyperparameters
    steps: list[dict] = []
    logged: list[dict] = []  # TRL's metrics per step, as it logs them

    class Timed(GRPOTrainer):
        """GRPOTrainer with its generation and scoring stamped (the same code, timed around)."""

        def _generate(self, prompts):
            start = time.time()
            out = super()._generate(prompts)
            steps[-1] |= {"generate_begin": start, "generate_end": time.time()}
            return out

        def _generate_single_turn(self, *a, **k):
            start = time.time()
            out = super()._generate_single_turn(*a, **k)
            steps[-1] |= {"model_generate_begin": start, "model_generate_end": time.time()}
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            steps[-1] |= {"scored": time.time(), "response_tokens": int(out["completion_mask"].sum()),
                          "has_old_log_probs": out.get("old_per_token_logps") is not None,
                          "has_ref_log_probs": out.get("ref_per_token_logps") is not None}
            return out

    class Stamps(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks["train_begin"] = time.time()

        def on_step_begin(self, *_, **__):
            steps.append({"begin": time.time()})

        def on_step_end(self, *_, **__):
            steps[-1]["end"] = time.time()

        def on_log(self, _args, state, _control, logs=None, **__):
            logged.append({"step": state.global_step, **(logs or {})})

        def on_train_end(self, *_, **__):
            marks["train_end"] = time.time()

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        # hfplan's actor as built by its workers (seed, fp32); saved so that TRL loads actor and reference
        # from it, as it does a hub model: the reference starts from the actor's weights, as in hfplan.
        model_dir = Path(tmp) / "model"
        build_model(workload.models["actor"], "lm", seed=args.seed, dtype=torch.float32).save_pretrained(model_dir)
        tokenizer = build_tokenizer(workload.models["actor"])
        dataset = Dataset.from_dict({"prompt": prompts_in_order(workload, args.seed, args.iterations)})
        config = GRPOConfig(
            output_dir=str(Path(tmp) / "out"),
            use_cpu=True,
            bf16=False, fp16=False,  # fp32, as hfplan's CPU workers
            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
            per_device_train_batch_size=workload.sequences,  # batch_prompts x samples_per_prompt sequences
            num_generations=workload.samples_per_prompt,
            gradient_accumulation_steps=1, num_iterations=1,  # one optimizer step per generation
            max_completion_length=workload.response_len,
            max_steps=args.iterations,
            shuffle_dataset=False,  # the prompts in hfplan's order
            learning_rate=hp.actor_lr, lr_scheduler_type="constant", warmup_steps=0,
            optim="adamw_torch", weight_decay=hp.weight_decay, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            max_grad_norm=hp.max_grad_norm,
            gradient_checkpointing=False,
            beta=hp.kl_loss_coef,  # > 0: the reference model and its forward, as hfplan's kl_loss_coef
            epsilon=hp.clip_ratio,
            loss_type="dapo",  # a token mean over the batch's response tokens, as hfplan's losses
            scale_rewards="group",  # GRPO's per-group normalisation
            temperature=hp.temperature, top_p=hp.top_p, top_k=0,
            generation_kwargs={"use_cache": True},  # hfplan's config turns the cache off for training passes
            use_vllm=False, use_transformers_continuous_batching=False,  # transformers' generate, static batch
            report_to="none", logging_steps=1, disable_tqdm=True,
            save_strategy="no", eval_strategy="no",
            seed=args.seed,
            dataloader_num_workers=0,
        )
        trainer = Timed(model=str(model_dir), reward_funcs=reward_function(reward_ref[len(RULE_PREFIX):]),
                        args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Stamps()])
        marks["trainer_ready"] = time.time()
        trainer.train()
    result = {"started": STARTED, **marks, "steps": steps, "logs": logged,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "trl": trl.__version__, "python": sys.version.split()[0]},
              "threads": torch.get_num_threads(), "ref_model": trainer.ref_model is not None}
    args.out.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
