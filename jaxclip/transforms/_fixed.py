"""TensorFlow's clip family as optax ``GradientTransformationExtraArgs``."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _clip, _numerics, _reduction, _validation
from jaxclip._kernel._typing import ArrayLike


def stateless(update: Any) -> optax.GradientTransformationExtraArgs:
  """A transform with an empty state whose ``update`` maps ``updates`` alone.

  ``update_fn`` accepts ``state=None`` (it never reads its state), any
  ``params`` and any extra keyword arguments, as optax's own transforms do.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return update(updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def value_clip_dtype(lo: ArrayLike, hi: ArrayLike) -> Any:
  """The dtype an integer or boolean leaf is promoted to when clipped to ``[lo, hi]``.

  That of ``jnp.clip(leaf, lo, hi)`` (and so of ``optax.clip``): integer
  bounds keep an integer leaf integer, float bounds make it float.
  """

  def dtype_for(dtype: Any) -> Any:
    with jax.numpy_dtype_promotion("standard"):
      return jnp.result_type(dtype, lo, hi)

  return dtype_for


def value_clip(lo: ArrayLike, hi: ArrayLike, fn_name: str, modulus: bool = False) -> Any:
  """``updates -> clip_by_value(updates, lo, hi)`` with jaxclip's leaf policy.

  With ``modulus`` (the symmetric ``clip(max_delta)``, ``lo == -hi``) a
  complex entry's modulus is bounded by ``hi``, its phase kept; otherwise a
  complex leaf is refused (complex numbers have no order).
  """
  dtype_for = value_clip_dtype(lo, hi)

  def update(updates):
    updates = _validation.numeric_leaves(updates, fn_name, dtype_for=dtype_for)
    return _clip.value_clip(updates, lo, hi, fn_name=fn_name, modulus=modulus)

  return update


def clip_by_value(
  min_value: ArrayLike, max_value: ArrayLike
) -> optax.GradientTransformationExtraArgs:
  r"""Clips every entry of the updates to ``[min_value, max_value]``.

  The transform form of :func:`jaxclip.ops.clip_by_value` (Keras's
  ``clipvalue=`` is ``clip_by_value(-v, v)``). Value clipping bounds each
  entry on its own, so it can change the update's direction; prefer
  :func:`clip_by_global_norm` unless entries are independent. An integer or
  boolean leaf is promoted as by ``jnp.clip`` (float bounds make it float).

  Args:
    min_value: Lower bound, a scalar or an array broadcastable to each leaf.
    max_value: Upper bound.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with an empty state.

  Raises:
    ValueError: for concrete NaN bounds or ``min_value > max_value``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = optax.chain(jaxclip.clip_by_value(-1.0, 1.0), optax.sgd(1.0))
    >>> params = {'w': jnp.zeros(3)}
    >>> updates, _ = tx.update({'w': jnp.array([-3., 0.5, 2.])}, tx.init(params))
    >>> updates['w']
    Array([ 1. , -0.5, -1. ], dtype=float32)
  """
  _validation.check_bounds(min_value, max_value, "min_value", "max_value")
  return stateless(value_clip(min_value, max_value, "clip_by_value"))


def clip(max_delta: ArrayLike) -> optax.GradientTransformationExtraArgs:
  r"""Clips updates elementwise to ``[-max_delta, max_delta]`` (``optax.clip``).

  A drop-in for ``optax.clip``: same name, signature and results, with a clear
  ``ValueError`` for a concrete negative or NaN ``max_delta`` (optax silently
  returns ``max_delta`` everywhere then). An integer leaf is promoted as by
  ``jnp.clip``: a float ``max_delta`` makes it float, an int one keeps it.

  Args:
    max_delta: The largest absolute value an entry may keep, ``>= 0``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with an empty state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> tx = jaxclip.clip(0.5)
    >>> tx.update(jnp.array([-2., 0.1, 3.]), tx.init(None))[0]
    Array([-0.5,  0.1,  0.5], dtype=float32)
  """
  _validation.check_hparam(max_delta, "max_delta", lo=0)
  if _validation.concrete_value(max_delta) is None:
    # Traced (inject_hyperparams): a negative max_delta acts as 0, as the norm
    # clips' negative thresholds do (it would clip to [1, -1], i.e. -1); NaN stays NaN.
    max_delta = jnp.maximum(max_delta, 0)
  return stateless(value_clip(jnp.negative(max_delta), max_delta, "clip", modulus=True))


