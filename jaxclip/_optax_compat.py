"""Drop-ins for the rest of optax's clipping module, on jaxclip's norm kernel.

Same names, signatures, defaults and results as ``optax`` within float32
rounding; where they differ, jaxclip is the more careful one: norms accumulate
in float32 for half-precision leaves, zero thresholds give zeros rather than
NaN and gradients at zero are finite. Integer and boolean inputs are promoted
to floating point, as optax does.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxclip import _numerics, _transforms, _validation

ArrayLike = jax.typing.ArrayLike
Axis = int | tuple[int, ...] | None


def clip_by_block_rms(threshold: ArrayLike) -> optax.GradientTransformationExtraArgs:
  r"""Clips each leaf of the updates to a root-mean-square of at most ``threshold``.

  .. math::

    u \mapsto \frac{u}{\max\!\big(1, \mathrm{rms}(u) / \tau\big)}, \qquad
    \mathrm{rms}(u) = \sqrt{\tfrac{1}{n}\textstyle\sum_i |u_i|^2}

  A drop-in for ``optax.clip_by_block_rms``; a zero threshold gives zeros
  (optax: NaN for all-zero leaves) and the RMS accumulates in float32.

  Args:
    threshold: The maximum RMS of each leaf, ``>= 0``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with an empty state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> tx = jaxclip.clip_by_block_rms(1.0)
    >>> tx.update(jnp.array([3., 4., 0., 0.]), tx.init(None))[0]  # rms 2.5
    Array([1.2, 1.6, 0. , 0. ], dtype=float32)
  """
  _validation.check_threshold(threshold, "threshold")

  def update(updates):
    updates = _validation.numeric_leaves(updates, "clip_by_block_rms")
    leaves, treedef = jax.tree.flatten(updates)
    return treedef.unflatten(
      _numerics.scale_by_leaf_norms(_block_rms_scale, leaves, 2, operands=(threshold,))
    )

  return _transforms.stateless(update)


def _block_rms_scale(norm, size, threshold):
  # rms >= threshold  <=>  norm >= threshold * sqrt(size)
  return _numerics.clip_scale(norm, jnp.asarray(threshold, norm.dtype) * math.sqrt(size))


def _unitwise_axes(shape: tuple[int, ...], axis: Axis) -> Axis:
  """optax's layer conventions for the axes a unit-wise norm reduces over."""
  if axis is not None:
    return axis
  if sum(d != 1 for d in shape) <= 1:  # a scalar or a vector, whatever its rank
    return None
  if len(shape) in (2, 3):
    return 0
  if len(shape) == 4:
    return (0, 1, 2)
  if len(shape) == 5:
    return (0, 1, 2, 3)
  raise ValueError(
    f"unitwise_norm: expected a leaf of rank 1 to 5, got shape {shape}; "
    "pass axis= to name the reduction axes for other shapes."
  )


def unitwise_norm(x: ArrayLike, axis: Axis = None) -> jax.Array:
  r"""The L2 norm of each unit of ``x``, broadcast back to ``x``'s shape.

  A unit is a slice of ``x`` over ``axis``; with ``axis=None`` the axes follow
  optax's layer conventions: the whole array for scalars and vectors, axis 0
  for rank 2 and 3 (linear and multi-head linear), axes ``(0, 1, 2)`` for rank
  4 (HWIO convolutions) and ``(0, 1, 2, 3)`` for rank 5. A drop-in for
  ``optax.transforms.unitwise_norm``, accumulated in float32 and returned in ``x``'s
  real dtype.

  Args:
    x: An array.
    axis: The axes to reduce over, or ``None`` for the conventions above.

  Returns:
    An array of ``x``'s shape holding each unit's norm.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> jaxclip.unitwise_norm(jnp.array([[3., 0.], [4., 1.]]))
    Array([[5., 1.],
           [5., 1.]], dtype=float32)
  """
  x = jnp.asarray(_validation.numeric_leaves(x, "unitwise_norm", "x"))
  norm = _numerics.leaf_norm(x, 2, _unitwise_axes(x.shape, axis), keepdims=True)
  return jnp.broadcast_to(norm.astype(jnp.finfo(x.dtype).dtype), x.shape)


def _unitwise_factor(g_norm: jax.Array, max_norm: jax.Array, div_eps: ArrayLike) -> jax.Array:
  """The factor of :func:`unitwise_clip`: ``1`` below the bound, ``bound / norm`` above.

  Written as one division (``1 / 1`` below the bound; ``g * 1`` is ``g``, bit
  for bit) so that the factor ends in an op XLA does not copy into each of
  its consumers: a trailing select was recomputed in the kernel of every row
  of :func:`adaptive_grad_clip`'s stacks (1.8x the instructions).
  """
  below = g_norm < max_norm
  one = jnp.ones_like(max_norm)
  return jnp.where(below, one, max_norm) / jnp.where(
    below, one, jnp.maximum(g_norm, jnp.asarray(div_eps, g_norm.dtype))
  )


