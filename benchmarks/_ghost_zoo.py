"""Ghost norms on the model zoo: ``python -m benchmarks.ghost --zoo``.

For each model of :mod:`workloads.zoo` (at its ``"bench"`` size) and each
batch size ``B``, four ways to get one step's gradient, each jitted and
compiled on its own:

* ``grad``: the non-private gradient, ``jax.grad`` of the summed per-example
  losses (the baseline);
* ``vmap``, ``ghost`` and ``auto``: ``jaxclip.per_example_clipped_grad(loss_fn,
  clip, batch_argnums=(1, 2), method=..., return_norms=True)``, the whole
  batch at once.

Reported: the compiled program's temporary memory (XLA's memory analysis), the
median step time (the four timed interleaved, one step of each in turn, the order
turned each round), the ratios issues #25, #39 and #50 set targets on (ghost/grad
time <= 1.5, ghost/grad memory <= 1.3, auto's time <= 1.05x the faster of
ghost and vmap) and
the share of the parameters' floats that :func:`jaxclip.ghost_plan`
instantiates under ``"ghost"`` (<= 10%), with the leaves it instantiates and
why, ``"auto"``'s cost model's plan, and, per row, the program ``"auto"``
measured fastest when it was traced (:mod:`jaxclip.privacy._measured`) and the
times it measured. ``l2_norm_clip`` is, per
model, the median per-example norm of the first batch (from vmap's norms), so that some examples are
clipped; it is a traced argument of every case (the non-private one ignores
it), so that one compiled program serves any clip. It writes
``ghost_zoo.md`` into ``--out``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib

import jaxclip
from benchmarks import _ghost_zoo_run, _main, _report
from workloads import zoo

BATCHES, QUICK_BATCHES = (16, 128), (4,)
TARGETS = {
  "ghost/grad time": 1.5,
  "ghost/grad mem": 1.3,
  "auto/faster time": 1.05,
  "fallback share": 0.10,
}


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def ratios(row: dict, share: float | None) -> dict[str, float | None]:
  """The figures issues #25 and #39 set targets on, for one row, and ghost/vmap's."""
  g, v, h, a = row["grad"], row["vmap"], row["ghost"], row["auto"]
  return {
    "ghost/vmap time": _ratio(h["ms"], v["ms"]),
    "ghost/vmap mem": _ratio(h["temp_mb"], v["temp_mb"]),
    "ghost/grad time": _ratio(h["ms"], g["ms"]),
    "ghost/grad mem": _ratio(h["temp_mb"], g["temp_mb"]),
    "auto/vmap time": _ratio(a["ms"], v["ms"]),
    "auto/faster time": _ratio(a["ms"], min(h["ms"], v["ms"]) if h["ms"] and v["ms"] else None),
    "fallback share": share,
  }


HEADER = [
  "model",
  "jax",
  "B",
  "params",
  "grad MiB",
  "vmap MiB",
  "ghost MiB",
  "auto MiB",
  "grad ms",
  "vmap ms",
  "ghost ms",
  "auto ms",
  "ghost/vmap time",
  "ghost/vmap mem",
  "ghost/grad time",
  "ghost/grad mem",
  "auto/vmap time",
  "auto/faster time",
  "fallback share",
  "auto",
  "targets missed",
]
RATIOS = HEADER[12:18]
# What each measured pick of method="auto" runs (jaxclip.privacy._measured).
PICKS = {"auto": "the cost model's plan", "ghost": "ghost's rules", "vmap": "vmap's program"}


def earlier_runs(text: str, jax_version: str) -> tuple[list[str], list[list[str]]]:
  """What a run on ``jax_version`` keeps of the ``ghost_zoo.md`` it rewrites (``text``).

  The rows measured on another jax (a table written before the ``jax``
  column takes its version from its ``machine`` line), and one line naming
  each run they come from, so that one table holds a run on each jax.
  Rows of a table of other columns are not kept, nor the line naming a
  run whose rows are rewritten.
  """
  lines = text.splitlines()
  meta = []
  for line in lines[2:]:  # after the title and its blank line, up to the next blank line
    if not line.startswith("- "):
      break
    meta.append(line)
  runs = [line for line in meta if line.startswith("- earlier run")]
  info = dict(line[2:].split(": ", 1) for line in meta if not line.startswith("- earlier run"))
  found = re.search(r"jax (\S+?),", info.get("machine", ""))
  table_lines = [line for line in lines if line.startswith("| ")]
  if not table_lines or found is None:
    return runs, []
  header, *rows = ([c.strip() for c in line.strip("|").split("|")] for line in table_lines)
  if "jax" not in header:
    header.insert(1, "jax")
    rows = [r[:1] + [found.group(1)] + r[1:] for r in rows]
  if header != HEADER:
    return runs, []
  kept = [r for r in rows if r[1] != jax_version]
  versions = {r[1] for r in kept}
  # A line naming a run whose rows this run rewrites goes with them.
  runs = [line for line in runs if re.match(r"- earlier run on jax (\S+) ", line)[1] in versions]
  if found.group(1) in versions:
    keys = ("command", "date", "machine", "load average (1, 5, 15 min) at start")
    runs.insert(
      0,
      f"- earlier run on jax {found.group(1)} (its rows kept in the table): "
      + "; ".join(f"{k}: {info[k]}" for k in keys if k in info),
    )
  return runs, kept


