"""Writes hfplan/export/known/<framework>-<version>*.txt: every key or flag a released verl or OpenRLHF defines.

    python scripts/export_keys.py verl 0.9.1          # downloads verl-0.9.1's wheel with `pip download --no-deps`
    python scripts/export_keys.py openrlhf 0.11.2 --wheel openrlhf-0.11.2-...whl   # or reads one already here

Nothing of the package is installed, imported or run: a wheel is a zip file, and this reads the release's own files
in it. verl: the leaf keys of its generated Hydra trainer configs (one list per training backend). OpenRLHF: the
flags its PPO entry point's argparse parser defines, read with `ast` (literal strings, and f-strings over a `for`
loop's literal tuple). Each list's first lines name the release, the wheel and its sha256.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

KNOWN = Path(__file__).resolve().parents[1] / "hfplan" / "export" / "known"
# (list suffix, file in the wheel) per framework
SOURCES = {
    "verl": (("fsdp", "verl/trainer/config/_generated_ppo_trainer.yaml"),
             ("megatron", "verl/trainer/config/_generated_ppo_megatron_trainer.yaml")),
    "openrlhf": (("", "openrlhf/cli/train_ppo_ray.py"),),
}


class ExtractError(Exception):
    """A source file this script cannot read keys or flags from (one line)."""


def yaml_keys(text: str) -> list[str]:
    """Every leaf key of a YAML mapping, dotted; an empty mapping, a list or a scalar is a leaf."""
    tree = yaml.safe_load(text)
    if not isinstance(tree, dict):
        raise ExtractError("the YAML file is not a mapping")
    keys: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                keys.append(f"{prefix}{key}")

    walk(tree, "")
    return sorted(keys)


def _text(node: ast.expr, names: dict[str, str]) -> str:
    """A string literal, or an f-string whose every placeholder is a plain name bound in `names`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                parts.append(str(part.value))
            elif (isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name)
                  and part.value.id in names and part.conversion == -1 and part.format_spec is None):
                parts.append(names[part.value.id])
            else:
                raise ExtractError(f"line {node.lineno}: an f-string placeholder this script cannot resolve")
        return "".join(parts)
    raise ExtractError(f"line {node.lineno}: an option name that is not a string literal")


def _loop_values(loop: ast.For) -> tuple[str, list[str]] | None:
    """(name, values) of `for name in ("a", "b"):`; None for any other loop."""
    if isinstance(loop.target, ast.Name) and isinstance(loop.iter, (ast.Tuple, ast.List)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in loop.iter.elts):
        return loop.target.id, [e.value for e in loop.iter.elts]
    return None


def argparse_flags(source: str) -> list[str]:
    """Every option string (`-x`, `--name`) given to an `add_argument` call in a Python source file; positional
    arguments are not flags. Raises ExtractError for an option name it cannot read statically."""
    flags: list[str] = []

    def visit(node: ast.AST, names: dict[str, str]) -> None:
        if isinstance(node, ast.For) and (loop := _loop_values(node)) is not None:
            name, values = loop
            for value in values:
                for stmt in node.body:
                    visit(stmt, {**names, name: value})
            for stmt in node.orelse:
                visit(stmt, names)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags.extend(t for t in (_text(a, names) for a in node.args) if t.startswith("-"))
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(ast.parse(source), {})
    return sorted(set(flags))


def read_member(wheel: zipfile.ZipFile, path: str) -> str:
    """A file of the wheel by its package path (a platform wheel keeps it under <name>.data/purelib/)."""
    found = [n for n in wheel.namelist() if n == path or n.endswith("/purelib/" + path)]
    if len(found) != 1:
        raise ExtractError(f"{path} is not in the wheel (found {len(found)} copies)")
    return wheel.read(found[0]).decode()


def download(package: str, version: str, folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                    f"{package}=={version}", "-d", str(folder)], check=True)
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise ExtractError(f"pip download left {len(wheels)} wheels in {folder}")
    return wheels[0]


def write_lists(framework: str, version: str, wheel_path: Path, out: Path) -> list[Path]:
    digest = hashlib.sha256(wheel_path.read_bytes()).hexdigest()
    written = []
    with zipfile.ZipFile(wheel_path) as wheel:
        for suffix, member in SOURCES[framework]:
            text = read_member(wheel, member)
            items = yaml_keys(text) if member.endswith(".yaml") else argparse_flags(text)
            what = "leaf key of" if member.endswith(".yaml") else "flag defined in"
            header = [f"# {framework} {version}: every {what} {member}, one a line.",
                      f"# From the wheel {wheel_path.name} (sha256 {digest}),",
                      f"# written by scripts/export_keys.py {framework} {version}."]
            path = out / f"{framework}-{version}{'-' + suffix if suffix else ''}.txt"
            path.write_text("\n".join(header + items) + "\n")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=sorted(SOURCES))
    parser.add_argument("version", help="the release, e.g. 0.9.1")
    parser.add_argument("--wheel", type=Path, help="a wheel already downloaded (default: pip download it)")
    parser.add_argument("--out", type=Path, default=KNOWN, help="where the lists go (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = args.wheel or download(args.framework, args.version, Path(tmp))
            if not wheel.name.startswith(f"{args.framework}-{args.version}-"):
                raise ExtractError(f"{wheel.name} is not a wheel of {args.framework} {args.version}")
            for path in write_lists(args.framework, args.version, wheel, args.out):
                sys.stdout.write(f"{path}\n")
    except (ExtractError, OSError, SyntaxError, yaml.YAMLError, zipfile.BadZipFile,
            subprocess.CalledProcessError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
