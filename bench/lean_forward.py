"""hfplan's lean forward (executor/engines/lean.py) against HF's own forward of the same model, on one torch thread.

The demo actor (`tiny-arith`, or --model) over a batch shaped as bench/vs_trl.py's was (32 sequences of 8 prompt
and 4 response tokens, some prompts left-padded and some responses ended early; arith-grpo's prompts now run 5
wide): the log-prob forward (no grad, logits of the last R + 1 positions) and a forward and backward of a loss on
them. Each is timed in CPU time (less disturbed
by a shared machine than wall time) over --rounds alternating rounds; prints the fastest round of each and the count
of aten ops one call dispatches (torch profiler). With --op-split, also the CPU time of each kind of aten op in
hfplan's forward and backward (timed one op at a time, so their sum exceeds the call's own time by the timing's cost):
what is kernel work and what is per-op overhead. Asserts nothing about time.

    python bench/lean_forward.py [--model NAME] [--rounds N] [--calls N] [--op-split]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from hfplan.executor import sequences
from hfplan.executor.engines import lean
from hfplan.executor.models import build_model

ROWS, PROMPT, RESPONSE = 32, 8, 4


def tensors(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompts, responses, response_mask) shaped as arith-grpo's (bench/compile_step.py shares them), pad id 0."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (ROWS, PROMPT), generator=gen)
    responses = torch.randint(1, vocab, (ROWS, RESPONSE), generator=gen)
    mask = torch.ones(ROWS, RESPONSE, dtype=torch.long)
    prompts[: ROWS // 4, :2] = 0  # left padding, as prompts of different lengths have
    mask[: ROWS // 8, 2:] = 0  # responses that ended early
    return prompts, responses * mask, mask


def batch(vocab: int) -> sequences.Joined:
    return sequences.join(*tensors(vocab), 0)


def hf_forward(model, joined: sequences.Joined) -> torch.Tensor:
    return model(input_ids=joined.input_ids, attention_mask=joined.attention_mask, position_ids=joined.position_ids,
                 use_cache=False, logits_to_keep=RESPONSE + 1).logits


def calls(model, joined: sequences.Joined, forward: Callable) -> dict[str, Callable[[], None]]:
    def inference() -> None:
        with torch.no_grad():
            forward(model, joined)

    def training() -> None:
        forward(model, joined).float().logsumexp(-1).sum().backward()

    return {"log-prob forward": inference, "forward + backward": training}


def aten_ops(fn: Callable[[], None]) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::"))


def op_split(fn: Callable[[], None], calls: int) -> list[tuple[str, float, int]]:
    """(aten op, CPU ms per call, times per call) of `fn`'s ops, most CPU first."""
    from collections import defaultdict

    from torch.utils._python_dispatch import TorchDispatchMode

    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.process_time()
            out = func(*args, **(kwargs or {}))
            seconds[func.overloadpacket.__name__] += time.process_time() - start
            count[func.overloadpacket.__name__] += 1
            return out

    with Timer():
        for _ in range(calls):
            fn()
    return sorted(((op, 1e3 * s / calls, count[op] // calls) for op, s in seconds.items()), key=lambda row: -row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-arith")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--op-split", action="store_true", help="CPU ms per aten op of hfplan's forward + backward")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.model, "lm", seed=0)
    joined = batch(model.config.vocab_size)
    if not lean.runs(model, joined):
        raise SystemExit(f"{args.model}: the lean forward does not run this model")
    systems = {"HF": calls(model, joined, hf_forward),
               "lean": calls(model, joined, lambda m, j: lean.head_output(m, j, RESPONSE + 1))}
    print(f"{args.model}, {ROWS} x ({PROMPT} + {RESPONSE}) tokens, one thread; fastest of {args.rounds} alternating "
          f"rounds of {args.calls} calls, CPU ms per call; load average {os.getloadavg()[0]:.2f}")
    for op in systems["HF"]:
        best = {name: float("inf") for name in systems}
        for fn in (fns[op] for fns in systems.values()):
            fn()  # warm-up
        for _ in range(args.rounds):
            for name, fns in systems.items():
                start = time.process_time()
                for _ in range(args.calls):
                    fns[op]()
                best[name] = min(best[name], (time.process_time() - start) / args.calls * 1e3)
        ops = {name: aten_ops(fns[op]) for name, fns in systems.items()}
        print(f"  {op:<20} HF {best['HF']:6.2f} ms ({ops['HF']} aten ops)  lean {best['lean']:6.2f} ms "
              f"({ops['lean']} aten ops)  HF/lean {best['HF'] / best['lean']:.2f}x")
    if args.op_split:
        rows = op_split(systems["lean"]["forward + backward"], args.calls)
        print(f"hfplan's forward + backward, CPU ms per call by aten op (timed one by one: "
              f"{sum(ms for _, ms, _ in rows):.2f} ms in all)")
        for name, ms, times in rows[:12]:
            print(f"  {name:<54} {ms:6.3f} ms  x{times}")


if __name__ == "__main__":
    main()
