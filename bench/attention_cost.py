"""torch's attention kernel timed alone at the profiler's attention cases, beside the simulator's price of each on a
hardware profile, and on the kernel fitted from these very rows (what `hfplan profile` would write as
compute.measured_attention). Each case is one call of scaled_dot_product_attention as the executor makes it
(`profiler.compute.measure_attention`, one thread): `decode`, one query a sequence against a KV cache; `forward`, a
causal pass. Prints per case the measured microseconds and each price's error, then the median and range of the
errors per kind of call. Asserts nothing: a reading of the attention cost model against the kernel it prices.

    PYTHONPATH=. python bench/attention_cost.py [--hardware cpu] [--quick]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hfplan.profiler import compute
from hfplan.profiler.device import probe
from hfplan.profiler.fit import fit_attention, measured_attention
from hfplan.profiler.sweeps import sweeps_for
from hfplan.profiles.hardware import HardwareProfile, load_hardware
from hfplan.profiles.models import ModelArch
from hfplan.simulator import kernels

MIN_TIME, QUICK_MIN_TIME = 0.3, 0.03  # seconds of timed calls per case (the profiler's full and quick sweeps)


def priced(hw: HardwareProfile, row: dict) -> float:
    """The simulator's attention seconds for the row's call, one layer of its shape on one rank."""
    arch = ModelArch("case", layers=1, hidden=row["hidden"], heads=row["heads"], kv_heads=row["kv_heads"], ffn=1,
                     vocab=1, context_len=1 << 20)
    if row["op"] == "decode":
        return kernels.attention_time(hw, arch, row["batch"], row["context"], 1, True)
    length = row["seq"]
    return kernels.attention_time(hw, arch, row["batch"] * length, (length + 1) / 2, 1, False, length)


def with_kernel(hw: HardwareProfile, fitted: dict) -> HardwareProfile:
    kernel = measured_attention(fitted)  # as `hfplan profile` writes it
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"measured_attention": kernel})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="cpu", help="shipped profile name or profile .yaml")
    parser.add_argument("--quick", action="store_true", help="the quick profile's cases, shorter timings")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hw = load_hardware(args.hardware)
    device = probe(torch, "cpu", 1)
    rows = compute.measure_attention(torch, device, sweeps_for("cpu", args.quick).attention,
                                     QUICK_MIN_TIME if args.quick else MIN_TIME, lambda: None)
    fitted = fit_attention(rows, hw.compute.value_bytes, hw.compute.cache_bytes)
    refit = with_kernel(hw, fitted) if fitted is not None else None
    print(f"{'op':<8}{'batch':>6}{'heads':>6}{'width':>6}{'length':>7}{'measured us':>13}{'profile':>9}{'refit':>8}")
    errors: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        measured = row["seconds"]
        cells = []
        for name, profile in (("profile", hw), ("refit", refit)):
            if profile is None:
                cells.append(f"{'-':>8}")
                continue
            error = (priced(profile, row) - measured) / measured
            errors.setdefault((row["op"], name), []).append(error)
            cells.append(f"{100 * error:>+7.0f}%")
        length = row["context"] if row["op"] == "decode" else row["seq"]
        print(f"{row['op']:<8}{row['batch']:>6}{row['heads']:>6}{row['hidden'] // row['heads']:>6}{length:>7}"
              f"{1e6 * measured:>13.1f}{cells[0]:>9}{cells[1]:>8}")
    for (op, name), found in sorted(errors.items()):
        print(f"{op} on {name}: median {100 * statistics.median(found):+.1f}% (|error| "
              f"{100 * statistics.median(abs(e) for e in found):.1f}%), {100 * min(found):+.0f}% to "
              f"{100 * max(found):+.0f}%")


if __name__ == "__main__":
    main()
