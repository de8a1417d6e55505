"""What each XLA:CPU trick of the kernel buys: with and without it, in one run.

``python -m benchmarks.tricks`` measures every trick on the row a user would
see it on (compile seconds over a tree of many leaves of mixed shapes, step
time or compiled temporary memory of a large half-precision leaf), with the
trick on and off, interleaved and repeated in one process, and writes
``benchmarks/results/tricks.md``. Each switch turns off one trick alone, by
replacing it with the plain math that GPU and TPU programs run (the values
are the same; ``check`` below asserts it for every row):

* ``bf16_barrier``: ``_platform._reductions.reduction_input`` (an optimization barrier
  before a bfloat16 norm) replaced by the identity;
* ``f16_two_output``: ``_reductions.float16_reduce`` (a two-output reduction,
  in blocks of ``_SEQUENTIAL_BLOCK``) replaced by ``plain_reduce``;
* ``stacked_scales``: the per-leaf clips' stacks of leaves of one shape
  (``_platform._stacks._by_stacks``, with ``_STACK``, ``_FLAT_STACK``) replaced by
  one scale per leaf;
* ``opaque_indices``: rows of a stack taken at opaque indices (``_STATIC_ROWS``)
  replaced by rows at constant offsets;
* ``grouped_parts``: the global norm's grouped partial sums
  (``_reductions.shares_by_group``: ``SMALL_LEAF``, ``_TINY_LEAF``, ``_GROUP``,
  ``_CHUNK_LEAVES``) replaced by one reduction per leaf;
* ``computed_once``: ``_numerics.computed_once`` (the skip and non-finite
  flags passed through one kernel) replaced by the identity;
* ``stacked_rules``: the per-tensor rules (AdaGC and its siblings) run once on
  vectors of every leaf's scalars, read back at opaque indices
  (``_per_tensor._apply_rule`` with ``on_cpu``), replaced by the rule on each
  leaf's scalars;
* ``segment_parts``: in those vectors, the small leaves' parts computed by
  one segment reduction of their concatenated terms
  (``_reductions.small_parts``, via ``share_vector``), replaced by one
  reduction per leaf.

The rows' custom JVP and custom vmap rules (``_stacks.rows``) are not
switches: without them ``jax.grad`` and ``jax.vmap`` of a stacked clip are
wrong in cost class (a full-stack update per row, a gather), which the suite
checks (tests/test_lowering.py), so they stand or fall with ``stacked_scales``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import benchmarks
import jaxclip
from benchmarks import _cases, _main, _timing
from jaxclip._kernel import _numerics, _platform
from jaxclip._kernel._platform import _reductions, _stacks
from jaxclip.transforms import _per_tensor
from workloads import trees

# ----------------------------------------------------------------------------
# The switches: each turns one trick off while the context is open.
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(module: Any, **attrs: Any) -> Iterator[None]:
  saved = {k: getattr(module, k) for k in attrs}
  for k, v in attrs.items():
    setattr(module, k, v)
  try:
    yield
  finally:
    for k, v in saved.items():
      setattr(module, k, v)


def _plain_scales(scaler, sizes, leaves, companions, operands):
  del sizes
  return _stacks._one_by_one(scaler, leaves, companions, operands)


def _plain_shares(leaves, term, op, acc, scale=None):
  fn, e = scale if scale is not None else (lambda x, e: x, None)
  return [_platform.share(fn(x, e), term, op).astype(acc) for x in leaves]


_apply_rule = _per_tensor._apply_rule


def _leaf_rule(*args, on_cpu):
  del on_cpu
  return _apply_rule(*args, on_cpu=False)


SWITCHES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
  "bf16_barrier": lambda: _patched(_platform, reduction_input=lambda x: x),
  "f16_two_output": lambda: _patched(_reductions, float16_reduce=_reductions.plain_reduce),
  "stacked_scales": lambda: _patched(_stacks, _by_stacks=_plain_scales),
  "opaque_indices": lambda: _patched(_stacks, _STATIC_ROWS=0),
  "grouped_parts": lambda: _patched(_platform, shares_by_group=_plain_shares),
  "stacked_rules": lambda: _patched(_per_tensor, _apply_rule=_leaf_rule),
  "segment_parts": lambda: _patched(
    _platform, share_vector=lambda *a: jnp.stack(_plain_shares(*a))
  ),
  "computed_once": lambda: _patched(_numerics, computed_once=lambda flag: jnp.asarray(flag)),
}

# ----------------------------------------------------------------------------
# The rows.
# ----------------------------------------------------------------------------


def _mixed_tree(leaves: int) -> dict:
  return trees.make_tree(trees.many_leaf_shapes(leaves, mixed=True))


def _clear() -> None:
  """Forgets every compiled and traced function, so each measurement compiles afresh."""
  jax.clear_caches()
  _numerics._leaf_scaler.cache_clear()
  _stacks._indexed_rows_from.cache_clear()


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
  """``reps`` interleaved with/without pairs of one row; medians, and whether values agree."""
  run = make_row()
  with_, without = [], []
  same = True
  for _ in range(reps):
    on = run()
    with SWITCHES[trick]():
      off = run()
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
