"""Per-example clipping of gradients that carry a batch axis, as optax's DP clips."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _validation
from jaxclip._kernel._typing import ArrayLike

Axis = int | tuple[int, ...] | None


def _check_batch_dim(grads: Any, fn_name: str) -> None:
  leaves = jax.tree.leaves(grads)
  if not leaves or any(
    jnp.ndim(g) < 1 or jnp.shape(g)[0] != jnp.shape(leaves[0])[0] for g in leaves
  ):
    raise ValueError(
      f"{fn_name} expects every array in grads to have the same batch "
      f"dimension in axis 0; got shapes {jax.tree.map(jnp.shape, grads)}."
    )


def _per_example_clip(grads, l2_norm_clip, *, mask=None, accumulate=False, return_norms=False):
  """Clipped sum over axis 0 and the number of clipped examples.

  ``mask`` (bool, one per example) drops padding examples from the sum (even
  non-finite ones) and from the count; ``accumulate=True`` returns the sums in
  float32 (or wider) instead of casting back to each leaf's dtype;
  ``return_norms=True`` also returns each example's norm.
  """
  leaves = jax.tree.leaves(grads)
  acc = _numerics.tree_accumulation_dtype(grads)
  sumsq = sum(
    jnp.sum(_numerics.abs_sq(g).reshape(g.shape[0], -1), axis=1).astype(acc) for g in leaves
  )
  norms = _numerics.safe_sqrt(sumsq)
  bound = jnp.asarray(l2_norm_clip, acc)
  multipliers, num_clipped = clip_multipliers(norms, bound, mask)

  def weighted_sum(g):
    g = jnp.asarray(g)
    dtype = _numerics.compute_dtype(g.dtype)
    # A broadcast product and a sum rather than a dot: under jit with the batch
    # axis sharded (explicit sharding), a dot contracting a sharded axis needs
    # an output sharding, while a sum reduces it with one all-reduce.
    m = multipliers.astype(dtype).reshape((-1,) + (1,) * (g.ndim - 1))
    terms = m * g.astype(dtype)
    if mask is not None:
      terms = jnp.where(mask.reshape(m.shape), terms, 0)
    out = jnp.sum(terms, axis=0)
    return out if accumulate else out.astype(g.dtype)

  out = jax.tree.map(weighted_sum, grads), num_clipped
  return out + (norms,) if return_norms else out


def clip_multipliers(norms, bound, mask=None):
  """Each example's clip factor ``min(1, C / norm)`` and how many are below 1.

  A non-finite norm gets a NaN factor, so the sum shows it (optax's sum is NaN
  there too: NaN * 1 or inf * 0). ``mask`` drops padding examples from the
  count.
  """
  multipliers = _numerics.clip_scale(norms, bound)
  clipped = multipliers < 1.0
  if mask is not None:
    clipped = clipped & mask
  return multipliers, jnp.sum(clipped)


def per_example_global_norm_clip(
  grads: Any, l2_norm_clip: ArrayLike, *, axis_name: Any = None
) -> tuple[Any, jax.Array]:
  r"""Clips each example's gradient to global norm ``l2_norm_clip`` and sums them.

  .. math::

    \sum_{b} g_b \cdot \min\!\Big(1, \frac{C}{\|g_b\|}\Big)

  where ``g_b`` is the slice of every leaf at index ``b`` of axis 0 — the
  clipping step of DP-SGD. A drop-in for ``optax.per_example_global_norm_clip``
  with float32 accumulation and a finite gradient at zero; integer gradients
  are promoted to floating point, as optax does.

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
    l2_norm_clip: The largest per-example global norm, ``>= 0``.
    axis_name: The mesh axis (or tuple of axes) the batch is split over
      inside ``shard_map``/``pmap``; ``None`` (default) sums the local batch
      only.

  Returns:
    ``(clipped_sum, num_clipped)``: the sum over the batch of the clipped
    per-example gradients (each leaf without its batch axis, in its dtype), and
    how many examples were scaled down.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> grads = [jnp.array([[0., 0., 0.], [0., 3., 4.], [4., 0., 3.], [3., 4., 0.]])]
    >>> jaxclip.per_example_global_norm_clip(grads, 1.25)
    ([Array([1.75, 1.75, 1.75], dtype=float32)], Array(3, dtype=int32))

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016
  """
  _validation.check_hparam(l2_norm_clip, "l2_norm_clip", lo=0)
  grads = _validation.numeric_leaves(grads, "per_example_global_norm_clip", "grads")
  _check_batch_dim(grads, "per_example_global_norm_clip")
  clipped_sum, num_clipped = _per_example_clip(grads, l2_norm_clip)
  if axis_name is not None:
    clipped_sum, num_clipped = jax.lax.psum((clipped_sum, num_clipped), axis_name)
  return clipped_sum, num_clipped


def per_example_layer_norm_clip(
  grads: Any, global_l2_norm_clip: ArrayLike, uniform: bool = True, *, axis_name: Any = None
) -> tuple[Any, Any]:
  r"""Clips each example's gradient layer by layer, then sums over the batch.

  Each of the ``K`` leaves gets its own per-example bound: ``C / sqrt(K)`` with
  ``uniform=True``, or ``C * sqrt(D_i / D)`` (its share of the ``D``
  parameters) with ``uniform=False``, so the per-example global norm stays at
  most ``C`` either way. A drop-in for ``optax.per_example_layer_norm_clip``.

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

  Returns:
    ``(clipped_sum, num_clipped)``: two pytrees with ``grads``' structure, the
    summed clipped gradients and, per leaf, how many examples were clipped.

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
  grads = _validation.numeric_leaves(grads, "per_example_layer_norm_clip", "grads")
  _check_batch_dim(grads, "per_example_layer_norm_clip")
  leaves = jax.tree.leaves(grads)
  if uniform:
    shares = [1.0 / len(leaves)] * len(leaves)
  else:
    sizes = [g[0].size for g in leaves]
    shares = [s / sum(sizes) for s in sizes]
  results = [
    _per_example_clip(g, global_l2_norm_clip * share**0.5)
    for g, share in zip(leaves, shares, strict=True)
  ]
  treedef = jax.tree.structure(grads)
  clipped_sum = jax.tree.unflatten(treedef, [r[0] for r in results])
  num_clipped = jax.tree.unflatten(treedef, [r[1] for r in results])
  if axis_name is not None:
    clipped_sum, num_clipped = jax.lax.psum((clipped_sum, num_clipped), axis_name)
  return clipped_sum, num_clipped
