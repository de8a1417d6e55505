"""The elementwise terms a norm reduces, the safe square root, and the axes it reduces over.

The square root has a custom JVP whose tangent is zero at zero, so
``jax.grad`` through any clip is finite at an all-zero input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxclip._kernel import _platform, _shapes
from jaxclip._kernel._numerics._dtypes import accumulation_dtype, convert

Axes = int | Sequence[int] | None


@jax.custom_jvp
def safe_sqrt(x: jax.Array) -> jax.Array:
  """``sqrt(x)`` for ``x >= 0`` whose derivative at ``0`` is ``0``, not ``inf``."""
  return jnp.sqrt(x)


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  y = jnp.sqrt(x)
  positive = x > 0
  # The coefficient is a primal value, so the transposed (reverse-mode) rule
  # multiplies the cotangent by an exact zero where x == 0: no 0 * inf.
  coef = jnp.where(positive, 0.5 / jnp.where(positive, y, 1), 0).astype(y.dtype)
  return y, coef * dx


def canonical_axes(ndim: int, axis: Axes) -> tuple[int, ...] | None:
  if axis is None:
    return None
  if isinstance(axis, int):
    axis = (axis,)
  out = []
  for a in axis:
    a = int(a)
    if not -ndim <= a < ndim:
      raise ValueError(f"axis {a} is out of bounds for a leaf of rank {ndim}.")
    out.append(a % ndim)
  return tuple(out)


def kept_shape(shape: tuple[int, ...], axis: Axes) -> tuple[int, ...]:
  """``shape`` with the dimensions of ``axis`` (all if ``None``) set to 1: a kept-dims norm's."""
  axes = canonical_axes(len(shape), axis)
  axes = range(len(shape)) if axes is None else axes
  return tuple(1 if i in axes else d for i, d in enumerate(shape))


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|**2`` elementwise, in ``x``'s accumulation dtype."""
  x = _platform.reduction_input(jnp.asarray(x))
  acc = accumulation_dtype(x.dtype)
  if jnp.iscomplexobj(x):
    re, im = convert(jax.lax.real(x), acc), convert(jax.lax.imag(x), acc)
    return jax.lax.add(jax.lax.mul(re, re), jax.lax.mul(im, im))
  x = convert(x, acc)
  return jax.lax.mul(x, x)


def safe_abs(x: jax.Array) -> jax.Array:
  """``|x|`` elementwise in the accumulation dtype; finite gradient at 0."""
  x = _platform.reduction_input(jnp.asarray(x))
  if jnp.iscomplexobj(x):
    return safe_sqrt(abs_sq(x))
  return jax.lax.abs(convert(x, accumulation_dtype(x.dtype)))


def norm_term(ord: float) -> Callable[[jax.Array], jax.Array]:
  """The elementwise term an ``ord``-norm reduces: ``|x|**2`` for 2, ``|x|`` otherwise."""
  return abs_sq if ord == 2 else safe_abs


def norm_op(ord: float) -> str:
  """How an ``ord``-norm combines its terms, within a leaf and across leaves."""
  return "max" if ord == math.inf else "sum"


def max_term(x: jax.Array) -> jax.Array:
  """A magnitude that cannot overflow, within ``sqrt(2)`` of ``|x|``: ``max(|re|, |im|)``.

  What the rescaled norms divide by: for a complex ``x`` the modulus itself
  overflows where its squares do.
  """
  x = _platform.reduction_input(jnp.asarray(x))
  if jnp.iscomplexobj(x):
    acc = accumulation_dtype(x.dtype)
    re, im = convert(jax.lax.real(x), acc), convert(jax.lax.imag(x), acc)
    return jax.lax.max(jax.lax.abs(re), jax.lax.abs(im))
  return safe_abs(x)


def constant_size_of(x: jax.Array, axes: tuple[int, ...] | None) -> int | None:
  """The number of entries of ``x`` over ``axes`` (all if ``None``); ``None`` if symbolic."""
  return dims_size(x.shape if axes is None else [x.shape[a] for a in axes])


def dims_size(dims) -> int | None:
  if any(_shapes.is_symbolic(d) for d in dims):
    return None
  return math.prod(dims)
