"""TensorFlow's reading of an op's tensor argument: a list of numbers is one tensor.

``jaxclip.ops`` follows TensorFlow's names and formulas; these helpers make its
arguments mean what TensorFlow's do where a pytree would read them otherwise.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxclip._kernel._typing import PyTree


def is_number_literal(x: Any) -> bool:
  """Whether ``x`` is a number, or a non-empty (nested) list or tuple of numbers only."""
  if type(x) in (list, tuple):
    return bool(x) and all(is_number_literal(y) for y in x)
  return isinstance(x, (int, float, np.number)) and not isinstance(x, (bool, np.bool_))


def as_tensor(t: PyTree, fn_name: str) -> PyTree:
  """A list or tuple of Python numbers as the one tensor TensorFlow makes of it.

  ``tf.clip_by_norm([3., 4.], 1.)`` clips the vector ``[3., 4.]``: TensorFlow
  converts its argument to one tensor. As a pytree the same list would be two
  scalar leaves, each clipped on its own, a silent difference; so a (nested)
  list or tuple whose leaves are all Python (or NumPy) numbers is read as one
  array, as TensorFlow reads it. A list that holds an array, and every
  other container, is a pytree.
  """
  if type(t) not in (list, tuple) or not is_number_literal(t):
    return t
  try:
    return jnp.asarray(np.asarray(t))
  except ValueError as e:
    raise ValueError(
      f"{fn_name} reads a list of numbers as one tensor, as TensorFlow does, but this "
      f"one is ragged ({e}); pass a pytree of arrays to clip each leaf on its own."
    ) from None
