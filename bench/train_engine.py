"""The training engine on one data-parallel rank: as built (no FSDP2 where it computes in its fp32 master
weights) against the same RoleModel wrapped in FSDP2 over its one rank (what it did before).

For the demo models (`tiny`, `tiny-arith`) in a gloo world of one, one torch thread: an actor update (one
optimizer step over the whole batch, the KL loss on) and a log-prob forward, each timed in alternating rounds
against the FSDP2 baseline built from the same weights; prints the medians and the ratio baseline / built.
Asserts nothing about time.

    python bench/train_engine.py [--rounds N] [--sequences N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from hfplan.executor.engines.training import RoleModel
from hfplan.executor.local import single_process_world
from hfplan.executor.mesh import ParallelDims
from hfplan.executor.models import build_model
from hfplan.hyperparams import Hyperparameters
from hfplan.profiles.models import CATALOG

PROMPT, RESPONSE = 8, 8


def role_model(name: str, fsdp: bool) -> RoleModel:
    """The actor as the executor builds it on one CPU rank; with `fsdp`, wrapped in FSDP2 over that rank."""
    hp = Hyperparameters()
    model = build_model(name, "lm", seed=0, dtype=torch.float32)
    return RoleModel(model, ParallelDims(1, 1, 1, 1).build("cpu"), hp, "cpu", torch.float32, pad_id=0, lr=1e-6,
                     fsdp=fsdp)


def batch(name: str, sequences: int) -> dict[str, torch.Tensor]:
    vocab = CATALOG[name].vocab
    gen = torch.Generator().manual_seed(0)
    return {"prompts": torch.randint(1, vocab, (sequences, PROMPT), generator=gen),
            "responses": torch.randint(1, vocab, (sequences, RESPONSE), generator=gen),
            "response_mask": torch.ones(sequences, RESPONSE, dtype=torch.long),
            "old_log_probs": torch.zeros(sequences, RESPONSE), "advantages": torch.ones(sequences, RESPONSE),
            "ref_log_probs": torch.zeros(sequences, RESPONSE)}


def calls(role: RoleModel, data: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    rows = data["prompts"].shape[0]
    return {"update": lambda: role.update_actor(data, mini_batches=1, epochs=1, micro_batch=rows, use_kl_loss=True),
            "log_prob": lambda: role.log_probs(data["prompts"], data["responses"], data["response_mask"],
                                               micro_batch=rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sequences", type=int, default=32, help="sequences per call (arith-grpo: 32)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"training engine, one rank, {args.sequences} sequences of {PROMPT}+{RESPONSE} tokens, {args.rounds} "
          f"alternating rounds (the first 3 not counted); load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':<12}{'call':<10}{'built ms':>10}{'FSDP2 ms':>10}{'FSDP2/built':>13}")
    with single_process_world():
        for name in ("tiny", "tiny-arith"):
            data = batch(name, args.sequences)
            built, baseline = calls(role_model(name, False), data), calls(role_model(name, True), data)
            for op in built:
                times: dict[str, list[float]] = {"built": [], "fsdp": []}
                for _ in range(args.rounds):
                    for label, fn in (("built", built[op]), ("fsdp", baseline[op])):
                        start = time.perf_counter()
                        fn()
                        times[label].append(time.perf_counter() - start)
                mine, theirs = (statistics.median(times[k][3:]) * 1e3 for k in ("built", "fsdp"))
                print(f"{name:<12}{op:<10}{mine:>10.2f}{theirs:>10.2f}{theirs / mine:>12.2f}x")


if __name__ == "__main__":
    main()
