"""The zoo benchmark's measurements: each model's ghost plan, each case's memory and time."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxclip
from benchmarks import _cases, _report, _timing
from workloads import zoo

METHODS = ("grad", "vmap", "ghost", "auto")


def _cases_for(model: zoo.Model, made: dict[str, Any]) -> dict[str, Any]:
  """``{method: fn(clip, params, x, y)}``; each traced case leaves its clipped-gradient
  function in ``made`` (``"auto"``'s holds what it measured)."""

  def summed_loss(params, x, y):
    return jnp.sum(jax.vmap(model.loss_fn, (None, 0, 0))(params, x, y))

  grad = jax.grad(summed_loss)
  cases = {"grad": lambda clip, params, x, y: grad(params, x, y)}
  for method in METHODS[1:]:

    def fn(clip, params, x, y, method=method):
      made[method] = jaxclip.per_example_clipped_grad(
        model.loss_fn, clip, batch_argnums=(1, 2), method=method, return_norms=True
      )
      return made[method](params, x, y)

    cases[method] = fn
  return cases


def measured_pick(fn: Any) -> dict[str, str | None]:
  """What a traced ``method="auto"`` function ran on this platform: ``{"pick", "why"}``
  (``pick`` ``None`` where it timed nothing, or ran no ghost plan)."""
  found = list(getattr(fn, "measured", {}).values())
  if not found:
    return {"pick": None, "why": "nothing measured (vmap's program: no ghost plan)"}
  (m,) = found
  return {"pick": m.pick, "why": m.why}


def plan_summary(model: zoo.Model) -> dict:
  """The fallback share and the instantiated leaves, from :func:`jaxclip.ghost_plan`, and
  ``"auto"``'s cost model's plan (each row's measured pick is in the row)."""
  if not hasattr(jaxclip, "ghost_plan"):
    return {"share": None, "fallback": [], "why": "jaxclip has no ghost_plan"}
  x, y = model.make_batch(2, 0)
  try:
    plan = jaxclip.ghost_plan(model.loss_fn, model.params, x, y, batch_argnums=(1, 2))
  except Exception as e:  # report, go on
    return {"share": None, "fallback": [], "why": f"{type(e).__name__}: {e}"[:300]}
  out = {
    "share": plan.fallback_share,
    "why": None,
    "rules": sorted({leaf.rule for leaf in plan.leaves}),
    "fallback": [
      (leaf.path, leaf.floats, leaf.reason) for leaf in plan.leaves if leaf.rule == "instantiate"
    ],
  }
  reasons = {leaf.reason for leaf in plan.leaves}
  if len(reasons) == 1 and plan.fallback_share == 1.0:  # a primitive the engine cannot read
    out["whole_loss"] = reasons.pop()
  auto = jaxclip.ghost_plan(
    model.loss_fn, model.params, x, y, batch_argnums=(1, 2), method="auto", measure=False
  )
  whole = {
    leaf.reason
    for leaf in auto.leaves
    if leaf.reason and "the loss runs as method='vmap'" in leaf.reason
  }
  out["auto"] = {
    "platform": auto.platform,
    "whole_loss": whole.pop() if whole else None,
    "chosen": [
      (leaf.path, leaf.reason)
      for leaf in auto.leaves
      if leaf.rule == "instantiate" and leaf.reason.startswith("auto on") and not whole
    ],
  }
  return out


def run_model(model: zoo.Model, batches: list[int], reps: int) -> list[dict]:
  """One row per batch size: memory, median times, ratios, checks."""
  made: dict[str, Any] = {}
  cases = _cases_for(model, made)
  rows, clip = [], None
  for b in batches:
    x, y = model.make_batch(b, 1)
    row: dict[str, Any] = {
      "model": model.name,
      "jax": jax.__version__,
      "B": b,
      "params": model.num_params(),
    }
    print(f"  {model.name} B={b} ...", flush=True)
    compiled, outputs = {}, {}
    for name, fn in cases.items():
      res = {"status": "ok", "temp_mb": None, "ms": None, "why": None}
      row[name] = res
      try:
        t0 = time.perf_counter()
        c = jax.jit(fn).lower(1.0, model.params, x, y).compile()
        res["compile_s"] = time.perf_counter() - t0
      except Exception as e:  # a method that cannot handle this model: say so, go on
        res.update(status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        continue
      res["temp_mb"] = _cases._temp_mb(c)
      compiled[name] = c
      if name == "auto":
        res.update(measured_pick(made["auto"]))
    if clip is None and "vmap" in compiled:  # the median norm of the first batch
      clip = float(np.median(np.asarray(compiled["vmap"](1.0, model.params, x, y)[2])))
    row["clip"] = clip if clip is not None else 1.0
    for name, c in compiled.items():
      outputs[name] = jax.block_until_ready(c(row["clip"], model.params, x, y))
    args = (row["clip"], model.params, x, y)
    steps = {name: (lambda s, c=c, args=args: (c(*args), s), None) for name, c in compiled.items()}
    for name, s in _timing.time_interleaved(steps, reps, warmup=1).items():
      row[name]["ms"] = 1e3 * s
    if "vmap" in outputs and "ghost" in outputs and "auto" in outputs:
      (gv, nv, normv) = outputs["vmap"]
      top = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(gv)) or 1.0
      row["check"] = {"clipped_vmap": int(nv)}
      for m in ("ghost", "auto"):
        gm, nm, normm = outputs[m]
        diff = max(
          float(jnp.max(jnp.abs(a - e)))
          for a, e in zip(jax.tree.leaves(gm), jax.tree.leaves(gv), strict=True)
        )
        row["check"].update(
          {
            f"clipped_{m}": int(nm),
            f"{m}_sum_rel_diff": diff / top,
            f"{m}_norm_rel_diff": float(jnp.max(jnp.abs(normm - normv) / normv)),
          }
        )
    for m in METHODS:
      res = row[m]
      print(
        f"    {m:5s} temp {_report._f(res['temp_mb'], '{:.1f}'):>8s} MiB  "
        f"{_report.num(res['ms']):>8s} ms  {res['why'] or ''}",
        flush=True,
      )
    rows.append(row)
  return rows
