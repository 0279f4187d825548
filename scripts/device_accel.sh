#!/usr/bin/env bash
# The accelerator bench for gpt_1b on the device machine (one H200; ../shared/device.md):
# run through the `run` tool with carry [".whl"], the wheels downloaded as device.md says.
# Two parts, each under the tool's 10 minutes a command:
#   bash scripts/device_accel.sh bench     # every variant, the prediction (9 minutes at most)
#   bash scripts/device_accel.sh extras    # flags off, xla attention, the Pallas GPU kernel
#   bash scripts/device_accel.sh           # both, one after the other
# Results under $OUT: accel.json (written after each variant), accel.txt (the tables),
# accel_predict.json (Seq1F1B over 1F1B on 4 and 8 GPUs from unit timings),
# accel_noflags.json (the reference without seqpipe's GPU XLA flags), accel_xla.json (the
# reference and seq1f1b K=4 with model.attention=xla: at 2048 tokens `step_cost`'s H200
# estimate has `blockwise` faster, `auto`'s pick; this measures it), accel_pallas.json
# (the reference, 1f1b and seq1f1b K=4 with the pallas_gpu kernel), attention.json and
# attention.txt (the pallas_gpu kernel against xla, and timed against blockwise). Each
# bench row also carries its compiled step's bytes and H200 estimate, to check the
# estimate against the measured time.
set -uo pipefail
PART=${1:-all}
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  # gpt_1b, seq 2048, batch 32: the reference, 1f1b M=8, seq1f1b M=8 K=4, then with the
  # remat policies that fit an H200 (ref@dots, 1f1b@none, seq1f1b:4@none), then K=1,2,8.
  timeout 400 python3 -m seqpipe.tools.bench --accelerator --config gpt_1b --steps 3 \
    --predict= --json "$OUT/accel.json" 2>&1 | tee "$OUT/accel.txt"
  # Seq1F1B K=4 over 1F1B on 4 and 8 H200s (M=8, remat none), predicted by the bench's
  # time model from one-layer units compiled and timed here (30 of them).
  timeout 130 python3 -m seqpipe.tools.bench --accelerator --config gpt_1b --variants= \
    --json "$OUT/accel_predict.json" 2>&1 | tail -12 | tee -a "$OUT/accel.txt"
fi
if [ "$PART" = extras ] || [ "$PART" = all ]; then
  # The same reference without the flags seqpipe sets on GPUs (their effect, in one row).
  SEQPIPE_XLA_GPU_FLAGS=0 timeout 90 python3 -m seqpipe.tools.bench --accelerator \
    --config gpt_1b --variants ref --steps 3 --no_profile --json "$OUT/accel_noflags.json" \
    2>&1 | tail -5 | tee -a "$OUT/accel.txt"
  # `auto` is blockwise on GPUs; at 2048 tokens `xla` may be faster (fewer, larger kernels).
  timeout 150 python3 -m seqpipe.tools.bench --accelerator --config gpt_1b \
    --variants ref,seq1f1b:4 --steps 3 --no_profile --json "$OUT/accel_xla.json" \
    --config.model.attention=xla 2>&1 | tail -6 | tee -a "$OUT/accel.txt"
  # The Triton kernel in every step, the reference's included (each data shard in a
  # shard_map): with the remat each fits on an H200 with. step_cost's H200 estimate:
  # ref@dots 1.33 s against blockwise's 1.68 s, before the kernels' own compute.
  timeout 150 python3 -m seqpipe.tools.bench --accelerator --config gpt_1b \
    --variants ref@dots,1f1b@none,seq1f1b:4@none --steps 3 --no_profile \
    --json "$OUT/accel_pallas.json" --config.model.attention=pallas_gpu 2>&1 | tail -6 \
    | tee -a "$OUT/accel.txt"
  # The pallas_gpu Triton kernel compiled for the GPU: exact against xla (bf16, output and
  # five cotangents), reading a K/V cache bit for bit as on arrays, then forward + backward
  # against blockwise and xla at gpt_1b's 8192-token shapes; cases past 50 s are skipped,
  # so this adds about a minute at most. Exit status 1: a check failed (see the output).
  timeout 75 python3 -m seqpipe.tools.attention_check --budget_s 50 \
    --json "$OUT/attention.json" 2>&1 | tail -20 | tee "$OUT/attention.txt"
fi
