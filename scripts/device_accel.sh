#!/usr/bin/env bash
# The accelerator bench for gpt_1b on the device machine (one H200; ../shared/device.md):
# run through the `run` tool with carry [".whl"], the wheels downloaded as device.md says.
#   bash scripts/device_accel.sh            # every variant, then a no-flags reference
# Results under $OUT: accel.json (written after each variant), accel.txt (the table),
# accel_noflags.json (the reference without seqpipe's GPU XLA flags).
set -uo pipefail
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# gpt_1b, seq 2048, batch 32: the reference, 1f1b M=8, seq1f1b M=8 K=1,2,4,8.
timeout 400 python3 -m seqpipe.tools.bench --accelerator --config gpt_1b --steps 3 \
  --json "$OUT/accel.json" 2>&1 | tee "$OUT/accel.txt"
# The same reference without the flags seqpipe sets on GPUs (their effect, in one row).
SEQPIPE_XLA_GPU_FLAGS=0 timeout 90 python3 -m seqpipe.tools.bench --accelerator \
  --config gpt_1b --variants ref --steps 3 --no_profile --json "$OUT/accel_noflags.json" \
  2>&1 | tail -5 | tee -a "$OUT/accel.txt"
