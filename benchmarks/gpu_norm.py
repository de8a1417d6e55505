"""The global norm on a GPU: the card's copy bandwidth, formulations of the norm, clip + adam.

Issue #50, item 3. One process per part (``--part``), each writing
``<out>/<part>.json``; ``benchmarks/gpu_norm.sh`` runs them all in one call
on a lent GPU machine and :func:`markdown` turns the JSON into the tables of
``benchmarks/results/gpu.md``.

How it times (the old standalone table timed one call at a time from the
host, so the host's dispatch and synchronisation were inside each figure):

* ``wall``: ``reps`` calls dispatched back to back with no synchronisation
  between them, then one ``block_until_ready``; the mean per call, median of
  ``rounds`` such runs. JAX dispatches asynchronously, so once the queue is
  full the host's overhead hides behind the device's work.
* ``kernels``: one call under ``jax.profiler``: the number of device kernels
  it launched, the sum of their durations and the span from the first
  kernel's start to the last one's end (device-side; no host in it).
* torch: CUDA events around ``reps`` back-to-back calls, and
  ``torch.profiler`` for its kernels.

Bandwidth is bytes over time, bytes counted as the fewest the operation must
move (a norm reads every gradient once; a copy reads and writes).

jaxclip's own forms are its public ``jaxclip.ops.global_norm`` (on a CUDA GPU
its Pallas kernel), and the same traced without one of its CUDA tricks:
``jaxclip.platform.without("cuda_norm")`` (XLA's reductions and the rescue's
``lax.cond``) or ``without("cuda_packing")`` (a kernel branch per leaf).

  python -m benchmarks.gpu_norm --part norm --out /tmp/g --quick   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip
from benchmarks import _gpu_forms, _gpu_timing, _gpu_torch
from workloads import trees

# ----------------------------------------------------------------------------
# Parts
# ----------------------------------------------------------------------------


def part_copy(args) -> list[dict]:
  """The card's bandwidth through JAX: copies, scale passes and reads of one big buffer."""
  rows = []
  n = (1 << 20) if args.quick else (1 << 28)  # 1 GiB of float32
  x = jnp.asarray(np.random.default_rng(0).standard_normal(n, np.float32))
  nbytes = 4 * n
  scale = jax.jit(lambda x, s: x * s, donate_argnums=0)
  s = jnp.float32(0.999)
  _gpu_timing.measure(
    "jax: in-place scale pass, 1 GiB (r+w)",
    lambda x: ((y := scale(x, s)), y),
    x + 0,
    2 * nbytes,
    args.reps,
    rows,
  )
  copy = jax.jit(lambda x: x * 1.0 + 0.0)  # folded to a plain copy or a loop fusion
  _gpu_timing.measure(
    "jax: copy to a new buffer, 1 GiB (r+w)", lambda x: (copy(x), x), x, 2 * nbytes, args.reps, rows
  )
  loops = 10

  @jax.jit
  def scaled_loop(x, s):
    return jax.lax.fori_loop(0, loops, lambda i, y: y * s, x)

  _gpu_timing.measure(
    f"jax: {loops} scale passes in one jit, 1 GiB (r+w each)",
    lambda x: (scaled_loop(x, s), x),
    x,
    loops * 2 * nbytes,
    max(1, args.reps // 4),
    rows,
  )
  ssq = jax.jit(lambda x: jnp.sum(x * x))
  _gpu_timing.measure(
    "jax: sum of squares (read), 1 GiB", lambda x: (ssq(x), x), x, nbytes, args.reps, rows
  )
  m = trees.num_params(trees.gpt2_shapes(args.shrink))
  flat = x[:m]
  _gpu_timing.measure(
    f"jax: sum of squares (read), one flat buffer of {m / 1e6:.1f}M",
    lambda y: (ssq(y), y),
    flat,
    4 * m,
    args.reps,
    rows,
  )
  two = jax.jit(lambda y: jnp.sum(jnp.sum(jnp.reshape(y * y, (-1, 256)), axis=1)))
  if m % 256 == 0:
    _gpu_timing.measure(
      f"jax: rows of 256 then one sum (read), {m / 1e6:.1f}M",
      lambda y: (two(y), y),
      flat,
      4 * m,
      args.reps,
      rows,
    )
  return rows


def _tree(args, dtype=jnp.float32):
  shapes = trees.gpt2_shapes(args.shrink)
  tree = trees.make_tree(shapes, dtype, seed=3)
  leaves = jax.tree.leaves(tree)
  ref = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in leaves))
  nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
  return shapes, leaves, ref, nbytes


