"""``python -m benchmarks.ghost_calibrate``: can ``"auto"``'s choice be fitted on single layers?

Times ``per_example_clipped_grad`` under ``method="ghost"`` and ``"vmap"``
against the non-private gradient on single-layer losses of each ghost rule's
kind and form (dense layers in the Gram form and the formed gradient, a
convolution, an embedding lookup, a norm's scale, a weight shared by a
scan's iterations and one stacked over them), at two batch sizes; fits by
non-negative least squares a linear model of each method's seconds over the
gradient, in the work :func:`jaxclip.ghost_plan` reports per leaf (norm
flops by form, per-example-gradient flops by rule, site calls, floats
written); and scores the fitted model and the released rule (``"auto"`` on
CPU: the flops share) on the zoo's measured times (the rows of this jax in
``benchmarks/results/ghost_zoo.md``), models the fit never saw. Writes
``ghost_calibration-<jax version>.md`` and its rows as ``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

import benchmarks
import jaxclip
from benchmarks import _report, _timing
from workloads import zoo

NORM_FORMS = ("dot", "dot:gram", "conv", "conv:gram", "lookup", "lookup:gram", "scale")
GRAD_RULES = ("dot", "conv", "lookup", "scale")
BATCHES = (16, 128)


def _dense(t: int, c: int, f: int) -> tuple[str, dict, Callable, Callable]:
  def loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"]))

  def batch(b, key):
    return jax.random.normal(key, (b, t, c) if t > 1 else (b, c))

  return f"dense T={t} {c}x{f}", {"w": jnp.full((c, f), 0.05)}, loss, batch


def _conv(side: int, cin: int, cout: int, k: int) -> tuple[str, dict, Callable, Callable]:
  def loss(p, x):
    y = jax.lax.conv_general_dilated(
      x[None], p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.sum(jnp.tanh(y))

  def batch(b, key):
    return jax.random.normal(key, (b, side, side, cin))

  name = f"conv {side}x{side} {cin}->{cout} k{k}"
  return name, {"k": jnp.full((k, k, cin, cout), 0.05)}, loss, batch


def _lookup(vocab: int, d: int, t: int) -> tuple[str, dict, Callable, Callable]:
  def loss(p, ids):
    return jnp.sum(jnp.tanh(p["e"][ids]))

  def batch(b, key):
    return jax.random.randint(key, (b, t), 0, vocab)

  return f"lookup V={vocab} d={d} T={t}", {"e": jnp.full((vocab, d), 0.05)}, loss, batch


def _scale(t: int, d: int) -> tuple[str, dict, Callable, Callable]:
  def loss(p, x):
    return jnp.sum(jnp.tanh(x * p["s"]))

  def batch(b, key):
    return jax.random.normal(key, (b, t, d))

  return f"scale T={t} d={d}", {"s": jnp.ones(d)}, loss, batch


def _scan(steps: int, d: int, stacked: bool) -> tuple[str, dict, Callable, Callable]:
  """A recurrence ``h = tanh(h W + x_t)``: one weight every step reads, or one per step."""

  def loss(p, xs):
    def step(h, inputs):
      w, x = inputs if stacked else (p["w"], inputs)
      return jnp.tanh(h @ w + x), None

    h, _ = jax.lax.scan(step, jnp.zeros(d), (p["w"], xs) if stacked else xs)
    return jnp.sum(h)

  def batch(b, key):
    return jax.random.normal(key, (b, steps, d))

  shape = (steps, d, d) if stacked else (d, d)
  kind = "stacked" if stacked else "shared"
  return f"scan {kind} L={steps} d={d}", {"w": jnp.full(shape, 0.05)}, loss, batch


def cases(quick: bool) -> list[tuple[str, dict, Callable, Callable]]:
  """The single-layer losses timed: each rule's kind and form, small and large."""
  if quick:
    return [_dense(8, 16, 16), _lookup(32, 8, 4), _scan(4, 8, False)]
  return [
    _dense(1, 256, 256),
    _dense(1, 64, 64),
    _dense(4, 64, 256),
    _dense(8, 64, 64),
    _dense(16, 128, 128),
    _dense(32, 64, 64),
    _dense(32, 64, 256),
    _dense(128, 64, 64),
    _dense(128, 256, 256),
    _conv(16, 3, 16, 3),
    _conv(16, 16, 32, 3),
    _conv(8, 32, 32, 3),
    _conv(16, 32, 32, 1),
    _lookup(256, 64, 32),
    _lookup(4096, 64, 8),
    _scale(32, 64),
    _scale(128, 256),
    _scan(16, 64, False),
    _scan(128, 32, False),
    _scan(256, 16, False),
    _scan(4, 128, True),
    _scan(32, 32, True),
  ]


