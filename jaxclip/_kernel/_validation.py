"""Every check that turns bad input into a clear error, before anything is traced.

Hyperparameters are checked where the user gives them: by each public op on
every call, and by each transform's factory once (``update`` checks only
what it is given: the updates' leaves and the state). Only concrete values
can be compared: a hyperparameter that is a tracer (inside ``jax.jit``, or
``optax.inject_hyperparams`` under ``jit``) gets the checks its type and
shape allow, and the ops document what a bad traced value does.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------
# What is known before tracing: concrete values, constant shapes
# ----------------------------------------------------------------------------


def concrete_value(x: Any) -> np.ndarray | None:
  """``x`` as a NumPy array if it is concrete, else ``None`` (a tracer)."""
  if x is None or any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x)):
    return None
  try:
    return np.asarray(x)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def _traced(name: str, why: str) -> TypeError:
  return TypeError(f"{name} must be a concrete value, not traced: {why}.")


# ----------------------------------------------------------------------------
# Hyperparameters and other arguments
# ----------------------------------------------------------------------------


def is_real(dtype: Any) -> bool:
  """Whether ``dtype`` holds real numbers: an integer or floating dtype, not bool."""
  return dtype != np.bool_ and (
    jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
  )


def _real(value: Any, name: str, what: str = "a real number or array") -> np.ndarray | None:
  """``value`` as a NumPy array (``None`` if traced); ``TypeError`` unless it is real."""
  if value is None:
    raise TypeError(f"{name} must be {what}, got None.")
  v = concrete_value(value)
  if v is None:
    return None
  if not is_real(v.dtype):
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
  static: str | None = None,
) -> np.ndarray | None:
  """Checks one hyperparameter; returns it as a NumPy array, or ``None`` if traced.

  The one check behind every threshold, rate, decay and percentile:
  ``TypeError`` unless ``value`` is a real number or array (not ``None``, a
  string, a bool, complex); ``ValueError`` if it is NaN, lies outside
  ``[lo, hi]`` (open at either end with ``lo_open`` / ``hi_open``), is
  infinite with ``finite``, or is not 0-d with ``scalar``. A traced value
  cannot be compared without a host sync, so only its type and shape are
  checked; unless ``static`` (why the value is needed before tracing) is
  given: then a traced value raises ``TypeError``.

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
      raise _traced(name, static)
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
    if v is not None and np.any(np.isnan(v)):
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


def check_size(value: Any, name: str, minimum: int = 1, *, static: str | None = None) -> int | None:
  """``value`` as a Python int ``>= minimum``, or ``None`` if it is traced.

  The one check of a count or a size. A size that fixes the shape of a
  transform's state is only needed concretely in ``init`` (see
  :func:`require_size`); ``update`` reads it from the state's shapes, so that
  ``optax.inject_hyperparams``, which turns every int argument into a
  (traced) array, still works. Where the value is needed before tracing,
  ``static`` says why, and a traced value raises ``TypeError``. Raises
  ``TypeError`` for a non-integer (a bool, a float) and ``ValueError`` below
  ``minimum``.
  """
  if isinstance(value, jax.core.Tracer):
    if static:
      raise _traced(name, static)
    return None
  try:
    if isinstance(value, bool):
      raise TypeError
    size = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be an int, got {value!r:.100}.") from None
  if size < minimum:
    need = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum)
    raise ValueError(f"{name} must be {need or f'an integer >= {minimum}'}, got {size}.")
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


_ORDS = {None: 2, 1: 1, 2: 2, math.inf: math.inf, "inf": math.inf}


