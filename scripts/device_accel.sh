#!/usr/bin/env bash
# The accelerator figures issues 13 and 14 ask for, on the device machine (one H200;
# docs/performance.md): run through the `run` tool with carry [".whl"], the wheels
# downloaded as docs/performance.md says. A session has 15 minutes of device time, start-up
# included, and 10 minutes a command, so the work comes in parts, most wanted first:
#   bash scripts/device_accel.sh bench     # call 1, 9 minutes at most
#   bash scripts/device_accel.sh long      # call 2, within 30 s (the machine still warm)
#   bash scripts/device_accel.sh extras    # a session with time to spare
#   bash scripts/device_accel.sh           # all three, one after the other
# Every step is cut by its own `timeout` and writes its JSON as it goes (the bench after
# each variant), so a part cut short keeps what it measured. Results under $OUT:
#   bench:  attention.json/.txt (the pallas_gpu kernels against xla in bf16, output and
#           five cotangents, reading a K/V cache bit for bit as on arrays; then timed
#           against blockwise and xla at gpt_1b's 8192-token shapes), accel_pallas.json
#           (gpt_1b 2048 x 32 with pallas_gpu, at the remat that fits an H200 with least
#           recompute, profiled), accel.json (the same steps with `auto` attention
#           (blockwise) and the default remat: what the yardstick in device.md ran),
#           accel_predict.json (Seq1F1B over 1F1B on 4 and 8 GPUs from unit timings);
#   long:   accel_32k.json (seq1f1b M=2 K=8 at 32768 x 2), accel_8k_pallas.json and
#           accel_8k_xla.json (the reference at 8192 x 8, the fused kernel against xla);
#   extras: attention_sweep.json (the pallas_gpu kernels' tilings, each checked against
#           xla and timed), accel_32k_blockwise.json, accel_k.json (seq1f1b K=1, 2, 8),
#           accel_noflags.json (the reference without seqpipe's GPU XLA flags).
# Back on the development machine, `python -m seqpipe.tools.device_report DIR` sets what
# came back against the issues' goals. accel.txt collects the tables, NAME.log each step's
# whole output. Each bench row also carries its compiled step's bytes and step_cost's H200
# estimate, to check the estimate against the measured time.
set -uo pipefail
PART=${1:-all}
OUT=${OUT:-runs/device}
WHEELS=${WHEELS:-.whl}
case $PART in bench | long | extras | all) ;; *)
  echo "error: unknown part '$PART'; name bench, long, extras or all" >&2
  exit 2
  ;;
esac
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then  # without them every step fails on import
  echo "error: no wheels in $WHEELS: download them as docs/performance.md says, carry $WHEELS" >&2
  exit 2
fi
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
START=$SECONDS
bench() {  # LIMIT_S JSON [bench flags...]: gpt_1b through the accelerator bench
  local limit=$1 json=$2
  shift 2
  echo "== $json (${limit} s at most; $((SECONDS - START)) s into this part)" | tee -a "$OUT/accel.txt"
  timeout "$limit" python3 -m seqpipe.bench --accelerator --config gpt_1b \
    --json "$OUT/$json" "$@" 2>&1 | tee "$OUT/${json%.json}.log" | tail -30 \
    | tee -a "$OUT/accel.txt"
}
# A step takes seconds at these lengths: one warm-up step, then one timed.
LONG8K=(--config.train.seq_len=8192 --config.train.global_batch_size=8 --variants ref
  --steps 1 --no_profile --predict=)
LONG32K=(--config.train.seq_len=32768 --config.train.global_batch_size=2 --microbatches 2
  --variants seq1f1b:8@none --steps 1 --no_profile --predict=)
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  # Exit status 1: a check failed (see attention.txt); the pallas rows then mean little.
  timeout 60 python3 -m seqpipe.tools.attention_check --budget_s 35 \
    --json "$OUT/attention.json" 2>&1 | tail -20 | tee "$OUT/attention.txt"
  # Issue 14's best case: the Triton kernel (step_cost's H200 estimate: ref@dots 1.33 s
  # against blockwise's 1.68 s, before the kernels' own compute) with 3 matmul passes.
  bench 190 accel_pallas.json --variants ref@dots,1f1b@none,seq1f1b:4@none --steps 3 \
    --predict= --config.model.attention=pallas_gpu
  # Before and after: the yardstick's steps (default remat, 0952314: 2.14, 2.60, 3.07 s).
  bench 150 accel.json --variants ref,1f1b,seq1f1b:4 --steps 3 --no_profile --predict=
  # Seq1F1B K=4 over 1F1B on 4 and 8 H200s (M=8, remat none), predicted by the bench's
  # time model from one-layer units compiled and timed here (30 of them).
  bench 120 accel_predict.json --variants=
fi
if [ "$PART" = long ] || [ "$PART" = all ]; then
  # Issue 13: gpt_1b at 32768 x 2 trains on one H200 (89 GiB peak compiled for it), then
  # the fused kernel against xla at 8192 x 8 (the reference, default remat).
  bench 100 accel_32k.json "${LONG32K[@]}" --config.model.attention=pallas_gpu
  bench 55 accel_8k_pallas.json "${LONG8K[@]}" --config.model.attention=pallas_gpu
  bench 55 accel_8k_xla.json "${LONG8K[@]}" --config.model.attention=xla
fi
if [ "$PART" = extras ] || [ "$PART" = all ]; then
  # The kernels' tiles (untuned): each tiling in attention_check.SWEEP checked, then timed.
  timeout 130 python3 -m seqpipe.tools.attention_check --sweep --budget_s 100 \
    --json "$OUT/attention_sweep.json" 2>&1 | tail -12 | tee -a "$OUT/attention.txt"
  bench 110 accel_32k_blockwise.json "${LONG32K[@]}" --config.model.attention=blockwise
  bench 150 accel_k.json --variants seq1f1b:1,seq1f1b:2,seq1f1b:8 --steps 3 --no_profile \
    --predict=
  SEQPIPE_XLA_GPU_FLAGS=0 bench 90 accel_noflags.json --variants ref --steps 3 \
    --no_profile --predict=
fi
echo "== $PART: $((SECONDS - START)) s" | tee -a "$OUT/accel.txt"
