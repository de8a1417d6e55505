"""Keras-style one-line clipping of any optax optimizer."""

from __future__ import annotations

import optax

from jaxclip._kernel import _validation
from jaxclip.transforms import _fixed


def clipped(
  optimizer: optax.GradientTransformation,
  *,
  clipnorm: float | None = None,
  clipvalue: float | None = None,
  global_clipnorm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Wraps an optimizer so that gradients are clipped first, as Keras's arguments.

  The keyword arguments mean what they mean on every ``keras.optimizers``
  optimizer:

  =====================  ========================  ============================
  argument               clips                     chained before ``optimizer``
  =====================  ========================  ============================
  ``clipnorm=c``         each leaf to L2 norm c    ``clip_by_norm(c)``
  ``global_clipnorm=c``  all leaves to norm c      ``clip_by_global_norm(c)``
  ``clipvalue=v``        each entry to [-v, v]     ``clip_by_value(-v, v)``
  =====================  ========================  ============================

  ``global_clipnorm`` is usually what you want: all leaves share one factor,
  so the update keeps its direction. ``clipnorm`` rescales each leaf by its
  own factor (the balance between layers changes) and ``clipvalue`` can turn
  the update's direction. With none of them the optimizer is returned
  unclipped (with extra-argument support). It is the optax counterpart of
  TensorFlow 1's ``tf.contrib.estimator.clip_gradients_by_norm(optimizer,
  clip_norm)`` and of calling ``torch.nn.utils.clip_grad_norm_`` before
  ``optimizer.step()``.

  Args:
    optimizer: Any optax ``GradientTransformation``.
    clipnorm: Maximum L2 norm of each leaf, ``>= 0``.
    clipvalue: Maximum absolute value of each entry, ``>= 0``.
    global_clipnorm: Maximum global L2 norm of all leaves, ``>= 0``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`: ``optax.chain`` of the
    clipping transform and ``optimizer``.

  Raises:
    ValueError: if more than one of ``clipnorm``, ``clipvalue`` and
      ``global_clipnorm`` is set (as Keras), for a negative or NaN value, or
      for a ``global_clipnorm`` that is not a scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.clipped(optax.sgd(0.1), global_clipnorm=1.0)
    >>> params = {'w': jnp.zeros(2)}
    >>> updates, _ = tx.update({'w': jnp.array([3., 4.])}, tx.init(params), params)
    >>> updates['w'].round(4)
    Array([-0.06, -0.08], dtype=float32)
  """
  _validation.check_transform(optimizer, "optimizer")
  given = {
    name: value
    for name, value in (
      ("clipnorm", clipnorm),
      ("clipvalue", clipvalue),
      ("global_clipnorm", global_clipnorm),
    )
    if value is not None
  }
  if len(given) > 1:
    raise ValueError(
      "Only one of clipnorm, clipvalue and global_clipnorm can be set, got "
      + ", ".join(f"{k}={v!r}" for k, v in given.items())
      + "."
    )
  for name, value in given.items():
    _validation.check_hparam(value, name, lo=0, scalar=name == "global_clipnorm")
  if clipnorm is not None:
    clip = _fixed.clip_by_norm(clipnorm)
  elif clipvalue is not None:
    clip = _fixed.clip(clipvalue)  # clip_by_value(-v, v); a complex entry's modulus bounded
  elif global_clipnorm is not None:
    clip = _fixed.clip_by_global_norm(global_clipnorm)
  else:
    return optax.with_extra_args_support(optimizer)
  return optax.chain(clip, optimizer)
