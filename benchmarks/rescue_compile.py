"""Compile and step time of a per-leaf clip over 480 leaves of distinct shapes.

The overflow rescue of the per-leaf clips (``jaxclip/_kernel/_numerics/``) is
a ``lax.cond`` branch compiled with every step. Leaves of a shape of their own
are not stacked, so how the branch treats them decides the compile time.

Usage (from the repo root; one process per run, so that nothing is cached)::

  python benchmarks/rescue_compile.py mid tiny

``mid``: 480 float32 leaves of 1,200-1,900 entries; ``tiny``: 480 of 4-27
entries; every other leaf 2-D. Prints trace + lower seconds, XLA compile
seconds, the compiled program's fusions (kernels), the median of 30 steps,
and whether the clip of a tree holding an entry of 3e30 per leaf is finite.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxclip

TREES = {"mid": (1200, 1900), "tiny": (4, 27)}


def tree(low: int, high: int, n: int = 480, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  out = {}
  for i in range(n):
    size = int(rng.integers(low, high + 1))
    shape = (size,)
    if i % 2 and size >= 8:
      rows = int(rng.integers(2, 8))
      shape = (rows, size // rows)
    out[f"l{i:03d}"] = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return out


def measure(name: str, g: dict) -> None:
  tx = jaxclip.clip_by_norm(1.0)
  state = tx.init(g)
  fn = jax.jit(lambda g, s: tx.update(g, s)[0])
  start = time.perf_counter()
  lowered = fn.lower(g, state)
  lower = time.perf_counter() - start
  compiled = lowered.compile()
  total = time.perf_counter() - start
  kernels = compiled.as_text().count(" fusion(")
  jax.block_until_ready(compiled(g, state))
  times = []
  for _ in range(30):
    start = time.perf_counter()
    jax.block_until_ready(compiled(g, state))
    times.append(time.perf_counter() - start)
  big = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(3e30), g)
  finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(compiled(big, state)))
  print(
    f"{name}: trace + lower {lower:.2f} s, compile {total - lower:.2f} s, {kernels} fusions, "
    f"step {1e3 * float(np.median(times)):.2f} ms, finite with 3e30 entries: {finite}",
    flush=True,
  )


def main(which: list[str]) -> None:
  for name in which or list(TREES):
    measure(f"clip_by_norm, {name}", tree(*TREES[name]))
  load = open("/proc/loadavg").read().split()[:3] if sys.platform == "linux" else "?"
  print(f"jax {jax.__version__}, jaxclip from {jaxclip.__file__}, load {load}")


if __name__ == "__main__":
  main(sys.argv[1:])
