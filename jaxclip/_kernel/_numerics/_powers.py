"""Exact scaling by powers of two: how a rescued norm divides and multiplies back.

Division by a large maximum is not safe on XLA:CPU, which multiplies by the
reciprocal and flushes a subnormal one to zero; a power of two is exact.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _platform
from jaxclip._kernel._numerics._dtypes import accumulation_dtype, convert
from jaxclip._kernel._numerics._terms import safe_sqrt


def _pow2(k: jax.Array, dtype: Any) -> jax.Array:
  """``2.0**k`` in ``dtype`` (float32 or float64), exactly, for ``k`` in the normal range."""
  dtype = jnp.dtype(dtype)
  info = jnp.finfo(dtype)
  bits, itype = (23, jnp.int32) if dtype == jnp.float32 else (52, jnp.int64)
  biased = jnp.clip(k, info.minexp, info.maxexp - 1).astype(itype) - (info.minexp - 1)
  return jax.lax.bitcast_convert_type(jax.lax.shift_left(biased, itype(bits)), dtype)


def times_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
  """``x * 2**k`` by two exact multiplications by normal powers of two.

  Division by a large maximum is not safe on XLA:CPU: it multiplies by the
  reciprocal, a subnormal that it flushes to zero. Powers of two are exact,
  so ``x * 2**-k * 2**k == x`` wherever nothing over- or underflows.
  ``x`` is float32 or float64 (real or complex); ``k`` an integer array
  broadcastable against it.
  """
  real = jnp.finfo(x.dtype).dtype
  limit = 2 * (jnp.finfo(real).maxexp - 2)
  k = jnp.clip(jnp.asarray(k), -limit, limit)
  half = jax.lax.div(k, jnp.asarray(2, k.dtype))
  for part in (half, k - half):
    factor = _pow2(part, real)
    x = x * (factor.astype(x.dtype) if jnp.iscomplexobj(x) else factor)
  return x


def scale_exponent(m: jax.Array) -> jax.Array:
  """The int32 ``e`` with ``m / 2**e`` in ``[0.5, 1)``; ``0`` where ``m`` is 0 or not finite.

  ``np.frexp``'s exponent, read from the bits of ``m`` (float32 or float64; a
  half-precision ``m`` is read as float32, exactly), for every positive finite
  ``m``, subnormal ones included; ``0`` for zero, negative, infinite and NaN
  ``m`` (``m`` is a largest magnitude: non-negative where it is finite).

  Integer ops on the bits, so that XLA:CPU, which reads subnormal floats as zero (DAZ:
  a subnormal ``m`` compares ``m > 0`` false there), still gives a subnormal
  ``m`` its exact exponent. The callers test ``m > 0`` themselves; and a value
  ``|x| <= m`` scaled by this ``2**-e`` (:func:`times_pow2`) lies in ``[0, 1)``
  whether or not the platform flushes it: none overflows.
  """
  m = jnp.asarray(m)
  if m.dtype.itemsize < 4:
    m = m.astype(jnp.float32)
  info = jnp.finfo(m.dtype)
  width, nmant, bias = info.bits, info.nmant, info.maxexp - 1
  itype = jnp.int32 if width == 32 else jnp.int64
  bits = jax.lax.bitcast_convert_type(m, itype)
  field = jax.lax.shift_right_logical(bits, itype(nmant))  # the biased exponent where m >= 0
  mantissa = jax.lax.bitwise_and(bits, itype((1 << nmant) - 1))
  # The bit length of the integer m / 2**(1 - bias - nmant) (m in smallest subnormals):
  # field + nmant for a normal m, the mantissa's bit length for a subnormal one (field 0).
  lead = jax.lax.select(field > 0, field + itype(nmant), itype(width) - jax.lax.clz(mantissa))
  e = (lead - itype(nmant + bias - 1)).astype(jnp.int32)
  # Positive and finite: the sign bit clear (bits > 0 as a signed integer), below inf's bits.
  ok = (bits > 0) & (bits < itype((2 * bias + 1) << nmant))
  # Every operand derives from m, so that under vmap with spmd_axis_name on an Explicit mesh
  # each carries the batch's sharding. jnp.frexp's did not: on jax 0.10.0 a select inside it
  # joins an unsharded case, on 0.12 its exponent of a 0-d value under vmap has no mesh.
  return jax.lax.select(ok, e, jnp.zeros_like(e))


def scaled_down(x: jax.Array, e: jax.Array) -> jax.Array:
  """``x / 2**e`` in the accumulation dtype (complex stays complex); ``e`` broadcasts."""
  x = _platform.reduction_input(jnp.asarray(x))
  acc = accumulation_dtype(x.dtype)
  if jnp.iscomplexobj(x):
    x = x.astype(jnp.complex128 if acc == jnp.float64 else jnp.complex64)
  else:
    x = convert(x, acc)
  return times_pow2(x, -e)


def scaled_norm(m: jax.Array, s: jax.Array, e: jax.Array, ord: float = 2) -> jax.Array:
  """The norm ``2**e * sqrt(s)`` (``2**e * s`` for ``ord=1``), saturated at ``finfo.max``.

  ``m`` is the maximum magnitude, ``e`` its :func:`scale_exponent` and ``s``
  the sum of the terms of the entries divided by ``2**e``. ``m == 0`` gives
  ``0``, a non-finite ``m`` itself (an ``inf`` or NaN entry).
  """
  root = safe_sqrt(s) if ord == 2 else s
  finite = jnp.isfinite(m)
  # Where m == 0 a constant 0, so that the derivative at zero is 0 (as safe_sqrt's).
  norm = jnp.where(finite & (m > 0), times_pow2(root, e), jnp.where(finite, 0, m))
  return jnp.where(finite, jnp.minimum(norm, jnp.finfo(norm.dtype).max), norm)


def combine_scaled(
  maxima: jax.Array, exps: jax.Array, sums: jax.Array, ord: float = 2
) -> jax.Array:
  """The norm of parts each scaled on its own: ``sums[i]`` of entries divided by ``2**exps[i]``.

  Each part's sum is brought to the largest part's exponent (a part of only
  zeros counts for nothing), then :func:`scaled_norm`.
  """
  m = jnp.max(maxima)
  nonzero = maxima > 0
  floor = jnp.iinfo(jnp.int32).min // 4
  exps = jnp.where(nonzero, exps, floor)
  top = jnp.max(exps)
  shift = exps - top
  shifted = times_pow2(sums, 2 * shift if ord == 2 else shift)
  total = jnp.sum(jnp.where(nonzero, shifted, 0))
  return scaled_norm(m, total, jnp.where(jnp.any(nonzero), top, 0), ord)


def wider(real: Any, dtype: Any) -> jnp.dtype:
  """The wider of float dtype ``real`` and ``dtype``'s precision, complex where ``dtype`` is.

  Explicit, as ``jnp.result_type`` refuses mixed float widths under strict promotion.
  """
  real, dtype = jnp.dtype(real), jnp.dtype(dtype)
  width = max(jnp.finfo(real).bits, jnp.finfo(dtype).bits)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.dtype(jnp.complex128 if width == 64 else jnp.complex64)
  return real if jnp.finfo(real).bits >= jnp.finfo(dtype).bits else dtype


def pow2_pair(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(2**k, 2**-k)`` that bring ``m >= 0`` into ``[0.5, 4)`` as ``m * 2**k``, from its bits.

  Both are normal (``|k| <= bias - 1``): an ``m`` at the top of the range lands in
  ``[2, 4)``, a zero or subnormal ``m`` is multiplied by ``2**(bias - 1)``, an ``inf`` or
  NaN stays what it is. Fewer integer ops than :func:`scale_exponent` (no exact
  exponent of a subnormal, no case for 0 or non-finite ``m``): the rescue of
  :func:`leaf_norm` is traced once per leaf.
  """
  info = jnp.finfo(m.dtype)
  bias, bits = info.maxexp - 1, info.nmant
  itype = jnp.int32 if m.dtype.itemsize == 4 else jnp.int64
  field = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(m, itype), itype(bits))
  # The biased exponent of 2**k is 2 * bias - 1 - field, kept within [1, 2 * bias - 1].
  biased = jax.lax.clamp(itype(1), itype(2 * bias - 1) - field, itype(2 * bias - 1))
  up = jax.lax.bitcast_convert_type(jax.lax.shift_left(biased, itype(bits)), m.dtype)
  down = jax.lax.bitcast_convert_type(
    jax.lax.shift_left(itype(2 * bias) - biased, itype(bits)), m.dtype
  )
  return up, down