def _work(plan: jaxclip.GhostPlan) -> dict[str, float]:
  """Per example, the work ``ghost_plan`` reports: flops by form and rule, site calls, writes."""
  work: dict[str, float] = {}
  for leaf in plan.leaves:
    for key, flops in [
      *(("norm " + f, n) for f, n in leaf.norm_flops),
      *(("grad " + r, n) for r, n in leaf.grad_flops),
      ("calls", leaf.site_calls),
      ("writes", leaf.grad_writes),
    ]:
      work[key] = work.get(key, 0) + flops
  return work


def measure(case: tuple, batches: tuple[int, ...], reps: int) -> list[dict]:
  """The case's median seconds under grad, ghost and vmap at each batch size."""
  name, params, loss, make = case
  rows = []
  for b in batches:
    x = make(b, jax.random.key(b))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(jax.vmap(loss, (None, 0))(p, x))))
    fns = {"grad": grad}
    for method in ("ghost", "vmap"):
      clipped = jaxclip.per_example_clipped_grad(loss, 1.0, batch_argnums=1, method=method)
      fns[method] = jax.jit(clipped)
    steps = {m: (lambda s, f=f, x=x: (f(params, x), s), None) for m, f in fns.items()}
    times = _timing.time_interleaved(steps, reps, warmup=2)
    work = _work(jaxclip.ghost_plan(loss, params, x, batch_argnums=1))
    rows.append({"case": name, "B": b, **times, "work": work})
    print(f"  {name} B={b}: " + "  ".join(f"{m} {1e3 * s:.3f} ms" for m, s in times.items()))
  return rows


def _features(row: dict) -> tuple[list[float], list[float]]:
  """A row's terms of ghost's seconds over the gradient, and of vmap's."""
  w, b = row["work"], row["B"]
  ghost = [b * w.get(f"norm {f}", 0) for f in NORM_FORMS] + [w.get("calls", 0)]
  return ghost, [b * w.get(f"grad {k}", 0) for k in GRAD_RULES] + [b * w.get("writes", 0)]


def fit(rows: list[dict]) -> dict[str, Any]:
  """Non-negative least squares of ghost's and vmap's seconds over the gradient, each row
  weighted by its gradient's time (relative errors)."""
  g, v = (np.array([_features(r)[j] for r in rows], float) for j in (0, 1))
  w = 1.0 / np.array([r["grad"] for r in rows])

  def nnls(a, y):
    used = a.any(axis=0)  # a term no case has keeps 0: the fit knows nothing of it
    coef = np.zeros(a.shape[1])
    coef[used] = scipy.optimize.nnls(a[:, used] * w[:, None], np.maximum(y, 0) * w)[0]
    return coef

  cg = nnls(g, np.array([r["ghost"] - r["grad"] for r in rows]))
  cv = nnls(v, np.array([r["vmap"] - r["grad"] for r in rows]))
  return {"ghost": cg, "vmap": cv}


def fitted_pick(c: dict[str, Any], row: dict) -> str:
  g, v = _features(row)
  return "ghost" if np.dot(g, c["ghost"]) <= np.dot(v, c["vmap"]) else "vmap"


