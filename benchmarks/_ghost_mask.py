"""The masked Poisson case of ``python -m benchmarks.ghost --mask``: what a mask costs.

DP-SGD with Poisson sampling under ``jit`` runs on batches of a fixed
``rows`` with a mask (:func:`jaxclip.poisson_batch`). For the benchmark's GPT
(tied head) at each ``(rows, T)`` and each method (``vmap``, ``ghost``), two
jitted steps of the same shapes are timed interleaved:

* ``plain``: ``per_example_clipped_grad(...)(params, pool[:rows])``, a fixed
  batch, no mask;
* ``masked``: ``batch = poisson_batch(key, pool_size, q, rows)``, then
  ``per_example_clipped_grad(...)(params, pool[batch.indices],
  example_mask=batch.mask)``, with ``q`` set so that about 80% of the rows
  are real; a fresh key each step.

Both do the same model work (the masked rows are evaluated on a stand-in and
dropped), so the mask's cost is the draw, the gather and the row replacement.
Reported per case: the median time of each, the median of the per-round
ratios ``masked / plain`` (one round times both back to back) with its
interquartile range, and the compiled temporary memory of each. Written to
``ghost_mask.md`` in ``--out``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jaxlib

import jaxclip
from benchmarks import _main, _model, _timing

SIZES = ((128, 16), (32, 128))
QUICK_SIZES = ((8, 8),)
REAL_FRACTION = 0.8  # expected share of real rows: q * pool = 0.8 * rows
POOL = 4  # the dataset holds POOL * rows sequences


def _temp_mib(fn, *args) -> float:
  analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
  return analysis.temp_size_in_bytes / 2**20


def run_case(model: dict, rows: int, seq: int, method: str, clip: float, reps: int) -> dict:
  cfg = _model.GPTConfig(seq_len=seq, batch=POOL * rows, tied=True, **model)
  params = _model.init_params(cfg, seed=0)
  pool = _model.make_tokens(cfg, seed=1)
  q = REAL_FRACTION * rows / pool.shape[0]

  def loss_fn(p, tokens):
    return _model.loss_fn(p, tokens, cfg)

  fn = jaxclip.per_example_clipped_grad(loss_fn, clip, method=method)

  def plain(p, key):
    return fn(p, pool[:rows]), jax.random.split(key)[0]

  def masked(p, key):
    key, sub = jax.random.split(key)
    batch = jaxclip.poisson_batch(sub, pool.shape[0], q, rows)
    return fn(p, pool[batch.indices], example_mask=batch.mask), key

  key = jax.random.key(2)
  mem = {"plain": _temp_mib(plain, params, key), "masked": _temp_mib(masked, params, key)}
  jitted = {"plain": jax.jit(plain), "masked": jax.jit(masked)}
  steps = {name: (lambda k, f=f: f(params, k), key) for name, f in jitted.items()}
  samples = _timing.interleaved_samples(steps, reps)
  ratios = sorted(m / p for m, p in zip(samples["masked"], samples["plain"], strict=True))
  quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
  return {
    "rows": rows,
    "T": seq,
    "method": method,
    "plain_ms": 1e3 * statistics.median(samples["plain"]),
    "masked_ms": 1e3 * statistics.median(samples["masked"]),
    "ratio": statistics.median(ratios),
    "q1": quartiles[0],
    "q3": quartiles[-1],
    "plain_mib": mem["plain"],
    "masked_mib": mem["masked"],
  }


def table(rows: list[dict]) -> str:
  lines = [
    "| rows | T | method | plain ms | masked ms | masked / plain time (median, IQR) "
    "| plain MiB | masked MiB |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['rows']} | {r['T']} | {r['method']} | {r['plain_ms']:.1f} | "
      f"{r['masked_ms']:.1f} | {r['ratio']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) | "
      f"{r['plain_mib']:.1f} | {r['masked_mib']:.1f} |"
    )
  return "\n".join(lines)


def main(out: Path, quick: bool, model: dict, reps: int, clip: float | None) -> str:
  """Runs every case, prints the table and writes ``out / 'ghost_mask.md'``."""
  sizes = QUICK_SIZES if quick else SIZES
  start = time.perf_counter()
  load = " ".join(f"{x:.2f}" for x in os.getloadavg())
  results = []
  for rows, seq in sizes:
    for method in ("vmap", "ghost"):
      results.append(run_case(model, rows, seq, method, 1.0 if clip is None else clip, reps))
      print(table(results[-1:]).splitlines()[-1], flush=True)
  device = jax.devices()[0]
  text = "\n".join(
    [
      "# The cost of a mask: masked Poisson batches against plain ones",
      "",
      "Written by `python -m benchmarks.ghost --mask` (see `benchmarks/_ghost_mask.py`).",
      "",
      f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
      f"- machine: {_main._cpu_name()}, {os.cpu_count()} cores; jax device: {device.platform}; "
      f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {platform.python_version()}",
      f"- load average (1, 5, 15 min) at start: {load}",
      f"- model: benchmarks/_model.py GPT, tied head, {model}; pool of {POOL} x rows "
      f"sequences, sampling rate {REAL_FRACTION} x rows / pool; {reps} timed rounds per case",
      f"- total time: {time.perf_counter() - start:.0f} s",
      "",
      table(results),
      "",
    ]
  )
  out.mkdir(parents=True, exist_ok=True)
  (out / "ghost_mask.md").write_text(text)
  print(text)
  return text
