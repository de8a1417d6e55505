"""Checks that turn bad input into a clear error, before anything is traced.

Only concrete values can be checked: a threshold that is a tracer (inside
``jax.jit`` or ``optax.inject_hyperparams`` under ``jit``) is left alone, and
the ops document what a bad traced value does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def concrete_value(x: Any) -> np.ndarray | None:
  """``x`` as a NumPy array if it is concrete, else ``None`` (a tracer)."""
  if x is None or any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x)):
    return None
  try:
    return np.asarray(x)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def check_threshold(value: Any, name: str) -> None:
  """Raises ``ValueError`` if a concrete threshold is negative or NaN."""
  v = concrete_value(value)
  if v is None:
    return
  if not np.issubdtype(v.dtype, np.number) or np.iscomplexobj(v):
    raise TypeError(f"{name} must be a real number or array, got {value!r}.")
  if np.any(np.isnan(v)):
    raise ValueError(f"{name} must not be NaN, got {value!r}.")
  if np.any(v < 0):
    raise ValueError(f"{name} must be non-negative, got {value!r}.")


def check_bounds(lo: Any, hi: Any, lo_name: str, hi_name: str) -> None:
  """Raises ``ValueError`` for concrete NaN bounds or ``lo > hi``."""
  vlo, vhi = concrete_value(lo), concrete_value(hi)
  for v, name, raw in ((vlo, lo_name, lo), (vhi, hi_name, hi)):
    if v is not None:
      if not np.issubdtype(v.dtype, np.number) or np.iscomplexobj(v):
        raise TypeError(f"{name} must be a real number or array, got {raw!r}.")
      if np.any(np.isnan(v)):
        raise ValueError(f"{name} must not be NaN, got {raw!r}.")
  if vlo is not None and vhi is not None and np.any(vlo > vhi):
    raise ValueError(
        f"{lo_name} must not exceed {hi_name}, got {lo_name}={lo!r} > "
        f"{hi_name}={hi!r}."
    )


def _leaf_dtype(x: Any) -> np.dtype:
  return jnp.result_type(x) if not hasattr(x, "dtype") else np.dtype(x.dtype)


def check_inexact_leaves(tree: Any, fn_name: str) -> None:
  """Raises ``TypeError`` naming the path of the first non-float leaf."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = _leaf_dtype(leaf)
    if not jnp.issubdtype(dtype, jnp.inexact):
      where = jax.tree_util.keystr(path) or "<root>"
      raise TypeError(
          f"{fn_name} needs floating-point or complex leaves, but the leaf at "
          f"{where} has dtype {dtype}. Cast it to a float dtype first (norms "
          "of integer or boolean arrays are not defined as gradients)."
      )


def check_real_leaves(tree: Any, fn_name: str) -> None:
  """Raises ``TypeError`` naming the path of the first complex or bool leaf."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = _leaf_dtype(leaf)
    if jnp.issubdtype(dtype, jnp.complexfloating) or dtype == np.bool_:
      where = jax.tree_util.keystr(path) or "<root>"
      raise TypeError(
          f"{fn_name} needs real (integer or floating-point) leaves, but the "
          f"leaf at {where} has dtype {dtype}; elementwise bounds are not "
          "defined for it."
      )
