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
import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip
from workloads import trees

MAX_NORM = 1.0


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def wall(step: Callable[[Any], tuple[Any, Any]], state: Any, reps: int, rounds: int = 5):
  """``(median seconds per call, state)``: ``reps`` calls back to back per round."""
  for _ in range(2):
    out, state = step(state)
  jax.block_until_ready((out, state))
  per = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(reps):
      out, state = step(state)
    jax.block_until_ready((out, state))
    per.append((time.perf_counter() - t0) / reps)
  return statistics.median(per), state


def _gpu_events(path: str) -> list[tuple[int, int, str]]:
  """``(start_ns, duration_ns, name)`` of every device kernel/memcpy in an xplane file."""
  from jax.profiler import ProfileData

  data = ProfileData.from_file(path)
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      events.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
  return sorted(events)


def kernels(step: Callable[[Any], tuple[Any, Any]], state: Any, calls: int = 3):
  """Per-call device kernels of ``step``: ``({count, sum_us, span_us, top}, state)``.

  ``calls`` calls are traced, 20 ms apart; the events are split into calls at
  gaps of more than 5 ms and the median call (by span) is reported.
  """
  if jax.default_backend() != "gpu":
    return None, state
  out, state = step(state)
  jax.block_until_ready((out, state))
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(calls):
      out, state = step(state)
      jax.block_until_ready((out, state))
      time.sleep(0.02)
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    events = _gpu_events(files[-1]) if files else []
  groups: list[list[tuple[int, int, str]]] = []
  for e in events:
    if groups and e[0] - (groups[-1][-1][0] + groups[-1][-1][1]) < 5_000_000:
      groups[-1].append(e)
    else:
      groups.append([e])
  if not groups:
    return {"count": 0}, state
  summary = []
  for g in groups:
    span = (max(s + d for s, d, _ in g) - g[0][0]) / 1e3
    summary.append((span, g))
  summary.sort(key=lambda t: t[0])
  span, g = summary[len(summary) // 2]
  by_name: dict[str, list[float]] = {}
  for _, dur, name in g:
    by_name.setdefault(name, []).append(dur / 1e3)
  top = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:8]
  return {
    "count": len(g),
    "sum_us": sum(d for _, d, _ in g) / 1e3,
    "span_us": span,
    "calls_seen": len(groups),
    "top": [{"name": k[:80], "n": n, "us": round(t, 2)} for t, n, k in top],
  }, state


_SINK: list[Any] = []  # (path, meta): measure() rewrites the part's JSON after every row


def measure(name, step, state, nbytes, reps, rows, ref=None, value=None):
  """Wall time and kernels of ``step``; appends a row; returns the new state."""
  t, state = wall(step, state, reps)
  k, state = kernels(step, state)
  row = {"case": name, "ms": 1e3 * t, "bytes": nbytes, "gbps": nbytes / t / 1e9}
  if k:
    row["kernels"] = k
    if k.get("sum_us"):
      row["kernel_gbps"] = nbytes / (k["sum_us"] * 1e-6) / 1e9
      row["span_gbps"] = nbytes / (k["span_us"] * 1e-6) / 1e9
  if ref is not None and value is not None:
    row["rel_err"] = abs(float(value) - ref) / ref
  rows.append(row)
  if _SINK:
    _SINK[0].write_text(json.dumps({"meta": _SINK[1], "rows": rows}, indent=1))
  k_txt = (
    ""
    if not k or "sum_us" not in k
    else (
      f" kernels {k['count']} sum {k['sum_us']:.0f}us span {k['span_us']:.0f}us "
      f"({row['kernel_gbps']:.0f}/{row['span_gbps']:.0f} GB/s)"
    )
  )
  err = f" err {row['rel_err']:.1e}" if "rel_err" in row else ""
  print(f"{name:48s} {1e3 * t:8.3f} ms {row['gbps']:7.0f} GB/s{k_txt}{err}", flush=True)
  return state


