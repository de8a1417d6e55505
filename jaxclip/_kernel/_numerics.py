"""The one norm kernel behind every jaxclip op and transform.

Everything that measures a gradient goes through this module:

* sums of squares accumulate in float32 whatever the leaf dtype (float64 for
  float64 leaves under ``jax_enable_x64``), within a leaf *and* across leaves,
  so bfloat16 trees do not lose precision and float16 trees do not overflow;
* the square root has a custom JVP whose tangent is zero at zero, so
  ``jax.grad`` through any clip is finite at an all-zero input;
* the clip factor ``max_norm / max(norm, max_norm)`` is written so that a zero
  threshold with a zero norm gives ``0``, an infinite threshold gives ``1``
  and a non-finite norm gives ``nan`` (the failure stays visible);
* scaling a half-precision leaf multiplies in float32 and casts back, so the
  product cannot overflow; under ``jit`` XLA fuses the casts into the scale,
  so no float32 copy of the leaf is materialised.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _platform, _validation
from jaxclip._kernel._typing import ArrayLike

Axes = int | Sequence[int] | None

_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype: Any) -> jnp.dtype:
  """The real dtype in which sums over a leaf of ``dtype`` are accumulated.

  float64 / complex128 leaves accumulate in float64; every other inexact
  dtype (bfloat16, float16, float32, complex64) in float32.
  """
  dtype = jnp.dtype(dtype)
  real = jnp.finfo(dtype).dtype  # complex64 -> float32, complex128 -> float64
  if real == jnp.dtype(jnp.float64):
    return real
  return jnp.dtype(jnp.float32)


def upcast_for_accumulation(x: jax.Array) -> jax.Array:
  """``x`` in :func:`accumulation_dtype` (float32, or float64 for float64 leaves)."""
  return x.astype(accumulation_dtype(x.dtype))


def hparam_float32(x: Any) -> jax.Array:
  """A hyperparameter or statistic as a float32 array.

  Hyperparameters may arrive as Python numbers, NumPy values or (from
  ``optax.inject_hyperparams``) arrays of another float dtype; an adaptive
  statistic is kept in float32 whatever the leaves' dtype.
  """
  return jnp.asarray(x).astype(jnp.float32)


def tree_accumulation_dtype(tree: Any) -> jnp.dtype:
  """The accumulation dtype shared by the inexact leaves of ``tree`` (float32 if none).

  Other leaves (integers, booleans, PRNG keys, ``float0``) are ignored, so any
  params tree optax accepts can size a transform's state.
  """
  dtypes = set()
  for x in jax.tree.leaves(tree):
    dtype = getattr(x, "dtype", None)
    if dtype is None and isinstance(x, (float, complex)):
      dtype = jnp.result_type(x)
    if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
      dtypes.add(accumulation_dtype(dtype))
  return jnp.dtype(jnp.float64) if jnp.dtype(jnp.float64) in dtypes else jnp.dtype(jnp.float32)


def compute_dtype(dtype: Any) -> jnp.dtype:
  """The dtype in which products with a leaf of ``dtype`` are formed.

  float32 for the half-precision dtypes (so a product cannot overflow
  float16), the leaf's own dtype otherwise.
  """
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if dtype in _HALF_DTYPES else dtype


@jax.custom_jvp
def safe_sqrt(x: jax.Array) -> jax.Array:
  """``sqrt(x)`` for ``x >= 0`` whose derivative at ``0`` is ``0``, not ``inf``."""
  return jnp.sqrt(x)


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  y = jnp.sqrt(x)
  positive = x > 0
  # The coefficient is a primal value, so the transposed (reverse-mode) rule
  # multiplies the cotangent by an exact zero where x == 0: no 0 * inf.
  coef = jnp.where(positive, 0.5 / jnp.where(positive, y, 1), 0).astype(y.dtype)
  return y, coef * dx


def as_array(x: Any) -> jax.Array:
  """``x`` as a jax array; an array (or tracer) is returned as is, with no traced op."""
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def computed_once(flag: jax.Array) -> jax.Array:
  """The boolean scalar ``flag``, computed in one kernel that its consumers read.

  Why: XLA copies cheap scalar ops (comparisons, ``and``, selects, maxima)
  into the kernel of each of their consumers. A flag that combines a result
  from every leaf, and that every leaf's select then reads, is recomputed in
  every leaf's kernel: compile time quadratic in the number of leaves. XLA
  does not copy a square root,
  so the flag goes through one: ``sqrt`` of ``0`` or ``1`` is exact, and its
  conversion back to a boolean (``!= 0``) is the one op each consumer copies.
  """
  flag = jnp.asarray(flag)
  return jax.lax.convert_element_type(jnp.sqrt(flag.astype(jnp.float32)), jnp.bool_)


def _canonical_axes(ndim: int, axis: Axes) -> tuple[int, ...] | None:
  if axis is None:
    return None
  if isinstance(axis, int):
    axis = (axis,)
  out = []
  for a in axis:
    a = int(a)
    if not -ndim <= a < ndim:
      raise ValueError(f"axis {a} is out of bounds for a leaf of rank {ndim}.")
    out.append(a % ndim)
  return tuple(out)


def _convert(x: jax.Array, dtype: Any) -> jax.Array:
  """``x.astype(dtype)`` as one primitive, nothing when the dtype matches.

  The hot per-leaf paths use ``lax`` directly: ``jnp`` functions are nested
  ``jit`` calls, and thousands of them make tracing a big tree slow.
  """
  return x if x.dtype == dtype else jax.lax.convert_element_type(x, dtype)


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|**2`` elementwise, in ``x``'s accumulation dtype."""
  x = _platform.reduction_input(jnp.asarray(x))
  acc = accumulation_dtype(x.dtype)
  if jnp.iscomplexobj(x):
    re, im = _convert(jax.lax.real(x), acc), _convert(jax.lax.imag(x), acc)
    return jax.lax.add(jax.lax.mul(re, re), jax.lax.mul(im, im))
  x = _convert(x, acc)
  return jax.lax.mul(x, x)


