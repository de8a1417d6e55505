"""Each example's overflow-safe L2 norm over leaves that share a leading batch axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _platform
from jaxclip._kernel._numerics._dtypes import tree_accumulation_dtype
from jaxclip._kernel._numerics._powers import scale_exponent, scaled_down, scaled_norm, times_pow2
from jaxclip._kernel._numerics._rescue import needs_rescaling
from jaxclip._kernel._numerics._scale import safe_divide
from jaxclip._kernel._numerics._terms import abs_sq, dims_size, max_term, safe_sqrt


class ScaledNorms(NamedTuple):
  """Per-example norms in scaled form: ``norm = 2**exponent * sqrt(sumsq)``.

  ``exponent`` (int32) is ``0`` where the fast sum was trusted, else that of
  the example's largest magnitude (:func:`scale_exponent`); ``sumsq`` is the
  sum of squares of the entries divided by ``2**exponent``; ``norms`` are
  the reported norms, saturated at ``finfo.max``.
  """

  exponent: jax.Array
  sumsq: jax.Array
  norms: jax.Array

  def clip_factor(self, max_norm: Any) -> jax.Array:
    """``min(1, max_norm / norm)`` from the scaled form, finite even where ``norm > finfo.max``.

    Computed as ``(max_norm / sqrt(sumsq)) * 2**-exponent``; a factor below
    the dtype's normal range is ``0`` on XLA:CPU, which flushes subnormals
    (the clipped example's norm is then ``0``, within the bound). ``nan`` for a
    non-finite norm, as :func:`clip_scale`; ``max_norm < 0`` acts as ``0``.
    """
    root = safe_sqrt(self.sumsq)
    c = jnp.maximum(jnp.asarray(max_norm, root.dtype), 0)
    clipping = self.norms >= c
    num = jnp.where(jnp.isfinite(self.norms), jnp.where(clipping, c, 1), jnp.nan)
    ratio = safe_divide(num, root, clipping & (root > 0))
    scale = jnp.where(clipping & (root > 0), -self.exponent, 0)
    return times_pow2(ratio, scale).astype(root.dtype)


def per_example_scaled_norms(leaves: Sequence[Any], acc: Any = None) -> ScaledNorms:
  """Each example's L2 norm over ``leaves`` that share a leading batch axis, overflow-safe.

  The fast pass sums each example's squares over every leaf. Where an
  example's sum :func:`needs_rescaling` (``inf``, or so small that squares
  were lost to subnormals) while its entries are finite, every example is
  recomputed scaled (one ``lax.cond`` on the batch's flag) and the rescaled
  examples take the scaled values.

  Args:
    leaves: arrays of shape ``(batch, ...)`` (at least one).
    acc: the accumulation dtype (default: the leaves' shared one).

  Returns:
    A :class:`ScaledNorms`; ``.norms`` is a ``(batch,)`` array.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxclip._kernel._numerics import per_example_scaled_norms
    >>> g = [jnp.array([[3e20, 4e20], [3.0, 4.0]]), jnp.zeros((2, 1))]
    >>> per_example_scaled_norms(g).norms
    Array([5.e+20, 5.e+00], dtype=float32)
  """
  leaves = [jnp.asarray(g) for g in leaves]
  acc = jnp.dtype(acc) if acc is not None else tree_accumulation_dtype(leaves)
  batch = leaves[0].shape[0]

  def per_example(term, op, arrays):
    parts = [
      _platform.reduce(term(g).reshape(batch, -1), op, (1,), False).astype(acc) for g in arrays
    ]
    stacked = jnp.stack(parts)
    return jnp.max(stacked, 0) if op == "max" else jnp.sum(stacked, 0)

  fast = per_example(abs_sq, "sum", leaves)
  size = sum(dims_size(g.shape[1:]) or 2**31 for g in leaves)
  needs = needs_rescaling(fast, size)
  zeros = jnp.zeros_like(fast, jnp.int32)  # varying as fast is, inside shard_map

  def slow(fast, needs):
    m = per_example(max_term, "max", leaves)
    e = scale_exponent(m)
    scaled = [scaled_down(g, jnp.reshape(e, (batch,) + (1,) * (g.ndim - 1))) for g in leaves]
    s = per_example(abs_sq, "sum", scaled)
    return (
      jnp.where(needs, e, 0),
      jnp.where(needs, s, fast),
      jnp.where(needs, scaled_norm(m, s, e), safe_sqrt(fast)),
    )

  def quick(fast, needs):
    return zeros, fast, safe_sqrt(fast)

  exponent, sumsq, norms = _platform.cond(jnp.any(needs), slow, quick, fast, needs)
  return ScaledNorms(exponent, sumsq, norms)


def per_example_norms(leaves: Sequence[Any], acc: Any = None) -> jax.Array:
  """The ``(batch,)`` overflow-safe L2 norms of :func:`per_example_scaled_norms`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxclip._kernel._numerics import per_example_norms
    >>> per_example_norms([jnp.array([[1e-30, 0.0], [3e30, 4e30]])])
    Array([1.e-30, 5.e+30], dtype=float32)
  """
  return per_example_scaled_norms(leaves, acc).norms
