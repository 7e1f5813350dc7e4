#!/usr/bin/env bash
# Profile the GPU machine at hand in one run of a few minutes and write a measured hardware profile
# named for the GPU, with its raw measurements (.csv) and the console report (.log) beside it.
#
#   bash bench/profile_gpu.sh [OUT_DIR]
#
# OUT_DIR defaults to $OUT when set (the device runner's output folder), else ./measured-profiles.
# Environment: MODEL (layer measured against the cost model, default llama3.1-8b), WORLD_SIZE
# (default: every visible GPU), QUICK=1 (short sweeps), PYTHON (default: python).
# Ship the result as hfplan/profiles/hardware/<name>.yaml: it is marked measured, with the date.
set -euo pipefail

py="${PYTHON:-python}"
out_dir="${1:-${OUT:-./measured-profiles}}"
mkdir -p "$out_dir"

gpus="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$gpus" -lt 1 ]; then
    echo "profile_gpu.sh: no CUDA GPU is visible to torch" >&2
    exit 1
fi
# "NVIDIA H100 80GB HBM3" -> h100-80gb-hbm3-measured
name="$("$py" -c 'import re, torch
n = torch.cuda.get_device_name(0).lower().replace("nvidia", "")
print(re.sub(r"[^a-z0-9]+", "-", n).strip("-") + "-measured")')"
out="$out_dir/$name.yaml"

if command -v hfplan >/dev/null 2>&1; then
    profile=(hfplan profile)
else  # the package importable but its script not on PATH
    profile=("$py" -c 'import sys; from hfplan.cli import app; sys.argv[0] = "hfplan"; app()' profile)
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version \
    --format=csv | tee "$out_dir/$name.nvidia-smi.csv"
args=(--device cuda --world-size "${WORLD_SIZE:-$gpus}" --model "${MODEL:-llama3.1-8b}" --out "$out")
if [ "${QUICK:-0}" = "1" ]; then
    args+=(--quick)
fi
start=$(date +%s)
COLUMNS="${COLUMNS:-160}" "${profile[@]}" "${args[@]}" 2>&1 | tee "$out_dir/$name.log"
echo "profile_gpu.sh: ${gpus} GPU(s), $(( $(date +%s) - start )) s; wrote $out, ${out%.yaml}.csv, $out_dir/$name.log"
