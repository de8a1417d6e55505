"""What each XLA:CPU trick of the kernel buys: with and without it, in one run.

``python -m benchmarks.tricks`` measures every trick on the row a user would
see it on (compile seconds over a tree of many leaves of mixed shapes, step
time or compiled temporary memory of a large half-precision leaf), with the
trick on and off, interleaved and repeated in one process, and writes
``benchmarks/results/tricks.md``. Each trick is switched off alone by
``jaxclip.platform.without(name)`` (``jaxclip.platform.TRICKS`` names and
describes them), under which jaxclip traces the plain math that GPU and TPU
programs run in its place (the values are the same; ``check`` below asserts
it for every row):

* ``bf16_barrier``: no optimization barrier before a bfloat16 norm;
* ``f16_two_output``: a float16 norm by the plain reduction, not a
  two-output reduction in blocks;
* ``stacked_scales``: the per-leaf clips scale each leaf on its own, not
  stacks of the small leaves of one shape;
* ``opaque_indices``: a stack's rows read at constant offsets, not at
  opaque indices;
* ``grouped_parts``: the global norm by one reduction per leaf, not by
  grouped partial sums of the small leaves;
* ``computed_once``: the skip and non-finite flags inline in every leaf's
  kernel, not computed once;
* ``stacked_rules``: the per-tensor rules (AdaGC and its siblings) on each
  leaf's scalars, not once on vectors of every leaf's scalars read back at
  opaque indices;
* ``segment_parts``: in those vectors, one reduction per small leaf, not one
  segment reduction of their concatenated terms.

The two CUDA tricks (``cuda_norm``, ``cuda_packing``) are measured on a GPU
by ``benchmarks/gpu_norm.py``. The stacks' custom JVP and custom vmap rules
are not switches: without them ``jax.grad`` and ``jax.vmap`` of a stacked
clip are wrong in cost class (a full-stack update per row, a gather), which
the suite checks (tests/test_lowering.py), so they stand or fall with
``stacked_scales``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import benchmarks
import jaxclip
from benchmarks import _cases, _main, _timing
from workloads import trees

# ----------------------------------------------------------------------------
# The switches: each turns one trick off while the context is open.
# ----------------------------------------------------------------------------


# The CPU tricks, in the order of the table; each row's switch is jaxclip.platform.without(name).
CPU_TRICKS = (
  "bf16_barrier",
  "f16_two_output",
  "stacked_scales",
  "opaque_indices",
  "grouped_parts",
  "stacked_rules",
  "segment_parts",
  "computed_once",
)
SWITCHES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
  name: functools.partial(jaxclip.platform.without, name) for name in CPU_TRICKS
}

# ----------------------------------------------------------------------------
# The rows.
# ----------------------------------------------------------------------------


def _mixed_tree(leaves: int) -> dict:
  return trees.make_tree(trees.many_leaf_shapes(leaves, mixed=True))


def _clear() -> None:
  """Forgets every compiled and traced function, so each measurement compiles afresh."""
  jax.clear_caches()


def _update_fn(make: Callable[[], Any], tree: Any) -> tuple[Callable, Any]:
  tx = make()
  return (lambda u, s: tx.update(u, s, tree)), tx.init(tree)


def compile_row(make: Callable[[], Any], leaves: int, uniform: bool = False) -> Callable[[], dict]:
  """Seconds to trace, lower and compile ``update`` over ``leaves`` mixed (or (64,)) leaves."""
  tree = {f"p{i}": jnp.ones((64,)) for i in range(leaves)} if uniform else _mixed_tree(leaves)

  def measure() -> dict:
    _clear()
    fn, state = _update_fn(make, tree)
    cpu0, t0 = time.process_time(), time.perf_counter()
    compiled = jax.jit(fn).lower(tree, state).compile()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out = compiled(tree, state)
    return {"value": wall, "cpu": cpu, "out": out}

  return measure


def step_row(make: Callable[[], Any], shape: tuple[int, ...], dtype: Any) -> Callable[[], dict]:
  """Median step time (ms) of ``update`` on one leaf, and its compiled temporary memory."""
  tree = {"w": jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)}

  def measure() -> dict:
    _clear()
    fn, state = _update_fn(make, tree)
    compiled = jax.jit(fn).lower(tree, state).compile()
    step = (lambda s: (compiled(tree, s)[0], s), state)
    seconds = _timing.time_interleaved({"x": step}, 10, warmup=2)["x"]
    return {
      "value": 1e3 * seconds,
      "temp_mb": _cases._temp_mb(compiled),
      "out": compiled(tree, state),
    }

  return measure


_BIG = (2048, 2048)  # 4M entries
ROWS: dict[str, list[tuple[str, str, Callable[[], Callable[[], dict]]]]] = {
  "bf16_barrier": [
    (
      "clip_by_global_norm step, one 4M-entry bfloat16 leaf",
      "ms",
      lambda: step_row(lambda: jaxclip.clip_by_global_norm(1.0), _BIG, jnp.bfloat16),
    ),
  ],
  "f16_two_output": [
    (
      "clip_by_global_norm step, one 4M-entry float16 leaf",
      "ms",
      lambda: step_row(lambda: jaxclip.clip_by_global_norm(1.0), _BIG, jnp.float16),
    ),
  ],
  "stacked_scales": [
    ("clip_by_norm compile, 400 mixed leaves", "s", lambda: compile_row(_clip_by_norm, 400)),
    (
      "adaptive_grad_clip compile, 400 mixed leaves",
      "s",
      lambda: compile_row(lambda: jaxclip.adaptive_grad_clip(0.1), 400),
    ),
  ],
  "opaque_indices": [
    ("clip_by_norm compile, 400 mixed leaves", "s", lambda: compile_row(_clip_by_norm, 400)),
  ],
  "stacked_rules": [
    ("adagc compile, 400 mixed leaves", "s", lambda: compile_row(lambda: jaxclip.adagc(), 400)),
    (
      "adaptive_norm_scale compile, 400 mixed leaves",
      "s",
      lambda: compile_row(lambda: jaxclip.adaptive_norm_scale(), 400),
    ),
  ],
  "segment_parts": [
    ("adagc compile, 400 mixed leaves", "s", lambda: compile_row(lambda: jaxclip.adagc(), 400)),
    (
      "adaptive_value_clip compile, 400 mixed leaves",
      "s",
      lambda: compile_row(lambda: jaxclip.adaptive_value_clip(), 400),
    ),
  ],
  "grouped_parts": [
    (
      "clip_by_global_norm compile, 400 mixed leaves",
      "s",
      lambda: compile_row(lambda: jaxclip.clip_by_global_norm(1.0), 400),
    ),
  ],
  "computed_once": [
    (
      "skip_nonfinite(sgd) compile, 1000 leaves of 64",
      "s",
      lambda: compile_row(lambda: jaxclip.skip_nonfinite(optax.sgd(0.1)), 1000, uniform=True),
    ),
  ],
}


def _clip_by_norm():
  return jaxclip.clip_by_norm(1.0)


def _same(a: Any, b: Any) -> bool:
  return all(
    np.allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-2, atol=1e-6)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def measure(trick: str, make_row: Callable[[], Callable[[], dict]], reps: int) -> dict:
  """``reps`` interleaved with/without pairs of one row; medians, and whether values agree.

  The pair's order turns each round (with first, then without first), so
  that neither side always runs on a process the other has just warmed.
  """
  run = make_row()

  def run_off() -> dict:
    with SWITCHES[trick]():
      return run()

  with_, without = [], []
  same = True
  for i in range(reps):
    if i % 2:
      off, on = run_off(), run()
    else:
      on, off = run(), run_off()
    same &= _same(on["out"], off["out"])
    with_.append(on)
    without.append(off)
  out = {
    "with": statistics.median(r["value"] for r in with_),
    "without": statistics.median(r["value"] for r in without),
    "same": same,
  }
  for key in ("cpu", "temp_mb"):
    if key in with_[0] and with_[0][key] is not None:
      out[key] = (
        statistics.median(r[key] for r in with_),
        statistics.median(r[key] for r in without),
      )
  return out


KEEP_AT = 1.2  # the bar: a trick stays if it buys this much on some row


def _memory_ratio(r: dict) -> float:
  """Temporary memory without / with the trick, each plus 1 MiB (so that 0 MiB divides)."""
  if "temp_mb" not in r:
    return 0.0
  with_mb, without_mb = r["temp_mb"]
  return (without_mb + 1.0) / (with_mb + 1.0)


def main(argv: list[str] | None = None) -> str:
  p = argparse.ArgumentParser(
    prog="python -m benchmarks.tricks", description=__doc__.split("\n", 1)[0]
  )
  p.add_argument("--reps", type=int, default=3, help="with/without pairs per row (default 3)")
  p.add_argument("--only", nargs="+", default=None, choices=sorted(SWITCHES))
  p.add_argument("--out", default=os.path.join(benchmarks.RESULTS, "tricks.md"))
  args = p.parse_args(argv)
  load0 = os.getloadavg()[0]
  results = []
  for trick, rows in ROWS.items():
    if args.only and trick not in args.only:
      continue
    for label, unit, make_row in rows:
      r = measure(trick, make_row, args.reps)
      results.append((trick, label, unit, r))
      print(trick, label, r, flush=True)
  best: dict[str, float] = {}
  for trick, _, _, r in results:
    best[trick] = max(best.get(trick, 0.0), r["without"] / r["with"], _memory_ratio(r))
  lines = [
    f"`python -m benchmarks.tricks` ({args.reps} interleaved with/without pairs per row, "
    f"medians; one process). Machine: {_main._cpu_name()}, {os.cpu_count()} cores, jax "
    f"{jax.__version__}; load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at "
    f"the end. A trick is kept if it buys at least {KEEP_AT}x (`without / with`) on one of "
    "its rows, in time or in temporary memory (`(without + 1 MiB) / (with + 1 MiB)`); "
    "`below`: less on every row. `same values`: the outputs with and without agree.",
    "",
    "| trick | row | with | without | without / with | CPU s with / without | "
    "temp MiB with / without | same values | kept? |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for trick, label, unit, r in results:
    cpu = "{:.2f} / {:.2f}".format(*r["cpu"]) if "cpu" in r else "-"
    mem = "{:.3g} / {:.3g}".format(*r["temp_mb"]) if "temp_mb" in r else "-"
    kept = "kept" if best[trick] >= KEEP_AT else "below"
    lines.append(
      f"| {trick} | {label} | {r['with']:.3g} {unit} | {r['without']:.3g} {unit} | "
      f"{r['without'] / r['with']:.2f} | {cpu} | {mem} | {'yes' if r['same'] else 'NO'} | "
      f"{kept} |"
    )
  text = "\n".join(["# What each XLA:CPU trick buys", "", *lines]) + "\n"
  with open(args.out, "w") as f:
    f.write(text)
  print(text)
  return text


if __name__ == "__main__":
  main()
