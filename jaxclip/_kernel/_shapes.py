"""Shapes known before tracing, and symbolic dimensions (``jax.export``).

A program exported with a symbolic batch (``jax.export.symbolic_shape``) has
dimensions that cannot be compared with a constant. Every choice jaxclip
makes by a shape or a size reads it here: a size that is not a constant
counts as large, and a ``min`` of a symbolic dimension is JAX's own where it
offers one (the one JAX internal of this module).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


def is_symbolic(d: Any) -> bool:
  """Whether a dimension is symbolic (a batch exported with ``jax.export.symbolic_shape``)."""
  return jax.export.is_symbolic_dim(d)


def min_dim(d: Any, limit: int) -> Any:
  """``min(d, limit)`` for a dimension ``d`` that may be symbolic.

  A symbolic ``min`` where JAX offers one; otherwise ``limit`` (work padded
  up to ``limit`` rows, still exact).
  """
  if not is_symbolic(d):
    return min(d, limit)
  try:
    from jax._src import core as _core

    return _core.min_dim(d, limit)
  except (ImportError, AttributeError):
    return limit


def constant_size(x: Any) -> int | None:
  """The number of entries of ``x``, or ``None`` if a dimension is symbolic.

  Under ``jax.export`` a symbolic size cannot be compared with a constant:
  every choice made by size reads it here, and a size that is not a
  constant counts as large (such a leaf takes the plain path, whose ops
  accept any shape).
  """
  shape = x.shape if hasattr(x, "shape") else np.shape(x)
  return None if any(is_symbolic(d) for d in shape) else math.prod(shape)
