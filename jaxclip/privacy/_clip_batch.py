"""Per-example clipping of gradients that carry a batch axis, as optax's DP clips."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _validation
from jaxclip._kernel._typing import ArrayLike


def _check_batch_dim(grads: Any, fn_name: str) -> None:
  leaves = jax.tree.leaves(grads)
  if not leaves or any(
    jnp.ndim(g) < 1 or jnp.shape(g)[0] != jnp.shape(leaves[0])[0] for g in leaves
  ):
    raise ValueError(
      f"{fn_name} expects every array in grads to have the same batch "
      f"dimension in axis 0; got shapes {jax.tree.map(jnp.shape, grads)}."
    )


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

  def bound(self, dtype: Any) -> jax.Array:
    """The thresholds as one array: a scalar, or ``(groups,)``."""
    if not self.per_group:
      return jnp.asarray(self.bounds[0], dtype)
    return jnp.stack([jnp.asarray(c, dtype) for c in self.bounds])

  def unflatten(self, x: jax.Array, axis: int) -> Any:
    """A per-group array (groups on ``axis``) as a pytree like the bound; as is for a scalar."""
    if not self.per_group:
      return x
    return jax.tree.unflatten(
      self.treedef, [jnp.take(x, k, axis=axis) for k in range(len(self.bounds))]
    )


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


def _scaled_norms(leaves: list[Any], groups: ClipGroups, acc: Any) -> _numerics.ScaledNorms:
  """Each example's overflow- and underflow-safe norm (:func:`jaxclip._kernel._numerics.
  per_example_scaled_norms`), in scaled form: ``(n,)``, or ``(n, groups)`` per group."""
  if not leaves:  # no parameters: one norm of 0 (the caller knows the batch)
    return _numerics.ScaledNorms(*(jnp.zeros((), d) for d in (jnp.int32, acc, acc)))
  if not groups.per_group:
    return _numerics.per_example_scaled_norms(leaves, acc)
  n = leaves[0].shape[0]
  per_group = []
  for j in range(len(groups.bounds)):
    mine = [g for g, k in zip(leaves, groups.of_leaf, strict=True) if k == j]
    if mine:
      per_group.append(_numerics.per_example_scaled_norms(mine, acc))
    else:  # a group without leaves: zeros sharded as the others (under an Explicit mesh)
      zero = jnp.zeros_like(jnp.sum(jnp.zeros_like(leaves[0], acc).reshape(n, -1), axis=1))
      per_group.append(_numerics.ScaledNorms(zero.astype(jnp.int32), zero, zero))
  return _numerics.ScaledNorms(*(jnp.stack(f, axis=1) for f in zip(*per_group, strict=True)))


def _per_example_clip(grads, l2_norm_clip, *, mask=None, accumulate=False, normalize=None):
  """Clipped sum over axis 0, the number of clipped examples, the norms and the number of
  non-finite examples.

  ``mask`` (bool, one per example) drops padding examples from the sum (even
  non-finite ones) and from the counts; ``accumulate=True`` returns the sums in
  float32 (or wider) instead of casting back to each leaf's dtype.
  ``l2_norm_clip`` is a number or a :class:`ClipGroups`: per group, the count
  is one entry of a ``(groups,)`` array and the norms are ``(batch, groups)``.
  ``normalize`` is automatic clipping's ``gamma`` (:func:`scale_factors`).

  An example whose norm is not finite (a NaN or infinite entry, or a square
  that overflows) is *selected* away, not multiplied by 0 (``0 * nan`` is
  ``nan``): it contributes exactly zero to every leaf of the sum.

  Returns:
    ``(summed, num_clipped, norms, num_nonfinite)``.
  """
  leaves = jax.tree.leaves(grads)
  acc = _numerics.tree_accumulation_dtype(grads)
  groups = (
    l2_norm_clip if isinstance(l2_norm_clip, ClipGroups) else ClipGroups([l2_norm_clip], None, None)
  )
  scaled = _scaled_norms(leaves, groups, acc)
  norms = scaled.norms
  bound = groups.bound(acc)
  multipliers, (num_clipped, num_nonfinite) = scale_factors(scaled, bound, mask, normalize)
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
  of_leaf = groups.of_leaf or (None,) * len(leaves)
  summed = jax.tree.unflatten(
    treedef, [weighted_sum(g, k) for g, k in zip(leaves, of_leaf, strict=True)]
  )
  return summed, num_clipped, norms, num_nonfinite


def _count(clipped: jax.Array) -> jax.Array:
  """How many are True: over everything, or per group (column) of ``(batch, groups)``."""
  return jnp.sum(clipped, axis=0 if clipped.ndim > 1 else None)


def _rows(mask: jax.Array, like: jax.Array) -> jax.Array:
  """A ``(rows,)`` mask shaped to broadcast against ``like`` (``(rows,)`` or ``(rows, groups)``)."""
  return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


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
    clipped = clipped & _rows(mask, norms)
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
    clipped = clipped & _rows(mask, norms)
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


def scale_factors(norms, bound, mask=None, normalize=None, floor=None):
  """Each example's factor and ``(num_clipped, num_nonfinite)``.

  The factor is :func:`clip_multipliers`'s, or :func:`normalize_multipliers`'s
  with ``normalize=gamma``, except for an example whose norm is not finite (in
  any group: a NaN or infinite gradient, or one whose norm overflows): its
  factor is 0 in every group, it is counted as clipped (in every group) and
  in ``num_nonfinite`` (one scalar count of examples). A factor of 0 is not
  enough on its own: the caller must *select* such an example's gradient away
  (``0 * nan`` is ``nan``). ``mask`` drops padding examples from both counts.

  ``norms`` may be a :class:`jaxclip._kernel._numerics.ScaledNorms`: the
  factors are then computed from its scaled form, exact for a norm beyond the
  dtype's range (whose ``norms`` entry is saturated). ``floor`` (with
  ``normalize``) is the least norm the factor divides by: for norms that
  may be under-read by up to ``floor * sqrt(eps)`` (squares flushed to zero),
  so that the factor cannot lift an example past ``C``.
  """
  scaled = norms if isinstance(norms, _numerics.ScaledNorms) else None
  norms = jnp.asarray(scaled.norms if scaled is not None else norms)
  ok = finite_rows(norms)
  finite = jnp.where(_rows(ok, norms), norms, jnp.zeros((), norms.dtype))
  if scaled is not None:
    scaled = _numerics.ScaledNorms(
      scaled.exponent, jnp.where(_rows(ok, norms), scaled.sumsq, 0), finite
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
  factors = jnp.where(_rows(ok, norms), factors, jnp.zeros((), factors.dtype))
  clipped = clipped | ~_rows(ok, norms)
  bad = ~ok
  if mask is not None:
    clipped = clipped & _rows(mask, norms)
    bad = bad & mask
  return factors, (_count(clipped), jnp.sum(bad))


def per_example_global_norm_clip(
  grads: Any,
  l2_norm_clip: Any,
  *,
  axis_name: Any = None,
  normalize: ArrayLike | None = None,
  return_num_nonfinite: bool = False,
) -> tuple[Any, ...]:
  r"""Clips each example's gradient to global norm ``l2_norm_clip`` and sums them.

  .. math::

    \sum_{b} g_b \cdot \min\!\Big(1, \frac{C}{\|g_b\|}\Big)

  where ``g_b`` is the slice of every leaf at index ``b`` of axis 0 — the
  clipping step of DP-SGD. A drop-in for ``optax.per_example_global_norm_clip``
  with float32 accumulation and a finite gradient at zero; integer gradients
  are promoted to floating point, as optax does.

  ``l2_norm_clip`` may also be a pytree prefix of ``grads`` with a number per
  group of leaves (per-layer clipping): each group ``k`` of each example is
  clipped on its own, to ``C_k``, and the sum's sensitivity is
  :math:`\sqrt{\sum_k C_k^2}`. ``normalize=gamma`` scales each example (each
  group) by :math:`C / (\|g_b\| + \gamma)` instead (automatic clipping, as
  :func:`jaxclip.per_example_clipped_grad`, whose edge-case table applies).

  **Bounded whatever an example holds.** An example whose norm is not finite
  (a NaN or infinite entry, or entries whose squares overflow) contributes
  exactly zero: it is selected away, not multiplied by 0, so one such example
  cannot make the sum NaN (which would tell whether it is in the batch). It
  is counted as clipped, and in ``num_nonfinite`` with
  ``return_num_nonfinite=True``. optax's own function gives NaN there.

  Inside ``jax.shard_map`` (or ``pmap``) over the batch axis each device holds
  whole examples, so their norms are local; pass ``axis_name`` to ``psum``
  the clipped sums and counts so every device gets the global ones. Under
  ``shard_map``'s default ``check_vma=True``, take the per-example gradients
  with respect to ``jax.lax.pcast(params, axis_name, to='varying')``: JAX
  sums the gradients of replicated parameters across devices otherwise,
  mixing examples before they are clipped. For long batches,
  :func:`jaxclip.per_example_clipped_grad` does all this in chunks.

  Args:
    grads: A pytree whose every leaf has the batch dimension on axis 0.
    l2_norm_clip: The largest per-example global norm, ``>= 0``; or a pytree
      prefix of ``grads``, one such number per group of leaves.
    axis_name: The mesh axis (or tuple of axes) the batch is split over
      inside ``shard_map``/``pmap``; ``None`` (default) sums the local batch
      only.
    normalize: ``None`` (default) to clip; a number ``gamma >= 0`` for
      automatic clipping, :math:`g_b \, C / (\|g_b\| + \gamma)`.
    return_num_nonfinite: Also return how many examples had a non-finite
      norm (and contributed zero).

  Returns:
    ``(clipped_sum, num_clipped)``: the sum over the batch of the clipped
    per-example gradients (each leaf without its batch axis; in float32 for
    bfloat16 and float16 leaves, as optax's, so noise is added before any
    rounding; in its dtype otherwise), and
    how many examples were scaled down (a pytree like ``l2_norm_clip``, a
    count per group, for per-group bounds). With
    ``return_num_nonfinite=True``, ``(clipped_sum, num_clipped,
    num_nonfinite)``, the last an int scalar. Neither count is private.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> grads = [jnp.array([[0., 0., 0.], [0., 3., 4.], [4., 0., 3.], [3., 4., 0.]])]
    >>> jaxclip.per_example_global_norm_clip(grads, 1.25)
    ([Array([1.75, 1.75, 1.75], dtype=float32)], Array(3, dtype=int32))

    A bound per group of leaves, and automatic clipping (every nonzero
    gradient scaled to norm ``C``, with ``gamma = 0``):

    >>> grads = {"w": jnp.array([[3., 4.], [0., 1.]]), "b": jnp.array([2., 0.])}
    >>> total, num_clipped = jaxclip.per_example_global_norm_clip(grads, {"w": 1.0, "b": 1.0})
    >>> total["w"], total["b"]  # w: [3, 4] clipped to [0.6, 0.8]; b: 2 clipped to 1
    (Array([0.6, 1.8], dtype=float32), Array(1., dtype=float32))
    >>> num_clipped  # per group
    {'b': Array(1, dtype=int32), 'w': Array(1, dtype=int32)}
    >>> # each example scaled to norm 1: [3, 4, 2] / sqrt(29) + [0, 1, 0]
    >>> jaxclip.per_example_global_norm_clip(grads, 1.0, normalize=0.0)[0]["w"]
    Array([0.557086 , 1.7427814], dtype=float32)

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016

    Bu et al., `Automatic Clipping: Differentially Private Deep Learning Made
    Easier and Stronger <https://arxiv.org/abs/2206.07136>`_, 2023
  """
  check_clip(l2_norm_clip)
  check_normalize(normalize, l2_norm_clip)
  grads = _validation.numeric_leaves(grads, "per_example_global_norm_clip", "grads")
  _check_batch_dim(grads, "per_example_global_norm_clip")
  groups = clip_groups(l2_norm_clip, grads)
  clipped_sum, num_clipped, _, num_bad = _per_example_clip(
    grads, groups if groups.per_group else l2_norm_clip, normalize=normalize, accumulate=True
  )
  if axis_name is not None:
    clipped_sum, num_clipped, num_bad = jax.lax.psum((clipped_sum, num_clipped, num_bad), axis_name)
  out = clipped_sum, groups.unflatten(num_clipped, 0)
  return out + (num_bad,) if return_num_nonfinite else out


def per_example_layer_norm_clip(
  grads: Any,
  global_l2_norm_clip: ArrayLike,
  uniform: bool = True,
  *,
  axis_name: Any = None,
  normalize: ArrayLike | None = None,
  return_num_nonfinite: bool = False,
) -> tuple[Any, ...]:
  r"""Clips each example's gradient layer by layer, then sums over the batch.

  Each of the ``K`` leaves gets its own per-example bound: ``C / sqrt(K)`` with
  ``uniform=True``, or ``C * sqrt(D_i / D)`` (its share of the ``D``
  parameters) with ``uniform=False``, so the per-example global norm stays at
  most ``C`` either way. A drop-in for ``optax.per_example_layer_norm_clip``.
  With ``normalize=gamma`` each leaf ``i`` of each example is scaled by
  :math:`C_i / (\|g_{b,i}\| + \gamma)` instead of clipped to ``C_i``
  (automatic clipping; the edge cases of
  :func:`jaxclip.per_example_clipped_grad`). An example with a non-finite
  norm in any leaf contributes zero to every leaf and is counted in every
  leaf (as :func:`per_example_global_norm_clip`).

  With data parallelism, as :func:`per_example_global_norm_clip`: inside
  ``jax.shard_map`` (or ``pmap``) over the batch axis each device holds whole
  examples, so every per-example, per-leaf norm is local; pass ``axis_name``
  to ``psum`` the clipped sums and the per-leaf counts so every device gets
  the global ones. Take the per-example gradients with respect to
  ``jax.lax.pcast(params, axis_name, to='varying')`` under ``shard_map``'s
  default ``check_vma=True``, so that JAX does not sum them across devices
  before they are clipped.

  Args:
    grads: A pytree whose every leaf has the batch dimension on axis 0.
    global_l2_norm_clip: The overall per-example bound ``C``, ``>= 0``.
    uniform: Split ``C`` equally between leaves, or by their sizes.
    axis_name: The mesh axis (or tuple of axes) the batch is split over
      inside ``shard_map``/``pmap``; ``None`` (default) sums the local batch
      only.
    normalize: ``None`` (default) to clip; a number ``gamma >= 0`` for
      automatic clipping of each leaf.
    return_num_nonfinite: Also return how many examples had a non-finite
      norm (and contributed zero).

  Returns:
    ``(clipped_sum, num_clipped)``: two pytrees with ``grads``' structure, the
    summed clipped gradients (float32 for bfloat16 and float16 leaves) and,
    per leaf, how many examples were clipped
    (with ``normalize``: scaled down). With ``return_num_nonfinite=True``,
    ``(clipped_sum, num_clipped, num_nonfinite)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> grads = [jnp.array([[0., 0., 2.], [2., 0., 0.], [0., .5, 0.]])]
    >>> jaxclip.per_example_layer_norm_clip(grads, 1.0)  # two examples halved
    ([Array([1. , 0.5, 1. ], dtype=float32)], [Array(2, dtype=int32)])

  References:
    McMahan et al., `Learning Differentially Private Recurrent Language Models
    <https://arxiv.org/abs/1710.06963>`_, 2017
  """
  _validation.check_hparam(global_l2_norm_clip, "global_l2_norm_clip", lo=0)
  check_normalize(normalize, global_l2_norm_clip, "global_l2_norm_clip")
  grads = _validation.numeric_leaves(grads, "per_example_layer_norm_clip", "grads")
  _check_batch_dim(grads, "per_example_layer_norm_clip")
  leaves, treedef = jax.tree.flatten(grads)
  if uniform:
    shares = [1.0 / len(leaves)] * len(leaves)
  else:
    sizes = [g[0].size for g in leaves]
    shares = [s / sum(sizes) for s in sizes]
  # One clip group per leaf: an example is judged (finite or not) on all its leaves at once.
  groups = ClipGroups(
    [global_l2_norm_clip * share**0.5 for share in shares], tuple(range(len(leaves))), treedef
  )
  clipped_sum, num_clipped, _, num_bad = _per_example_clip(
    grads, groups, normalize=normalize, accumulate=True
  )
  num_clipped = groups.unflatten(num_clipped, 0)
  if axis_name is not None:
    clipped_sum, num_clipped, num_bad = jax.lax.psum((clipped_sum, num_clipped, num_bad), axis_name)
  out = clipped_sum, num_clipped
  return out + (num_bad,) if return_num_nonfinite else out
