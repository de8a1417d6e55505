#!/usr/bin/env bash
# Issue #50 item 3 on a lent GPU machine, in one call: the card's bandwidth,
# the global norm's formulations, clip + adam, and torch on the same card.
#
#   OUT=/some/folder bash benchmarks/gpu_norm.sh          # on the GPU
#   OUT=/tmp/x QUICK=1 bash benchmarks/gpu_norm.sh        # a smoke run, any machine
#
# One process per part under its own time limit; each writes $OUT/<part>.json
# and its log to $OUT/gpu_norm.log. benchmarks/results/gpu.md gives what it measured.
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
PY=${PY:-python3}
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  $PY -c "import sys, jax, jaxlib, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, jax.devices())"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tail -1
  uptime
} 2>&1 | tee "$OUT/env.txt"
for part in ${PARTS:-copy:60 norm:200 adam:120 torch:60}; do
  name=${part%%:*}
  t0=$SECONDS
  echo "=== $name" | tee -a "$OUT/gpu_norm.log"
  timeout -s INT -k 10 "${part##*:}" $PY -m benchmarks.gpu_norm --part "$name" --out "$OUT" \
    "${quick[@]}" ${HLO:+--hlo} ${FORMS:+--forms "$FORMS"} 2>&1 | tee -a "$OUT/gpu_norm.log"
  echo "=== $name: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$OUT/gpu_norm.log"
done
