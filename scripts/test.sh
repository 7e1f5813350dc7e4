#!/usr/bin/env bash
# Installs hfplan with every extra into .venv (torch 2.13.0 CPU build first, pinned by constraints.txt)
# and runs the whole test suite. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[execute,dev]"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