def check_ord(ord: Any) -> float:
  """Normalises ``ord`` to ``1``, ``2`` or ``inf`` (``None`` means 2).

  A concrete 0-d array is read as its value; a traced one (as
  ``optax.inject_hyperparams`` makes of numeric arguments) cannot choose a
  reduction and raises, asking for ``static_args=("ord",)``.
  """
  if isinstance(ord, jax.core.Tracer):
    raise ValueError(
      "ord must be a static Python value, not a traced array; with "
      "optax.inject_hyperparams pass static_args=('ord',)."
    )
  if getattr(ord, "shape", None) == ():
    ord = ord.item()
  try:
    if not isinstance(ord, bool):  # True == 1 as a dict key
      return _ORDS[ord]
  except (KeyError, TypeError):
    pass
  raise ValueError(
    f"Unsupported ord={ord!r}: jaxclip norms support ord=1, ord=2 and "
    "ord=inf (as torch.nn.utils.get_total_norm)."
  )


def check_key(key: Any) -> None:
  """Raises ``TypeError`` unless ``key`` is one ``jax.random`` key (typed, or legacy uint32)."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    ok = key.shape == ()
  else:
    ok = dtype == jnp.uint32 and getattr(key, "ndim", None) == 1
  if not ok:
    raise TypeError(
      "key must be one jax.random key (jax.random.key(seed), or a legacy "
      f"jax.random.PRNGKey(seed)), got {key!r:.100}."
    )


def check_transform(inner: Any, name: str) -> None:
  """Raises ``TypeError`` unless ``inner`` looks like an optax transform."""
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
      f"{name} must be an optax GradientTransformation (with init and update), got {inner!r:.100}."
    )


# ----------------------------------------------------------------------------
# The updates' leaves and the state
# ----------------------------------------------------------------------------


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


def is_float_leaf(x: Any) -> bool:
  """Whether a pytree leaf holds floating-point (or complex) numbers.

  The one test of floatness for updates and params alike: an array or
  NumPy scalar by its dtype (a PRNG key or ``float0`` is not), a Python
  ``float`` or ``complex`` by its type; anything else is not.
  """
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
  if all(is_float_leaf(x) for x in jax.tree.leaves(tree)):
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


def check_inexact_leaves(tree: Any, fn_name: str) -> None:
  """Raises ``TypeError`` naming the path of the first non-float leaf."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = _leaf_dtype(leaf)
    if isinstance(dtype, str) or not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
        f"{fn_name} needs floating-point or complex leaves, but the leaf at "
        f"{_where(path)} has dtype {dtype}. Cast it to a float dtype first (norms "
        "of integer or boolean arrays are not defined as gradients)."
      )


def check_real_leaves(
  tree: Any, fn_name: str, why: str = "elementwise bounds are not defined for it"
) -> None:
  """Raises ``TypeError`` naming the path of the first leaf that is not real (complex, bool)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = _leaf_dtype(leaf)
    if isinstance(dtype, str) or not is_real(dtype):
      raise TypeError(
        f"{fn_name} needs real (integer or floating-point) leaves, but the "
        f"leaf at {_where(path)} has dtype {dtype}; {why}."
      )


def check_mask(example_mask: Any, size: Any) -> jax.Array | None:
  """``example_mask`` as a boolean ``(size,)`` array (or ``None``), else a ``ValueError``."""
  if example_mask is None:
    return None
  mask = example_mask if isinstance(example_mask, jax.Array) else jnp.asarray(example_mask)
  if mask.dtype != jnp.bool_ or jnp.shape(mask) != (size,):
    raise ValueError(
      f"example_mask must be a boolean array of shape (batch,) = ({size},), True for a real "
      f"example; got {jax.typeof(mask)}."
    )
  return mask


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


def check_axes(axes: Any, name: str = "axes") -> None:
  """Raises ``TypeError`` unless ``axes`` is ``None``, an int or a sequence of ints."""
  items = [axes] if isinstance(axes, (int, np.integer)) else axes
  ok = axes is None or (
    not isinstance(axes, (str, bytes))
    and hasattr(items, "__iter__")
    and all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in items)
  )
  if isinstance(axes, bool) or not ok:
    raise TypeError(f"{name} must be None, an int or a sequence of ints, got {axes!r}.")
