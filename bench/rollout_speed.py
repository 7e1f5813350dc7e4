"""Generated tokens/s of the torch rollout engine and of vLLM (where installed) against transformers' `generate`,
in the same run.

Same model, prompts and lengths for all; every response runs to full length (no EOS), greedy and sampled
(temperature 1, top-p 1). The figure is the best of a few repeats, to damp the noise of a shared machine. vLLM
runs in this process (its CPU build on CPU; a model whose head size its CPU attention does not run shows n/a).
`measure(...)` is importable (bench/execute_speed.py prints its ratio).

    PYTHONPATH=. python bench/rollout_speed.py [--threads N] [--repeats N] [--clock cpu|wall] [--no-vllm]
"""

from __future__ import annotations

import argparse
import time

import torch

from hfplan.errors import HfplanError
from hfplan.executor.codec import build_codec
from hfplan.executor.models import build_model
from hfplan.executor.prompts import builtin_prompts
from hfplan.executor.rollout.base import SamplingParams
from hfplan.executor.rollout.installed import vllm_missing
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
from hfplan.executor.tokenizers import build_tokenizer

# (model, batch, prompt_len, response_len): the demo workload's shape, arith-grpo's (8 prompts x 4
# samples, at the prompt_len of 8 it had before its 5-token prompts set it to 5), and a wider batch of each.
CASES = [("tiny", 8, 16, 16), ("tiny", 64, 16, 16), ("tiny-arith", 32, 8, 4), ("tiny-arith", 64, 8, 4)]


def _prompts(model_ref: str, batch: int, prompt_len: int, vocab: int) -> torch.Tensor:
    texts = builtin_prompts(model_ref)
    if texts is None:
        return torch.randint(4, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    return torch.from_numpy(build_codec(model_ref).encode([texts[i % len(texts)] for i in range(batch)], prompt_len))


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _best_seconds(runs, repeats: int, clock: str) -> list[float]:
    """Best time of each callable; the repeats alternate between them, so noise hits both alike.
    The cpu clock (this process's CPU time) does not count time other processes hold the cores."""
    now = CLOCKS[clock]
    best = [float("inf")] * len(runs)
    for repeat in range(repeats + 1):
        for i, run in enumerate(runs):
            start = now()
            run()
            if repeat:  # the first round warms up
                best[i] = min(best[i], now() - start)
    return best


def _vllm_engine(model, pad: int, batch: int, length: int):
    """vLLM over the model's weights, or None where it does not run here (not installed, or a head size its CPU
    attention lacks)."""
    if vllm_missing():
        return None
    from hfplan.executor.rollout.vllm_engine import VllmRolloutEngine

    try:
        engine = VllmRolloutEngine(model.config, pad, -1, max_num_seqs=batch, max_model_len=length,
                                   dtype=torch.float32, device=torch.device("cpu"))
    except HfplanError:
        return None
    engine.load_weights(model)
    return engine


def measure(
    model_ref: str, batch: int, prompt_len: int, response_len: int, repeats: int = 5, clock: str = "cpu",
    with_vllm: bool = False,
) -> dict:
    """Generated tokens/s of the engines, greedy and sampled, and their ratios to transformers' (`ratio`: the torch
    engine's; `vllm_ratio`: vLLM's, None where it does not run). clock "cpu" counts this process's CPU seconds
    (equal to wall seconds on an idle machine with one torch thread; steadier on a shared one), "wall" counts
    elapsed time."""
    model = build_model(model_ref, "lm", seed=0).eval()
    tokenizer = build_tokenizer(model_ref)
    pad = tokenizer.pad_token_id
    prompts = _prompts(model_ref, batch, prompt_len, model.config.vocab_size)
    attention_mask = (prompts != pad).long()
    engine = TorchRolloutEngine(model, pad, eos_id=-1)  # no EOS: every response runs to full length
    vllm = _vllm_engine(model, pad, batch, prompt_len + response_len) if with_vllm else None
    tokens = batch * response_len
    result: dict = {"model": model_ref, "batch": batch, "prompt_len": prompt_len, "response_len": response_len,
                    "threads": torch.get_num_threads(), "clock": clock}
    for mode, greedy in (("greedy", True), ("sampled", False)):
        params = SamplingParams(max_new_tokens=response_len, greedy=greedy)
        generator = torch.Generator().manual_seed(0)

        def ours(params=params, generator=generator):
            return engine.generate(prompts, params, generator)

        def theirs(greedy=greedy):
            sampling = {} if greedy else {"temperature": 1.0, "top_p": 1.0}
            with torch.inference_mode():
                return model.generate(
                    input_ids=prompts, attention_mask=attention_mask, max_new_tokens=response_len,
                    min_new_tokens=response_len, do_sample=not greedy, pad_token_id=pad, eos_token_id=None,
                    use_cache=True, **sampling,
                )

        def vllm_run(params=params, generator=generator):
            return vllm.generate(prompts, params, generator)

        runs = [ours, theirs] + ([vllm_run] if vllm is not None else [])
        seconds = _best_seconds(runs, repeats, clock)
        engine_rate, hf_rate = tokens / seconds[0], tokens / seconds[1]
        vllm_rate = tokens / seconds[2] if vllm is not None else None
        result[mode] = {"engine_tokens_per_s": engine_rate, "transformers_tokens_per_s": hf_rate,
                        "ratio": engine_rate / hf_rate, "vllm_tokens_per_s": vllm_rate,
                        "vllm_ratio": None if vllm_rate is None else vllm_rate / hf_rate}
    if vllm is not None:
        vllm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: process CPU seconds (steady on a shared machine); wall: elapsed seconds")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out even where it is installed")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'model':<11} {'batch':>5} {'P':>3} {'R':>3} {'mode':<8} {'engine tok/s':>13} {'HF tok/s':>10} "
          f"{'ratio':>6} {'vLLM tok/s':>11} {'vLLM ratio':>10}")
    for model_ref, batch, prompt_len, response_len in CASES:
        row = measure(model_ref, batch, prompt_len, response_len, repeats=args.repeats, clock=args.clock,
                      with_vllm=not args.no_vllm)
        for mode in ("greedy", "sampled"):
            m = row[mode]
            vllm = ("n/a", "n/a") if m["vllm_tokens_per_s"] is None else (
                f"{m['vllm_tokens_per_s']:.0f}", f"{m['vllm_ratio']:.2f}x")
            print(f"{model_ref:<11} {batch:>5} {prompt_len:>3} {response_len:>3} {mode:<8} "
                  f"{m['engine_tokens_per_s']:>13.0f} {m['transformers_tokens_per_s']:>10.0f} {m['ratio']:>5.2f}x "
                  f"{vllm[0]:>11} {vllm[1]:>10}")
    print(f"torch threads: {torch.get_num_threads()}; clock: {args.clock} (tokens per {args.clock} second)")


if __name__ == "__main__":
    main()
