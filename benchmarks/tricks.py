"""What the XLA:CPU platform tricks buy: compile time with and without, in one run.

``python -m benchmarks.tricks`` compiles a transform's ``update`` over a tree of
many small leaves with each switch on and off, interleaved and repeated, and
writes ``benchmarks/tricks.md``. The switches monkeypatch the kernel:

* ``platform``: every ``_platform.on_cpu`` choice (stacked per-leaf clips,
  opaque indices, custom_vmap rows, float16 two-output reductions, bfloat16
  barriers, sequential blocks) replaced by its ``default`` branch, the one
  GPU and TPU programs run;
* ``computed_once``: ``_numerics.computed_once`` replaced by the identity.
"""

from __future__ import annotations

import os
import statistics
import sys

import jax
import jax.numpy as jnp

import jaxclip
from benchmarks import _timing
from jaxclip._kernel import _numerics, _platform

_ON_CPU = _platform.on_cpu
_ONCE = _numerics.computed_once


def _switch(name: str, on: bool) -> None:
  if name == "platform":
    _platform.on_cpu = _ON_CPU if on else (lambda cpu, default, *args: default(*args))
  elif name == "computed_once":
    _numerics.computed_once = _ONCE if on else (lambda flag: jnp.asarray(flag))


def _tree(leaves: int) -> dict:
  shapes = [(64,), (32, 16), (128,), (8, 8)]
  return {f"p{i}": jnp.ones(shapes[i % 4], jnp.float32) for i in range(leaves)}


_ROWS = {
  "platform": [
    ("clip_by_norm", lambda: jaxclip.clip_by_norm(1.0)),
    ("adaptive_grad_clip", lambda: jaxclip.adaptive_grad_clip(0.1)),
  ],
  "computed_once": [("adagc", lambda: jaxclip.adagc())],
}


def _compile(make, tree) -> float:
  jax.clear_caches()
  _numerics._leaf_scaler.cache_clear()
  tx = make()
  state = tx.init(tree)
  return _timing.compile_seconds(lambda u, s: tx.update(u, s, tree), tree, state)


def main(leaves: int = 400, reps: int = 3) -> str:
  tree = _tree(leaves)
  lines = [
    "# What each XLA:CPU trick buys",
    "",
    f"Compile seconds of `update` over {leaves} small float32 leaves, median of {reps} "
    "interleaved with/without pairs, one process; "
    f"machine: {os.cpu_count()}-core VM, CPU only, load {os.getloadavg()[0]:.1f} at the end "
    "(other engineers' jobs ran alongside).",
    "",
    "| trick | row | with (s) | without (s) | ratio | kept? |",
    "|---|---|---|---|---|---|",
  ]
  for trick, rows in _ROWS.items():
    for row, make in rows:
      with_, without = [], []
      for _ in range(reps):
        _switch(trick, True)
        with_.append(_compile(make, tree))
        _switch(trick, False)
        without.append(_compile(make, tree))
        _switch(trick, True)
      w, wo = statistics.median(with_), statistics.median(without)
      kept = "kept" if wo / w >= 1.2 else "below 1.2x on this row"
      cells = [trick, f"{row}, {leaves} leaves", f"{w:.2f}", f"{wo:.2f}", f"{wo / w:.2f}", kept]
      lines.append("| " + " | ".join(cells) + " |")
      print(lines[-1], flush=True)
  text = "\n".join(lines) + "\n"
  return text


if __name__ == "__main__":
  n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
  out = main(n)
  with open(os.path.join(os.path.dirname(__file__), "tricks.md"), "w") as f:
    f.write(out)
