"""The safe factors, and how a leaf is multiplied by one.

The clip factor ``max_norm / max(norm, max_norm)`` is written so that a zero
threshold with a zero norm gives ``0``, an infinite threshold gives ``1``
and a non-finite norm gives ``nan`` (the failure stays visible). A
half-precision leaf is scaled in float32 and cast back; under ``jit`` XLA
fuses the casts into the scale, so no float32 copy of the leaf is
materialised.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _platform, _sharding
from jaxclip._kernel._numerics._dtypes import compute_dtype, convert
from jaxclip._kernel._typing import ArrayLike


def computed_once(flag: jax.Array) -> jax.Array:
  """The boolean scalar ``flag``, computed in one kernel that its consumers read.

  Why: XLA copies cheap scalar ops (comparisons, ``and``, selects, maxima)
  into the kernel of each of their consumers. A flag that combines a result
  from every leaf, and that every leaf's select then reads, is recomputed in
  every leaf's kernel: compile time quadratic in the number of leaves. XLA
  does not copy a square root,
  so the flag goes through one: ``sqrt`` of ``0`` or ``1`` is exact, and its
  conversion back to a boolean (``!= 0``) is the one op each consumer copies.
  Trick ``computed_once``: off, ``flag`` as it is.
  """
  flag = jnp.asarray(flag)
  if not _platform.is_on("computed_once"):
    return flag
  return jax.lax.convert_element_type(jnp.sqrt(flag.astype(jnp.float32)), jnp.bool_)


def clip_scale(norm: jax.Array, max_norm: Any) -> jax.Array:
  """The factor ``max_norm / max(norm, max_norm)``, safe at every edge.

  ============================  =========
  case                          factor
  ============================  =========
  ``norm < max_norm``           ``1``
  ``norm >= max_norm > 0``      ``max_norm / norm``
  ``norm == max_norm == 0``     ``0`` (zeros stay zeros, gradient 0)
  ``max_norm == inf``           ``1``
  ``max_norm < 0`` (traced)     acts as ``0``
  ``max_norm`` is ``nan``       ``nan`` (traced; visible, as optax)
  ``norm`` is ``inf``/``nan``   ``nan``
  ============================  =========
  """
  norm = jnp.asarray(norm)
  max_norm = jnp.asarray(max_norm, norm.dtype)
  # A NaN threshold (traced: a schedule gone bad) gives NaN, visibly, as
  # optax's clip does; it would otherwise fail the comparison and not clip.
  valid = jnp.isfinite(norm) & jnp.logical_not(jnp.isnan(max_norm))
  max_norm = jnp.maximum(max_norm, 0)
  clipping = norm >= max_norm
  numerator = jnp.where(valid, jnp.where(clipping, max_norm, 1), jnp.nan)
  return safe_divide(numerator, norm, clipping & (norm > 0)).astype(norm.dtype)


def safe_divide(
  num: ArrayLike, den: ArrayLike, where: ArrayLike, otherwise: Any = None
) -> jax.Array:
  """``num / den`` where ``where`` holds; elsewhere ``num`` (or ``otherwise``) over ``1``.

  The one safe division of jaxclip's scale factors. The denominator is
  replaced by ``1`` where ``where`` is false, so neither the value nor its
  gradient divides by zero; with ``otherwise`` the numerator is replaced
  there too, giving ``otherwise`` exactly. The division comes last, so XLA
  computes the factor once rather than copying its selects into every
  consumer's kernel.

  Args:
    num: the numerator.
    den: the denominator; only read where ``where`` holds.
    where: where to divide (broadcasts against ``num`` and ``den``).
    otherwise: the result where ``where`` is false (``None``: ``num``).

  Returns:
    The quotient, in the dtype ``num / den`` has.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxclip._kernel._numerics import safe_divide
    >>> n = jnp.array([0.0, 4.0])
    >>> safe_divide(2.0, n, n > 2.0, otherwise=1.0)
    Array([1. , 0.5], dtype=float32)
  """
  if otherwise is not None:
    num = jnp.where(where, num, otherwise)
  return num / jnp.where(where, den, 1)


def apply_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``x * scale`` formed in :func:`compute_dtype`, in ``x.dtype``; ``x`` where ``scale == 1``.

  ``scale`` is a scalar or broadcasts against ``x`` with the same rank (a
  norm taken with ``keepdims=True``).
  """
  x, scale = jnp.asarray(x), jnp.asarray(scale)
  dtype = compute_dtype(x.dtype)
  scale = convert(scale, dtype)
  # A scalar factor's test stays scalar: a broadcast one would carry no
  # sharding of its own and select refuses it against a sharded leaf.
  # (A per-leaf factor of one entry, a keepdims norm, is tested as a scalar too;
  # a factor per row or column of a leaf laid out over an Explicit mesh is
  # multiplied without the test.)
  scalar_one = (
    jax.lax.eq(jnp.reshape(scale, ()), jnp.ones((), scale.dtype)) if scale.size == 1 else None
  )
  if scalar_one is None and _sharding.layout(x) is not _sharding.LOCAL:
    if scale.shape != x.shape:
      dims = tuple(range(x.ndim - scale.ndim, x.ndim))
      scale = jax.lax.broadcast_in_dim(scale, x.shape, dims)
    return convert(jax.lax.mul(convert(x, dtype), scale), x.dtype)
  if scale.shape != x.shape:
    dims = tuple(range(x.ndim - scale.ndim, x.ndim))
    scale = jax.lax.broadcast_in_dim(scale, x.shape, dims)
  product = convert(jax.lax.mul(convert(x, dtype), scale), x.dtype)
  # A factor of exactly 1 passes the entry through bit for bit: XLA:CPU
  # flushes a subnormal times 1.0 to zero. The select is elementwise in the
  # scale's own kernel, no pass of its own.
  one = scalar_one if scalar_one is not None else jax.lax.eq(scale, jax.lax.full_like(scale, 1))
  return jax.lax.select(one, x, product)


def scale_entries_above(x: jax.Array, bound: jax.Array, factor: jax.Array) -> jax.Array:
  """``x * factor`` where ``|x| > bound``, else ``x``, formed in :func:`compute_dtype`.

  ``bound`` and ``factor`` are scalars; the result is in ``x.dtype``. In
  ``lax``, as :func:`apply_scale`: it runs once per leaf.
  """
  x = jnp.asarray(x)
  dtype = compute_dtype(x.dtype)
  xc = convert(x, dtype)
  magnitude = jax.lax.abs(xc)
  bound = jax.lax.broadcast(convert(jnp.asarray(bound), magnitude.dtype), x.shape)
  factor = jax.lax.broadcast(convert(jnp.asarray(factor), dtype), x.shape)
  over = jax.lax.gt(magnitude, bound)
  return convert(jax.lax.select(over, jax.lax.mul(xc, factor), xc), x.dtype)
