"""Ghost norms on the model zoo: ``python -m benchmarks.ghost --zoo``.

For each model of :mod:`benchmarks._zoo` (at its ``"bench"`` size) and each
batch size ``B``, three ways to get one step's gradient, each jitted and
compiled on its own:

* ``grad``: the non-private gradient, ``jax.grad`` of the summed per-example
  losses (the baseline);
* ``vmap`` and ``ghost``: ``jaxclip.per_example_clipped_grad(loss_fn, clip,
  batch_argnums=(1, 2), method=..., return_norms=True)``, the whole batch at
  once.

Reported: the compiled program's temporary memory (XLA's memory analysis), the
median step time (the three timed interleaved, one step of each in turn), the
ratios issue #25 sets targets on (ghost/vmap time <= 1.05, ghost/grad time
<= 1.5, ghost/grad memory <= 1.3) and the share of the parameters' floats that
:func:`jaxclip.ghost_plan` instantiates (<= 10%), with the leaves it
instantiates and why. ``l2_norm_clip`` is, per model, the median per-example
norm of the first batch (from vmap's norms), so that some examples are
clipped; it is a traced argument of every case (the non-private one ignores
it), so that one compiled program serves any clip. It writes
``ghost_zoo.md`` into ``--out``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import jaxclip
from benchmarks import _cases, _main, _report, _timing, _zoo
from jaxclip.privacy import _ghost

METHODS = ("grad", "vmap", "ghost")
BATCHES, QUICK_BATCHES = (16, 128), (4,)
TARGETS = {
  "ghost/vmap time": 1.05,
  "ghost/grad time": 1.5,
  "ghost/grad mem": 1.3,
  "fallback share": 0.10,
}


def _cases_for(model: _zoo.Model) -> dict[str, Any]:
  """``{method: fn(clip, params, x, y)}``."""

  def summed_loss(params, x, y):
    return jnp.sum(jax.vmap(model.loss_fn, (None, 0, 0))(params, x, y))

  grad = jax.grad(summed_loss)
  cases = {"grad": lambda clip, params, x, y: grad(params, x, y)}
  for method in METHODS[1:]:

    def fn(clip, params, x, y, method=method):
      return jaxclip.per_example_clipped_grad(
        model.loss_fn, clip, batch_argnums=(1, 2), method=method, return_norms=True
      )(params, x, y)

    cases[method] = fn
  return cases


def plan_summary(model: _zoo.Model) -> dict:
  """The fallback share and the instantiated leaves, from :func:`jaxclip.ghost_plan`."""
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
  if len(reasons) == 1 and plan.fallback_share == 1.0 and hasattr(_ghost, "_VMAP_RATIO"):
    # The whole loss falls back on cost: what the ghost rules alone would instantiate.
    ratio, _ghost._VMAP_RATIO = _ghost._VMAP_RATIO, math.inf
    try:
      forced = jaxclip.ghost_plan(model.loss_fn, model.params, x, y, batch_argnums=(1, 2))
    finally:
      _ghost._VMAP_RATIO = ratio
    out.update(
      whole_loss=reasons.pop(),
      forced_share=forced.fallback_share,
      forced_rules=sorted({leaf.rule for leaf in forced.leaves}),
    )
  return out


def run_model(model: _zoo.Model, batches: list[int], reps: int) -> list[dict]:
  """One row per batch size: memory, median times, ratios, checks."""
  cases = _cases_for(model)
  rows, clip = [], None
  for b in batches:
    x, y = model.make_batch(b, 1)
    row: dict[str, Any] = {"model": model.name, "B": b, "params": model.num_params()}
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
    if clip is None and "vmap" in compiled:  # the median norm of the first batch
      clip = float(np.median(np.asarray(compiled["vmap"](1.0, model.params, x, y)[2])))
    row["clip"] = clip if clip is not None else 1.0
    for name, c in compiled.items():
      outputs[name] = jax.block_until_ready(c(row["clip"], model.params, x, y))
    args = (row["clip"], model.params, x, y)
    steps = {name: (lambda s, c=c, args=args: (c(*args), s), None) for name, c in compiled.items()}
    for name, s in _timing.time_interleaved(steps, reps, warmup=1).items():
      row[name]["ms"] = 1e3 * s
    if "vmap" in outputs and "ghost" in outputs:
      (gv, nv, normv), (gg, ng, normg) = outputs["vmap"], outputs["ghost"]
      top = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(gv)) or 1.0
      diff = max(
        float(jnp.max(jnp.abs(a - e)))
        for a, e in zip(jax.tree.leaves(gg), jax.tree.leaves(gv), strict=True)
      )
      row["check"] = {
        "clipped_vmap": int(nv),
        "clipped_ghost": int(ng),
        "sum_rel_diff": diff / top,
        "norm_rel_diff": float(jnp.max(jnp.abs(normg - normv) / normv)),
      }
    for m in METHODS:
      res = row[m]
      print(
        f"    {m:5s} temp {_report._f(res['temp_mb'], '{:.1f}'):>8s} MiB  "
        f"{_report.num(res['ms']):>8s} ms  {res['why'] or ''}",
        flush=True,
      )
    rows.append(row)
  return rows


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def ratios(row: dict, share: float | None) -> dict[str, float | None]:
  """The four figures issue #25 sets targets on, for one row."""
  g, v, h = row["grad"], row["vmap"], row["ghost"]
  return {
    "ghost/vmap time": _ratio(h["ms"], v["ms"]),
    "ghost/grad time": _ratio(h["ms"], g["ms"]),
    "ghost/grad mem": _ratio(h["temp_mb"], g["temp_mb"]),
    "fallback share": share,
  }


