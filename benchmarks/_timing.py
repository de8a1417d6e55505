"""Timing helpers: median wall time of a donated, jitted function."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def time_loop(step: Callable[[Any], Any], state: Any, reps: int, warmup: int = 2
              ) -> tuple[float, Any]:
  """Median seconds of ``state = step(state)`` (blocked), after ``warmup`` calls."""
  for _ in range(warmup):
    state = jax.block_until_ready(step(state))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state = jax.block_until_ready(step(state))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), state


def time_call(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
  """Median seconds of ``fn()`` (whose result is blocked on)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def compile_seconds(fn: Callable, *args: Any) -> float:
  """Seconds to trace, lower and compile ``jax.jit(fn)`` for ``args``."""
  t0 = time.perf_counter()
  jax.jit(fn).lower(*args).compile()
  return time.perf_counter() - t0
