"""Compiles and times the GPT's cases of ``python -m benchmarks.ghost``, one row per ``(B, T)``."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import _cases, _ghost_cases, _model, _report, _timing


def _tree_max_abs(tree: Any) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


def _compare(vmap_out: Any, ghost_out: Any) -> dict:
  """How far ghost's clipped sum is from vmap's, and both clip counts."""
  (gv, nv), (gg, ng) = vmap_out, ghost_out
  diff = _tree_max_abs(jax.tree.map(lambda a, b: a.astype(jnp.float32) - b, gg, gv))
  return {
    "max_rel_diff": diff / max(_tree_max_abs(gv), 1e-30),
    "clipped_vmap": int(nv),
    "clipped_ghost": int(ng),
  }


def run_config(
  cfg: _model.GPTConfig,
  clip: float,
  reps: int,
  time_budget_s: float,
  max_mb: float,
  estimates: dict[str, float | None],
  timed: bool = True,
) -> dict:
  """Compile every case at ``cfg``'s batch and length, then time those within budget.

  ``estimates`` maps a method to a predicted step time in seconds (``None``:
  unknown); a case predicted above ``time_budget_s`` is not run, nor one
  whose probe step (the first call, also a warm-up) takes longer. With
  ``timed=False`` every case is compiled (its memory read) and none is run.
  """
  params = _model.init_params(cfg, seed=0)
  tokens = _model.make_tokens(cfg, seed=1)
  row: dict[str, Any] = {
    "B": cfg.batch,
    "T": cfg.seq_len,
    "params": _model.num_params(cfg),
    "clip": clip,
  }
  compiled, outputs = {}, {}
  for name, (fn, why) in _ghost_cases.make_cases(cfg, clip).items():
    res: dict[str, Any] = {"status": "n/a", "temp_mb": None, "ms": None, "why": why}
    row[name] = res
    if fn is None:
      continue
    try:
      t0 = time.perf_counter()
      c = jax.jit(fn).lower(params, tokens).compile()
      res["compile_s"] = time.perf_counter() - t0
    except Exception as e:  # a method that cannot handle this model: say so, go on
      res.update(status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
      continue
    res["temp_mb"] = _cases._temp_mb(c)
    if not timed:
      res.update(status="not run", why="memory only (--memory-only)")
      continue
    est = estimates.get(name)
    if res["temp_mb"] is not None and res["temp_mb"] > max_mb:
      res.update(status="not run", why=f"temp memory {res['temp_mb']:.4g} MiB > {max_mb:.4g} MiB")
      continue
    if est is not None and est > time_budget_s:
      res.update(
        status="not run",
        why=(
          "not timed at a smaller batch already"
          if math.isinf(est)
          else f"one step predicted at {est:.3g} s > {time_budget_s:g} s from a smaller batch"
        ),
      )
      continue
    t0 = time.perf_counter()
    outputs[name] = jax.block_until_ready(c(params, tokens))
    probe = time.perf_counter() - t0
    if probe > time_budget_s:
      res.update(status="not run", why=f"one step took {probe:.3g} s > {time_budget_s:g} s")
      continue
    res["status"] = "ok"
    compiled[name] = c
  steps = {name: (lambda s, c=c: (c(params, tokens), s), None) for name, c in compiled.items()}
  if steps:
    for name, s in _timing.time_interleaved(steps, reps, warmup=1).items():
      row[name]["ms"] = 1e3 * s
  if "vmap" in outputs:
    row["clipped_vmap"] = int(outputs["vmap"][1])
  if "vmap" in outputs and "ghost" in outputs:
    row["check"] = _compare(outputs["vmap"], outputs["ghost"])
  return row


def run(
  batches: list[int],
  seq_lens: list[int],
  model: dict,
  clip: float | None,
  reps: int,
  time_budget_s: float,
  max_mb: float,
  timed: bool = True,
) -> list[dict]:
  """One row per ``(B, T)``, the batches of each ``T`` in increasing order.

  A case's step time at the next batch is predicted proportional to the
  batch from its last one timed, so that a step far over the budget is
  never started.
  """
  rows = []
  for t in seq_lens:
    last: dict[str, tuple[int, float]] = {}
    t_clip = (
      (_ghost_cases.median_norm(_model.GPTConfig(seq_len=t, tied=True, **model)) if timed else 1.0)
      if clip is None
      else clip
    )
    for b in sorted(batches):
      estimates = {m: s * b / b0 for m, (b0, s) in last.items()}
      cfg = _model.GPTConfig(seq_len=t, batch=b, tied=True, **model)
      print(f"  B={b:4d} T={t:4d} ...", flush=True)
      row = run_config(cfg, t_clip, reps, time_budget_s, max_mb, estimates, timed)
      for m in _ghost_cases.METHODS:
        res = row[m]
        if res["ms"] is not None:
          last[m] = (b, res["ms"] / 1e3)
        elif res["status"] == "not run":
          last[m] = (b, math.inf)
        print(
          f"    {m:5s} temp {_report._f(res['temp_mb'], '{:.1f}'):>8s} MiB  "
          f"{_report._f(res['ms'], '{:.2f}') if res['status'] == 'ok' else res['status']:>8s}"
          f" ms{'  (' + res['why'] + ')' if res['why'] and res['status'] != 'ok' else ''}",
          flush=True,
        )
      rows.append(row)
  return rows
