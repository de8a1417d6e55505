"""The platform switch, and which leaves the XLA:CPU choices treat as small."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxclip._kernel import _sharding
from jaxclip._kernel._validation import constant_size

# Leaves of at most this many elements are reduced together (grouping and
# segment reductions) and scaled by stacks.
SMALL_LEAF = 1024


def on_cpu(cpu: Callable[..., Any], default: Callable[..., Any], *args: Any) -> Any:
  """``cpu(*args)`` in programs lowered for CPU, ``default(*args)`` elsewhere.

  Both callables must compute the same values; only their speed differs.
  Both are traced, and only the one for the lowering platform is compiled.
  """
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def is_small(x: Any, limit: int = SMALL_LEAF) -> bool:
  """Non-empty with at most ``limit`` entries; a symbolic size counts as large."""
  size = constant_size(x)
  return size is not None and 0 < size <= limit


def segmentable(x: jax.Array) -> bool:
  """Small and whole on this device: concatenating a sharded array would gather it."""
  return is_small(x) and _sharding.layout(x) is _sharding.LOCAL
