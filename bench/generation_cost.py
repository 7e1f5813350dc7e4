"""The torch rollout engine's static generation timed beside the simulator's price of it on a hardware profile.

For each model, batch and response length: prompts of PROMPT tokens (no padding), every response running its full
length (no token is EOS), sampled at temperature 1, one thread; the median of REPEATS calls after a warm-up, against
`costs.wave_phases` on the profile (its prefill, its decode steps and the generation's own cost). One response
token is the prefill's alone; the longer ones add decode steps. Asserts nothing: a reading of where the cost model
of a generation stands against the engine it prices, without Ray or the executor around it.

    PYTHONPATH=. python bench/generation_cost.py [--hardware cpu] [--models tiny,tiny-arith] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hfplan.executor.models import build_model
from hfplan.executor.rollout.base import SamplingParams
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
from hfplan.profiles.hardware import load_hardware
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs
from hfplan.spec import ResponseLengths

PROMPT = 5  # arith-grpo's prompt width
BATCHES, LENGTHS = (1, 8, 32), (1, 4, 17)
REPEATS = 15


def median_seconds(engine: TorchRolloutEngine, prompts: torch.Tensor, tokens: int, repeats: int) -> float:
    params = SamplingParams(max_new_tokens=tokens)
    for _ in range(3):
        engine.generate(prompts, params)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="cpu", help="shipped profile name or profile .yaml")
    parser.add_argument("--models", default="tiny,tiny-arith", help="catalog models, comma-separated")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, lengths 1 and 4, 3 repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hw = load_hardware(args.hardware)
    batches, lengths, repeats = ((1, 8), (1, 4), 3) if args.quick else (BATCHES, LENGTHS, REPEATS)
    one = costs.SetShape(1, 1)
    print(f"{'model':<12}{'batch':>6}{'tokens':>7}{'measured ms':>13}{'priced ms':>11}{'error':>8}  priced: prefill + "
          "steps x step")
    for name in args.models.split(","):
        arch = CATALOG[name]
        engine = TorchRolloutEngine(build_model(name, "lm", seed=0, dtype=torch.float32).eval(), pad_id=0, eos_id=-1)
        for batch in batches:
            prompts = torch.randint(1, arch.vocab, (batch, PROMPT))
            for tokens in lengths:
                measured = median_seconds(engine, prompts, tokens, repeats)
                phases = costs.wave_phases(hw, arch, 1, 1, one, batch, PROMPT, tokens, ResponseLengths.fixed(tokens))
                priced = phases.prefill.total + phases.decode.total
                step = phases.decode.total / phases.decode_steps if phases.decode_steps else 0.0
                print(f"{name:<12}{batch:>6}{tokens:>7}{1e3 * measured:>13.3f}{1e3 * priced:>11.3f}"
                      f"{100 * (priced - measured) / measured:>+7.0f}%  {1e3 * phases.prefill.total:.3f} + "
                      f"{phases.decode_steps:g} x {1e3 * step:.3f}")


if __name__ == "__main__":
    main()
