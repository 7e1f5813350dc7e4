"""Continuous against static batching in the torch rollout engine, in the same run.

Same model, prompts and slots for both (greedy, so both generate the same tokens): a first run without EOS
picks as EOS the token that ends the responses at the most spread-out lengths, as real responses vary.
Static runs the rows in waves of at most `--max-batch`, each until its longest response ends; continuous
keeps that many slots busy, a finished sequence's slot taking the next prompt. Tokens/s counts real
response tokens; the figure is the best of a few repeats (bench/rollout_speed.py's `_best_seconds`).

    PYTHONPATH=. python bench/rollout_batching.py [--rows N] [--max-batch N] [--threads N] [--repeats N]
"""

from __future__ import annotations

import argparse

import torch
from rollout_speed import CLOCKS, _best_seconds, _prompts  # bench/ is the script's folder, hence on sys.path

from hfplan.executor.models import build_model
from hfplan.executor.rollout.base import SamplingParams
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
from hfplan.executor.tokenizers import build_tokenizer


def spread_eos(responses: torch.Tensor) -> int:
    """The token that, taken as EOS, gives the responses the largest spread of lengths."""
    steps = responses.shape[1]

    def lengths(token: int) -> torch.Tensor:
        hits = responses == token
        return torch.where(hits.any(1), hits.int().argmax(1) + 1, steps).float()

    return max(responses.unique().tolist(), key=lambda token: float(lengths(token).std()))


def measure(model_ref: str, rows: int, prompt_len: int, response_len: int, max_batch: int, repeats: int,
            clock: str) -> dict:
    model = build_model(model_ref, "lm", seed=0).eval()
    pad = build_tokenizer(model_ref).pad_token_id
    prompts = _prompts(model_ref, rows, prompt_len, model.config.vocab_size)
    params = SamplingParams(max_new_tokens=response_len, greedy=True)
    eos = spread_eos(TorchRolloutEngine(model, pad, eos_id=-1).generate(prompts, params).responses)
    engines = {mode: TorchRolloutEngine(model, pad, eos, batching=mode, max_batch=max_batch)
               for mode in ("static", "continuous")}
    results = {mode: engine.generate(prompts, params) for mode, engine in engines.items()}
    assert torch.equal(results["static"].responses, results["continuous"].responses)
    lengths = results["static"].response_mask.sum(1)
    tokens = float(lengths.sum())
    seconds = _best_seconds([lambda e=e: e.generate(prompts, params) for e in engines.values()], repeats, clock)
    out = {"model": model_ref, "rows": rows, "max_batch": max_batch, "mean_len": float(lengths.mean()),
           "max_len": int(lengths.max())}
    for (mode, engine), spent in zip(engines.items(), seconds, strict=True):
        out[mode] = {"tokens_per_s": tokens / spent, "decode_steps": engine.stats.decode_steps,
                     "prefills": engine.stats.prefills}
    out["ratio"] = out["continuous"]["tokens_per_s"] / out["static"]["tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    row = measure(args.model, args.rows, args.prompt_len, args.response_len, args.max_batch, args.repeats,
                  args.clock)
    print(f"{row['model']}: {row['rows']} rows, {row['max_batch']} at once, response length mean "
          f"{row['mean_len']:.1f} max {row['max_len']}")
    for mode in ("static", "continuous"):
        m = row[mode]
        print(f"  {mode:<10} {m['tokens_per_s']:>9.0f} tok/s  {m['decode_steps']:>5} decode steps  "
              f"{m['prefills']:>3} prefills")
    print(f"  continuous / static: {row['ratio']:.2f}x (tokens per {args.clock} second, "
          f"{torch.get_num_threads()} torch threads)")


if __name__ == "__main__":
    main()
