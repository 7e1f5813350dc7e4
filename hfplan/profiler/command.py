"""`hfplan profile`: measure the machine at hand and write a hardware profile the simulator reads.

The CLI parses the options and calls `profile_machine`, which measures, writes the profile and its raw
measurements, and returns what the report shows. torch and transformers are imported only when it runs
(they come with the `execute` extra).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hfplan.errors import HfplanError
from hfplan.profiler.run import Result

# The same install command as the README's (the package is installed from its checkout).
INSTALL_HINT = "hfplan profile needs torch and transformers: pip install '.[execute]' in the hfplan checkout"


class Progress(Protocol):
    def started(self, description: str) -> None:
        """What is about to be measured, once the options are checked."""

    def phase(self, name: str, total: int) -> Callable[[], None]:
        """Start a phase of `total` steps; returns the function to call after each step."""


@dataclass(frozen=True)
class Outcome:
    result: Result
    out: Path
    csv_path: Path


def import_torch():
    """torch, or the one-line install hint."""
    try:
        import torch
        import transformers  # noqa: F401 - the layer measurement needs it
    except ImportError:
        raise HfplanError(INSTALL_HINT) from None
    return torch


def default_name(device_name: str, kind: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or kind
    return slug if kind == "cuda" or slug.startswith("cpu") else f"cpu-{slug}"


def check_out(out: Path) -> None:
    from hfplan.files import check_outputs

    if out.suffix not in (".yaml", ".yml"):
        raise HfplanError(f"--out {out}: the profile is a .yaml file")
    check_outputs([(out, "--out"), (out.with_suffix(".csv"), "--out's raw measurements")])


def profile_machine(device: str | None, world_size: int | None, model: str, quick: bool, out: Path | None,
                    base: str | None, progress: Progress) -> Outcome:
    """Measure this machine, write the profile (`out`, default ./<device name>.yaml) and its raw measurements
    beside it (.csv), both or neither."""
    torch = import_torch()

    from hfplan.profiler import device as devices
    from hfplan.profiler.run import Request, run_profile
    from hfplan.profiler.sweeps import sweeps_for
    from hfplan.profiles.hardware import load_hardware
    from hfplan.profiles.models import resolve_model

    kind = (device or devices.default_device(torch)).lower()
    if kind not in ("cuda", "cpu"):
        raise HfplanError(f"--device {device}: use cuda or cpu")
    world = world_size if world_size is not None else devices.default_world_size(torch, kind)
    arch = resolve_model(model)
    if out is not None:
        check_out(out)
    info = devices.probe(torch, kind, world)
    base_profile = load_hardware(base or info.nominal.base)
    if out is None:
        out = Path(f"{default_name(info.name, kind)}.yaml")
        check_out(out)
    csv_path = out.with_suffix(".csv")

    progress.started(f"profiling {world} x {info.name} ({kind}, {info.backend}"
                     + (f", {info.threads} thread(s) each" if kind == "cpu" else "")
                     + f"){' --quick' if quick else ''}; layer of {arch.name}")
    result = run_profile(torch, Request(device=info, model=arch, sweeps=sweeps_for(kind, quick), name=out.stem,
                                        base=base_profile), progress)

    command = (f"hfplan profile --device {kind} --world-size {world} --model {model}{' --quick' if quick else ''}"
               f" --out {out}" + (f" --base {base}" if base else ""))
    header = (f"# Hardware profile measured by `{command}` on {result.profile.date}.\n"
              f"# Raw measurements: {csv_path.name} (same folder). Links marked 'not measured' in the description\n"
              f"# come from base profile '{base_profile.name}'.\n")
    return _written(result, out, header)


def refit_profile_file(source: Path, out: Path | None, base: str | None) -> Outcome:
    """Fit the measured profile `source` again from its raw measurements (source's .csv beside it) with this
    version of hfplan; write the new profile (`out`, default ./<source name>-refit.yaml) and its rows with this
    version's predictions beside it (.csv), both or neither. Needs neither torch nor the machine measured."""
    import datetime

    from hfplan.profiler.refit import read_rows, refit_profile
    from hfplan.profiles.hardware import load_hardware

    if source.suffix not in (".yaml", ".yml"):
        raise HfplanError(f"--refit {source}: give the .yaml of a profile hfplan profile wrote")
    if not source.is_file():
        raise HfplanError(f"--refit {source}: no such file")
    profile = load_hardware(str(source))
    out = out if out is not None else Path(f"{source.stem}-refit.yaml")
    check_out(out)
    sources = {source.resolve(), source.with_suffix(".csv").resolve()}
    if out.resolve() in sources or out.with_suffix(".csv").resolve() in sources:
        raise HfplanError(f"--out {out}: would overwrite the profile being refitted or its measurements")
    rows = read_rows(source.with_suffix(".csv"))
    try:
        result = refit_profile(profile, rows, out.stem, base)
    except (KeyError, ValueError, TypeError) as error:  # a cell or column the fit reads is missing or malformed
        raise HfplanError(f"{source.with_suffix('.csv')}: malformed raw measurements "
                          f"({type(error).__name__}: {' '.join(str(error).split())})") from None
    csv_path = out.with_suffix(".csv")
    command = f"hfplan profile --refit {source} --out {out}" + (f" --base {base}" if base else "")
    header = (f"# Hardware profile refitted by `{command}` on {datetime.date.today().isoformat()} from the raw\n"
              f"# measurements of {source.name} (taken {profile.date}). Raw measurements: {csv_path.name} (same\n"
              "# folder), with this version's predictions.\n")
    return _written(result, out, header)


def _written(result: Result, out: Path, header: str) -> Outcome:
    """Write the profile (`header` on top) and its raw measurements beside it (.csv), both or neither, once the
    profile reads back as the simulator will read it."""
    import yaml

    from hfplan.files import write_outputs
    from hfplan.profiles.hardware import HardwareProfile

    text = header + result.profile.to_yaml()
    HardwareProfile.model_validate(yaml.safe_load(text))
    csv_path = out.with_suffix(".csv")
    write_outputs([(out, text), (csv_path, result.measurements.to_csv(index=False))])
    return Outcome(result=result, out=out, csv_path=csv_path)
