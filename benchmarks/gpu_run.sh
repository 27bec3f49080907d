#!/usr/bin/env bash
# Every GPU measurement in one command (well inside ten minutes with the default budget):
#   1. benchmarks/kernels.py --tune: the tuning sweep (writes this GPU's table to OUTDIR/configs/
#      and installs it), then every kernel section timed with that table (with the batch-1 linears
#      at growing K: fixed cost against cost per row), then end-to-end decode;
#   2. benchmarks/gpu_engine_check.py: the engine on CUDA against transformers, when the
#      tokenizer files are at hand (TOKENIZER_DIR or the default model's package).
# Usage: bash benchmarks/gpu_run.sh OUTDIR [TUNE_BUDGET_S]   (default 240 s of tuning)
# Afterwards: copy OUTDIR/configs/<gpu>.json into qpage/kernels/gpu_tables/ (tuned.CONFIG_DIR) to ship it.
# On a machine without the default model (and no package index), bring its tokenizer files:
#   mkdir -p .carry/tok && cp "$(python -c 'from qpage.formats.gguf import default_model_dir as d; print(d())')"/\
#       {tokenizer.json,tokenizer_config.json,chat_template.jinja} .carry/tok   # .carry is git-ignored
#   then run with TOKENIZER_DIR=.carry/tok.
set -uo pipefail
out=${1:-benchmarks/results/gpu}
budget=${2:-240}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$out/gpu.txt"
timeout $((budget + 300)) python3 benchmarks/kernels.py --tune --tune-budget "$budget" --out "$out/kernels.json" \
    2>&1 | tee "$out/kernels.log"
status=${PIPESTATUS[0]}
tok=()
if [ -n "${TOKENIZER_DIR:-}" ]; then tok=(--tokenizer "$TOKENIZER_DIR"); fi
timeout 200 python3 benchmarks/gpu_engine_check.py --quantized "${tok[@]}" --out "$out/gpu_engine_check.json" 2>&1 \
    | tee "$out/engine.log" || echo "engine check did not complete (see engine.log)"
exit "$status"
