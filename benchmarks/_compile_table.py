"""Every transform's compile cost against adam's own, on many leaves of mixed shapes.

``python -m benchmarks --only transforms --leaves 400 5000`` (or this module
directly, ``python -m benchmarks._compile_table --leaves 400``) profiles
every factory of ``jaxclip.__all__`` (``workloads/every.py``) twice: its
update ``chained`` in front of adam (``optax.chain(t, optax.adam(1e-3))``,
what a user compiles) and ``alone``. Each profile runs in a fresh process
and records the seconds to trace, lower and XLA-compile, the jaxpr's
equation count, the lowered StableHLO's op count and the optimised HLO's
instruction count, and the process's CPU seconds for all of it (``cpu``: on a
loaded machine they move less than the wall time). ``optax.adam``'s own
update is profiled in the same run, before every few transforms, and each
transform is reported as a ratio to the median of adam's runs, so that a
loaded machine moves both alike.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import optax

from workloads import every, trees

ADAM = "optax.adam"
# Transforms profiled between two profiles of adam.
_ADAM_EVERY = 6


def _chain(name: str, chained: bool) -> optax.GradientTransformation:
  if name == ADAM:
    return optax.adam(1e-3)
  tx = every.build(name)
  return optax.chain(tx, optax.adam(1e-3)) if chained else tx


_HLO_INSTR = re.compile(r"^\s*(ROOT )?%?[\w.\-]+ = ", re.M)


def profile(name: str, leaves: int, chained: bool, compile_: bool = True) -> dict[str, Any]:
  """Trace, lower and (``compile_``) compile ``update`` of ``name`` on ``leaves`` mixed leaves."""
  shapes = trees.many_leaf_shapes(leaves, mixed=True)
  updates, params = trees.make_tree(shapes), trees.make_tree(shapes, seed=1)
  tx = _chain(name, chained)
  state = tx.init(params)
  t0, c0 = time.perf_counter(), time.process_time()
  traced = jax.jit(tx.update).trace(updates, state, params)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  out = {
    "trace": t1 - t0,
    "lower": t2 - t1,
    "jaxpr_eqns": every.count_eqns(traced.jaxpr.jaxpr),
    "stablehlo_ops": lowered.as_text().count("stablehlo."),
  }
  if compile_:
    compiled = lowered.compile()
    out["compile"] = time.perf_counter() - t2
    out["hlo_instrs"] = len(_HLO_INSTR.findall(compiled.as_text()))
  out["total"] = time.perf_counter() - t0
  # The process's CPU seconds: on a loaded machine they move less than the wall time.
  out["cpu"] = time.process_time() - c0
  return out


def _run_one(name: str, leaves: int, chained: bool, timeout_s: float | None) -> dict[str, Any]:
  """``profile`` in a fresh process, or in this one when ``timeout_s`` is ``None``."""
  if timeout_s is None:
    return profile(name, leaves, chained)
  cmd = [sys.executable, "-m", "benchmarks._compile_table", "--one", name, str(leaves)]
  cmd += ["--chained"] if chained else []
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
  except subprocess.TimeoutExpired:
    return {"timeout": timeout_s}
  except subprocess.CalledProcessError as e:
    return {"error": (e.stderr or "").strip().splitlines()[-1:]}
  return json.loads(out.stdout.strip().splitlines()[-1])


def run(
  leaf_counts: list[int],
  names: list[str] | None = None,
  jobs: int = 1,
  repeats: int = 1,
  timeout_s: float | None = 600.0,
  modes: tuple[bool, ...] = (True, False),
) -> list[dict[str, Any]]:
  """One row per transform, leaf count and mode, with adam's median in the same run."""
  names = names if names is not None else every.factories()
  rows = []
  for leaves in leaf_counts:
    for chained in modes:
      order: list[str] = []
      for _ in range(repeats):
        for i, n in enumerate(names):
          if i % _ADAM_EVERY == 0:
            order.append(ADAM)
          order.append(n)
        order.append(ADAM)
      with concurrent.futures.ThreadPoolExecutor(jobs if timeout_s else 1) as pool:
        futures = [(n, pool.submit(_run_one, n, leaves, chained, timeout_s)) for n in order]
        results: dict[str, list[dict]] = {}
        for n, f in futures:
          r = f.result()
          results.setdefault(n, []).append(r)
          print(f"  {leaves:5d} {'chained' if chained else 'alone':7s} {n:30s} {r}", flush=True)
      adam = _median(results[ADAM])
      for n in names:
        rows.append(
          {"transform": n, "leaves": leaves, "chained": chained, "adam": adam}
          | {"t": _median(results[n])}
        )
  return rows


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
  ok = [r for r in runs if "total" in r]
  if not ok:
    return runs[0]
  return {k: statistics.median(r[k] for r in ok) for k in ok[0]}


