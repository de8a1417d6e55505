"""Checks that turn bad input into a clear error, before anything is traced.

Only concrete values can be checked: a threshold that is a tracer (inside
``jax.jit`` or ``optax.inject_hyperparams`` under ``jit``) is left alone, and
the ops document what a bad traced value does.
"""

from __future__ import annotations

import operator
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


def _real(value: Any, name: str, what: str = "a real number or array") -> np.ndarray | None:
  """``value`` as a NumPy array (``None`` if traced); ``TypeError`` unless it is real."""
  if value is None:
    raise TypeError(f"{name} must be {what}, got None.")
  v = concrete_value(value)
  if v is None:
    return None
  if v.dtype == np.bool_ or not jnp.issubdtype(v.dtype, jnp.number) or np.iscomplexobj(v):
    raise TypeError(f"{name} must be {what}, got {value!r}.")
  return v


def check_hparam(
  value: Any,
  name: str,
  *,
  lo: float | None = None,
  hi: float | None = None,
  lo_open: bool = False,
  hi_open: bool = False,
  scalar: bool = False,
  finite: bool = False,
  static: bool = False,
) -> np.ndarray | None:
  """Checks one hyperparameter; returns it as a NumPy array, or ``None`` if traced.

  The one check behind every threshold, rate, decay and percentile:

  * ``TypeError`` unless ``value`` is a real number or array (not ``None``, a
    string, a bool, complex);
  * ``ValueError`` if it is NaN, lies outside ``[lo, hi]`` (open at either end
    with ``lo_open`` / ``hi_open``) or, with ``finite``, is infinite;
  * with ``scalar``, ``ValueError`` unless it is 0-d. Shapes are static, so
    this also holds for a traced value.

  A traced value (under ``jax.jit``, or ``optax.inject_hyperparams`` under
  ``jit``) cannot be compared without a host sync, so only its type and shape
  are checked, unless ``static``: then it must be concrete, and a traced
  value raises ``TypeError``.

  Args:
    value: the hyperparameter.
    name: its argument name, shown in the error.
    lo: smallest allowed value (``None``: no lower bound).
    hi: largest allowed value (``None``: no upper bound).
    lo_open: exclude ``lo`` itself.
    hi_open: exclude ``hi`` itself.
    scalar: require a 0-d value.
    finite: refuse ``inf``.
    static: refuse a traced value.

  Returns:
    ``value`` as a NumPy array, or ``None`` for a traced one.

  Examples:
    >>> from jaxclip._kernel._validation import check_hparam
    >>> float(check_hparam(0.5, "beta", lo=0, hi=1, hi_open=True, scalar=True))
    0.5
    >>> check_hparam(-1.0, "max_norm", lo=0)
    Traceback (most recent call last):
    ...
    ValueError: max_norm must be non-negative, got -1.0.
  """
  v = _real(value, name)
  if v is None:
    if static:
      raise TypeError(
        f"{name} must be a concrete value, not traced: it is needed before tracing. "
        f"Under optax.inject_hyperparams pass static_args=({name!r},)."
      )
    if scalar:
      check_scalar(value, name)
    return None
  if hi is not None:
    below = (v <= lo if lo_open else v < lo) if lo is not None else False
    above = v >= hi if hi_open else v > hi
    if np.any(np.isnan(v) | below | above):
      left = "(" if lo_open else "["
      right = ")" if hi_open else "]"
      low = "-inf" if lo is None else lo
      raise ValueError(f"{name} must lie in {left}{low}, {hi}{right}, got {value!r}.")
  else:
    if np.any(np.isnan(v)):
      raise ValueError(f"{name} must not be NaN, got {value!r}.")
    if lo is not None and np.any(v <= lo if lo_open else v < lo):
      if lo == 0:
        need = "positive" if lo_open else "non-negative"
      else:
        need = f"greater than {lo}" if lo_open else f"at least {lo}"
      raise ValueError(f"{name} must be {need}, got {value!r}.")
  if finite and not np.all(np.isfinite(v)):
    raise ValueError(f"{name} must be finite, got {value!r}.")
  if scalar:
    check_scalar(value, name)
  return v


def check_bounds(lo: Any, hi: Any, lo_name: str, hi_name: str) -> None:
  """Raises ``ValueError`` for concrete NaN bounds or ``lo > hi``."""
  vlo, vhi = _real(lo, lo_name), _real(hi, hi_name)
  for v, name, raw in ((vlo, lo_name, lo), (vhi, hi_name, hi)):
    if v is not None:
      if np.any(np.isnan(v)):
        raise ValueError(f"{name} must not be NaN, got {raw!r}.")
  if vlo is not None and vhi is not None and np.any(vlo > vhi):
    raise ValueError(
      f"{lo_name} must not exceed {hi_name}, got {lo_name}={lo!r} > {hi_name}={hi!r}."
    )


def check_scalar(value: Any, name: str) -> None:
  """Raises ``ValueError`` unless ``value`` is 0-d (shapes are static, even traced)."""
  try:
    shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a real scalar, got {value!r}.") from None
  if shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {shape}: {value!r}.")


