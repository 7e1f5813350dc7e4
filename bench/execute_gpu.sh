#!/usr/bin/env bash
# `hfplan execute` on one CUDA GPU: PPO, every role colocated, Qwen2.5-0.5B's architecture built from its
# config with random weights (no hub), bf16 compute. Writes the run folder, the measured timeline, the
# console report and a summary (tokens/s, per-stage seconds, peak memory, date) under OUT_DIR, to be kept
# in the repo as docs/execute-<gpu>.md. Nothing in CI runs this.
#
#   bash bench/execute_gpu.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./execute-gpu
# Environment: PYTHON (default python), ITERATIONS (default 10), MODEL (default qwen2.5-0.5b).
set -euo pipefail

py="${PYTHON:-python}"
out_dir="${1:-${OUT:-./execute-gpu}}"
iterations="${ITERATIONS:-10}"
model="${MODEL:-qwen2.5-0.5b}"
mkdir -p "$out_dir"
export RAY_AUTH_MODE=disabled

"$py" - "$out_dir" "$model" <<'PY'
import json, sys
from pathlib import Path

out, model = Path(sys.argv[1]), sys.argv[2]
workload = {"algorithm": "ppo", "models": {"actor": model, "critic": model, "reference": model,
                                           "reward": "rule:vowel-fraction"},
            "prompt_len": 128, "response_len": 256, "batch_prompts": 64, "mini_batches": 2,
            "hyperparameters": {"actor_lr": 1.0e-6, "critic_lr": 1.0e-5}}
(out / "workload.json").write_text(json.dumps(workload))
words = ["the", "a", "model", "learns", "to", "write", "short", "clear", "answers", "about", "cats", "and", "rain"]
with (out / "prompts.jsonl").open("w") as sink:
    for i in range(256):
        sink.write(json.dumps({"prompt": " ".join(words[(i * k) % len(words)] for k in range(1, 9))}) + "\n")
PY

hfplan=("$py" -c "import sys; from hfplan.cli import app; sys.argv[0] = 'hfplan'; app()")
"${hfplan[@]}" search --workload "$out_dir/workload.json" --hardware h200-141g --gpus 1 --no-compare \
    --out "$out_dir/plan.json" | tee "$out_dir/search.log"
"${hfplan[@]}" execute "$out_dir/plan.json" --iterations "$iterations" --data "$out_dir/prompts.jsonl" \
    --out "$out_dir/run" --timeline "$out_dir/timeline.png" | tee "$out_dir/execute.log"

"$py" - "$out_dir" <<'PY'
import datetime, json, statistics, sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()][1:]  # warm-up
keys = ["iteration_s", "tokens_per_s", "response_tokens_per_s", "generation_s", "preparation_s", "training_s"]
summary = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
           **{k: statistics.median(r[k] for r in rows) for k in keys},
           "peak_memory_gib": {w: b / 2**30 for w, b in
                               json.loads((out / "run" / "workers.json").read_text())["peak_memory_bytes"].items()}}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
