"""Eager calls (no ``jax.jit``): each clip's ``update`` against optax's, called again and again.

Notebooks and first experiments call a transform's ``update`` eagerly. jax
then runs it op by op and compiles each op the first time it sees its shapes;
later calls reuse those kernels. This script times, side by side in one
process, the first call and the median of the next 20 of each jaxclip clip
and of its optax counterpart, on GPT-2 small's tree shrunk 8 times per
dimension (148 float32 leaves).

Usage (from the repo root)::

  python -m benchmarks.eager

Prints one row per transform: first call, median later call, and the later
call as a multiple of optax's.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import jax
import optax

import jaxclip
from workloads import trees

Factory = Callable[[], optax.GradientTransformation]
# Each jaxclip clip and its optax counterpart (None: optax has none).
CASES: dict[str, tuple[Factory, Factory | None]] = {
  "clip_by_global_norm": (
    lambda: jaxclip.clip_by_global_norm(1.0),
    lambda: optax.clip_by_global_norm(1.0),
  ),
  "clip_by_norm": (lambda: jaxclip.clip_by_norm(1.0), None),
  "clip_by_block_rms": (
    lambda: jaxclip.clip_by_block_rms(1.0),
    lambda: optax.clip_by_block_rms(1.0),
  ),
  "adaptive_grad_clip": (
    lambda: jaxclip.adaptive_grad_clip(0.1),
    lambda: optax.adaptive_grad_clip(0.1),
  ),
  "clip_by_value": (lambda: jaxclip.clip_by_value(-1.0, 1.0), None),
}


def timed(tx: optax.GradientTransformation, grads: dict, calls: int = 20) -> tuple[float, float]:
  """The first eager call's seconds and the median of the next ``calls``."""
  state = tx.init(grads)
  start = time.perf_counter()
  jax.block_until_ready(tx.update(grads, state, grads))
  first = time.perf_counter() - start
  later = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(tx.update(grads, state, grads))
    later.append(time.perf_counter() - start)
  return first, statistics.median(later)


def main() -> None:
  grads = trees.make_tree(trees.gpt2_shapes(shrink=8))
  print(f"{len(grads)} leaves, {sum(x.size for x in grads.values()):,} float32 entries")
  print("| transform | jaxclip first | jaxclip later | optax first | optax later | later / optax |")
  print("|---|---:|---:|---:|---:|---:|")
  for name, (make, counterpart) in CASES.items():
    first, later = timed(make(), grads)
    row = f"| {name} | {first * 1e3:.0f} ms | {later * 1e3:.1f} ms |"
    if counterpart:
      o_first, o_later = timed(counterpart(), grads)
      row += f" {o_first * 1e3:.0f} ms | {o_later * 1e3:.1f} ms | {later / o_later:.2f}x |"
    else:
      row += " | | |"
    print(row, flush=True)
  load = open("/proc/loadavg").read().split()[:3] if sys.platform == "linux" else "?"
  print(f"jax {jax.__version__}, optax {optax.__version__}, load {load}")


if __name__ == "__main__":
  main()
