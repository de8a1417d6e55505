"""A per-example clip bound (a number, or one per group of leaves), its checks, and the
clipped sum over the batch axis of per-example gradients that the clips share (by a
:class:`jaxclip.privacy._clip_factors.Clip`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _validation
from jaxclip.privacy._clip_factors import Clip, finite_rows, scale_factors


class ClipGroups(NamedTuple):
  """A per-example clip bound: one scalar, or one per group of leaves (a pytree prefix).

  Attributes:
    bounds: The thresholds, one per group (one for a scalar bound).
    of_leaf: The group of each leaf of the clipped tree, in flattening order;
      ``None`` for a scalar bound (one group, the whole tree).
    treedef: The bound's tree structure (``None`` for a scalar): counts and
      norms per group come back in it.
  """

  bounds: list[Any]
  of_leaf: tuple[int, ...] | None
  treedef: Any

  @property
  def per_group(self) -> bool:
    return self.of_leaf is not None

  def clip(self, dtype: Any, normalize: Any = None) -> Clip:
    """The clip of these groups: the thresholds as one array in ``dtype`` (that of the norms),
    a scalar or ``(groups,)``."""
    if not self.per_group:
      bounds = jnp.asarray(self.bounds[0], dtype)
    else:
      bounds = jnp.stack([jnp.asarray(c, dtype) for c in self.bounds])
    return Clip(bounds, self.of_leaf, normalize, self.treedef)


def clip_groups(l2_norm_clip: Any, tree: Any, name: str = "l2_norm_clip") -> ClipGroups:
  """``l2_norm_clip`` (a scalar, or a pytree prefix of ``tree`` with a scalar per group) as
  :class:`ClipGroups`, or a ``ValueError`` naming what does not fit."""
  treedef = jax.tree.structure(l2_norm_clip)
  if _is_number(l2_norm_clip):
    return ClipGroups([l2_norm_clip], None, None)
  bounds = jax.tree.leaves(l2_norm_clip)
  if not bounds:
    raise ValueError(f"{name} must be a number or a pytree of numbers, got {l2_norm_clip!r}.")
  try:
    subtrees = treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as exc:
    raise ValueError(
      f"{name} must be a number or a pytree prefix of the parameters (one threshold per "
      f"group of leaves); its structure {treedef} does not match theirs "
      f"{jax.tree.structure(tree)}: {exc}"
    ) from None
  of_leaf = tuple(k for k, sub in enumerate(subtrees) for _ in jax.tree.leaves(sub))
  return ClipGroups(bounds, of_leaf, treedef)


def _is_number(l2_norm_clip: Any) -> bool:
  """Whether a bound is one leaf (a number or an array; ``None`` too, refused by its check)."""
  treedef = jax.tree.structure(l2_norm_clip)
  return l2_norm_clip is None or (
    jax.tree_util.treedef_is_leaf(treedef) and treedef.num_leaves == 1
  )


def check_clip(
  l2_norm_clip: Any, name: str = "l2_norm_clip", *, scalar: bool = False, finite: bool = False
) -> None:
  """Checks a clip bound: a number ``>= 0`` (0-d with ``scalar``), or a pytree of 0-d ones;
  each finite with ``finite``."""
  if _is_number(l2_norm_clip):
    _validation.check_hparam(l2_norm_clip, name, lo=0, scalar=scalar, finite=finite)
    return
  paths = jax.tree_util.tree_flatten_with_path(l2_norm_clip)[0]
  if not paths:
    raise ValueError(
      f"{name} must be a number or a pytree of numbers (one per layer or group), got "
      f"{l2_norm_clip!r:.100}, which holds none."
    )
  for path, c in paths:
    where = f"{name}{jax.tree_util.keystr(path)}"
    _validation.check_hparam(c, where, lo=0, scalar=True, finite=finite)


def check_normalize(normalize: Any, l2_norm_clip: Any, name: str = "l2_norm_clip") -> None:
  """``normalize`` is ``None`` or a concrete ``gamma >= 0``; with it, concrete bounds are finite."""
  if normalize is None:
    return
  _validation.check_hparam(normalize, "normalize", lo=0, scalar=True, finite=True)
  for c in jax.tree.leaves(l2_norm_clip):
    _validation.check_hparam(c, f"{name} (with normalize)", lo=0, finite=True)


def _scaled_norms(leaves: list[Any], clip: Clip, acc: Any) -> _numerics.ScaledNorms:
  """Each example's overflow- and underflow-safe norm (:func:`jaxclip._kernel._numerics.
  per_example_scaled_norms`), in scaled form: ``(n,)``, or ``(n, groups)`` per group."""
  if not leaves:  # no parameters: one norm of 0 (the caller knows the batch)
    return _numerics.ScaledNorms(*(jnp.zeros((), d) for d in (jnp.int32, acc, acc)))
  if not clip.per_group:
    return _numerics.per_example_scaled_norms(leaves, acc)
  n = leaves[0].shape[0]
  per_group = []
  for j in range(clip.num_groups):
    mine = [g for g, k in zip(leaves, clip.of_leaf, strict=True) if k == j]
    if mine:
      per_group.append(_numerics.per_example_scaled_norms(mine, acc))
    else:  # a group without leaves: zeros sharded as the others (under an Explicit mesh)
      zero = jnp.zeros_like(jnp.sum(jnp.zeros_like(leaves[0], acc).reshape(n, -1), axis=1))
      per_group.append(_numerics.ScaledNorms(zero.astype(jnp.int32), zero, zero))
  return _numerics.ScaledNorms(*(jnp.stack(f, axis=1) for f in zip(*per_group, strict=True)))


def _per_example_clip(grads, clip: Clip, *, mask=None, accumulate=False):
  """Clipped sum over axis 0, the number of clipped examples, the norms and the number of
  non-finite examples.

  ``mask`` (bool, one per example) drops padding examples from the sum (even
  non-finite ones) and from the counts; ``accumulate=True`` returns the sums in
  float32 (or wider) instead of casting back to each leaf's dtype.
  ``clip``'s bounds are in the norms' dtype (``grads``' accumulation dtype); per
  group, the count is one entry of a ``(groups,)`` array and the norms are
  ``(batch, groups)``. With ``clip.normalize``, automatic clipping
  (:func:`scale_factors`).

  An example whose norm is not finite (a NaN or infinite entry, or a square
  that overflows) is *selected* away, not multiplied by 0 (``0 * nan`` is
  ``nan``): it contributes exactly zero to every leaf of the sum.

  Returns:
    ``(summed, num_clipped, norms, num_nonfinite)``.
  """
  leaves = jax.tree.leaves(grads)
  acc = _numerics.tree_accumulation_dtype(grads)
  scaled = _scaled_norms(leaves, clip, acc)
  norms = scaled.norms
  multipliers, (num_clipped, num_nonfinite) = scale_factors(scaled, clip, mask)
  keep = finite_rows(norms) if jnp.ndim(norms) else None
  if mask is not None:
    keep = mask if keep is None else keep & mask

  def weighted_sum(g, k):
    g = jnp.asarray(g)
    dtype = _numerics.compute_dtype(g.dtype)
    # A broadcast product and a sum rather than a dot: under jit with the batch
    # axis sharded (explicit sharding), a dot contracting a sharded axis needs
    # an output sharding, while a sum reduces it with one all-reduce.
    m = multipliers if k is None else multipliers[:, k]
    m = m.astype(dtype).reshape((-1,) + (1,) * (g.ndim - 1))
    terms = m * g.astype(dtype)
    if keep is not None:  # selected, not multiplied: 0 * nan is nan
      terms = jnp.where(keep.reshape(m.shape), terms, jnp.zeros((), dtype))
    out = jnp.sum(terms, axis=0)
    return out if accumulate else out.astype(g.dtype)

  treedef = jax.tree.structure(grads)
  of_leaf = clip.of_leaf or (None,) * len(leaves)
  summed = jax.tree.unflatten(
    treedef, [weighted_sum(g, k) for g, k in zip(leaves, of_leaf, strict=True)]
  )
  return summed, num_clipped, norms, num_nonfinite