def part_norm(args) -> list[dict]:
  rows = []
  dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
  for dtype in dtypes[:1] if args.quick else dtypes:
    _, leaves, ref, nbytes = _tree(args, dtype)
    dname = jnp.dtype(dtype).name
    print(f"-- {len(leaves)} leaves, {nbytes / 2**20:.0f} MiB of {dname}", flush=True)
    for name, fn in _gpu_forms.formulations(args.quick).items():
      if dtype != jnp.float32 and not name.startswith(("jaxclip", "optax", "pallas: 1 kernel")):
        continue
      if args.forms and not name.startswith(tuple(args.forms.split("|"))):
        continue
      try:
        t0 = time.perf_counter()
        c = jax.jit(fn).lower(leaves).compile()
        ct = time.perf_counter() - t0
        value = c(leaves)
        _gpu_timing.measure(
          f"{name} ({dname})",
          lambda ls, c=c: (c(ls), ls),
          leaves,
          nbytes,
          args.reps,
          rows,
          ref=ref,
          value=value,
        )
        rows[-1]["compile_s"] = ct
        print(f"  compiled in {ct:.1f} s", flush=True)
        if args.hlo and jax.default_backend() == "gpu":
          (Path(args.out) / f"hlo_{len(rows):02d}.txt").write_text(c.as_text())
      except Exception as e:  # report and go on
        print(f"{name} ({dname}): FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        rows.append({"case": f"{name} ({dname})", "error": f"{type(e).__name__}: {str(e)[:300]}"})
  return rows


def part_adam(args) -> list[dict]:
  """adam alone and clip + adam: time and kernels; the extra over adam against one read."""
  rows = []
  shapes, leaves, _, nbytes = _tree(args)
  grads = trees.make_tree(shapes, seed=2)
  cases = {
    "adam": optax.adam(1e-4),
    "jaxclip.clip_by_global_norm + adam": optax.chain(
      jaxclip.clip_by_global_norm(_gpu_forms.MAX_NORM), optax.adam(1e-4)
    ),
    "optax.clip_by_global_norm + adam": optax.chain(
      optax.clip_by_global_norm(_gpu_forms.MAX_NORM), optax.adam(1e-4)
    ),
    "clip by jaxclip's plain norm (XLA, rescue cond) + adam": optax.chain(
      _gpu_forms._clip_with(_gpu_forms._norm_without("cuda_norm")), optax.adam(1e-4)
    ),
    "clip by the pallas norm (2048x16) + adam": optax.chain(
      _gpu_forms._clip_with(_gpu_forms._pallas(block=2048, steps=16, num_warps=8)), optax.adam(1e-4)
    ),
    "optax.scale(0.5) + adam (control: scale, no norm)": optax.chain(
      optax.scale(0.5), optax.adam(1e-4)
    ),
  }
  # adam's fewest bytes: read g, p, m, v; write p, m, v (7 passes over the tree).
  for name, tx in cases.items():
    try:
      params = trees.make_tree(shapes, seed=1)
      compiled, opt_state = trees.compile_train_step(tx, params, grads)
      _gpu_timing.measure(
        name,
        lambda s, c=compiled: ((y := c(*s, grads)), y),
        (params, opt_state),
        7 * nbytes,
        args.reps,
        rows,
      )
    except Exception as e:
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      rows.append({"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
  norm = jax.jit(lambda ls: jaxclip.ops.global_norm(ls)).lower(leaves).compile()
  _gpu_timing.measure(
    "reference: jaxclip.ops.global_norm (one read)",
    lambda ls: (norm(ls), ls),
    leaves,
    nbytes,
    args.reps,
    rows,
  )
  return rows


PARTS = {"copy": part_copy, "norm": part_norm, "adam": part_adam, "torch": _gpu_torch.part_torch}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--part", choices=sorted(PARTS), required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--quick", action="store_true", help="small sizes, a smoke run on any machine")
  p.add_argument("--reps", type=int, default=None)
  p.add_argument("--hlo", action="store_true", help="write each norm's optimised HLO")
  p.add_argument("--dtypes", default="float32,bfloat16", help="norm part: leaf dtypes")
  p.add_argument("--forms", default="", help="norm part: only these name prefixes (separated by |)")
  args = p.parse_args(argv)
  args.shrink = 16 if args.quick else 1
  args.reps = args.reps or (3 if args.quick else 20)
  Path(args.out).mkdir(parents=True, exist_ok=True)
  meta = {
    "part": args.part,
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "python": sys.version.split()[0],
    "jax": jax.__version__,
    "optax": optax.__version__,
    "device": str(jax.devices()[0].device_kind),
    "load": os.getloadavg(),
  }
  print(json.dumps(meta), flush=True)
  _gpu_timing._SINK[:] = [Path(args.out) / f"{args.part}.json", meta]
  rows = PARTS[args.part](args)
  (Path(args.out) / f"{args.part}.json").write_text(
    json.dumps({"meta": meta, "rows": rows}, indent=1)
  )


if __name__ == "__main__":
  main()
