"""The compile-time cases: each clip's compile seconds against the leaf count, every transform's."""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxclip
from benchmarks import _cases, _timing
from workloads import every, trees

# ----------------------------------------------------------------------------
# Compile time against the number of leaves.
# ----------------------------------------------------------------------------

COMPILE_IMPLS = (
  "tree_map x*s",
  "jaxclip.clip_by_global_norm",
  "jaxclip.clip_by_norm",
  "optax.clip_by_global_norm",
)

# Every other transform that touches each leaf, with optax's counterpart where
# it has one, compiled at the sweep's largest leaf count.
TRANSFORMS = {
  "clip_by_value": (lambda: jaxclip.clip_by_value(-1.0, 1.0), lambda: optax.clip(1.0)),
  "clip_by_average_norm": (lambda: jaxclip.clip_by_average_norm(0.01), None),
  "clip_by_block_rms": (
    lambda: jaxclip.clip_by_block_rms(1.0),
    lambda: optax.clip_by_block_rms(1.0),
  ),
  "adaptive_grad_clip": (
    lambda: jaxclip.adaptive_grad_clip(0.01),
    lambda: optax.adaptive_grad_clip(0.01),
  ),
  "zero_nonfinite": (lambda: jaxclip.zero_nonfinite(), None),
  "skip_nonfinite(identity)": (
    lambda: jaxclip.skip_nonfinite(optax.identity()),
    lambda: optax.apply_if_finite(optax.identity(), 10),
  ),
}


# Every other transform of jaxclip.__all__ (workloads/every.py), so that a
# new one is timed without anyone adding it here.
for _name in every.factories():
  if not any(k == _name or k.startswith(_name + "(") for k in TRANSFORMS):
    TRANSFORMS[_name] = (lambda n=_name: every.build(n), None)


def _make(impl: str) -> optax.GradientTransformation:
  lib, name = impl.split(".", 1)
  if name in TRANSFORMS and TRANSFORMS[name][0 if lib == "jaxclip" else 1] is not None:
    return TRANSFORMS[name][0 if lib == "jaxclip" else 1]()
  return getattr(jaxclip if lib == "jaxclip" else optax, name)(_cases.MAX_NORM)


def _reads_params(impl: str) -> bool:
  return impl.endswith(".adaptive_grad_clip")


def compile_fn(impl: str):
  """``fn(updates, s)``, or ``fn(updates, params, s)`` for a transform that reads params."""
  if impl == "tree_map x*s":
    return lambda t, s: jax.tree.map(lambda x: x * s, t)
  tx = _make(impl)
  if _reads_params(impl):
    return lambda t, p, s: tx.update(t, tx.init(p), p)[0]
  return lambda t, s: tx.update(t, tx.init(t))[0]


def compile_once(impl: str, leaves: int, mixed: bool) -> float:
  shapes = trees.many_leaf_shapes(leaves, mixed)
  args = [trees.make_tree(shapes)]
  if _reads_params(impl):
    args.append(trees.make_tree(shapes, seed=1))
  return _timing.compile_seconds(compile_fn(impl), *args, jnp.float32(0.5))


def _compile_seconds(impl: str, leaves: int, mixed: bool, timeout_s: float | None) -> float | None:
  """One compile: in a fresh process when ``timeout_s`` is set; ``None`` if it timed out."""
  if timeout_s is None:
    return compile_once(impl, leaves, mixed)
  cmd = [sys.executable, "-m", "benchmarks._compile_one", impl, str(leaves), str(int(mixed))]
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
  except subprocess.TimeoutExpired:
    return None
  return float(out.stdout.strip().splitlines()[-1])


def run_compile_sweep(
  leaf_counts: list[int],
  timeout_s: float | None,
  mixed_at: int | None,
  repeats: int = 1,
  impls: tuple[str, ...] = COMPILE_IMPLS,
  mixed_impls: tuple[str, ...] | None = None,
) -> list[dict]:
  """Seconds to compile each impl, each in a fresh process when ``timeout_s`` is set.

  Each impl is compiled ``repeats`` times, the impls in turn (so that they
  sample the same stretch of the machine's drift), and the median is kept.
  Once an impl runs past ``timeout_s`` it is not run again (reported as
  ``> timeout_s``), nor at larger leaf counts nor on the mixed tree, which
  only ``mixed_impls`` (default: all) are compiled for.
  """
  rows, given_up = [], set()
  jobs = [(n, False) for n in leaf_counts] + ([(mixed_at, True)] if mixed_at else [])
  for n, mixed in jobs:
    row: dict[str, Any] = {"leaves": n, "mixed": mixed}
    seconds: dict[str, list[float]] = {impl: [] for impl in impls}
    for impl in impls:
      if impl in given_up or (mixed and mixed_impls is not None and impl not in mixed_impls):
        row[impl] = ("not run", timeout_s)
    for _ in range(repeats):
      for impl in impls:
        if impl in row:  # timed out in an earlier repeat, or not run
          continue
        sec = _compile_seconds(impl, n, mixed, timeout_s)
        if sec is None:
          row[impl] = ("timeout", timeout_s)
          given_up.add(impl)
        else:
          seconds[impl].append(sec)
        print(
          f"  compile {impl:40s} leaves={n:5d}{' mixed' if mixed else ''}: {row.get(impl, sec)}",
          flush=True,
        )
    for impl, runs in seconds.items():
      if impl not in row:
        row[impl] = ("ok", statistics.median(runs))
    rows.append(row)
  return rows


def run_transform_compiles(
  leaves: int, timeout_s: float | None, repeats: int, mixed: bool = True
) -> list[dict]:
  """Compile seconds of every transform of :data:`TRANSFORMS` at ``leaves`` leaves.

  One row per transform, with the bare tree_map and adam's own update
  compiled in the same turns:
  ``{"transform", "leaves", "mixed", "tree_map", "adam", "jaxclip", "optax"}``, each
  time an ``(status, seconds)`` pair. optax's counterparts are compiled on
  the uniform tree only.
  """
  names = list(TRANSFORMS)
  impls = (
    ("tree_map x*s", "optax.adam")
    + tuple(f"jaxclip.{n}" for n in names)
    + tuple(f"optax.{n}" for n in names if TRANSFORMS[n][1] is not None)
  )
  sweep = run_compile_sweep(
    [leaves],
    timeout_s,
    leaves if mixed else None,
    repeats,
    impls,
    mixed_impls=impls[: len(names) + 2],
  )
  rows = []
  for r in sweep:
    for n in names:
      rows.append(
        {
          "transform": n,
          "leaves": r["leaves"],
          "mixed": r["mixed"],
          "tree_map": r["tree_map x*s"],
          "adam": r["optax.adam"],
          "jaxclip": r[f"jaxclip.{n}"],
          "optax": r.get(f"optax.{n}", ("none", None)),
        }
      )
  return rows