def _leaf_dtype(x: Any) -> Any:
  """The dtype of a leaf (a NumPy dtype, or JAX's extended dtype of a PRNG key).

  For a leaf that is no array nor number (a string, an object) its type's
  name, which no dtype check accepts, so that the error names the leaf.
  """
  if hasattr(x, "dtype"):
    return x.dtype
  if isinstance(x, (str, bytes)):
    return type(x).__name__
  try:
    return jnp.result_type(x)
  except (TypeError, ValueError):
    return type(x).__name__


def _is_float_leaf(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return isinstance(x, (float, complex))
  return jnp.issubdtype(dtype, jnp.inexact)


def _where(path: Any) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def numeric_leaves(
  tree: Any, fn_name: str, arg: str = "updates", *, promote: bool = True, dtype_for: Any = None
) -> Any:
  """``tree`` with integer and boolean leaves promoted to floating point.

  The one policy of jaxclip's transforms for leaves that are not floats: as
  optax's arithmetic does, an integer or boolean leaf is a number, promoted
  to JAX's default float dtype (``dtype_for(dtype)`` instead, where given)
  and clipped as one. A leaf that holds no number (a PRNG key, a ``float0``
  tangent, anything that is not an array) raises ``TypeError`` naming its
  path. With ``promote=False`` the leaves are only checked and ``tree`` is
  returned as is.
  """
  if all(_is_float_leaf(x) for x in jax.tree.leaves(tree)):
    return tree
  out = []
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  for path, leaf in paths:
    try:
      dtype = _leaf_dtype(leaf)
      ok = not jnp.issubdtype(dtype, jax.dtypes.extended) and (
        dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)
      )
    except (TypeError, ValueError):
      dtype, ok = type(leaf).__name__, False
    if not ok:
      raise TypeError(
        f"{fn_name} clips numbers, but the leaf of {arg} at {_where(path)} has "
        f"dtype {dtype}, which holds none (a PRNG key, a float0 tangent or a "
        "non-array). Leave such leaves out of the updates, e.g. with "
        "optax.masked or optax.partition."
      )
    if not promote or jnp.issubdtype(dtype, jnp.inexact):
      out.append(leaf)
    else:
      to = dtype_for(dtype) if dtype_for is not None else jax.dtypes.canonicalize_dtype(jnp.float64)
      out.append(jnp.asarray(leaf).astype(to))
  return tree if not promote else treedef.unflatten(out)


def check_transform(inner: Any, name: str) -> None:
  """Raises ``TypeError`` unless ``inner`` looks like an optax transform."""
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
      f"{name} must be an optax GradientTransformation (with init and update), got {inner!r:.100}."
    )


def check_state(state: Any, state_type: type, fn_name: str) -> None:
  """Raises ``TypeError`` unless ``state`` has the fields of ``state_type``.

  Duck-typed, so a state restored from a checkpoint as another named tuple of
  the same fields still works.
  """
  if not all(hasattr(state, field) for field in state_type._fields):
    raise TypeError(
      f"{fn_name}'s update needs the state its init returned (a "
      f"{state_type.__name__}), got state={type(state).__name__}: {state!r:.200}."
    )


def check_inexact_leaves(tree: Any, fn_name: str) -> None:
  """Raises ``TypeError`` naming the path of the first non-float leaf."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = _leaf_dtype(leaf)
    if isinstance(dtype, str) or not jnp.issubdtype(dtype, jnp.inexact):
      where = _where(path)
      raise TypeError(
        f"{fn_name} needs floating-point or complex leaves, but the leaf at "
        f"{where} has dtype {dtype}. Cast it to a float dtype first (norms "
        "of integer or boolean arrays are not defined as gradients)."
      )


def check_real_leaves(tree: Any, fn_name: str) -> None:
  """Raises ``TypeError`` naming the path of the first complex or bool leaf."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = _leaf_dtype(leaf)
    if isinstance(dtype, str) or jnp.issubdtype(dtype, jnp.complexfloating) or (dtype == np.bool_):
      where = _where(path)
      raise TypeError(
        f"{fn_name} needs real (integer or floating-point) leaves, but the "
        f"leaf at {where} has dtype {dtype}; elementwise bounds are not "
        "defined for it."
      )


def check_size(value: Any, name: str, minimum: int = 1) -> int | None:
  """``value`` as a Python int ``>= minimum``, or ``None`` if it is traced.

  A size fixes the shape of a transform's state, so it is only needed
  concretely in ``init`` (see :func:`require_size`); ``update`` reads it from
  the state's shapes. That way ``optax.inject_hyperparams``, which turns
  every int argument into a (traced) array, still works. Raises ``TypeError``
  for a non-integer and ``ValueError`` below ``minimum``.
  """
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, bool):
    raise TypeError(f"{name} must be an int, got {value!r}.")
  try:
    size = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be an int, got {value!r}.") from None
  if size < minimum:
    raise ValueError(f"{name} must be at least {minimum}, got {size}.")
  return size


def require_size(size: int | None, name: str) -> int:
  """``size`` from :func:`check_size`; a ``TypeError`` if it was traced."""
  if size is None:
    raise TypeError(
      f"{name} fixes the shape of the transform's state, so it must be a "
      f"concrete int when the state is initialised. Under "
      f"optax.inject_hyperparams with a jitted init, pass "
      f"static_args=({name!r},)."
    )
  return size