def unitwise_clip(
  g_norm: ArrayLike,
  max_norm: ArrayLike,
  grad: ArrayLike,
  div_eps: ArrayLike = 1e-6,
) -> jax.Array:
  r"""Scales ``grad`` by ``max_norm / g_norm`` where ``g_norm >= max_norm``.

  .. math::

    g \mapsto \begin{cases} g & \|g\| < m \\
      g \cdot m / \max(\|g\|, \epsilon) & \text{otherwise} \end{cases}

  The elementwise step of adaptive gradient clipping, a drop-in for
  ``optax.transforms.unitwise_clip``. All three arrays must have the same shape; the
  product is computed in float32 for half-precision ``grad`` and returned in
  ``grad``'s dtype.

  Args:
    g_norm: Each unit's gradient norm, broadcast to ``grad``'s shape.
    max_norm: Each unit's largest allowed norm, same shape.
    grad: The gradient.
    div_eps: Guards the division when ``g_norm`` is ``0``.

  Returns:
    The clipped gradient.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> g = jnp.array([3., 4.])
    >>> jaxclip.unitwise_clip(jnp.full(2, 5.), jnp.full(2, 1.), g)
    Array([0.6, 0.8], dtype=float32)
  """
  g_norm, max_norm, grad = (
    jnp.asarray(_validation.numeric_leaves(v, "unitwise_clip", name))
    for v, name in ((g_norm, "g_norm"), (max_norm, "max_norm"), (grad, "grad"))
  )
  if not g_norm.shape == max_norm.shape == grad.shape:
    raise ValueError(
      "unitwise_clip needs g_norm, max_norm and grad of one shape, got "
      f"{g_norm.shape}, {max_norm.shape} and {grad.shape}."
    )
  acc = _numerics.accumulation_dtype(grad.dtype)
  g_norm, max_norm = g_norm.astype(acc), max_norm.astype(acc)
  return _numerics.apply_scale(grad, _unitwise_factor(g_norm, max_norm, div_eps))


def adaptive_grad_clip(
  clipping: ArrayLike, eps: ArrayLike = 1e-3, axis: Axis = None
) -> optax.GradientTransformationExtraArgs:
  r"""Adaptive gradient clipping: unit-wise ``||g|| <= clipping * max(||w||, eps)``.

  .. math::

    g_u \mapsto \begin{cases} g_u & \|g_u\| < \lambda \max(\|w_u\|, \epsilon)\\
      \lambda \max(\|w_u\|, \epsilon)\, g_u / \|g_u\| & \text{otherwise}
    \end{cases}

  for every unit ``u`` (see :func:`unitwise_norm`). A drop-in for
  ``optax.adaptive_grad_clip``; needs ``params`` in ``update``, of the
  updates' shapes. Both norms accumulate in float32 for half-precision
  leaves (optax rounds them to the leaf's dtype), and small leaves of one
  shape are clipped together, so thousands of them compile in seconds.

  Args:
    clipping: The largest allowed ratio of update norm to parameter norm.
    eps: Floor on the parameter norm, so zero-initialised units still move.
    axis: The unit axes, or ``None`` for :func:`unitwise_norm`'s conventions.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with an empty state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> tx = jaxclip.adaptive_grad_clip(0.5)
    >>> params = jnp.array([3., 4.])  # norm 5: updates held to norm 2.5
    >>> tx.update(jnp.array([6., 8.]), tx.init(params), params)[0]
    Array([1.5, 2. ], dtype=float32)

  References:
    Brock et al., `High-Performance Large-Scale Image Recognition Without
    Normalization <https://arxiv.org/abs/2102.06171>`_, 2021
  """
  _validation.check_threshold(clipping, "clipping")
  _validation.check_threshold(eps, "eps")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(
        "adaptive_grad_clip needs the current parameters: call update(updates, state, params)."
      )

    updates = _validation.numeric_leaves(updates, "adaptive_grad_clip")
    leaves, treedef = jax.tree.flatten(updates)
    if jax.tree.structure(params) != treedef:
      raise ValueError(
        "adaptive_grad_clip needs params with the tree structure of the updates, "
        f"got params {jax.tree.structure(params)} for updates {treedef}."
      )
    param_leaves = jax.tree.leaves(
      _validation.numeric_leaves(params, "adaptive_grad_clip", "params")
    )
    for g, p in zip(leaves, param_leaves, strict=True):
      if jnp.shape(g) != jnp.shape(p):
        raise ValueError(
          "adaptive_grad_clip needs params of the updates' shapes, got "
          f"{jnp.shape(p)} for updates of shape {jnp.shape(g)}."
        )

    return treedef.unflatten(
      _numerics.scale_by_leaf_norms(
        _agc_factor,
        leaves,
        2,
        lambda shape: _unitwise_axes(shape, axis),
        param_leaves,
        operands=(clipping, eps),
      )
    ), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _agc_factor(g_norm, size, p_norm, clipping, eps):
  del size
  max_norm = jnp.asarray(clipping, g_norm.dtype) * jnp.maximum(
    p_norm.astype(g_norm.dtype), jnp.asarray(eps, g_norm.dtype)
  )
  return _unitwise_factor(g_norm, max_norm, 1e-6)


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
  _validation.check_threshold(l2_norm_clip, "l2_norm_clip")
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
  _validation.check_threshold(global_l2_norm_clip, "global_l2_norm_clip")
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
