"""The platform switches, and which leaves the XLA:CPU choices treat as small."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxclip._kernel import _sharding
from jaxclip._kernel._shapes import constant_size

# Leaves of at most this many elements are reduced together (grouping and
# segment reductions) and scaled by stacks.
SMALL_LEAF = 1024


def on_cpu(cpu: Callable[..., Any], default: Callable[..., Any], *args: Any) -> Any:
  """``cpu(*args)`` in programs lowered for CPU, ``default(*args)`` elsewhere.

  Both callables must compute the same values; only their speed differs.
  Both are traced, and only the one for the lowering platform is compiled.
  """
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def cond(flag: Any, slow: Callable[..., Any], fast: Callable[..., Any], *operands: Any) -> Any:
  """``jax.lax.cond(flag, slow, fast, *operands)``; decided in Python where ``flag`` is concrete.

  Called eagerly (no ``jax.jit`` around it), a ``lax.cond`` is compiled as a
  program of its own, both branches, at every call: the branches are
  closures traced anew each time, so jax's compile cache never hits. A
  rescue's ``cond`` made every eager call of ``jaxclip.ops.global_norm``
  take about half a second on XLA:CPU (optax's: 2 ms). With a concrete
  ``flag`` only the branch taken runs, op by op like the rest of an eager
  call, with the same values (and the same derivatives under an eager
  ``jax.grad``). Under a trace (``jit``, ``vmap``, ``shard_map``) it is
  ``lax.cond``.
  """
  if isinstance(flag, jax.core.Tracer):
    return jax.lax.cond(flag, slow, fast, *operands)
  return slow(*operands) if bool(flag) else fast(*operands)


def on_cuda(cuda: Callable[..., Any], default: Callable[..., Any], *args: Any) -> Any:
  """``cuda(*args)`` in programs lowered for CUDA GPUs, ``default(*args)`` elsewhere (ROCm too)."""
  return jax.lax.platform_dependent(*args, cuda=cuda, default=default)


@functools.cache
def cuda_in_process() -> bool:
  """Whether this process has a CUDA backend.

  The CUDA choices are staged only then: their kernels take seconds to trace
  for a tree of a hundred leaves, which a process that cannot run them should
  not pay. A program exported for ``cuda`` from a process without one runs
  the plain program there.
  """
  try:
    return bool(jax.devices("cuda"))
  except (RuntimeError, ValueError):  # no such backend in this process
    return False


def is_small(x: Any, limit: int = SMALL_LEAF) -> bool:
  """Non-empty with at most ``limit`` entries; a symbolic size counts as large."""
  size = constant_size(x)
  return size is not None and 0 < size <= limit


def segmentable(x: jax.Array) -> bool:
  """Small and whole on this device: concatenating a sharded array would gather it."""
  return is_small(x) and _sharding.layout(x) is _sharding.LOCAL