def safe_abs(x: jax.Array) -> jax.Array:
  """``|x|`` elementwise in the accumulation dtype; finite gradient at 0."""
  x = _platform.reduction_input(jnp.asarray(x))
  if jnp.iscomplexobj(x):
    return safe_sqrt(abs_sq(x))
  return jax.lax.abs(_convert(x, accumulation_dtype(x.dtype)))


def leaf_sumsq(x: jax.Array, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """``sum(|x|**2)`` over ``axis`` (all axes if ``None``), accumulated in float32+."""
  x = jnp.asarray(x)
  axes = _canonical_axes(x.ndim, axis)
  return _platform.reduce(abs_sq(x), "sum", axes, keepdims, of_float16=x.dtype == jnp.float16)


def leaf_norm(x: jax.Array, ord: float = 2, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """The ``ord``-norm of ``x`` over ``axis`` (all axes if ``None``).

  Returned in the accumulation dtype of ``x``. ``ord`` must already be
  normalised by ``_validation.check_ord`` (1, 2 or ``inf``).
  """
  x = jnp.asarray(x)
  axes = _canonical_axes(x.ndim, axis)
  if ord == 2:
    return safe_sqrt(leaf_sumsq(x, axes, keepdims))
  op = "sum" if ord == 1 else "max"
  return _platform.reduce(safe_abs(x), op, axes, keepdims, of_float16=x.dtype == jnp.float16)


def norm_term(ord: float) -> Callable[[jax.Array], jax.Array]:
  """The elementwise term an ``ord``-norm reduces: ``|x|**2`` for 2, ``|x|`` otherwise."""
  return abs_sq if ord == 2 else safe_abs


def norm_op(ord: float) -> str:
  """How an ``ord``-norm combines its terms, within a leaf and across leaves."""
  return "max" if ord == math.inf else "sum"


def leaf_norm_shares(leaves: list[Any], ord: float, acc: jnp.dtype) -> list[jax.Array]:
  """Each leaf's share of a tree norm, in ``acc``: ``sum |x|**2``, ``sum |x|`` or ``max |x|``.

  One reduction per leaf, no leaf copied. Shares are added (maxed for
  ``ord=inf``) across leaves; the ``2``-norm is the root of their sum.
  """
  term, op = norm_term(ord), norm_op(ord)
  return [_platform.share(as_array(x), term, op).astype(acc) for x in leaves]


def scale_by_leaf_norms(
  fn: Callable[..., jax.Array],
  leaves: Sequence[Any],
  ord: float = 2,
  axis: Axes | Callable[[tuple[int, ...]], Axes] = None,
  companions: Sequence[Any] | None = None,
  operands: tuple[Any, ...] = (),
) -> list[jax.Array]:
  """Each leaf times ``fn`` of its norm.

  The result is ``[apply_scale(x, fn(norm(x), x.size, *operands)) for x in
  leaves]``, where ``norm(x)`` is ``leaf_norm(x, ord, axis, keepdims=True)``:
  ``fn`` maps a norm (with kept dimensions), the leaf's size and the
  ``operands`` to a factor broadcastable against the leaf, e.g. a clip
  factor. ``axis`` may also be a function of the leaf's shape. With
  ``companions``, one array of the leaf's shape per leaf (a parameter for its
  gradient), the factor is ``fn(norm(x), x.size, norm(c), *operands)``.

  ``fn`` must get every array it depends on (a threshold) through
  ``operands``, never by closing over it: derivatives with respect to them
  are taken through the operands. It should end in a division (or another
  op XLA deems expensive): XLA copies cheap elementwise ops into each of
  their consumers, so a factor ending in a select would be recomputed in
  every consumer's kernel.

  That per-leaf math is written once (:func:`_leaf_scaler`);
  :func:`jaxclip._kernel._platform.scale_each_leaf` decides how it runs
  (on XLA:CPU, vmapped over stacks of small leaves of one shape).
  """
  axes_of = axis if callable(axis) else lambda shape: axis

  def scaler(shape):
    return _leaf_scaler(fn, ord, _canonical_axes(len(shape), axes_of(shape)))

  others = None if companions is None else [as_array(c) for c in companions]
  return _platform.scale_each_leaf(scaler, [as_array(x) for x in leaves], others, tuple(operands))


@functools.lru_cache(maxsize=256)
def _leaf_scaler(fn, ord, axes):
  """One leaf's scale as a jitted function, traced once per leaf type.

  A call of a jitted function whose argument types it has seen is one cached
  equation, and XLA inlines it: the compiled program is the same as the
  inline math, and the Python cost of tracing it is paid once.
  """

  def scale(x, companion, operands):
    norms = leaf_norm(x, ord, axes, keepdims=True)
    if companion is None:
      return apply_scale(x, fn(norms, x.size, *operands))
    return apply_scale(
      x, fn(norms, x.size, leaf_norm(companion, ord, axes, keepdims=True), *operands)
    )

  return jax.jit(scale)


def count_sum(indicators: list[jax.Array]) -> jax.Array:
  """The sum of every entry of ``indicators`` (integer arrays), one int32 scalar.

  Summed by :func:`jaxclip._kernel._platform.count_all` (on XLA:CPU the small
  arrays by one segment reduction).
  """
  arrays = [
    jax.lax.convert_element_type(x, jnp.int32)
    for x in indicators
    if _validation.constant_size(x) != 0
  ]
  return _platform.count_all(arrays) if arrays else jnp.zeros((), jnp.int32)


def clip_scale(norm: jax.Array, max_norm: Any) -> jax.Array:
  """The factor ``max_norm / max(norm, max_norm)``, safe at every edge.

  ============================  =========
  case                          factor
  ============================  =========
  ``norm < max_norm``           ``1``
  ``norm >= max_norm > 0``      ``max_norm / norm``
  ``norm == max_norm == 0``     ``0`` (zeros stay zeros, gradient 0)
  ``max_norm == inf``           ``1``
  ``max_norm < 0`` (traced)     acts as ``0``
  ``norm`` is ``inf``/``nan``   ``nan``
  ============================  =========
  """
  norm = jnp.asarray(norm)
  max_norm = jnp.maximum(jnp.asarray(max_norm, norm.dtype), 0)
  clipping = norm >= max_norm
  numerator = jnp.where(jnp.isfinite(norm), jnp.where(clipping, max_norm, 1), jnp.nan)
  return safe_divide(numerator, norm, clipping & (norm > 0)).astype(norm.dtype)


def safe_divide(
  num: ArrayLike, den: ArrayLike, where: ArrayLike, otherwise: Any = None
) -> jax.Array:
  """``num / den`` where ``where`` holds; elsewhere ``num`` (or ``otherwise``) over ``1``.

  The one safe division of jaxclip's scale factors. The denominator is
  replaced by ``1`` where ``where`` is false, so neither the value nor its
  gradient divides by zero; with ``otherwise`` the numerator is replaced
  there too, giving ``otherwise`` exactly. The division comes last, so XLA
  computes the factor once rather than copying its selects into every
  consumer's kernel.

  Args:
    num: the numerator.
    den: the denominator; only read where ``where`` holds.
    where: where to divide (broadcasts against ``num`` and ``den``).
    otherwise: the result where ``where`` is false (``None``: ``num``).

  Returns:
    The quotient, in the dtype ``num / den`` has.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxclip._kernel._numerics import safe_divide
    >>> n = jnp.array([0.0, 4.0])
    >>> safe_divide(2.0, n, n > 2.0, otherwise=1.0)
    Array([1. , 0.5], dtype=float32)
  """
  if otherwise is not None:
    num = jnp.where(where, num, otherwise)
  return num / jnp.where(where, den, 1)


def apply_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``x * scale`` formed in :func:`compute_dtype`, returned in ``x.dtype``.

  ``scale`` is a scalar or broadcasts against ``x`` with the same rank (a
  norm taken with ``keepdims=True``).
  """
  x, scale = jnp.asarray(x), jnp.asarray(scale)
  dtype = compute_dtype(x.dtype)
  scale = _convert(scale, dtype)
  if scale.shape != x.shape:
    dims = tuple(range(x.ndim - scale.ndim, x.ndim))
    scale = jax.lax.broadcast_in_dim(scale, x.shape, dims)
  return _convert(jax.lax.mul(_convert(x, dtype), scale), x.dtype)


def scale_entries_above(x: jax.Array, bound: jax.Array, factor: jax.Array) -> jax.Array:
  """``x * factor`` where ``|x| > bound``, else ``x``, formed in :func:`compute_dtype`.

  ``bound`` and ``factor`` are scalars; the result is in ``x.dtype``. In
  ``lax``, as :func:`apply_scale`: it runs once per leaf.
  """
  x = jnp.asarray(x)
  dtype = compute_dtype(x.dtype)
  xc = _convert(x, dtype)
  magnitude = jax.lax.abs(xc)
  bound = jax.lax.broadcast(_convert(jnp.asarray(bound), magnitude.dtype), x.shape)
  factor = jax.lax.broadcast(_convert(jnp.asarray(factor), dtype), x.shape)
  over = jax.lax.gt(magnitude, bound)
  return _convert(jax.lax.select(over, jax.lax.mul(xc, factor), xc), x.dtype)