HEADER = [
  "model",
  "B",
  "params",
  "grad MiB",
  "vmap MiB",
  "ghost MiB",
  "grad ms",
  "vmap ms",
  "ghost ms",
  "ghost/vmap time",
  "ghost/grad time",
  "ghost/grad mem",
  "fallback share",
  "targets missed",
]


def table(rows: list[dict], plans: dict[str, dict]) -> str:
  body = []
  for r in rows:
    share = plans[r["model"]]["share"]
    rat = ratios(r, share)
    missed = [k for k, t in TARGETS.items() if rat[k] is not None and rat[k] > t]
    unknown = [k for k in TARGETS if rat[k] is None]
    cells = [r["model"], str(r["B"]), f"{r['params']:,}"]
    for key in ("temp_mb", "ms"):
      cells += [
        r[m]["status"] if r[m]["status"] != "ok" else _report.num(r[m][key]) for m in METHODS
      ]
    cells += [f"{rat[k]:.2f}" if rat[k] is not None else "n/a" for k in list(TARGETS)[:3]]
    p = plans[r["model"]]
    cells.append(
      "n/a"
      if share is None
      else f"{share:.1%}"
      if "whole_loss" not in p
      else f"{share:.0%} (on cost; rules alone {p['forced_share']:.1%})"
    )
    cells.append(", ".join(missed + [f"{k} n/a" for k in unknown]) or "none")
    body.append(cells)
  return _report._table(HEADER, body)


