"""The report of ``--peers``: each private step against its framework's own, and every case."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks import _peers_cases, _report

SUMMARY = (
  "jaxclip ghost",
  "jaxclip auto",
  "jaxclip vmap",
  "jax_privacy",
  "opacus ghost",
  "opacus hooks",
)

HEADER = [
  "B",
  "T",
  "framework",
  "method",
  "CPU ms",
  "x own CPU (IQR)",
  "wall ms",
  "x own wall (IQR)",
  "XLA temp MiB",
  "x own temp",
  "peak MiB",
  "x own peak",
  "busiest thread",
  "clipped sum vs",
]


def _cell(r: dict, key: str, fmt: str = "{:.3g}") -> str:
  if r["status"] != "ok":
    return r["status"]
  return _report._f(r.get(key), fmt)


def _x_time(r: dict, key: str) -> str:
  if r["status"] != "ok":
    return r["status"]
  if r["case"] == r["baseline"]:
    return "1 (baseline)"
  if r.get(key) is None:
    return "n/a"
  lo, hi = r[key + "_iqr"]
  return f"{r[key]:.2f} ({lo:.2f}-{hi:.2f})"


def _x(r: dict, key: str) -> str:
  if r["status"] != "ok":
    return r["status"]
  if r["case"] == r["baseline"]:
    return "1" if r.get(key[2:]) is not None else "n/a"
  return _report._f(r.get(key))


def _check(r: dict) -> str:
  if r["status"] != "ok":
    return r["status"]
  if r.get("check") is None:
    return "reference"
  return f"{r['check_ref']}: {r['check']:.1e}"


def table(rows: list[dict]) -> str:
  """The table of every case, one row per ``(B, T, case)``."""
  body = [
    [
      str(r["B"]),
      str(r["T"]),
      r["framework"],
      r["method"],
      _cell(r, "cpu_ms", "{:.1f}"),
      _x_time(r, "x_cpu"),
      _cell(r, "ms", "{:.1f}"),
      _x_time(r, "x_time"),
      "-" if r["framework"] in ("torch", "Opacus") else _cell(r, "temp_mb"),
      "-" if r["framework"] in ("torch", "Opacus") else _x(r, "x_temp_mb"),
      _cell(r, "peak_mb"),
      _x(r, "x_peak_mb"),
      _cell(r, "thread", "{:.0%}"),
      _check(r),
    ]
    for r in rows
  ]
  return _report._table(HEADER, body)


def summary(rows: list[dict], key: str) -> str:
  """Each private case's ``key`` ratio to its own non-private step, one row per ``(B, T)``."""
  names = {c[0]: f"{c[1]} {c[2].split(' ')[0]}" for c in _peers_cases.CASES}
  configs = list(dict.fromkeys((r["B"], r["T"]) for r in rows))
  by = {(r["B"], r["T"], r["case"]): r for r in rows}
  body = []
  for b, t in configs:
    cells = []
    for case in SUMMARY:
      r = by.get((b, t, case))
      if r is None:
        cells.append("n/a")
      elif r["status"] != "ok":
        cells.append(r["status"])
      else:
        cells.append(_report._f(r.get(key)))
    body.append([str(b), str(t), *cells])
  return _report._table(["B", "T", *(names[c] for c in SUMMARY)], body)


def markdown(meta: dict, rows: list[dict]) -> str:
  out = ["# Per-example clipping of a small GPT beside its peers: jax_privacy and Opacus", ""]
  out += [f"- {k}: {v}" for k, v in meta.items()]
  out += [
    "",
    "Every private case computes one step's sum of per-example gradients clipped to "
    "`l2_norm_clip` (no noise, no optimizer step) and is compared with its own framework's "
    "non-private gradient of the same model and batch: JAX's `jax.grad` for jaxclip and "
    "jax_privacy, torch's `loss.backward()` for Opacus (for Opacus ghost, of the untied "
    "model it runs). The cases of a `(B, T)` are timed interleaved, one call each in turn, "
    "round after round, the order turned by one case each round. `CPU ms` is the CPU time "
    "of the process's threads during a call (`time.process_time`), `wall ms` its wall-clock "
    "time, each the median over the rounds. On a machine shared with other jobs the wall "
    "time includes the time the step waited for a core; the CPU time does not, so it is the "
    "steadier measure of the "
    "work done. `x own` is the median over the rounds of the ratio of the two calls of the "
    "same round, with its interquartile range. `XLA temp MiB` is the compiled program's "
    "temporary memory (XLA's memory analysis). `peak MiB` is the resident memory one call "
    "adds at its peak above what was resident before it (Linux `VmHWM`, reset before the "
    "call, after `malloc_trim`; the median of the probes): activations, per-example "
    "gradients or norms, the output gradient. `busiest thread` is the share of the "
    "process's CPU time taken by its busiest thread during a call (median over the rounds): "
    "100% is one thread. `clipped sum vs`: the largest difference of the case's result from "
    "the reference's, divided by the reference's largest entry, both from the same weights "
    "and tokens (an untied gradient is folded into the tied one, `wte + head.kernel.T`, to "
    "meet JAX's).",
    "",
    "## CPU time of each private step as a multiple of its framework's non-private step",
    "",
    summary(rows, "x_cpu"),
    "",
    "## Wall time of each private step as a multiple of its framework's non-private step",
    "",
    summary(rows, "x_time"),
    "",
    "## Peak memory of each private step as a multiple of its framework's non-private step",
    "",
    summary(rows, "x_peak_mb"),
    "",
    "## Every case",
    "",
    table(rows),
    "",
  ]
  notes = sorted({f"- {r['framework']} {r['method']}: {r['why']}" for r in rows if r["why"]})
  if notes:
    out += ["## Cases not run", "", *notes, ""]
  return "\n".join(out)


def _source() -> str:
  """The commit measured, and whether jaxclip/ differed from it."""
  root = Path(__file__).resolve().parents[1]
  try:
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
      [*git, "status", "--porcelain", "--", "jaxclip"], capture_output=True, text=True
    )
  except OSError:
    return "unknown (no git)"
  if head.returncode != 0:
    return "unknown (not a git checkout)"
  changed = len(dirty.stdout.splitlines())
  return f"commit {head.stdout.strip()}" + (
    f" with uncommitted changes to {changed} files of jaxclip/" if changed else ""
  )