def _ratio(row: dict[str, Any], key: str) -> str:
  t, a = row["t"], row["adam"]
  if key not in t or key not in a:
    return "timeout" if "timeout" in t else "error" if "error" in t else "n/a"
  return f"{t[key] / a[key]:.2f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, str]) -> str:
  out = [
    "# Compile time of every transform against adam's",
    "",
    "Generated by `python -m benchmarks --only transforms` (benchmarks/_compile_table.py).",
    "",
  ]
  out += [f"- {k}: {v}" for k, v in meta.items()]
  out += [
    "",
    "Trees of mixed 1-D and 2-D float32 leaves of 64-100 elements. `chained` compiles "
    "`optax.chain(t, optax.adam(1e-3)).update(updates, state, params)`; `alone` "
    "compiles `t.update`. Every ratio divides by `optax.adam`'s own update on the same "
    "tree, profiled in the same run between every few transforms (median of its runs): "
    "`compile x` is the ratio of the whole trace + lower + XLA compile, `cpu x` of the "
    "process CPU seconds they took, `jaxpr x` of the "
    "jaxpr equations, `HLO x` of the optimised HLO instructions. Each profile runs in a "
    "fresh process, unless the wall-time line says they ran in one.",
    "",
  ]
  for leaves in sorted({r["leaves"] for r in rows}):
    sub = [r for r in rows if r["leaves"] == leaves]
    adam = next(r["adam"] for r in sub if r["chained"])
    out += [
      f"## {leaves} leaves",
      "",
      f"adam alone: {adam.get('total', float('nan')):.2f} s (trace {adam.get('trace', 0):.2f}, "
      f"lower {adam.get('lower', 0):.2f}, compile {adam.get('compile', 0):.2f}), "
      f"{adam.get('jaxpr_eqns', 0):.0f} jaxpr equations, "
      f"{adam.get('hlo_instrs', 0):.0f} HLO instructions.",
      "",
      "| transform | chained: compile x | cpu x | jaxpr x | HLO x | s "
      "| alone: compile x | cpu x | HLO x | s |",
      "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted({r["transform"] for r in sub}):
      c = next((r for r in sub if r["transform"] == name and r["chained"]), None)
      a = next((r for r in sub if r["transform"] == name and not r["chained"]), None)
      cells = [name]
      chained_keys = ("total", "cpu", "jaxpr_eqns", "hlo_instrs")
      for r, keys in ((c, chained_keys), (a, ("total", "cpu", "hlo_instrs"))):
        if r is None:
          cells += ["-"] * (len(keys) + 1)
          continue
        cells += [_ratio(r, k) for k in keys]
        cells.append(f"{r['t']['total']:.2f}" if "total" in r["t"] else "-")
      out.append("| " + " | ".join(cells) + " |")
    out.append("")
  return "\n".join(out)


def _meta(argv: list[str]) -> dict[str, str]:
  import platform

  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {
    "command": "python -m benchmarks._compile_table " + " ".join(argv),
    "machine": f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on "
    f"{jax.devices()[0].platform}, optax {optax.__version__}",
    "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
  }


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--one", nargs=2, metavar=("NAME", "LEAVES"), help=argparse.SUPPRESS)
  p.add_argument("--chained", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--leaves", type=int, nargs="+", default=[400])
  p.add_argument("--only", nargs="+", default=None, help="these factories only")
  p.add_argument("--jobs", type=int, default=1, help="profiles run at once")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--modes", nargs="+", default=["chained", "alone"], choices=["chained", "alone"])
  p.add_argument(
    "--timeout",
    type=float,
    default=600.0,
    help="seconds one profile may take, each in a fresh process (0: all in this process)",
  )
  p.add_argument("--out", default=None, help="write the markdown table here")
  args = p.parse_args(argv)
  if args.one:
    print(json.dumps(profile(args.one[0], int(args.one[1]), args.chained)))
    return
  meta = _meta(argv)
  t0 = time.perf_counter()
  modes = tuple(m == "chained" for m in args.modes)
  rows = run(args.leaves, args.only, args.jobs, args.repeats, args.timeout or None, modes)
  meta["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  meta["wall time"] = f"{time.perf_counter() - t0:.0f} s" + (
    f" with {args.jobs} profiles at once, each in a fresh process"
    if args.timeout
    else ", every profile in one process"
  )
  text = markdown(rows, meta)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
