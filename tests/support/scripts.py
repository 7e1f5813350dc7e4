"""The project's scripts (bench/, scripts/: folders of scripts, not packages) loaded as modules for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "bench"


def load_script(path: Path, name: str):
    """The script at `path` as module `name`, registered in sys.modules (its dataclasses look their module up
    there); the script's folder is on sys.path while it loads, for the scripts beside it that it imports."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def load_bench(name: str):
    """bench/<name>.py as module `bench_<name>`."""
    return load_script(BENCH_DIR / f"{name}.py", f"bench_{name}")