def table(rows: list[dict], plans: dict[str, dict], earlier: list[list[str]] = ()) -> str:
  body = []
  for r in rows:
    share = plans[r["model"]]["share"]
    rat = ratios(r, share)
    missed = [k for k, t in TARGETS.items() if rat[k] is not None and rat[k] > t]
    unknown = [k for k in TARGETS if rat[k] is None]
    cells = [r["model"], r["jax"], str(r["B"]), f"{r['params']:,}"]
    for key in ("temp_mb", "ms"):
      cells += [
        r[m]["status"] if r[m]["status"] != "ok" else _report.num(r[m][key])
        for m in _ghost_zoo_run.METHODS
      ]
    cells += [f"{rat[k]:.2f}" if rat[k] is not None else "n/a" for k in RATIOS]
    p = plans[r["model"]]
    cells.append(
      "n/a"
      if share is None
      else f"{share:.1%}"
      if "whole_loss" not in p
      else f"{share:.0%} (the engine cannot read the loss)"
    )
    pick = r["auto"].get("pick")
    cells.append(PICKS[pick] + " (measured)" if pick else "cost model: " + _model_plan(p))
    cells.append(", ".join(missed + [f"{k} n/a" for k in unknown]) or "none")
    body.append(cells)
  return _report._table(HEADER, body + list(earlier))


def same_program_spread(rows: list[dict], plans: dict[str, dict]) -> str:
  """How far apart this run timed one program twice: auto's time over that of the method
  whose program it ran (ghost's rules or vmap's, as measured or as the cost model chose)."""
  found = []
  for r in rows:
    pick = r["auto"].get("pick")
    if pick == "auto" or pick is None:  # the cost model's plan: on CPU one of the two
      plan = plans[r["model"]].get("auto")
      if plan is None or plan["chosen"]:
        continue
      pick = "vmap" if plan["whole_loss"] else "ghost"
    same = _ratio(r["auto"]["ms"], r[pick]["ms"])
    if same is not None:
      found.append(same)
  if not found:
    return "no row ran auto as one of the other methods' programs"
  return (
    f"in this run `auto` running the program of `ghost` or `vmap` read "
    f"{min(found):.2f}-{max(found):.2f}x that method's time ({len(found)} rows), so a time "
    "ratio that close to 1 is noise"
  )


def _model_plan(p: dict) -> str:
  """The cost model's plan of a model's summary (``plan_summary``), in a few words."""
  auto = p.get("auto")
  if auto is None:
    return "n/a"
  if auto["whole_loss"]:
    return "vmap's program"
  return f"rules, {len(auto['chosen'])} instantiated" if auto["chosen"] else "ghost's rules"


