"""optax's per-example clips of gradients that carry a batch axis, as drop-ins: a global
norm (or one per group of leaves) and a norm per layer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _validation
from jaxclip._kernel._typing import ArrayLike
from jaxclip.privacy._clip_batch import (
  ClipGroups,
  _per_example_clip,
  check_clip,
  check_normalize,
  clip_groups,
)


def _check_batch_dim(grads: Any, fn_name: str) -> None:
  leaves = jax.tree.leaves(grads)
  if not leaves or any(
    jnp.ndim(g) < 1 or jnp.shape(g)[0] != jnp.shape(leaves[0])[0] for g in leaves
  ):
    raise ValueError(
      f"{fn_name} expects every array in grads to have the same batch "
      f"dimension in axis 0; got shapes {jax.tree.map(jnp.shape, grads)}."
    )


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
  clip = clip_groups(l2_norm_clip, grads).clip(_numerics.tree_accumulation_dtype(grads), normalize)
  clipped_sum, num_clipped, _, num_bad = _per_example_clip(grads, clip, accumulate=True)
  if axis_name is not None:
    clipped_sum, num_clipped, num_bad = jax.lax.psum((clipped_sum, num_clipped, num_bad), axis_name)
  out = clipped_sum, clip.unflatten(num_clipped, 0)
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
  clip = groups.clip(_numerics.tree_accumulation_dtype(grads), normalize)
  clipped_sum, num_clipped, _, num_bad = _per_example_clip(grads, clip, accumulate=True)
  num_clipped = clip.unflatten(num_clipped, 0)
  if axis_name is not None:
    clipped_sum, num_clipped, num_bad = jax.lax.psum((clipped_sum, num_clipped, num_bad), axis_name)
  out = clipped_sum, num_clipped
  return out + (num_bad,) if return_num_nonfinite else out