def clip_by_norm(max_norm: ArrayLike, axes: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Clips each leaf of the updates on its own to L2 norm ``max_norm``.

  The transform form of :func:`jaxclip.ops.clip_by_norm` and of Keras's
  ``clipnorm=``: :math:`u \mapsto u \cdot c / \max(\|u\|_2, c)` per leaf (per
  row with ``axes=[1]``, per column with ``axes=[0]``). Each leaf gets its own
  factor, so the balance between leaves changes; a per-tensor threshold is
  smaller than a global one for the same model.

  Args:
    max_norm: The maximum L2 norm of each leaf (or slice), ``>= 0``.
    axes: The axes the norm is taken over; ``None`` for the whole leaf.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with an empty state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> tx = jaxclip.clip_by_norm(5.0)
    >>> tx.update({'w': jnp.array([-2., 3., 6.])}, tx.init(None))[0]['w']
    Array([-1.4285715,  2.142857 ,  4.285714 ], dtype=float32)
  """
  _validation.check_hparam(max_norm, "max_norm", lo=0)
  _validation.check_axes(axes)
  return stateless(
    lambda u: _clip.norm_clip(
      _validation.numeric_leaves(u, "clip_by_norm"), max_norm, axes, arg="max_norm"
    )
  )


def clip_by_average_norm(max_norm: ArrayLike) -> optax.GradientTransformationExtraArgs:
  r"""Clips each leaf so its L2 norm divided by its size is at most ``max_norm``.

  The transform form of :func:`jaxclip.ops.clip_by_average_norm` (TensorFlow
  v1's ``clip_by_average_norm``).

  Args:
    max_norm: The maximum average L2 norm of each leaf, ``>= 0``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with an empty state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> tx = jaxclip.clip_by_average_norm(1.0)
    >>> tx.update([jnp.array([3., 4.])], tx.init(None))[0]
    [Array([1.2, 1.6], dtype=float32)]
  """
  _validation.check_hparam(max_norm, "max_norm", lo=0)
  return stateless(
    lambda u: _clip.average_norm_clip(
      _validation.numeric_leaves(u, "clip_by_average_norm"), max_norm
    )
  )


class ClipByGlobalNormState(NamedTuple):
  """State of :func:`clip_by_global_norm`.

  Attributes:
    pre_clip_norm: The global norm of the last updates before clipping (float32,
      or float64 for float64 params); ``0`` before the first step. Read it
      from any chain with ``optax.tree.get(opt_state, "pre_clip_norm")``.
  """

  pre_clip_norm: jax.Array


def clip_by_global_norm(
  max_norm: ArrayLike,
  *,
  ord: int | float | str | None = None,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Scales all updates by one factor so their global norm is at most ``max_norm``.

  .. math::

    u \mapsto u \cdot \frac{c}{\max(\|u\|, c)}

  A drop-in for ``optax.clip_by_global_norm`` that also keeps the pre-clip
  norm in its state (for logging and for choosing a threshold), accumulates
  the norm in float32 for half-precision updates, returns zeros rather than
  NaN for a zero threshold with zero updates, has a finite gradient at zero,
  and supports ``ord=1`` and ``ord=inf`` as PyTorch's ``clip_grad_norm_``.
  A non-finite norm turns every entry NaN (as TensorFlow and optax), so a bad
  step is visible.

  Under ``jax.jit`` with sharded parameters (FSDP, tensor parallelism) it
  works as is: XLA all-reduces one scalar and every leaf keeps its sharding.
  Inside ``jax.shard_map``/``jax.pmap``, where the updates are local shards,
  pass ``axis_name`` so all devices share the global norm (see
  ``docs/sharding_args.md``).

  Args:
    max_norm: The maximum global norm, ``>= 0``; a number, an array or a
      traced value (e.g. a schedule under ``optax.inject_hyperparams``).
    ord: ``None`` or ``2`` for the L2 norm (default), ``1`` or ``inf``. The
      default is ``None``, as in ``optax.tree.norm``, because
      ``optax.inject_hyperparams`` turns every numeric argument into a
      traced array; to pass an explicit ``ord`` through it, add
      ``static_args=("ord",)``.
    axis_name: Inside ``shard_map``/``pmap``, the mesh axis (or tuple of
      axes) the updates are sharded over; ``None`` (default) otherwise.
    replicated: Which leaves every device of ``axis_name`` holds in full
      (counted once); inferred under ``check_vma=True``.
    partition_specs: Where the leaves are sharded (``PartitionSpec`` leaves),
      instead of ``replicated``. The three are explained once in
      ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`ClipByGlobalNormState`.

  Raises:
    ValueError: for a concrete negative or NaN ``max_norm``, a ``max_norm``
      that is not a scalar (a traced scalar is fine), or an unsupported
      ``ord``.
    TypeError: in ``update``, for a leaf that holds no number (a PRNG key),
      named by its path. Integer and boolean leaves are promoted to float,
      as optax's arithmetic does.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(0.1))
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.array([3., 4.])}, state, params)
    >>> optax.tree.get(state, 'pre_clip_norm')
    Array(5., dtype=float32)
    >>> updates['w'].round(4)
    Array([-0.06, -0.08], dtype=float32)

  References:
    Pascanu et al., `On the difficulty of training Recurrent Neural Networks
    <https://arxiv.org/abs/1211.5063>`_, 2012
  """
  ord = _validation.check_ord(ord)
  _validation.check_hparam(max_norm, "max_norm", lo=0, scalar=True)

  def init_fn(params):
    return ClipByGlobalNormState(
      pre_clip_norm=jnp.zeros((), _numerics.tree_accumulation_dtype(params))
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if state is not None:  # None: the norm is not kept (optax's clip takes any state)
      _validation.check_state(state, ClipByGlobalNormState, "clip_by_global_norm")
    updates = _validation.numeric_leaves(updates, "clip_by_global_norm")
    norm = _reduction.tree_norm(updates, ord, axis_name, replicated, partition_specs)
    clipped = _clip.global_norm_clip(updates, max_norm, norm)
    if state is not None:
      norm = norm.astype(state.pre_clip_norm.dtype)
    return clipped, ClipByGlobalNormState(pre_clip_norm=norm)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
