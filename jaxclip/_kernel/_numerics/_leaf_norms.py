"""One leaf's norm, and each leaf's share of a tree's norm or count."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _platform, _shapes
from jaxclip._kernel._numerics._dtypes import as_array
from jaxclip._kernel._numerics._rescue import leaf_norm_rescued
from jaxclip._kernel._numerics._terms import (
  Axes,
  abs_sq,
  canonical_axes,
  norm_op,
  norm_term,
  safe_abs,
)


def leaf_sumsq(x: jax.Array, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """``sum(|x|**2)`` over ``axis`` (all axes if ``None``), accumulated in float32+."""
  x = jnp.asarray(x)
  axes = canonical_axes(x.ndim, axis)
  return _platform.reduce(abs_sq(x), "sum", axes, keepdims, of_float16=x.dtype == jnp.float16)


def leaf_norm(x: jax.Array, ord: float = 2, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """The ``ord``-norm of ``x`` over ``axis`` (all axes if ``None``).

  Returned in the accumulation dtype of ``x``. ``ord`` must already be
  normalised by ``_validation.check_ord`` (1, 2 or ``inf``).
  """
  x = jnp.asarray(x)
  axes = canonical_axes(x.ndim, axis)
  if ord == 2:
    return leaf_norm_rescued(x, ord, axes, keepdims, leaf_sumsq(x, axes, keepdims))
  op = "sum" if ord == 1 else "max"
  fast = _platform.reduce(safe_abs(x), op, axes, keepdims, of_float16=x.dtype == jnp.float16)
  return fast if ord == math.inf else leaf_norm_rescued(x, ord, axes, keepdims, fast)


def leaf_norm_shares(
  leaves: list[Any], ord: float, acc: jnp.dtype, term: Any = None
) -> list[jax.Array]:
  """Each leaf's share of a tree norm, in ``acc``: ``sum |x|**2``, ``sum |x|`` or ``max |x|``.

  One reduction per leaf, no leaf copied. Shares are added (maxed for
  ``ord=inf``) across leaves; the ``2``-norm is the root of their sum.
  """
  term, op = term or norm_term(ord), norm_op(ord)
  return [_platform.share(as_array(x), term, op).astype(acc) for x in leaves]


def count_sum(indicators: list[jax.Array]) -> jax.Array:
  """The sum of every entry of ``indicators`` (integer arrays), one int32 scalar.

  Summed by :func:`jaxclip._kernel._platform.count_all` (on XLA:CPU the small
  arrays by one segment reduction).
  """
  arrays = [
    jax.lax.convert_element_type(x, jnp.int32) for x in indicators if _shapes.constant_size(x) != 0
  ]
  return _platform.count_all(arrays) if arrays else jnp.zeros((), jnp.int32)
