"""Command line of the benchmark (``python -m benchmarks --help``)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import optax

import benchmarks
from benchmarks import _cases, _compile_cases, _compile_table, _model, _report, _standalone_cases
from tools.figure_record import package_sources, write_record
from workloads import trees

SECTIONS = ("train", "full-step", "standalone", "compile", "transforms", "sizes")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
  p.add_argument(
    "--quick",
    action="store_true",
    help="tiny sizes and few repetitions (a smoke test, no meaningful timings)",
  )
  p.add_argument(
    "--out",
    type=Path,
    default=benchmarks.RESULTS,
    help="folder for results.md and results.png (default: benchmarks/results/)",
  )
  p.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
  p.add_argument(
    "--shrink",
    type=int,
    default=None,
    help="divide GPT-2's widths by this (1 = the real 124M tree)",
  )
  p.add_argument(
    "--leaves",
    type=int,
    nargs="*",
    default=None,
    help="leaf counts of the compile sweep (default 10 100 1000 2000 5000)",
  )
  p.add_argument(
    "--compile-timeout",
    type=float,
    default=None,
    help="seconds one compile may take, each run in a fresh process "
    "(default 240; 0 runs them in this process with no limit)",
  )
  p.add_argument(
    "--compile-repeats",
    type=int,
    default=None,
    help="compiles per impl and leaf count, the median reported (default 3)",
  )
  p.add_argument(
    "--peak-gbps",
    type=float,
    default=None,
    help="the device's peak memory bandwidth, to report %% of peak (e.g. 3350 for an H100 SXM)",
  )
  p.add_argument("--no-torch", action="store_true", help="skip torch even if installed")
  p.add_argument("--skip", nargs="*", default=(), choices=SECTIONS, help="sections to skip")
  p.add_argument(
    "--only",
    nargs="+",
    default=None,
    choices=SECTIONS,
    help="run only these sections (e.g. --only full-step; --only transforms "
    "--leaves 400 5000 for every transform's compile against adam's, compile.md); "
    "overrides --skip",
  )
  return p


def _cpu_name() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _torch_version() -> str:
  try:
    import torch
  except ImportError:
    return "not installed (torch columns are n/a)"
  return torch.__version__


def main(argv: list[str] | None = None) -> str:
  args = _parser().parse_args(argv)
  quick = args.quick
  reps = args.reps or (2 if quick else 10)
  shrink = args.shrink or (64 if quick else 1)
  leaves = (
    args.leaves if args.leaves is not None else ([10] if quick else [10, 100, 1000, 2000, 5000])
  )
  timeout = args.compile_timeout if args.compile_timeout is not None else (0 if quick else 240)
  timeout = timeout or None
  with_torch = not args.no_torch
  run = set(args.only) if args.only else set(SECTIONS) - set(args.skip)
  shapes = trees.gpt2_shapes(shrink)
  device = jax.devices()[0]
  load_before = os.getloadavg()
  meta = {
    "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{_cpu_name()}, {os.cpu_count()} cores; jax device: {device.platform} "
    f"({device.device_kind})",
    "versions": f"python {platform.python_version()}, jax {jax.__version__}, jaxlib "
    f"{jaxlib.__version__}, optax {optax.__version__}, torch {_torch_version()}",
  }
  if run & {"train", "standalone"}:
    meta["train tree"] = (
      f"GPT-2 small shapes / {shrink}: {trees.num_params(shapes) / 1e6:.1f}M "
      f"float32 params in {len(shapes)} leaves"
    )
    meta["clip tree"] = f"the same {len(shapes)} leaves"
  meta["load average (1, 5, 15 min) at start"] = " ".join(f"{x:.2f}" for x in load_before)
  t_start = time.perf_counter()
  _cases.check_numbers(trees.gpt2_shapes(64))
  train, standalone, compile_rows, size_rows, temp_rows = [], [], [], [], []
  transform_rows, full_step = [], None
  if "standalone" in run:
    print("standalone clip ...", flush=True)
    for dtype in (jnp.float32,) if quick else (jnp.float32, jnp.bfloat16):
      standalone.append(
        _standalone_cases.run_standalone(shapes, dtype, reps, args.peak_gbps, with_torch)
      )
  if "train" in run:
    print("train steps ...", flush=True)
    train = _cases.run_train_steps(shapes, 2 * reps)
    if not quick:
      temp_rows = _cases.temp_bytes_table(trees.gpt2_shapes(max(shrink, 4)))
  if "full-step" in run:
    print("full train steps ...", flush=True)
    full_step = _cases.run_full_train_steps(_model.QUICK if quick else _model.FULL, 2 * reps)
  if "compile" in run:
    print("compile sweep ...", flush=True)
    mixed_at = None if quick or not leaves else max(leaves)
    repeats = args.compile_repeats or (1 if quick else 3)
    compile_rows = _compile_cases.run_compile_sweep(leaves, timeout, mixed_at, repeats)
    if leaves:
      print("transform compiles ...", flush=True)
      transform_rows = _compile_cases.run_transform_compiles(
        max(leaves), timeout, repeats, mixed=not quick
      )
    meta["compiles per impl and leaf count (median kept)"] = str(repeats)
  if "transforms" in run and "compile" not in run:
    # Only the table of every transform's compile time against adam's, chained
    # and alone, at each --leaves count: benchmarks/results/compile.md.
    print("transform compiles ...", flush=True)
    rows = _compile_table.run(leaves, repeats=args.compile_repeats or 1, timeout_s=timeout)
    text = _compile_table.markdown(rows, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile.md").write_text(text + "\n")
    print(text)
    return text
  if "sizes" in run:
    print("size sweep ...", flush=True)
    shrinks = [128] if quick else [16, 8, 4, 2, 1]
    size_rows = _standalone_cases.run_size_sweep(shrinks, reps, with_torch)
  meta["load average (1, 5, 15 min) at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  meta["total benchmark time"] = f"{time.perf_counter() - t_start:.0f} s"
  text = _report.markdown(
    meta,
    train,
    standalone,
    compile_rows,
    _compile_cases.COMPILE_IMPLS,
    size_rows,
    temp_rows,
    transform_rows,
    full_step,
  )
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "results.md").write_text(text + "\n")
  _report.plot(str(args.out / "results.png"), compile_rows, _compile_cases.COMPILE_IMPLS, size_rows)
  command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
  write_record(
    args.out / "results.png", package_sources("benchmarks") + package_sources("workloads"), command
  )
  print(text)
  return text
