#!/usr/bin/env bash
# bench/validate.py on one CUDA GPU: the machine profiled first (hfplan profile --quick, one GPU), then the
# simulator against the executor on that profile, for the demo workloads' own tiny models and for every role
# running qwen2.5-0.5b's architecture (random weights built from its config, bf16). Writes the profile, both
# benchmark outputs and a summary (date, GPU, the figures) under OUT_DIR, to be kept in the repo as
# docs/validate-<gpu>.md. About 6-8 minutes on one GPU; nothing in CI runs this.
#
#   bash bench/validate_gpu.sh [OUT_DIR]      # OUT_DIR defaults to $OUT, else ./validate-gpu
# Environment: PYTHON (default python), MODEL (the larger model, default qwen2.5-0.5b), REPEATS (default 2),
# ITERATIONS (default 4).
set -euo pipefail

py="${PYTHON:-python}"
out_dir="${1:-${OUT:-./validate-gpu}}"
model="${MODEL:-qwen2.5-0.5b}"
repeats="${REPEATS:-2}"
iterations="${ITERATIONS:-4}"
mkdir -p "$out_dir"
export RAY_AUTH_MODE=disabled
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [ "$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')" != "1" ]; then
    echo "validate_gpu.sh: no CUDA GPU is visible to torch" >&2
    exit 1
fi
hfplan=("$py" -c "import sys; from hfplan.cli import app; sys.argv[0] = 'hfplan'; app()")
start=$(date +%s)
"${hfplan[@]}" profile --device cuda --world-size 1 --quick --out "$out_dir/profile.yaml" | tee "$out_dir/profile.log"
for models in own "$model"; do
    args=(--hardware "$out_dir/profile.yaml" --max-processes 1 --repeats "$repeats" --iterations "$iterations")
    if [ "$models" != own ]; then
        args+=(--model "$models")
    fi
    "$py" "$here/validate.py" "${args[@]}" 2>&1 | grep -v '^iteration ' | tee "$out_dir/validate-$models.txt"
done

"$py" - "$out_dir" "$model" "$(( $(date +%s) - start ))" <<'PY'
import datetime, sys
from pathlib import Path

import torch

out, model, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lines = [f"# hfplan validate on {torch.cuda.get_device_name(0)}", "",
         f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {seconds} s in all "
         "(`bash bench/validate_gpu.sh`: profile --quick on this GPU, then bench/validate.py on it).", ""]
for models in ("own", model):
    lines += [f"## models: {models}", "", "```", (out / f"validate-{models}.txt").read_text().rstrip(), "```", ""]
(out / "summary.md").write_text("\n".join(lines))
print("\n".join(lines))
PY