def markdown(
  meta: dict, rows: list[dict], plans: dict[str, dict], models: dict[str, _zoo.Model]
) -> str:
  out = ["# Ghost norms on the model zoo", ""]
  out += [f"- {k}: {v}" for k, v in meta.items()]
  out += [
    "",
    "`grad` is the non-private gradient (`jax.grad` of the summed per-example losses); "
    "`vmap` and `ghost` are `jaxclip.per_example_clipped_grad(loss_fn, clip, "
    "batch_argnums=(1, 2), method=..., return_norms=True)`, the whole batch at once. `MiB` "
    "is the compiled program's temporary memory (XLA's memory analysis), `ms` the median "
    "step time, the three cases of a row timed interleaved. `fallback share`: the share of "
    "the parameters' floats that `jaxclip.ghost_plan` instantiates (per-example gradient "
    "formed exactly); `on cost`: the whole loss is instantiated because its ghost norms "
    "would cost more flops than its per-example gradients, and `rules alone` is the share "
    "the ghost rules would leave to instantiation. Targets (issue #25): ghost/vmap time <= "
    f"{TARGETS['ghost/vmap time']}, ghost/grad time <= {TARGETS['ghost/grad time']}, "
    f"ghost/grad memory <= {TARGETS['ghost/grad mem']}, fallback share <= "
    f"{TARGETS['fallback share']:.0%}.",
    "",
  ]
  out += [table(rows, plans), "", "## Models", ""]
  for name, m in models.items():
    out.append(f"- `{name}` ({m.num_params():,} float32 params): {m.description}")
  out += ["", "## Leaves ghost_plan instantiates", ""]
  for name, p in plans.items():
    if p["share"] is None:
      out.append(f"- `{name}`: n/a ({p['why']})")
      continue
    if "whole_loss" in p:
      out.append(
        f"- `{name}` (100% of the floats): every leaf, {p['whole_loss']}; the ghost "
        f"rules alone (rules {', '.join(p['forced_rules'])}) would instantiate "
        f"{p['forced_share']:.1%}"
      )
      continue
    big = sorted(p["fallback"], key=lambda leaf: -leaf[1])
    leaves = "; ".join(f"`{path}` ({n:,}: {why})" for path, n, why in big[:8])
    if big[8:]:
      leaves += f"; and {len(big) - 8} more of {sum(n for _, n, _ in big[8:]):,} floats"
    out.append(
      f"- `{name}` ({p['share']:.1%} of the floats; rules used: "
      f"{', '.join(p['rules'])}): {leaves or 'none'}"
    )
  notes = [
    f"- {r['model']} B={r['B']} {m}: {r[m]['status']}: {r[m]['why']}"
    for r in rows
    for m in METHODS
    if r[m]["status"] != "ok"
  ]
  if notes:
    out += ["", "## Cases that failed", ""] + notes
  out += ["", "## Checks (the probe step of each row)", ""]
  for r in rows:
    c = r.get("check")
    if c:
      out.append(
        f"- {r['model']} B={r['B']}, l2_norm_clip {r['clip']:.3g}: examples clipped: "
        f"vmap {c['clipped_vmap']}, ghost {c['clipped_ghost']} of {r['B']}; ghost's "
        f"clipped sum differs from vmap's by at most {c['sum_rel_diff']:.1e} of its "
        f"largest entry, its norms by at most {c['norm_rel_diff']:.1e} (relative)"
      )
  return "\n".join(out) + "\n"


def main(args: Any, argv_text: str) -> str:
  """Runs the zoo benchmark for parsed ``args`` of ``python -m benchmarks.ghost``."""
  quick = args.quick
  size = "tiny" if quick else "bench"
  reps = args.reps or (2 if quick else 5)
  batches = args.batch or list(QUICK_BATCHES if quick else BATCHES)
  names = args.models or list(_zoo.MODELS)
  unknown = sorted(set(names) - set(_zoo.MODELS))
  if unknown:
    raise SystemExit(f"unknown zoo models {unknown}; choose from {list(_zoo.MODELS)}")
  device = jax.devices()[0]
  meta = {
    "command": "python -m benchmarks.ghost " + argv_text,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{_main._cpu_name()}, {os.cpu_count()} cores; jax device: {device.platform} "
    f"({device.device_kind}); jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
    f"python {platform.python_version()}",
    "libraries": f"jaxclip at {Path(jaxclip.__file__).resolve().parent}; flax "
    f"{importlib.metadata.version('flax')}, equinox "
    f"{importlib.metadata.version('equinox')}, optax "
    f"{importlib.metadata.version('optax')}",
    "models": f"benchmarks/_zoo.py at size {size!r}; {reps} timed steps per case",
    "load average (1, 5, 15 min) at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
  }
  t_start = time.perf_counter()
  models = {name: _zoo.build(name, size) for name in names}
  plans, rows = {}, []
  for name, model in models.items():
    plans[name] = plan_summary(model)
    rows += run_model(model, sorted(batches), reps)
  meta["load average (1, 5, 15 min) at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  meta["total benchmark time"] = f"{time.perf_counter() - t_start:.0f} s"
  text = markdown(meta, rows, plans, models)
  Path(args.out).mkdir(parents=True, exist_ok=True)
  (Path(args.out) / "ghost_zoo.md").write_text(text)
  print(text)
  return text
