"""`hfplan profile`: measure the machine at hand and write a hardware profile the simulator reads.

Registered by the CLI as `app.command("profile")(profile_command)`. torch and transformers are
imported only when the command runs (they come with the `execute` extra).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from hfplan.errors import HfplanError

INSTALL_HINT = "hfplan profile needs torch: pip install 'hfplan[execute]'"


def profile_command(
    device: Annotated[str | None, typer.Option(
        help="device to profile: cuda or cpu (default: cuda when available, else cpu)")] = None,
    world_size: Annotated[int | None, typer.Option(
        "--world-size", "-w", help="processes (devices) the collectives run across (default: every visible GPU; "
                                   "on CPU 2-4, one per core)")] = None,
    model: Annotated[str, typer.Option(
        help="catalog model (or config.json) whose transformer layer is measured against the cost model")]
        = "llama3.1-8b",
    quick: Annotated[bool, typer.Option(
        "--quick", help="short sweeps: under 2 minutes on a 2-core CPU, a few minutes on a GPU node")] = False,
    out: Annotated[Path | None, typer.Option(
        help="profile YAML to write; the raw measurements go beside it as .csv (default: ./<device>.yaml)")] = None,
    base: Annotated[str | None, typer.Option(
        help="profile whose unmeasured links (inter-node; host on CPU) are carried over (default: cpu on CPU; "
             "a100-80g, h100-80g or h200-141g by GPU name)")] = None,
) -> None:
    """Measure compute, memory and communication on this machine; write a hardware profile for `--hardware`."""
    try:
        _profile(device, world_size, model, quick, out, base)
    except HfplanError as error:
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


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
    if out.suffix not in (".yaml", ".yml"):
        raise HfplanError(f"--out {out}: the profile is a .yaml file")
    if not out.parent.is_dir():
        raise HfplanError(f"--out {out}: folder {out.parent} does not exist")


def _profile(device: str | None, world_size: int | None, model: str, quick: bool, out: Path | None,
             base: str | None) -> None:
    torch = import_torch()
    import yaml
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hfplan.files import write_atomically
    from hfplan.profiles.hardware import HardwareProfile, load_hardware
    from hfplan.profiles.models import resolve_model
    from hfplan.profiles.profiler import device as devices
    from hfplan.profiles.profiler import report
    from hfplan.profiles.profiler.run import Request, run_profile
    from hfplan.profiles.profiler.sweeps import sweeps_for

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
    name = out.stem
    csv_path = out.with_suffix(".csv")

    console = Console()
    console.print(f"profiling {world} x {info.name} ({kind}, {info.backend}"
                  + (f", {info.threads} thread(s) each" if kind == "cpu" else "")
                  + f"){' --quick' if quick else ''}; layer of {arch.name}", highlight=False)
    columns = (TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        class Tracker:
            def phase(self, label: str, total: int):
                task = progress.add_task(label, total=total)
                return lambda: progress.advance(task)

        result = run_profile(torch, Request(device=info, model=arch, sweeps=sweeps_for(kind, quick), name=name,
                                            base=base_profile), Tracker())

    command = (f"hfplan profile --device {kind} --world-size {world} --model {model}{' --quick' if quick else ''}"
               f" --out {out}" + (f" --base {base}" if base else ""))
    header = (f"# Hardware profile measured by `{command}` on {result.profile.date}.\n"
              f"# Raw measurements: {csv_path.name} (same folder). Links marked 'not measured' in the description\n"
              f"# come from base profile '{base_profile.name}'.\n")
    text = header + result.profile.to_yaml()
    HardwareProfile.model_validate(yaml.safe_load(text))  # what the simulator will read back
    write_atomically(out, text)
    write_atomically(csv_path, result.measurements.to_csv(index=False))

    console.print(report.fits_table(result))
    console.print(report.layer_table(result))
    console.print(report.error_summary(result.measurements), highlight=False)
    console.print(f"profile written to {out} (raw measurements: {csv_path}); use it with "
                  f"`hfplan search --hardware {out}`", highlight=False)