def markdown(
  meta: dict,
  rows: list[dict],
  plans: dict[str, dict],
  models: dict[str, zoo.Model],
  earlier: tuple[list[str], list[list[str]]] = ([], []),
) -> str:
  out = ["# Ghost norms on the model zoo", ""]
  out += [f"- {k}: {v}" for k, v in meta.items()] + earlier[0]
  out += [
    "",
    "`jax`: the jax version the row ran on. "
    "`grad` is the non-private gradient (`jax.grad` of the summed per-example losses); "
    "`vmap`, `ghost` and `auto` are `jaxclip.per_example_clipped_grad(loss_fn, clip, "
    "batch_argnums=(1, 2), method=..., return_norms=True)`, the whole batch at once. `MiB` "
    "is the compiled program's temporary memory (XLA's memory analysis), `ms` the median "
    "step time, the four cases of a row timed interleaved (one step of each in turn, the "
    "order turned each round), on a machine shared with other jobs (the load averages "
    f"above): {same_program_spread(rows, plans)}. "
    "`fallback share`: the share of the parameters' floats that `jaxclip.ghost_plan` "
    'instantiates under `method="ghost"` (per-example gradient formed exactly), which '
    'applies every ghost rule it finds. `auto`: the program `method="auto"` ran in this '
    "row, measured fastest of its candidates when it was traced (the times are under "
    '"What auto measured"), or, where it timed nothing, the cost model\'s plan. '
    "`auto/faster time`: auto's time over the faster of ghost's and vmap's. Targets: "
    f"ghost/grad time <= {TARGETS['ghost/grad time']} and fallback share <= "
    f"{TARGETS['fallback share']:.0%} (issue #25), ghost/grad memory <= "
    f"{TARGETS['ghost/grad mem']} (issue #39), auto/faster time <= "
    f"{TARGETS['auto/faster time']} (issue #50).",
    "",
  ]
  if earlier[1]:
    out[-2] += (
      " The rows of another jax come from the earlier run named above; the sections below "
      "are this run's."
    )
  out += [table(rows, plans, earlier[1]), "", "## Models", ""]
  for name, m in models.items():
    out.append(f"- `{name}` ({m.num_params():,} float32 params): {m.description}")
  out += ["", "## Leaves ghost_plan instantiates", ""]
  for name, p in plans.items():
    if p["share"] is None:
      out.append(f"- `{name}`: n/a ({p['why']})")
      continue
    if "whole_loss" in p:
      out.append(f"- `{name}` (100% of the floats): every leaf, {p['whole_loss']}")
      continue
    big = sorted(p["fallback"], key=lambda leaf: -leaf[1])
    leaves = "; ".join(f"`{path}` ({n:,}: {why})" for path, n, why in big[:8])
    if big[8:]:
      leaves += f"; and {len(big) - 8} more of {sum(n for _, n, _ in big[8:]):,} floats"
    out.append(
      f"- `{name}` ({p['share']:.1%} of the floats; rules used: "
      f"{', '.join(p['rules'])}): {leaves or 'none'}"
    )
  out += ["", "## What auto measured (each row, when it was traced)", ""]
  for r in rows:
    out.append(f"- {r['model']} B={r['B']}: {r['auto'].get('why') or 'n/a'}")
  out += ["", '## The cost model\'s plan (`ghost_plan(..., method="auto", measure=False)`)', ""]
  for name, p in plans.items():
    auto = p.get("auto")
    if auto is None:
      continue
    if auto["whole_loss"]:
      out.append(f"- `{name}`: {auto['whole_loss']}")
    elif auto["chosen"]:
      out.append(
        f"- `{name}`: ghost's rules but for "
        + "; ".join(f"`{path}` ({why})" for path, why in auto["chosen"])
      )
    else:
      out.append(f"- `{name}`: ghost's rules")
  notes = [
    f"- {r['model']} B={r['B']} {m}: {r[m]['status']}: {r[m]['why']}"
    for r in rows
    for m in _ghost_zoo_run.METHODS
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
        f"vmap {c['clipped_vmap']}, ghost {c['clipped_ghost']}, auto {c['clipped_auto']} of "
        f"{r['B']}; the clipped sums differ from vmap's by at most "
        f"{c['ghost_sum_rel_diff']:.1e} (ghost) and {c['auto_sum_rel_diff']:.1e} (auto) of "
        f"its largest entry, the norms by at most {c['ghost_norm_rel_diff']:.1e} and "
        f"{c['auto_norm_rel_diff']:.1e} (relative)"
      )
  return "\n".join(out) + "\n"


def main(args: Any, argv_text: str) -> str:
  """Runs the zoo benchmark for parsed ``args`` of ``python -m benchmarks.ghost``."""
  quick = args.quick
  size = "tiny" if quick else "bench"
  reps = args.reps or (2 if quick else 5)
  batches = args.batch or list(QUICK_BATCHES if quick else BATCHES)
  names = args.models or list(zoo.MODELS)
  unknown = sorted(set(names) - set(zoo.MODELS))
  if unknown:
    raise SystemExit(f"unknown zoo models {unknown}; choose from {list(zoo.MODELS)}")
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
    "models": f"workloads/zoo/ at size {size!r}; {reps} timed steps per case",
    "load average (1, 5, 15 min) at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
  }
  t_start = time.perf_counter()
  models = {name: zoo.build(name, size) for name in names}
  plans, rows = {}, []
  for name, model in models.items():
    plans[name] = _ghost_zoo_run.plan_summary(model)
    rows += _ghost_zoo_run.run_model(model, sorted(batches), reps)
  meta["load average (1, 5, 15 min) at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  meta["total benchmark time"] = f"{time.perf_counter() - t_start:.0f} s"
  path = Path(args.out) / "ghost_zoo.md"
  earlier = earlier_runs(path.read_text(), jax.__version__) if path.exists() else ([], [])
  text = markdown(meta, rows, plans, models, earlier)
  Path(args.out).mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  print(text)
  return text
