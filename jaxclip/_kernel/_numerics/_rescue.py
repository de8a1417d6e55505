"""Norms that neither overflow nor underflow: a fast sum, rescued where it cannot be trusted."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _platform
from jaxclip._kernel._numerics._dtypes import convert
from jaxclip._kernel._numerics._powers import pow2_pair, wider
from jaxclip._kernel._numerics._terms import constant_size_of, max_term, norm_term, safe_sqrt

# ----------------------------------------------------------------------------
# Norms that neither overflow nor underflow
# ----------------------------------------------------------------------------
#
# Every norm is first taken the fast way: one pass of sums of squares (or of
# |x|) in the accumulation dtype. That sum overflows to ``inf`` once an entry
# reaches about 1.8e19 in float32, and loses its terms to subnormals (XLA:CPU
# flushes them to zero) once the entries fall below about 1e-19. Where the
# fast total is ``inf``, or below ``size * tiny / eps`` (the most the lost
# terms can matter), the norm is recomputed scaled: ``m = max |x|``, then
# ``m * sqrt(sum (x / m)**2)``. The choice is a ``lax.cond`` on one scalar
# (``any`` of the flags), so the common case runs only the fast pass; under
# ``jax.vmap`` a batched flag makes both branches run.
#
# Edges: a NaN entry gives NaN; an ``inf`` entry gives ``inf`` (TF's
# semantics, the failure stays visible); finite entries whose true norm
# exceeds the dtype's largest value give that largest value
# (``finfo.max``), so the clip factor ``c / finfo.max`` is finite and the
# clipped update too. Entries that are themselves subnormal count as zero on
# XLA:CPU, which flushes them in every arithmetic op.


def _size_bound(size: int | None) -> int:
  return 2**31 if size is None else max(int(size), 1)


def needs_rescaling(total: jax.Array, size: Any) -> jax.Array:
  """Where a fast sum of ``size`` non-negative terms is not to be trusted.

  ``True`` where ``total`` is ``inf`` (a square overflowed, or an entry is
  ``inf``) or below ``size * tiny / eps`` (a square may have been lost as a
  subnormal: each loses at most ``tiny``). ``False`` for NaN: the rescaled
  norm of a NaN entry is NaN as well.

  Args:
    total: the fast totals, of a real dtype.
    size: the number of terms in each total (``None``: unknown, taken as
      ``2**31``), or a sequence of them, one per entry of a vector ``total``.

  Returns:
    A boolean array of ``total``'s shape.
  """
  total = jnp.asarray(total)
  info = jnp.finfo(total.dtype)
  sizes = [size] if size is None or isinstance(size, int) else list(size)
  bounds = np.minimum(
    float(info.max),
    np.array([_size_bound(n) for n in sizes], np.float64) * float(info.tiny) / float(info.eps),
  ).astype(total.dtype)
  if size is None or isinstance(size, int):
    low = bounds[0]
  else:
    # Runs of equal bounds as broadcast scalars, not an array constant: a jitted
    # program hoists array constants into arguments, which jax 0.10's compiled
    # gradients of a ``lax.cond`` were then called without.
    runs = [(b, len(list(g))) for b, g in itertools.groupby(bounds.tolist())]
    pieces = [jnp.full((n,), b, total.dtype) for b, n in runs]
    low = pieces[0] if len(pieces) == 1 else jax.lax.concatenate(pieces, 0)
  return (total == jnp.inf) | (total < low)


@_platform.cache(maxsize=1024)
def any_needs_rescaling(size: int | None) -> Callable[[jax.Array], jax.Array]:
  """``jnp.any(needs_rescaling(total, size))`` as a jitted function of ``total``.

  One cached equation per call: a tree's per-leaf flags cost one equation
  per leaf, not a comparison's few.
  """
  return jax.jit(lambda total: jnp.any(needs_rescaling(total, size)))


def rescued_norm(
  total: jax.Array, ord: float, size: int | None, rescue: Callable[[], jax.Array]
) -> jax.Array:
  """The norm from a fast ``total``, recomputed by ``rescue()`` where needed.

  ``total`` holds fast sums (of squares for ``ord=2``, of ``|x|`` for
  ``ord=1``; maxima for ``ord=inf``, returned as they are: a maximum cannot
  overflow). Where :func:`needs_rescaling` holds, the norm is ``rescue()``'s
  (an array of ``total``'s shape, normally :func:`scaled_norm`), elsewhere the
  root of ``total``. ``rescue`` is only run (``lax.cond``) when some entry
  needs it.
  """
  total = jnp.asarray(total)
  if ord == math.inf:
    return total
  root = safe_sqrt(total) if ord == 2 else total
  needs = needs_rescaling(total, size)
  flag = needs if needs.ndim == 0 else jnp.any(needs)

  def slow(root, needs):
    return jnp.where(needs, rescue().astype(root.dtype), root)

  return _platform.cond(flag, slow, lambda root, needs: root, root, needs)


def leaf_norm_rescued(
  x: jax.Array, ord: float, axes: tuple[int, ...] | None, keepdims: bool, fast: jax.Array
) -> jax.Array:
  """:func:`leaf_norm` from its fast ``total`` (same ``axes``, ``keepdims``), rescued."""
  size = constant_size_of(x, axes)

  def rescue():
    norm = rescued(x, ord, axes)
    return norm if keepdims else jnp.reshape(norm, fast.shape)

  return rescued_norm(fast, ord, size, rescue)


def rescued(x: jax.Array, ord: float, axes: tuple[int, ...] | None) -> jax.Array:
  """``x``'s ``ord``-norm over ``axes`` (kept dims), recomputed scaled by a power of two.

  The bits of the largest magnitude pick the power of two (:func:`pow2_pair`;
  no derivative goes through them); a finite leaf whose norm overflows
  saturates at ``finfo.max``, an ``inf`` or NaN entry stays visible.
  """
  half = x.dtype == jnp.float16  # reduced so that no float32 copy of the leaf is made
  m = _platform.reduce(max_term(x), "max", axes, True, of_float16=half)
  up, down = pow2_pair(m)
  xa = convert(x, wider(m.dtype, x.dtype))  # complex stays complex
  s = _platform.reduce(
    norm_term(ord)(xa * convert(up, xa.dtype)), "sum", axes, True, of_float16=half
  )
  norm = (safe_sqrt(s) if ord == 2 else s) * down
  big = jnp.full_like(norm, jnp.finfo(norm.dtype).max)
  return jax.lax.select(jax.lax.is_finite(m), jax.lax.min(norm, big), norm)


@_platform.cache(maxsize=256)
def leaf_rescue(ord, axes):
  """One leaf's norm from its fast ``total`` (kept dims): rescued where it needs it (jitted)."""

  def rescue(x, total):
    size = constant_size_of(x, axes)
    root = safe_sqrt(total) if ord == 2 else total
    return jax.lax.select(needs_rescaling(total, size), rescued(x, ord, axes), root)

  return jax.jit(rescue)
