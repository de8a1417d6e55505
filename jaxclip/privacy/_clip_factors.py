"""Each example's clip factor from its norm: clipped, or automatic clipping's, 0 where not
finite, and the counts of those scaled down and not finite; and :class:`Clip`, the one value
both methods of :func:`jaxclip.per_example_clipped_grad` take them from."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy._batching import rows


class Clip(NamedTuple):
  """How one call clips each example: a value passed down to whichever method forms the norms.

  Attributes:
    bounds: The thresholds, in the norms' dtype: a scalar, or ``(groups,)``
      with one per group of leaves (per-layer clipping).
    of_leaf: The group of each leaf of the clipped tree, in flattening order;
      ``None`` for one group (a scalar bound), the whole tree.
    normalize: ``None`` to clip, or automatic clipping's ``gamma``.
    treedef: The bound's tree structure (``None`` for a scalar): counts and
      norms per group come back in it.
  """

  bounds: jax.Array
  of_leaf: tuple[int, ...] | None = None
  normalize: Any = None
  treedef: Any = None

  @property
  def per_group(self) -> bool:
    return self.of_leaf is not None

  @property
  def num_groups(self) -> int | None:
    """How many groups (some may hold no leaf); ``None`` for one bound."""
    return self.bounds.shape[0] if self.per_group else None

  @property
  def group_shape(self) -> tuple[int, ...]:
    """The trailing shape of per-group counts and norms: ``(groups,)``, or ``()``."""
    return (self.num_groups,) if self.per_group else ()

  def unflatten(self, x: jax.Array, axis: int) -> Any:
    """A per-group array (groups on ``axis``) as a pytree like the bound; as is for a scalar."""
    if not self.per_group:
      return x
    return jax.tree.unflatten(
      self.treedef, [jnp.take(x, k, axis=axis) for k in range(self.num_groups)]
    )


def _count(clipped: jax.Array) -> jax.Array:
  """How many are True: over everything, or per group (column) of ``(batch, groups)``."""
  return jnp.sum(clipped, axis=0 if clipped.ndim > 1 else None)


def finite_rows(norms: jax.Array) -> jax.Array:
  """Which examples have a finite norm in every group: ``(batch,)`` for ``(batch[, groups])``."""
  ok = jnp.isfinite(norms)
  return jnp.all(ok, axis=1) if ok.ndim > 1 else ok


def clip_multipliers(norms, bound, mask=None):
  """Each example's clip factor ``min(1, C / norm)`` and how many are below 1.

  A non-finite norm gets a NaN factor here (:func:`scale_factors` turns it
  into 0 and counts it). ``mask`` drops padding examples from the count. With
  norms ``(batch, groups)`` and bounds ``(groups,)``, the count is per group.
  """
  multipliers = _numerics.clip_scale(norms, bound)
  clipped = multipliers < 1.0
  if mask is not None:
    clipped = clipped & rows(mask, norms)
  return multipliers, _count(clipped)


def normalize_multipliers(norms, bound, gamma, mask=None):
  """Automatic clipping's factor ``C / (norm + gamma)`` and how many are below 1.

  ==============================  ===================================
  case                            factor
  ==============================  ===================================
  ``norm + gamma > 0``            ``C / (norm + gamma)`` (at most
                                  float32's largest number)
  ``norm == gamma == 0``          ``0``: a zero gradient stays zero
  ``C == 0``                      ``0``
  ``norm`` is ``inf``/``nan``     ``nan`` (:func:`scale_factors` turns
                                  it into 0 and counts it)
  ==============================  ===================================

  The count is of the examples with ``norm + gamma > C`` (scaled down);
  ``mask`` drops padding examples from it.
  """
  norms = jnp.asarray(norms)
  dtype = norms.dtype
  bound = jnp.maximum(jnp.asarray(bound, dtype), 0)
  den = norms + jnp.asarray(gamma, dtype)
  tiny, big = jnp.finfo(dtype).tiny, jnp.finfo(dtype).max
  positive = den > 0
  factor = _numerics.safe_divide(bound, jnp.maximum(den, tiny), positive, otherwise=0)
  factor = jnp.where(jnp.isfinite(norms), jnp.minimum(factor, big), jnp.nan).astype(dtype)
  clipped = den > bound
  if mask is not None:
    clipped = clipped & rows(mask, norms)
  return factor, _count(clipped)


def _normalize_scaled(scaled: _numerics.ScaledNorms, bound: Any, gamma: Any) -> jax.Array:
  """:func:`normalize_multipliers`'s factor ``C / (norm + gamma)`` from the scaled form
  ``norm = 2**e sqrt(s)``: ``(C / (sqrt(s) + gamma 2**-e)) 2**-e``, so a norm beyond the
  dtype's range (saturated in ``norms``) still gets the factor that brings it to ``C``."""
  root = _numerics.safe_sqrt(scaled.sumsq)
  dtype = root.dtype
  bound = jnp.maximum(jnp.asarray(bound, dtype), 0)
  den = root + _numerics.times_pow2(
    jnp.broadcast_to(jnp.asarray(gamma, dtype), root.shape), -scaled.exponent
  )
  tiny, big = jnp.finfo(dtype).tiny, jnp.finfo(dtype).max
  positive = den > 0
  ratio = _numerics.safe_divide(bound, jnp.maximum(den, tiny), positive, otherwise=0)
  factor = _numerics.times_pow2(ratio, -scaled.exponent)
  return jnp.where(jnp.isfinite(scaled.norms), jnp.minimum(factor, big), jnp.nan).astype(dtype)


def scale_factors(norms, clip: Clip, mask=None, floor=None):
  """Each example's factor by ``clip`` and ``(num_clipped, num_nonfinite)``.

  The factor is :func:`clip_multipliers`'s, or :func:`normalize_multipliers`'s
  with ``clip.normalize=gamma``, except for an example whose norm is not finite (in
  any group: a NaN or infinite gradient, or one whose norm overflows): its
  factor is 0 in every group, it is counted as clipped (in every group) and
  in ``num_nonfinite`` (one scalar count of examples). A factor of 0 is not
  enough on its own: the caller must *select* such an example's gradient away
  (``0 * nan`` is ``nan``). ``mask`` drops padding examples from both counts.

  ``norms`` may be a :class:`jaxclip._kernel._numerics.ScaledNorms`: the
  factors are then computed from its scaled form, exact for a norm beyond the
  dtype's range (whose ``norms`` entry is saturated). ``floor`` (with
  ``clip.normalize``) is the least norm the factor divides by: for norms that
  may be under-read by up to ``floor * sqrt(eps)`` (squares flushed to zero),
  so that the factor cannot lift an example past ``C``.
  """
  bound, normalize = clip.bounds, clip.normalize
  scaled = norms if isinstance(norms, _numerics.ScaledNorms) else None
  norms = jnp.asarray(scaled.norms if scaled is not None else norms)
  ok = finite_rows(norms)
  finite = jnp.where(rows(ok, norms), norms, jnp.zeros((), norms.dtype))
  if scaled is not None:
    scaled = _numerics.ScaledNorms(
      scaled.exponent, jnp.where(rows(ok, norms), scaled.sumsq, 0), finite
    )
  if normalize is None:
    factors = clip_multipliers(finite, bound)[0] if scaled is None else scaled.clip_factor(bound)
    clipped = factors < 1.0
  else:
    if scaled is None:
      at_least = finite
      if floor is not None:  # a zero norm stays zero: its factor is 0 (or C / gamma)
        floored = jnp.maximum(finite, jnp.asarray(floor, finite.dtype))
        at_least = jnp.where(finite > 0, floored, finite)
      factors = normalize_multipliers(at_least, bound, normalize)[0]
    else:
      factors = _normalize_scaled(scaled, bound, normalize)
    den = finite + jnp.asarray(normalize, norms.dtype)
    clipped = den > jnp.maximum(jnp.asarray(bound, norms.dtype), 0)
  factors = jnp.where(rows(ok, norms), factors, jnp.zeros((), factors.dtype))
  clipped = clipped | ~rows(ok, norms)
  bad = ~ok
  if mask is not None:
    clipped = clipped & rows(mask, norms)
    bad = bad & mask
  return factors, (_count(clipped), jnp.sum(bad))
