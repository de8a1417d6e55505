"""What ``--peers`` measures: one compute thread, each call's CPU and wall time, peak memory."""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from benchmarks import _timing


def pin_one_thread(with_torch: bool) -> str:
  """Makes XLA's CPU client (and torch) run each step on one thread; says how.

  XLA sizes its CPU thread pool from the cores the process may run on when
  the client is made: the process is restricted to one core for that moment,
  then given all of them back, so the one compute thread may run on either.
  """
  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized():
    return "not pinned: jax's backend was started before --peers could pin it"
  flag = "--xla_cpu_multi_thread_eigen=false"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"
  cpus = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {min(cpus)})
  try:
    jax.devices()
    if with_torch:
      import torch

      torch.set_num_threads(1)
      torch.set_num_interop_threads(1)
  finally:
    os.sched_setaffinity(0, cpus)
  return (
    f"XLA's CPU client made on one core ({flag}), torch.set_num_threads(1) and "
    f"set_num_interop_threads(1), OMP_NUM_THREADS=1; then all {len(cpus)} cores allowed"
  )


def _thread_cpu_ns() -> dict[str, int]:
  out = {}
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/schedstat") as f:
        out[tid] = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
      pass
  return out


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status")


def _block(out: Any) -> None:
  for leaf in jax.tree.leaves(out):
    if isinstance(leaf, jax.Array):
      leaf.block_until_ready()


def peak_mb(step: Callable[[], Any]) -> float | None:
  """MiB of resident memory that one call of ``step`` adds at its peak (Linux only)."""
  try:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: RSS is what is live
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets VmHWM to the current RSS
    out = step()
    _block(out)
    peak = _status_kib("VmHWM")
    del out
  except (OSError, RuntimeError, AttributeError):
    return None
  return (peak - before) / 1024


def time_interleaved(steps: dict[str, Callable[[], Any]], reps: int, warmup: int = 1) -> dict:
  """The steps called in turn, ``reps`` rounds: ``{name: (wall s, CPU s, busiest share)}``.

  Each is a list, one entry per round: the call's wall-clock seconds, the CPU
  seconds of all the process's threads during it (``time.process_time``), and
  the busiest thread's share of the CPU time (from each thread's
  ``schedstat``, which lags by up to a scheduler tick). The order turns by
  one step each round (:func:`benchmarks._timing.round_order`).
  """
  out: dict[str, tuple[list[float], list[float], list[float]]] = {
    name: ([], [], []) for name in steps
  }
  for i in range(warmup + reps):
    for name in _timing.round_order(list(steps), i):
      step = steps[name]
      before = _thread_cpu_ns()
      c0, t0 = time.process_time(), time.perf_counter()
      _block(step())
      dt, dc = time.perf_counter() - t0, time.process_time() - c0
      after = _thread_cpu_ns()
      used = [after[t] - before.get(t, 0) for t in after]
      if i >= warmup:
        out[name][0].append(dt)
        out[name][1].append(dc)
        out[name][2].append(max(used) / sum(used) if sum(used) > 0 else float("nan"))
  return out
