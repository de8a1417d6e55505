#!/usr/bin/env bash
# The GPU rows of the benchmarks, in one call on a lent GPU machine.
#
# The machine's python3 has jax with CUDA, optax, chex, flax, equinox and
# torch; nothing can be installed from a registry there, so jaxclip runs from
# this checkout (PYTHONPATH) and dp-accounting comes as a wheel carried in
# .devwheels/ (`pip download --no-deps -d .devwheels dp-accounting`).
#
#   OUT=/some/folder bash benchmarks/device_run.sh          # on the GPU
#   OUT=/tmp/x QUICK=1 bash benchmarks/device_run.sh        # a smoke run, any machine
#
# Each step has its own time limit; SIGINT lets pytest and the benchmarks end
# cleanly. benchmarks/results/gpu.md gives what these steps measured on an H200 (run
# there over three calls, within a session's device time). Everything lands in $OUT: env.txt, one markdown table per benchmark,
# run.log (each step's output, the tests' included).
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)" >>"$OUT/run.log"
  timeout -s INT -k 10 "$limit" "$@" >>"$OUT/run.log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/run.log"
}

{
  nvidia-smi -L 2>&1
  $PY -c "import sys, jax, jaxlib, optax, chex; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, 'chex', chex.__version__); print(jax.devices())"
  if ls .devwheels/*.whl >/dev/null 2>&1; then
    $PY -m pip install --no-deps --no-index -q .devwheels/*.whl 2>&1 | tail -2
  fi
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# results.md's tables on this device: the clip alone against the bandwidth
# floor (and torch's clip_grad_norm_ on the same GPU), clip + adam, and the
# full GPT train step. One process per section, so that one over its limit
# leaves the others' tables.
for section in standalone:80 train:150 full-step:80; do
  name=${section%%:*}
  step "bench $name" "${section##*:}" $PY -m benchmarks --only "$name" \
    --peak-gbps "${PEAK_GBPS:-4800}" --out "$OUT/b-$name" "${quick[@]}"
  [ -f "$OUT/b-$name/results.md" ] && mv "$OUT/b-$name/results.md" "$OUT/bench-$name.md"
  rm -rf "$OUT/b-$name"
done

# Per-example clipping of the GPT: ghost norms against vmap (ghost.md's
# table). The GPU compiles of T = 128 take long: one batch size of it.
for seq in 16:"32 128 512":90 128:32:120; do
  IFS=: read -r t batches limit <<<"$seq"
  # shellcheck disable=SC2086
  step "ghost T=$t" "$limit" $PY -m benchmarks.ghost --seq "$t" --batch $batches \
    --out "$OUT/g$t" "${quick[@]}"
  [ -f "$OUT/g$t/ghost.md" ] && mv "$OUT/g$t/ghost.md" "$OUT/ghost-T$t.md"
  rm -rf "$OUT/g$t"
done

# The library's tests with the GPU as the default device: the non-CPU branch
# of every platform choice runs for real here. float32 matmuls at full
# precision (the tests compare against float64 NumPy); compiled-program
# checks of XLA:CPU (test_kernel, test_lowering) stay on the CPU machine.
XLA_FLAGS=--xla_backend_optimization_level=3 JAX_DEFAULT_MATMUL_PRECISION=highest \
  step "tests" "${TEST_LIMIT:-140}" \
  $PY -m pytest -n "${WORKERS:-8}" -q -p no:cacheprovider -m "not slow" -rfE \
  tests/test_ops.py tests/test_numerics.py tests/test_every_transform.py \
  tests/test_adaptive.py tests/test_stable.py tests/test_ghost_models.py \
  tests/test_ghost_rules.py tests/test_ghost_tied.py tests/test_ghost_conv.py \
  tests/test_ghost_scan.py tests/test_ghost_plan.py tests/test_ghost_options.py \
  tests/test_ghost_multi_device.py tests/test_privacy.py \
  tests/test_per_example.py tests/test_optax_compat.py tests/test_dp_noise.py \
  tests/test_quantile.py
grep -n "passed\|failed\|error" "$OUT/run.log" | tail -5