def zoo_rows(results: Path) -> list[dict]:
  """The zoo's measured rows for this jax (``ghost_zoo.md``), with each model's work and the
  shipped ``method="auto"``'s pick on CPU."""
  lines = [line for line in (results / "ghost_zoo.md").read_text().splitlines()]
  table = [
    [c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")
  ]
  head, rows, models = table[0], [], {}
  for cells in table[2:]:
    r = dict(zip(head, cells, strict=False))
    if r.get("jax") != jax.__version__:
      continue
    if r["model"] not in models:
      m = zoo.build(r["model"], "bench")
      x, y = m.make_batch(2, 0)
      kw = {"batch_argnums": (1, 2)}
      plan = jaxclip.ghost_plan(m.loss_fn, m.params, x, y, **kw)
      auto = jaxclip.ghost_plan(
        m.loss_fn, m.params, x, y, method="auto", platform="cpu", measure=False, **kw
      )
      vmap = all(leaf.rule == "instantiate" for leaf in auto.leaves)
      models[r["model"]] = (_work(plan), "vmap" if vmap else "ghost")
    work, shipped = models[r["model"]]
    times = {k: float(r[f"{k} ms"]) / 1e3 for k in ("grad", "ghost", "vmap")}
    rows.append({"case": r["model"], "B": int(r["B"]), **times, "work": work, "shipped": shipped})
  return rows


def _right(row: dict, pick: str) -> bool:
  return row[pick] <= 1.05 * min(row["ghost"], row["vmap"])


def markdown(meta: dict, rows: list[dict], c: dict[str, Any], zoo_: list[dict]) -> str:
  ms = lambda s: _report.num(1e3 * s)
  out = ['# Fitting `method="auto"`\'s cost model on single-layer losses', ""]
  out += [f"- {k}: {v}" for k, v in meta.items()]
  out += [
    "",
    "Each single-layer loss is timed under the non-private gradient (`jax.grad` of the summed "
    'losses), `method="ghost"` and `method="vmap"` (`per_example_clipped_grad`, clip 1), '
    "interleaved; `ms` are medians. The model: ghost's seconds over the gradient = the batch "
    "times each form's norm flops (per example, as `jaxclip.ghost_plan` reports them) times "
    "a constant, plus a constant per site evaluation; vmap's = the batch times each rule's "
    "per-example-gradient flops and the floats written forming them, each times a constant; "
    "the constants fitted by non-negative least squares. `fit` is the method the fitted "
    "model picks, `right` whether that was within 5% of the faster measured.",
    "",
  ]
  header = ["case", "B", "grad ms", "ghost ms", "vmap ms", "fit", "right"]
  table = [
    [r["case"], str(r["B"]), ms(r["grad"]), ms(r["ghost"]), ms(r["vmap"]), p, str(_right(r, p))]
    for r in rows
    for p in [fitted_pick(c, r)]
  ]
  out += [_report._table(header, table), "", "## The constants fitted", ""]
  names = [f"norm {f}" for f in NORM_FORMS] + ["site call"]
  names += [f"grad {k}" for k in GRAD_RULES] + ["float written"]
  values = [*c["ghost"], *c["vmap"]]
  out += [
    _report._table(
      ["term", "seconds"], [[n, f"{x:.3g}"] for n, x in zip(names, values, strict=True)]
    )
  ]
  out += ["", "## Both rules on the zoo's measured times (`ghost_zoo.md`, this jax)", ""]
  out += [
    '`shipped`: the pick of `method="auto"` as released (the flops share); `fit`: the '
    "fitted model's. Neither saw these models.",
    "",
  ]
  header = ["model", "B", "ghost ms", "vmap ms", "shipped", "right", "fit", "right"]
  table = [
    [r["case"], str(r["B"]), ms(r["ghost"]), ms(r["vmap"])]
    + [r["shipped"], str(_right(r, r["shipped"])), p, str(_right(r, p))]
    for r in zoo_
    for p in [fitted_pick(c, r)]
  ]
  out += [_report._table(header, table), ""]
  count = lambda rs, pick: sum(_right(r, pick(r)) for r in rs)
  out += [
    f"Within 5% of the faster method: the fitted model on its own cases "
    f"{count(rows, lambda r: fitted_pick(c, r))}/{len(rows)}; on the zoo, the fitted model "
    f"{count(zoo_, lambda r: fitted_pick(c, r))}/{len(zoo_)}, the shipped rule "
    f"{count(zoo_, lambda r: r['shipped'])}/{len(zoo_)}.",
    "",
  ]
  return "\n".join(out)


def _cpu_name() -> str:
  try:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.ghost_calibrate", description=__doc__)
  p.add_argument("--quick", action="store_true", help="three tiny cases (a smoke test)")
  p.add_argument("--reps", type=int, default=9, help="timed rounds per case")
  p.add_argument("--out", type=Path, default=benchmarks.RESULTS)
  args = p.parse_args(argv)
  start = time.time()
  load = " ".join(f"{x:.2f}" for x in os.getloadavg())
  rows = []
  for case in cases(args.quick):
    rows += measure(case, (2, 4) if args.quick else BATCHES, 2 if args.quick else args.reps)
  c = fit(rows)
  day = datetime.date.today().isoformat()
  meta = {
    "command": "python -m benchmarks.ghost_calibrate" + (" --quick" if args.quick else ""),
    "date": day,
    "machine": f"{_cpu_name()}, {os.cpu_count()} cores; jax device: {jax.default_backend()}",
    "versions": f"jax {jax.__version__}, python {platform.python_version()}",
    "load average (1, 5, 15 min) at start": load,
    "load average at end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    "total time": f"{time.time() - start:.0f} s",
  }
  zoo_ = [] if args.quick else zoo_rows(benchmarks.RESULTS)
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / f"ghost_calibration-{jax.__version__}.md"
  path.write_text(markdown(meta, rows, c, zoo_))
  path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
