"""Where a leaf's sums accumulate and its products are formed.

* sums of squares accumulate in float32 whatever the leaf dtype (float64 for
  float64 leaves under ``jax_enable_x64``), within a leaf *and* across leaves,
  so bfloat16 trees do not lose precision and float16 trees do not overflow;
* scaling a half-precision leaf multiplies in float32 (:func:`compute_dtype`)
  and casts back, so the product cannot overflow;
* statistics kept in float32 saturate rather than overflow.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype: Any) -> jnp.dtype:
  """The real dtype in which sums over a leaf of ``dtype`` are accumulated.

  float64 / complex128 leaves accumulate in float64; every other inexact
  dtype (bfloat16, float16, float32, complex64) in float32.
  """
  dtype = jnp.dtype(dtype)
  real = jnp.finfo(dtype).dtype  # complex64 -> float32, complex128 -> float64
  if real == jnp.dtype(jnp.float64):
    # Canonical: float32 with x64 off (a NumPy float64 leaf), so that no
    # float64 is requested (and no truncation warned about).
    return jnp.dtype(jax.dtypes.canonicalize_dtype(real))
  return jnp.dtype(jnp.float32)


def upcast_for_accumulation(x: jax.Array) -> jax.Array:
  """``x`` in :func:`accumulation_dtype` (float32, or float64 for float64 leaves)."""
  return x.astype(accumulation_dtype(x.dtype))


def hparam_float32(x: Any) -> jax.Array:
  """A hyperparameter or statistic as a float32 array.

  Hyperparameters may arrive as Python numbers, NumPy values or (from
  ``optax.inject_hyperparams``) arrays of another float dtype; an adaptive
  statistic is kept in float32 whatever the leaves' dtype.
  """
  return jnp.asarray(x).astype(jnp.float32)


def tree_accumulation_dtype(tree: Any) -> jnp.dtype:
  """The accumulation dtype shared by the inexact leaves of ``tree`` (float32 if none).

  Other leaves (integers, booleans, PRNG keys, ``float0``) are ignored, so any
  params tree optax accepts can size a transform's state.
  """
  dtypes = set()
  for x in jax.tree.leaves(tree):
    dtype = getattr(x, "dtype", None)
    if dtype is None and isinstance(x, (float, complex)):
      dtype = jnp.result_type(x)
    if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
      dtypes.add(accumulation_dtype(dtype))
  return jnp.dtype(jnp.float64) if jnp.dtype(jnp.float64) in dtypes else jnp.dtype(jnp.float32)


def compute_dtype(dtype: Any) -> jnp.dtype:
  """The dtype in which products with a leaf of ``dtype`` are formed.

  float32 for the half-precision dtypes (so a product cannot overflow
  float16), the leaf's own dtype otherwise.
  """
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if dtype in _HALF_DTYPES else dtype


def as_array(x: Any) -> jax.Array:
  """``x`` as a jax array; an array (or tracer) is returned as is, with no traced op."""
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def convert(x: jax.Array, dtype: Any) -> jax.Array:
  """``x.astype(dtype)`` as one primitive, nothing when the dtype matches.

  The hot per-leaf paths use ``lax`` directly: ``jnp`` functions are nested
  ``jit`` calls, and thousands of them make tracing a big tree slow.
  """
  return x if x.dtype == dtype else jax.lax.convert_element_type(x, dtype)


def saturated_float32(x: Any) -> jax.Array:
  """``x`` as float32, a finite value beyond float32's range saturated at its ``finfo.max``.

  A norm of float64 leaves kept by a float32 statistic stays finite; ``inf``
  and NaN stay what they are.
  """
  x = jnp.asarray(x)
  if x.dtype == jnp.float32:
    return x
  big = float(jnp.finfo(jnp.float32).max)
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x).astype(jnp.float32)


def saturate(x: Any) -> jax.Array:
  """``x`` with finite overflows held at its dtype's largest magnitude: ``inf`` -> ``finfo.max``.

  For statistics (EMAs of norms and of their squares) fed only finite
  values: a sum that overflowed is saturated, so that one huge finite norm
  cannot leave a statistic ``inf`` for good. NaN stays NaN.
  """
  x = jnp.asarray(x)
  big = jnp.finfo(x.dtype).max
  # One clamp: a per-tensor rule runs this once per leaf on other platforms
  # (jnp's where and clip are nested jits). XLA's clamp is max then min, both
  # NaN-propagating, so NaN stays NaN.
  return jax.lax.clamp(jnp.asarray(-big, x.dtype), x, jnp.asarray(big, x.dtype))
