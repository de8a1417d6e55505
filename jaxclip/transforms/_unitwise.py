"""Drop-ins for the rest of optax's clipping module, on jaxclip's norm kernel.

Same names, signatures, defaults and results as ``optax`` within float32
rounding; where they differ, jaxclip is the more careful one: norms accumulate
in float32 for half-precision leaves, zero thresholds give zeros rather than
NaN and gradients at zero are finite. Integer and boolean inputs are promoted
to floating point, as optax does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _validation
from jaxclip._kernel._typing import ArrayLike
from jaxclip.transforms import _fixed

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
  _validation.check_hparam(threshold, "threshold", lo=0)

  def update(updates):
    updates = _validation.numeric_leaves(updates, "clip_by_block_rms")
    leaves, treedef = jax.tree.flatten(updates)
    return treedef.unflatten(
      _numerics.scale_by_leaf_norms(_block_rms_scale, leaves, 2, operands=(threshold,))
    )

  return _fixed.stateless(update)


def _block_rms_scale(norm, size, threshold):
  # rms >= threshold  <=>  norm >= threshold * sqrt(size)
  # A symbolic size (jax.export) is a value only known when the program runs.
  root = math.sqrt(size) if isinstance(size, int) else jnp.sqrt(jnp.asarray(size, norm.dtype))
  return _numerics.clip_scale(norm, jnp.asarray(threshold, norm.dtype) * root)


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
  real = jnp.finfo(x.dtype).dtype
  # A finite norm beyond the real dtype's range (a bfloat16 or float16 leaf)
  # saturates at its largest value rather than becoming inf.
  big = float(jnp.finfo(real).max)
  norm = jnp.where(jnp.isfinite(norm), jnp.minimum(norm, big), norm)
  return jnp.broadcast_to(norm.astype(real), x.shape)


def _unitwise_factor(g_norm: jax.Array, max_norm: jax.Array, div_eps: ArrayLike) -> jax.Array:
  """The factor of :func:`unitwise_clip`: ``1`` below the bound, ``bound / norm`` above.

  ``1`` below the bound leaves ``g * 1 == g`` bit for bit, as optax's select
  does; the factor above is optax's ``max_norm / max(g_norm, div_eps)``.
  """
  above = jnp.logical_not(g_norm < max_norm)
  den = jnp.maximum(g_norm, jnp.asarray(div_eps, g_norm.dtype))
  return _numerics.safe_divide(max_norm, den, above, otherwise=1)


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
  _validation.check_hparam(clipping, "clipping", lo=0)
  _validation.check_hparam(eps, "eps", lo=0)

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
  # A traced negative clipping acts as 0 (zero updates), as the norm clips'
  # negative thresholds do; a NaN one gives NaN.
  max_norm = jnp.maximum(jnp.asarray(clipping, g_norm.dtype), 0) * jnp.maximum(
    p_norm.astype(g_norm.dtype), jnp.asarray(eps, g_norm.dtype)
  )
  return _unitwise_factor(g_norm, max_norm, 1e-6)
