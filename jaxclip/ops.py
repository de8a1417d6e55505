"""TensorFlow's clip-op family as pure functions over any pytree.

Names and formulas follow ``tf.clip_by_value``, ``tf.clip_by_norm``,
``tf.compat.v1.clip_by_average_norm``, ``tf.linalg.global_norm`` and
``tf.clip_by_global_norm``; the arguments are pytrees instead of tensors or
lists of tensors. ``None`` leaves are skipped and returned in place, and the
output has the input's structure and every leaf's dtype.

>>> import jax.numpy as jnp
>>> from jaxclip import ops
>>> ops.clip_by_global_norm({'w': jnp.array([3., 4.])}, 1.0)[1]
Array(5., dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _clip, _reduction, _tf_args, _validation
from jaxclip._kernel._typing import ArrayLike, PyTree

__all__ = (
  "clip_by_average_norm",
  "clip_by_global_norm",
  "clip_by_norm",
  "clip_by_value",
  "global_norm",
)


def global_norm(
  tree: PyTree,
  *,
  ord: int | float | str = 2,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> jax.Array:
  r"""Computes the global norm of every leaf of a pytree taken together.

  .. math::

    \|g\|_2 = \sqrt{\textstyle\sum_{t} \sum_i |t_i|^2}, \quad
    \|g\|_1 = \textstyle\sum_t \sum_i |t_i|, \quad
    \|g\|_\infty = \max_t \max_i |t_i|

  The sums accumulate in float32 whatever the leaf dtype (float64 for float64
  leaves under ``jax_enable_x64``), within and across leaves, so ten thousand
  bfloat16 leaves or float16 leaves of size 300 give the right norm where a
  sum in the leaf dtype drifts or overflows. Complex leaves contribute
  ``|z|``. The gradient at an all-zero tree is zero, not NaN.

  On many devices: under ``jax.jit`` with sharded arrays nothing is needed
  (XLA all-reduces one scalar). Inside ``jax.shard_map``, ``jax.pmap`` or
  ``jax.vmap(axis_name=)``, where each device holds local values, pass
  ``axis_name``: the partial sums are ``psum``-ed (``pmax``-ed for
  ``ord=inf``) across those axes, so every device gets the norm of the whole
  tree. A leaf that every device holds in full (a replicated parameter, or
  the gradient of one passed with ``P()``) must count once, not once per
  device:

  * inside ``shard_map`` with its default ``check_vma=True`` this is
    inferred: a leaf is summed over the axes of ``axis_name`` its type varies
    over (``jax.typeof(x)``'s varying manual axes), and counted once over
    the others;
  * under ``check_vma=False``, ``pmap`` and ``vmap`` types carry no such
    information and every leaf is taken for a shard: say which leaves are
    replicated with ``replicated=``, or pass their ``partition_specs=``.

  Either argument, when given, overrides the inference.

  Args:
    tree: A pytree of floating-point or complex arrays; ``None`` leaves are
      ignored.
    ord: ``2`` (default), ``1`` or ``inf``, as
      ``torch.nn.utils.get_total_norm``.
    axis_name: Inside ``shard_map``/``pmap``/``vmap``, the mesh axis name
      (or tuple of names) the leaves are sharded over; ``None`` (default)
      for a tree that is whole on this device or sharded under ``jit``.
    replicated: Which leaves are replicated over which of those axes:
      ``None`` (default: inferred under ``check_vma=True``, else every leaf
      is a shard over every axis), a pytree prefix of ``tree`` whose leaves
      are ``True`` (replicated over all of ``axis_name``), ``False`` (a
      shard) or an axis name or tuple of names it is replicated over; or a
      callable ``(path, leaf)`` returning one of these. Needs ``axis_name``.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``: a pytree prefix of ``tree`` of ``PartitionSpec``
      leaves (e.g. the ``in_specs`` given to ``shard_map``); a leaf is a
      shard over the axes its spec names and replicated over the rest of
      ``axis_name``. Needs ``axis_name``.

  Returns:
    A scalar in float32 (float64 if any leaf is float64). ``0`` for an empty
    tree; ``inf``/``nan`` if a leaf holds one.

  Raises:
    TypeError: if a leaf is an integer or boolean array (its path is named),
      if ``replicated`` holds a ``PartitionSpec`` (pass it as
      ``partition_specs``) or ``partition_specs`` holds anything else.
    ValueError: if ``ord`` is not 1, 2 or inf, if ``replicated`` or
      ``partition_specs`` is given without ``axis_name``, with the other, or
      does not match the tree, or names an axis outside ``axis_name``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jaxclip
    >>> jaxclip.ops.global_norm([jnp.array([-2., 3., 6.]), jnp.array([-4., 6., 12.])])
    Array(15.652476, dtype=float32)
    >>> jaxclip.ops.global_norm({'w': jnp.array([3., -4.])}, ord=1)
    Array(7., dtype=float32)

    Two shards of ``w`` (one per device along axis ``'i'``; ``vmap`` stands
    in for ``shard_map`` here) and a bias ``b`` that both hold in full:

    >>> def norm(w_shard, b):
    ...   return jaxclip.ops.global_norm({'w': w_shard, 'b': b}, axis_name='i',
    ...                                  replicated={'w': False, 'b': True})
    >>> w_shards, b = jnp.array([[3., 0.], [0., 4.]]), jnp.array([12.])
    >>> jax.vmap(norm, in_axes=(0, None), axis_name='i')(w_shards, b)  # sqrt(9+16+144)
    Array([13., 13.], dtype=float32)

    The same with the ``PartitionSpec`` of each leaf (as ``shard_map``'s
    ``in_specs``) instead:

    >>> from jax.sharding import PartitionSpec as P
    >>> def norm_from_specs(w_shard, b):
    ...   return jaxclip.ops.global_norm({'w': w_shard, 'b': b}, axis_name='i',
    ...                                  partition_specs={'w': P('i'), 'b': P()})
    >>> jax.vmap(norm_from_specs, in_axes=(0, None), axis_name='i')(w_shards, b)
    Array([13., 13.], dtype=float32)

  References:
    Pascanu et al., `On the difficulty of training Recurrent Neural Networks
    <https://arxiv.org/abs/1211.5063>`_, 2012
  """
  ord = _validation.check_ord(ord)
  _validation.check_inexact_leaves(tree, "global_norm")
  return _reduction.tree_norm(tree, ord, axis_name, replicated, partition_specs)


def clip_by_value(tree: PyTree, clip_value_min: ArrayLike, clip_value_max: ArrayLike) -> PyTree:
  r"""Clips every entry of every leaf to ``[clip_value_min, clip_value_max]``.

  .. math::

    t_i \mapsto \min(\max(t_i, \mathrm{lo}), \mathrm{hi})

  Each entry is clipped on its own, so the direction of a gradient can change
  (``[-1, 2, 10]`` clipped to ``[0, 3]`` is ``[0, 2, 3]``); use
  :func:`clip_by_norm` or :func:`clip_by_global_norm` to keep it.

  Bounds are scalars or arrays broadcastable to each leaf's shape. Integer
  leaves keep their dtype; a fractional bound is rounded inwards for them
  (``lo`` up, ``hi`` down), so the result never leaves the interval. The
  gradient is ``1`` inside the interval and ``0`` outside.

  Args:
    tree: A pytree of real (integer or floating-point) arrays.
      A list or tuple of Python numbers is one array, as TensorFlow
      reads it (``[3., 4.]`` is a vector, not two scalar leaves).
    clip_value_min: The lower bound.
    clip_value_max: The upper bound.

  Returns:
    The clipped pytree, with the input's structure, shapes and dtypes.

  Raises:
    ValueError: if a concrete bound is NaN, if concretely
      ``clip_value_min > clip_value_max``, or if a bound does not broadcast to
      a leaf's shape. Traced bounds cannot be checked: with ``lo > hi`` every
      entry becomes ``hi``, as in TensorFlow and ``jnp.clip``.
    TypeError: if a leaf is complex or boolean.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> jaxclip.ops.clip_by_value(jnp.array([-1, 2, 10]), 0, 3)
    Array([0, 2, 3], dtype=int32)
    >>> jaxclip.ops.clip_by_value({'w': jnp.array([-1.5, 0.5])}, -1.0, 1.0)
    {'w': Array([-1. ,  0.5], dtype=float32)}
  """
  tree = _tf_args.as_tensor(tree, "clip_by_value")
  _validation.check_bounds(clip_value_min, clip_value_max, "clip_value_min", "clip_value_max")
  _validation.check_real_leaves(tree, "clip_by_value")

  return _clip.value_clip(tree, clip_value_min, clip_value_max)


def clip_by_norm(tree: PyTree, clip_norm: ArrayLike, axes: Any = None) -> PyTree:
  r"""Clips each leaf on its own to a maximum L2 norm.

  .. math::

    t \mapsto t \cdot \frac{c}{\max(\|t\|_2, c)}

  with the norm taken over ``axes`` (every axis if ``None``): with
  ``axes=[1]`` each row of a matrix is held to ``clip_norm``, with ``[0]``
  each column. Within a leaf the direction is kept, but each leaf is scaled by
  its own factor, so the balance *between* leaves changes; use
  :func:`clip_by_global_norm` to keep it.

  ==============================  ==========================================
  case                            result
  ==============================  ==========================================
  ``norm <= clip_norm``           the leaf, unchanged
  ``clip_norm == 0``              zeros (gradient 0), never NaN
  ``clip_norm == inf``            the leaf, unchanged
  leaf all zeros                  zeros; ``jax.grad`` finite (identity)
  leaf holds ``inf``/``nan``      NaN everywhere in that slice
  traced negative ``clip_norm``   acts as ``0``
  ==============================  ==========================================

  Args:
    tree: A pytree of floating-point or complex arrays.
      A list or tuple of Python numbers is one array, as TensorFlow
      reads it (``[3., 4.]`` is a vector, not two scalar leaves).
    clip_norm: The maximum L2 norm, ``>= 0``; a scalar or an array that
      broadcasts against the reduced norm.
    axes: ``None``, an int, or a sequence of ints: the axes the norm is taken
      over (applied to every leaf).

  Returns:
    The clipped pytree, with the input's structure and dtypes.

  Raises:
    ValueError: for a concrete negative or NaN ``clip_norm``.
    TypeError: if a leaf is an integer or boolean array (its path is named).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> jaxclip.ops.clip_by_norm(jnp.array([-2., 3., 6.]), 5.)  # norm 7 -> 5
    Array([-1.4285715,  2.142857 ,  4.285714 ], dtype=float32)
    >>> jaxclip.ops.clip_by_norm(jnp.array([[3., 4.], [0., 1.]]), 1., axes=[1])
    Array([[0.6, 0.8],
           [0. , 1. ]], dtype=float32)
    >>> jaxclip.ops.clip_by_norm([3., 4.], 1.)  # one vector, as tf.clip_by_norm reads it
    Array([0.6, 0.8], dtype=float32)
  """
  tree = _tf_args.as_tensor(tree, "clip_by_norm")
  _validation.check_hparam(clip_norm, "clip_norm", lo=0)
  _validation.check_axes(axes)
  _validation.check_inexact_leaves(tree, "clip_by_norm")

  return _clip.norm_clip(tree, clip_norm, axes)


def clip_by_average_norm(tree: PyTree, clip_norm: ArrayLike) -> PyTree:
  r"""Clips each leaf so that its L2 norm divided by its size is at most ``clip_norm``.

  TensorFlow v1's ``tf.clip_by_average_norm``, leaf by leaf:

  .. math::

    t \mapsto t \cdot \min\!\Big(1, \frac{c \cdot n}{\|t\|_2}\Big),
    \qquad n = \text{number of elements of } t

  which is :func:`clip_by_norm` with a threshold of ``clip_norm * n``. The
  edge cases are those of :func:`clip_by_norm`.

  Args:
    tree: A pytree of floating-point or complex arrays.
      A list or tuple of Python numbers is one array, as TensorFlow
      reads it (``[3., 4.]`` is a vector, not two scalar leaves).
    clip_norm: The maximum average L2 norm, ``>= 0``.

  Returns:
    The clipped pytree, with the input's structure and dtypes.

  Raises:
    ValueError: for a concrete negative or NaN ``clip_norm``.
    TypeError: if a leaf is an integer or boolean array.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> jaxclip.ops.clip_by_average_norm(jnp.array([3., 4.]), 1.)
    Array([1.2, 1.6], dtype=float32)
  """
  tree = _tf_args.as_tensor(tree, "clip_by_average_norm")
  _validation.check_hparam(clip_norm, "clip_norm", lo=0)
  _validation.check_inexact_leaves(tree, "clip_by_average_norm")

  return _clip.average_norm_clip(tree, clip_norm)


def clip_by_global_norm(
  tree: PyTree,
  clip_norm: ArrayLike,
  use_norm: ArrayLike | None = None,
  *,
  ord: int | float | str = 2,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> tuple[PyTree, jax.Array]:
  r"""Scales every leaf by one common factor so the global norm is at most ``clip_norm``.

  .. math::

    t \mapsto t \cdot \frac{c}{\max(\|g\|, c)}, \qquad
    \|g\| = \sqrt{\textstyle\sum_t \|t\|_2^2}

  All leaves share one factor, so both the direction of the whole gradient
  and the balance between its tensors are kept (Pascanu et al., 2012). The
  norm is :func:`global_norm` (float32 accumulation), or ``use_norm`` if
  given, e.g. a norm a trainer computed in float32 or across devices.

  =============================  ===========================================
  case                           result
  =============================  ===========================================
  ``norm <= clip_norm``          the tree, unchanged
  ``clip_norm == 0``             zeros (gradient 0), never NaN
  all-zero tree                  zeros; ``jax.grad`` finite
  norm is ``inf`` or ``nan``     every entry NaN, as TensorFlow, so the
                                 failure is visible (see
                                 :func:`jaxclip.skip_nonfinite`-style
                                 policies for skipping such steps)
  traced negative ``clip_norm``  acts as ``0``
  =============================  ===========================================

  Args:
    tree: A pytree of floating-point or complex arrays.
    clip_norm: The maximum global norm, ``>= 0``.
    use_norm: A precomputed global norm (a real scalar) to use instead of
      computing one; it is also what is returned as the norm (``axis_name`` is
      then unused). It is read in float32 (float64 where a leaf or
      ``use_norm`` is float64), so a bfloat16 or integer norm gives the factor
      a float32 norm would.
    ord: The norm: ``2`` (default), ``1`` or ``inf``.
    axis_name: Inside ``shard_map``/``pmap``, the mesh axis (or tuple of
      axes) the leaves are sharded over, as in :func:`global_norm`: every
      device then scales its shards by the same factor. Not needed under
      ``jax.jit`` with sharded arrays, which keeps each leaf's sharding.
    replicated: Which leaves are replicated across ``axis_name`` and counted
      once; see :func:`global_norm`.
    partition_specs: Where the leaves are sharded (``PartitionSpec``
      leaves), instead of ``replicated``; see :func:`global_norm`.

  Returns:
    ``(clipped_tree, norm)``: the clipped pytree with the input's structure
    and dtypes, and the global norm before clipping.

  Raises:
    ValueError: for a concrete negative or NaN ``clip_norm``, a ``clip_norm``
      that is not a scalar, or an unsupported ``ord``.
    TypeError: if a leaf is an integer or boolean array (its path is named).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> tree = [jnp.array([-2., 3., 6.]), jnp.array([-4., 6., 12.])]
    >>> clipped, norm = jaxclip.ops.clip_by_global_norm(tree, 14.5)
    >>> norm  # sqrt(7**2 + 14**2)
    Array(15.652476, dtype=float32)
    >>> print(f"{jaxclip.ops.global_norm(clipped):.4f}")
    14.5000

  References:
    Pascanu et al., `On the difficulty of training Recurrent Neural Networks
    <https://arxiv.org/abs/1211.5063>`_, 2012
  """
  ord = _validation.check_ord(ord)
  _validation.check_hparam(clip_norm, "clip_norm", lo=0, scalar=True)
  _validation.check_inexact_leaves(tree, "clip_by_global_norm")
  if use_norm is None:
    norm = _reduction.tree_norm(tree, ord, axis_name, replicated, partition_specs)
  else:
    _validation.check_scalar(use_norm, "use_norm")
    try:
      real = _validation.is_real(jnp.result_type(use_norm))
    except (TypeError, ValueError):
      real = False
    if not real:
      raise TypeError(f"use_norm must be a real scalar, got {use_norm!r:.100}.")
    norm = _clip.read_norm(use_norm, tree)
  return _clip.global_norm_clip(tree, clip_norm, norm), norm
