"""What a CPU process pays for having waited: a call right after an idle stretch runs longer (Compute.idle_wake).

An executor worker on CPU waits between its calls for the other sets, the controller or Ray. On the project's
2-core VM the same call ran longer the longer its process had slept before it: the rollout engine's generation of
one prompt (about 11 ms) took 0.75 ms longer after 10 ms asleep and about 2.5 ms longer after 100 ms or more,
nearly all of it in the first milliseconds of work (a forward of 1.5 ms ran 2.3x as long after 100 ms, the one
after it 1.2x). The core comes back cold: its caches held other work meanwhile, and a virtual CPU that halted waits
to be run again at full speed. A plan whose sets take turns (one generates while the other waits) pays it on every
call after a wait; a set that calls back to back does not. So the probe times that generation back to back and
after each of IDLE_MS of sleep, in alternating rounds, alone in its process (one CPU thread, as a worker has).
torch is passed in.
"""

from __future__ import annotations

import math
import time

from hfplan.measure import typical

IDLE_MS = (3.0, 10.0, 20.0, 30.0, 50.0, 100.0, 300.0)
LEAST_ROUNDS = 5
BACK_TO_BACK = "back_to_back"
AFTER_IDLE = "after_idle"


def measure_idle_wake(torch, budget_s: float) -> list[dict]:
    """Rows (kind `wake`) of the probe's seconds back to back (idle_ms 0) and after each idle wait; about
    `budget_s` of timing, at least LEAST_ROUNDS rounds."""
    from hfplan.executor.rollout.base import SamplingParams
    from hfplan.profiler import runtime

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine, prompts = runtime.cpu_probe(torch)
        params = SamplingParams(max_new_tokens=runtime.LONG)

        def call() -> float:
            start = time.perf_counter()
            engine.generate(prompts, params)
            return time.perf_counter() - start

        once = min(call() for _ in range(3))  # and the warm-up
        idles = (0.0, *IDLE_MS)
        per_round = sum(idles) * 1e-3 + 3 * len(idles) * once
        rounds = max(LEAST_ROUNDS, math.ceil(budget_s / per_round))
        times: dict[float, list[float]] = {idle: [] for idle in idles}
        for _ in range(rounds):
            for idle in idles:
                call()
                call()  # the core busy with this work right before the wait
                if idle:
                    time.sleep(idle * 1e-3)
                times[idle].append(call())
    finally:
        torch.set_num_threads(threads)
    return [dict(kind="wake", op=AFTER_IDLE if idle else BACK_TO_BACK, model=runtime.MODEL, world=1,
                 idle_ms=idle, seconds=typical(values)) for idle, values in times.items()]


def fit_idle_wake(rows: list[dict]) -> tuple[tuple[float, float], ...] | None:
    """Compute.idle_wake from measure_idle_wake's rows: (idle ms, extra us) for each wait, the extra the typical
    call after it over the typical call back to back (none where it came out faster); None without the rows."""
    wake = [r for r in rows if r.get("kind") == "wake"]
    base = [r["seconds"] for r in wake if r["op"] == BACK_TO_BACK]
    after = sorted((r["idle_ms"], r["seconds"]) for r in wake if r["op"] == AFTER_IDLE)
    if not base or not after:
        return None
    return tuple((float(idle), round(max(0.0, seconds - base[0]) * 1e6, 1)) for idle, seconds in after)
