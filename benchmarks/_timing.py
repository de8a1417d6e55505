"""Timing helpers: compile time, and median wall times of steps timed interleaved."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def compile_seconds(fn: Callable, *args: Any) -> float:
  """Seconds to trace, lower and compile ``jax.jit(fn)`` for ``args``."""
  t0 = time.perf_counter()
  jax.jit(fn).lower(*args).compile()
  return time.perf_counter() - t0


def time_interleaved(
  steps: dict[str, tuple[Callable[[Any], tuple[Any, Any]], Any]], reps: int, warmup: int = 2
) -> dict[str, float]:
  """Median seconds of each step, the steps timed in turn, one call each, ``reps`` times over.

  ``steps`` maps a name to ``(step, state)``; ``step(state)`` returns
  ``(result, new_state)`` and the clock stops once ``result`` is ready.
  Interleaving makes every step sample the same stretch of time, so that a
  machine whose speed drifts does not skew their ratios; the order turns by
  one step each round (:func:`round_order`), so that no step is always timed
  first, or always right after the same one.
  """
  times = interleaved_samples(steps, reps, warmup)
  return {name: statistics.median(ts) for name, ts in times.items()}


def interleaved_samples(
  steps: dict[str, tuple[Callable[[Any], tuple[Any, Any]], Any]], reps: int, warmup: int = 2
) -> dict[str, list[float]]:
  """The seconds of every timed call of :func:`time_interleaved`, round by round.

  ``result[name][i]`` is the time of ``name``'s call in round ``i``, so that
  two steps' times at the same ``i`` were taken in the same round.
  """
  states = {name: state for name, (_, state) in steps.items()}
  times: dict[str, list[float]] = {name: [] for name in steps}
  for i in range(warmup + reps):
    for name in round_order(list(steps), i):
      step = steps[name][0]
      t0 = time.perf_counter()
      result, states[name] = step(states[name])
      jax.block_until_ready(result)
      if i >= warmup:
        times[name].append(time.perf_counter() - t0)
  return times


def round_order(names: list[str], i: int) -> list[str]:
  """``names`` turned by ``i``: round ``i`` of an interleaved timing starts at step ``i``.

  A step timed right after another pays for what that one left behind: on
  XLA:CPU, a call after ``method="vmap"``'s larger program took 8 % more CPU
  time than the same program after a smaller one (``benchmarks/results/ghost_peers.md``'s
  GPT, B = 32, T = 16, 28 November 2026: 1.38x against 1.28x the non-private
  step, where a fixed order put the ghost step after vmap's and ``"auto"``,
  the same program, after it). Turned, each step starts one round in every
  ``len(names)``, after the step that ended the round before; in that run the
  two columns running the same program read 1.30x and 1.29x. The step timed
  before a given one is still mostly the same (a shuffled order each round
  would vary it; not measured).
  """
  k = i % len(names) if names else 0
  return names[k:] + names[:k]