# ----------------------------------------------------------------------------
# Norm formulations over a list of leaves
# ----------------------------------------------------------------------------


def _sq(x):
  x = x.astype(jnp.float32)
  return x * x


def norm_per_leaf_stacked(leaves):
  return jnp.sqrt(jnp.sum(jnp.stack([jnp.sum(_sq(x)) for x in leaves])))


def norm_concat(leaves):
  return jnp.sqrt(jnp.sum(_sq(jnp.concatenate([jnp.ravel(x) for x in leaves]))))


def _rows(n: int, width: int) -> int:
  """The largest power of two <= ``width`` dividing ``n`` (1 if none)."""
  k = width
  while k > 1 and n % k:
    k //= 2
  return k


def norm_two_stage(leaves, width=2048):
  """Each leaf as rows of up to ``width`` entries: row sums, then one sum of them all."""
  parts = []
  for x in leaves:
    k = _rows(x.size, width)
    parts.append(jnp.sum(_sq(jnp.reshape(x, (x.size // k, k))), axis=1))
  return jnp.sqrt(jnp.sum(jnp.concatenate(parts)))


def norm_grouped(leaves, groups=4):
  """Leaves sorted by size into ``groups`` groups of similar bytes, each concatenated."""
  order = sorted(range(len(leaves)), key=lambda i: leaves[i].size)
  total = sum(x.size for x in leaves)
  parts, cur, acc = [], [], 0
  for i in order:
    cur.append(jnp.ravel(leaves[i]))
    acc += leaves[i].size
    if acc >= total * (len(parts) + 1) / groups:
      parts.append(jnp.sum(_sq(jnp.concatenate(cur) if len(cur) > 1 else cur[0])))
      cur = []
  if cur:
    parts.append(jnp.sum(_sq(jnp.concatenate(cur))))
  return jnp.sqrt(jnp.sum(jnp.stack(parts)))


def norm_vdot(leaves):
  return jnp.sqrt(sum(jnp.vdot(jnp.ravel(x), jnp.ravel(x)).astype(jnp.float32) for x in leaves))


def _pallas(**kw):
  from benchmarks import _pallas_norm

  interpret = jax.default_backend() != "gpu"

  def f(leaves):
    return jnp.sqrt(_pallas_norm.sum_of_squares(leaves, interpret=interpret, **kw))

  return f


def _norm_without(*tricks: str) -> Callable[[list[jax.Array]], jax.Array]:
  """``jaxclip.ops.global_norm`` traced without ``tricks`` (``jaxclip.platform.TRICKS``).

  The switch is read while the norm is traced, so it is opened inside the
  function that ``jax.jit`` traces.
  """

  def norm(leaves: list[jax.Array]) -> jax.Array:
    with jaxclip.platform.without(*tricks):
      return jaxclip.ops.global_norm(leaves)

  return norm


def formulations(quick: bool) -> dict[str, Callable[[list[jax.Array]], jax.Array]]:
  forms = {
    "jaxclip.ops.global_norm": lambda leaves: jaxclip.ops.global_norm(leaves),
    "optax.tree.norm": lambda leaves: optax.tree.norm(leaves),
    "per-leaf sums, stacked": norm_per_leaf_stacked,
    "one concatenated buffer": norm_concat,
    "4 groups by size, concatenated": norm_grouped,
    "rows of 2048, then one sum": norm_two_stage,
    "rows of 8192, then one sum": lambda leaves: norm_two_stage(leaves, 8192),
    "vdot per leaf": norm_vdot,
    "pallas: 1 kernel, tiles 1024x32, 4 warps": _pallas(block=1024, steps=32, num_warps=4),
    "pallas: 1 kernel, tiles 2048x16, 8 warps": _pallas(block=2048, steps=16, num_warps=8),
    # On a CUDA GPU jaxclip's global norm is its kernel; on other machines (a smoke run) the
    # plain program.
    "jaxclip's CUDA kernel (scaled tiles 1024x32)": _norm_without(),
    "jaxclip's CUDA kernel, a branch per leaf (unpacked)": _norm_without("cuda_packing"),
    "jaxclip's plain program (XLA reductions, rescue cond)": _norm_without("cuda_norm"),
    "pallas: 1 kernel, tiles 4096x8, 8 warps, 3 stages": _pallas(
      block=4096, steps=8, num_warps=8, num_stages=3
    ),
  }
  if quick:
    forms = {k: v for k, v in forms.items() if "2048x16" not in k and "4096" not in k}
  return forms


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
  measure(
    "jax: in-place scale pass, 1 GiB (r+w)",
    lambda x: ((y := scale(x, s)), y),
    x + 0,
    2 * nbytes,
    args.reps,
    rows,
  )
  copy = jax.jit(lambda x: x * 1.0 + 0.0)  # folded to a plain copy or a loop fusion
  measure(
    "jax: copy to a new buffer, 1 GiB (r+w)", lambda x: (copy(x), x), x, 2 * nbytes, args.reps, rows
  )
  loops = 10

  @jax.jit
  def scaled_loop(x, s):
    return jax.lax.fori_loop(0, loops, lambda i, y: y * s, x)

  measure(
    f"jax: {loops} scale passes in one jit, 1 GiB (r+w each)",
    lambda x: (scaled_loop(x, s), x),
    x,
    loops * 2 * nbytes,
    max(1, args.reps // 4),
    rows,
  )
  ssq = jax.jit(lambda x: jnp.sum(x * x))
  measure("jax: sum of squares (read), 1 GiB", lambda x: (ssq(x), x), x, nbytes, args.reps, rows)
  m = trees.num_params(trees.gpt2_shapes(args.shrink))
  flat = x[:m]
  measure(
    f"jax: sum of squares (read), one flat buffer of {m / 1e6:.1f}M",
    lambda y: (ssq(y), y),
    flat,
    4 * m,
    args.reps,
    rows,
  )
  two = jax.jit(lambda y: jnp.sum(jnp.sum(jnp.reshape(y * y, (-1, 256)), axis=1)))
  if m % 256 == 0:
    measure(
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
    for name, fn in formulations(args.quick).items():
      if dtype != jnp.float32 and not name.startswith(("jaxclip", "optax", "pallas: 1 kernel")):
        continue
      if args.forms and not name.startswith(tuple(args.forms.split("|"))):
        continue
      try:
        t0 = time.perf_counter()
        c = jax.jit(fn).lower(leaves).compile()
        ct = time.perf_counter() - t0
        value = c(leaves)
        measure(
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


def _clip_with(norm_fn) -> optax.GradientTransformation:
  """clip_by_global_norm with the norm computed by ``norm_fn(leaves)``."""

  def update(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    norm = norm_fn(leaves)
    scale = MAX_NORM / jnp.maximum(norm, MAX_NORM)
    return treedef.unflatten([(x * scale).astype(x.dtype) for x in leaves]), state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def part_adam(args) -> list[dict]:
  """adam alone and clip + adam: time and kernels; the extra over adam against one read."""
  rows = []
  shapes, leaves, _, nbytes = _tree(args)
  grads = trees.make_tree(shapes, seed=2)
  cases = {
    "adam": optax.adam(1e-4),
    "jaxclip.clip_by_global_norm + adam": optax.chain(
      jaxclip.clip_by_global_norm(MAX_NORM), optax.adam(1e-4)
    ),
    "optax.clip_by_global_norm + adam": optax.chain(
      optax.clip_by_global_norm(MAX_NORM), optax.adam(1e-4)
    ),
    "clip by jaxclip's plain norm (XLA, rescue cond) + adam": optax.chain(
      _clip_with(_norm_without("cuda_norm")), optax.adam(1e-4)
    ),
    "clip by the pallas norm (2048x16) + adam": optax.chain(
      _clip_with(_pallas(block=2048, steps=16, num_warps=8)), optax.adam(1e-4)
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
      measure(
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
  measure(
    "reference: jaxclip.ops.global_norm (one read)",
    lambda ls: (norm(ls), ls),
    leaves,
    nbytes,
    args.reps,
    rows,
  )
  return rows


def part_torch(args) -> list[dict]:
  """torch on the same card: copy bandwidth, foreach norm, clip_grad_norm_(foreach=True)."""
  import torch

  rows = []
  cuda = torch.cuda.is_available()
  dev = "cuda" if cuda else "cpu"

  def timed(name, fn, nbytes, reps):
    for _ in range(3):
      fn()
    if cuda:
      torch.cuda.synchronize()
      per = []
      for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
          fn()
        b.record()
        torch.cuda.synchronize()
        per.append(a.elapsed_time(b) / 1e3 / reps)
    else:
      per = []
      for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
          fn()
        per.append((time.perf_counter() - t0) / reps)
    t = statistics.median(per)
    row = {"case": name, "ms": 1e3 * t, "bytes": nbytes, "gbps": nbytes / t / 1e9}
    if cuda:
      try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
          fn()
          torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        dur = [getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) for e in evs]
        row["kernels"] = {"count": len(evs), "sum_us": sum(dur) if evs else None}
      except Exception as e:  # the profile is extra: keep the timing
        row["kernels"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    rows.append(row)
    k = row.get("kernels") or {}
    print(
      f"{name:48s} {1e3 * t:8.3f} ms {row['gbps']:7.0f} GB/s kernels {k.get('count')} "
      f"sum {k.get('sum_us')}",
      flush=True,
    )

  n = (1 << 20) if args.quick else (1 << 28)
  a = torch.randn(n, device=dev)
  b = torch.empty_like(a)
  timed("torch: copy_, 1 GiB (r+w)", lambda: b.copy_(a), 8 * n, args.reps)
  timed("torch: vector_norm (read), 1 GiB", lambda: torch.linalg.vector_norm(a), 4 * n, args.reps)
  shapes = trees.gpt2_shapes(args.shrink)
  for dname, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    if args.quick and dname != "float32":
      continue
    gen = torch.Generator(device=dev).manual_seed(0)
    params = []
    for shape in shapes.values():
      p = torch.zeros(shape, dtype=dtype, device=dev)
      p.grad = (torch.randn(shape, generator=gen, device=dev) * 1e-2).to(dtype)
      params.append(p)
    grads = [p.grad for p in params]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    timed(
      f"torch: _foreach_norm + norm of norms ({dname})",
      lambda g=grads: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g, 2)), 2),
      nbytes,
      args.reps,
    )
    timed(
      f"torch: clip_grad_norm_(foreach=True) ({dname})",
      lambda p=params: torch.nn.utils.clip_grad_norm_(p, MAX_NORM, foreach=True),
      3 * nbytes,
      args.reps,
    )
    if dname == "float32":
      for label, kw in (("foreach", {"foreach": True}), ("fused", {"fused": cuda})):
        if label == "fused" and not cuda:
          continue
        opt = torch.optim.Adam(params, lr=1e-4, **kw)
        timed(f"torch: Adam({label}=True) step", opt.step, 7 * nbytes, max(1, args.reps // 2))

        def clip_step(opt=opt, p=params):
          torch.nn.utils.clip_grad_norm_(p, MAX_NORM, foreach=True)
          opt.step()

        timed(
          f"torch: clip_grad_norm_ + Adam({label}=True) step",
          clip_step,
          7 * nbytes,
          max(1, args.reps // 2),
        )
  return rows


PARTS = {"copy": part_copy, "norm": part_norm, "adam": part_adam, "torch": part_torch}


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
  _SINK[:] = [Path(args.out) / f"{args.part}.json", meta]
  rows = PARTS[args.part](args)
  (Path(args.out) / f"{args.part}.json").write_text(
    json.dumps({"meta": meta, "rows": rows}, indent=1)
  )


if __name__ == "__main__":
  main()
