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
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _platform, _sharding, _validation
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
    # Canonical: float32 with x64 off (a NumPy float64 leaf), so that no
    # float64 is requested (and no truncation warned about).
    return jnp.dtype(jax.dtypes.canonicalize_dtype(real))
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
  Trick ``computed_once``: off, ``flag`` as it is.
  """
  flag = jnp.asarray(flag)
  if not _platform.is_on("computed_once"):
    return flag
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


def kept_shape(shape: tuple[int, ...], axis: Axes) -> tuple[int, ...]:
  """``shape`` with the dimensions of ``axis`` (all if ``None``) set to 1: a kept-dims norm's."""
  axes = _canonical_axes(len(shape), axis)
  axes = range(len(shape)) if axes is None else axes
  return tuple(1 if i in axes else d for i, d in enumerate(shape))


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
    return leaf_norm_rescued(x, ord, axes, keepdims, leaf_sumsq(x, axes, keepdims))
  op = "sum" if ord == 1 else "max"
  fast = _platform.reduce(safe_abs(x), op, axes, keepdims, of_float16=x.dtype == jnp.float16)
  return fast if ord == math.inf else leaf_norm_rescued(x, ord, axes, keepdims, fast)


def norm_term(ord: float) -> Callable[[jax.Array], jax.Array]:
  """The elementwise term an ``ord``-norm reduces: ``|x|**2`` for 2, ``|x|`` otherwise."""
  return abs_sq if ord == 2 else safe_abs


def norm_op(ord: float) -> str:
  """How an ``ord``-norm combines its terms, within a leaf and across leaves."""
  return "max" if ord == math.inf else "sum"


def leaf_norm_shares(
  leaves: list[Any], ord: float, acc: jnp.dtype, term: Any = None
) -> list[jax.Array]:
  """Each leaf's share of a tree norm, in ``acc``: ``sum |x|**2``, ``sum |x|`` or ``max |x|``.

  One reduction per leaf, no leaf copied. Shares are added (maxed for
  ``ord=inf``) across leaves; the ``2``-norm is the root of their sum.
  """
  term, op = term or norm_term(ord), norm_op(ord)
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

  def scaler(shape, stacked=False):
    return _leaf_scaler(fn, ord, _canonical_axes(len(shape), axes_of(shape)), stacked)

  leaves = [as_array(x) for x in leaves]
  others = None if companions is None else [as_array(c) for c in companions]
  together = None
  arrays = leaves + (others or [])
  if ord != math.inf and all(_validation.constant_size(a) is not None for a in arrays):

    def together(xs, cs, ops, stacks):  # closes over no traced value (a custom_jvp's argument)
      axes = [_canonical_axes(x.ndim, axes_of(x.shape)) for x in xs]
      return _scaled_with_one_rescue(fn, ord, axes, xs, cs, tuple(ops), stacks)

  return _platform.scale_each_leaf(scaler, leaves, others, tuple(operands), together)


def _scaled_with_one_rescue(fn, ord, axes, leaves, companions, operands, stacks) -> list[jax.Array]:
  """:func:`scale_by_leaf_norms`' result, every norm rescued under one ``lax.cond``.

  Each leaf's (and companion's) fast sums come from one pass; where any of
  them :func:`needs_rescaling`, the slow branch recomputes the norms scaled
  (:func:`_leaf_rescue`). Each leaf is then scaled by ``fn`` of its norms
  outside the ``cond``: the multiply still fuses into the leaf's consumer.

  With ``stacks`` (programs lowered for CPU) the local sums enter the
  ``cond`` as one vector per dtype, in the order of
  :func:`jaxclip._kernel._platform.join_plan`: the fast branch is one square
  root per dtype, the slow branch rescues the leaves by groups (stacks of
  small leaves of one shape, whole leaves flattened and padded; vmapped once
  per group: :func:`jaxclip._kernel._platform.map_joined`), and each leaf
  reads its norms as a slice of the vector, fused into its scale. A branch
  output per leaf was a kernel per leaf in each branch.

  Without ``stacks`` (programs lowered for platforms other than CPU) nothing
  is stacked or concatenated: the flags are or-ed as scalars and each norm is
  rescued by its own plain math, still under the one ``cond``.
  """
  arrays = list(leaves) + (list(companions) if companions is not None else [])
  axes = list(axes) * (1 if companions is None else 2)
  term = norm_term(ord)
  sums = [
    _platform.reduce(term(a), "sum", ax, True, of_float16=a.dtype == jnp.float16)
    for a, ax in zip(arrays, axes, strict=True)
  ]
  root = safe_sqrt if ord == 2 else (lambda t: t)
  sizes = [constant_size_of(a, ax) for a, ax in zip(arrays, axes, strict=True)]
  # An empty norm is 0, exactly: nothing to rescue. A sharded one is not joined.
  rescued = [i for i, t in enumerate(sums) if sizes[i] and t.size]
  joined = [i for i in rescued if stacks and _sharding.layout(sums[i]) is _sharding.LOCAL]
  single = sorted(set(rescued) - set(joined))
  plan = _platform.join_plan(
    [arrays[i] for i in joined], [sums[i] for i in joined], [axes[i] for i in joined], None
  )
  group_dtypes = [sums[joined[members[0]]].dtype for _, members in plan]
  by_dtype: dict[Any, list[int]] = {}  # the joined sums' order in their dtype's vector
  for (_, members), dtype in zip(plan, group_dtypes, strict=True):
    by_dtype.setdefault(dtype, []).extend(joined[j] for j in members)
  vectors = [_platform.flat_concatenate([sums[i] for i in order]) for order in by_dtype.values()]
  flags = [any_needs_rescaling(sizes[i])(sums[i]) for i in single]
  flags += [
    jnp.any(needs_rescaling(v, [sizes[i] for i in order for _ in range(sums[i].size)]))
    for v, order in zip(vectors, by_dtype.values(), strict=True)
  ]

  def fast(vectors, singles):
    return [root(v) for v in vectors], [root(t) for t in singles]

  def slow(vectors, singles):
    del vectors  # recomputed from the arrays
    parts = _platform.map_joined(
      lambda ax: _leaf_rescue(ord, ax),
      plan,
      [arrays[i] for i in joined],
      [sums[i] for i in joined],
      [axes[i] for i in joined],
    )
    by_part: dict[Any, list[jax.Array]] = {}
    for dtype, part in zip(group_dtypes, parts, strict=True):
      by_part.setdefault(dtype, []).append(part)
    rows = [_platform.flat_concatenate(by_part[dtype]) for dtype in by_dtype]
    return rows, [_leaf_rescue(ord, axes[i])(arrays[i], sums[i]) for i in single]

  singles = [sums[i] for i in single]
  if not flags:
    vectors, singles = fast(vectors, singles)
  else:
    flag = flags[0] if len(flags) == 1 else functools.reduce(jnp.logical_or, flags)
    vectors, singles = _platform.cond(flag, slow, fast, vectors, singles)
  kept = set(rescued)
  norms = [None if i in kept else root(t) for i, t in enumerate(sums)]  # root: the empty ones
  for i, t in zip(single, singles, strict=True):
    norms[i] = t
  for v, order in zip(vectors, by_dtype.values(), strict=True):
    at = 0
    for i in order:
      norms[i] = jax.lax.reshape(jax.lax.slice(v, (at,), (at + sums[i].size,)), sums[i].shape)
      at += sums[i].size
  n = len(leaves)
  others = [None] * n if companions is None else norms[n:]
  return [_leaf_applier(fn)(x, norms[i], others[i], operands) for i, x in enumerate(leaves)]


@_platform.cache(maxsize=256)
def _leaf_rescue(ord, axes):
  """One leaf's norm from its fast ``total`` (kept dims): rescued where it needs it (jitted)."""

  def rescue(x, total):
    size = constant_size_of(x, axes)
    root = safe_sqrt(total) if ord == 2 else total
    return jax.lax.select(needs_rescaling(total, size), _rescued(x, ord, axes), root)

  return jax.jit(rescue)


@_platform.cache(maxsize=256)
def _leaf_applier(fn):
  """One leaf times ``fn`` of its norms (and its companion's), jitted: traced once per type."""

  def apply(x, norm, companion_norm, operands):
    if companion_norm is None:
      return apply_scale(x, fn(norm, x.size, *operands))
    return apply_scale(x, fn(norm, x.size, companion_norm, *operands))

  return jax.jit(apply)


@_platform.cache(maxsize=256)
def _leaf_scaler(fn, ord, axes, stacked=False):
  """One leaf's scale as a jitted function, traced once per leaf type.

  A call of a jitted function whose argument types it has seen is one cached
  equation, and XLA inlines it: the compiled program is the same as the
  inline math, and the Python cost of tracing it is paid once.

  ``stacked``: the function takes a stack of small leaves (a new leading
  axis) and scales each row by its own norms, always measured scaled
  (:func:`_rescued`: a maximum, then the sum of the terms scaled by a power of
  two; the same value as the fast sum's wherever that one is exact). Two
  reductions per stack and no ``lax.cond``: a ``cond`` per stack was six
  kernels per stack on XLA:CPU, and a ``vmap`` of the one-leaf function
  batches the ``cond``'s predicate, which makes it a ``select``.
  """

  def norm(x, ax):
    if stacked and ord != math.inf:
      return _rescued(x, ord, ax)
    return leaf_norm(x, ord, ax, keepdims=True)

  def scale(x, companion, operands):
    ax, size = axes, x.size
    if stacked:
      ax = tuple(a + 1 for a in (range(x.ndim - 1) if axes is None else axes))
      size = math.prod(x.shape[1:])
    if companion is None:
      return apply_scale(x, fn(norm(x, ax), size, *operands))
    return apply_scale(x, fn(norm(x, ax), size, norm(companion, ax), *operands))

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
  ``max_norm`` is ``nan``       ``nan`` (traced; visible, as optax)
  ``norm`` is ``inf``/``nan``   ``nan``
  ============================  =========
  """
  norm = jnp.asarray(norm)
  max_norm = jnp.asarray(max_norm, norm.dtype)
  # A NaN threshold (traced: a schedule gone bad) gives NaN, visibly, as
  # optax's clip does; it would otherwise fail the comparison and not clip.
  valid = jnp.isfinite(norm) & jnp.logical_not(jnp.isnan(max_norm))
  max_norm = jnp.maximum(max_norm, 0)
  clipping = norm >= max_norm
  numerator = jnp.where(valid, jnp.where(clipping, max_norm, 1), jnp.nan)
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
  """``x * scale`` formed in :func:`compute_dtype`, in ``x.dtype``; ``x`` where ``scale == 1``.

  ``scale`` is a scalar or broadcasts against ``x`` with the same rank (a
  norm taken with ``keepdims=True``).
  """
  x, scale = jnp.asarray(x), jnp.asarray(scale)
  dtype = compute_dtype(x.dtype)
  scale = _convert(scale, dtype)
  # A scalar factor's test stays scalar: a broadcast one would carry no
  # sharding of its own and select refuses it against a sharded leaf.
  # (A per-leaf factor of one entry, a keepdims norm, is tested as a scalar too;
  # a factor per row or column of a leaf laid out over an Explicit mesh is
  # multiplied without the test.)
  scalar_one = (
    jax.lax.eq(jnp.reshape(scale, ()), jnp.ones((), scale.dtype)) if scale.size == 1 else None
  )
  if scalar_one is None and _sharding.layout(x) is not _sharding.LOCAL:
    if scale.shape != x.shape:
      dims = tuple(range(x.ndim - scale.ndim, x.ndim))
      scale = jax.lax.broadcast_in_dim(scale, x.shape, dims)
    return _convert(jax.lax.mul(_convert(x, dtype), scale), x.dtype)
  if scale.shape != x.shape:
    dims = tuple(range(x.ndim - scale.ndim, x.ndim))
    scale = jax.lax.broadcast_in_dim(scale, x.shape, dims)
  product = _convert(jax.lax.mul(_convert(x, dtype), scale), x.dtype)
  # A factor of exactly 1 passes the entry through bit for bit: XLA:CPU
  # flushes a subnormal times 1.0 to zero. The select is elementwise in the
  # scale's own kernel, no pass of its own.
  one = scalar_one if scalar_one is not None else jax.lax.eq(scale, jax.lax.full_like(scale, 1))
  return jax.lax.select(one, x, product)


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


# ----------------------------------------------------------------------------
# Norms that neither overflow nor underflow
# ----------------------------------------------------------------------------
#
# Every norm is first taken the fast way: one pass of sums of squares (or of
# |x|) in the accumulation dtype. That sum overflows to ``inf`` once an entry
# reaches about 1.8e19 in float32, and loses its terms to subnormals (XLA:CPU
# flushes them to zero) once the entries fall below about 1e-19. Where the
# fast total is ``inf``, or below ``size * tiny / eps`` (the most the lost
# terms can matter), the norm is recomputed scaled: ``m = max |x|``, then
# ``m * sqrt(sum (x / m)**2)``. The choice is a ``lax.cond`` on one scalar
# (``any`` of the flags), so the common case runs only the fast pass; under
# ``jax.vmap`` a batched flag makes both branches run.
#
# Edges: a NaN entry gives NaN; an ``inf`` entry gives ``inf`` (TF's
# semantics, the failure stays visible); finite entries whose true norm
# exceeds the dtype's largest value give that largest value
# (``finfo.max``), so the clip factor ``c / finfo.max`` is finite and the
# clipped update too. Entries that are themselves subnormal count as zero on
# XLA:CPU, which flushes them in every arithmetic op.


def _size_bound(size: int | None) -> int:
  return 2**31 if size is None else max(int(size), 1)


def needs_rescaling(total: jax.Array, size: Any) -> jax.Array:
  """Where a fast sum of ``size`` non-negative terms is not to be trusted.

  ``True`` where ``total`` is ``inf`` (a square overflowed, or an entry is
  ``inf``) or below ``size * tiny / eps`` (a square may have been lost as a
  subnormal: each loses at most ``tiny``). ``False`` for NaN: the rescaled
  norm of a NaN entry is NaN as well.

  Args:
    total: the fast totals, of a real dtype.
    size: the number of terms in each total (``None``: unknown, taken as
      ``2**31``), or a sequence of them, one per entry of a vector ``total``.

  Returns:
    A boolean array of ``total``'s shape.
  """
  total = jnp.asarray(total)
  info = jnp.finfo(total.dtype)
  sizes = [size] if size is None or isinstance(size, int) else list(size)
  bounds = np.minimum(
    float(info.max),
    np.array([_size_bound(n) for n in sizes], np.float64) * float(info.tiny) / float(info.eps),
  ).astype(total.dtype)
  if size is None or isinstance(size, int):
    low = bounds[0]
  else:
    # Runs of equal bounds as broadcast scalars, not an array constant: a jitted
    # program hoists array constants into arguments, which jax 0.10's compiled
    # gradients of a ``lax.cond`` were then called without.
    runs = [(b, len(list(g))) for b, g in itertools.groupby(bounds.tolist())]
    pieces = [jnp.full((n,), b, total.dtype) for b, n in runs]
    low = pieces[0] if len(pieces) == 1 else jax.lax.concatenate(pieces, 0)
  return (total == jnp.inf) | (total < low)


@_platform.cache(maxsize=1024)
def any_needs_rescaling(size: int | None) -> Callable[[jax.Array], jax.Array]:
  """``jnp.any(needs_rescaling(total, size))`` as a jitted function of ``total``.

  One cached equation per call: a tree's per-leaf flags cost one equation
  per leaf, not a comparison's few.
  """
  return jax.jit(lambda total: jnp.any(needs_rescaling(total, size)))


def _pow2(k: jax.Array, dtype: Any) -> jax.Array:
  """``2.0**k`` in ``dtype`` (float32 or float64), exactly, for ``k`` in the normal range."""
  dtype = jnp.dtype(dtype)
  info = jnp.finfo(dtype)
  bits, itype = (23, jnp.int32) if dtype == jnp.float32 else (52, jnp.int64)
  biased = jnp.clip(k, info.minexp, info.maxexp - 1).astype(itype) - (info.minexp - 1)
  return jax.lax.bitcast_convert_type(jax.lax.shift_left(biased, itype(bits)), dtype)


def times_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
  """``x * 2**k`` by two exact multiplications by normal powers of two.

  Division by a large maximum is not safe on XLA:CPU: it multiplies by the
  reciprocal, a subnormal that it flushes to zero. Powers of two are exact,
  so ``x * 2**-k * 2**k == x`` wherever nothing over- or underflows.
  ``x`` is float32 or float64 (real or complex); ``k`` an integer array
  broadcastable against it.
  """
  real = jnp.finfo(x.dtype).dtype
  limit = 2 * (jnp.finfo(real).maxexp - 2)
  k = jnp.clip(jnp.asarray(k), -limit, limit)
  half = jax.lax.div(k, jnp.asarray(2, k.dtype))
  for part in (half, k - half):
    factor = _pow2(part, real)
    x = x * (factor.astype(x.dtype) if jnp.iscomplexobj(x) else factor)
  return x


def scale_exponent(m: jax.Array) -> jax.Array:
  """The int32 ``e`` with ``m / 2**e`` in ``[0.5, 1)``; ``0`` where ``m`` is 0 or not finite."""
  ok = (m > 0) & jnp.isfinite(m)
  e = jnp.frexp(jnp.where(ok, m, 1))[1].astype(jnp.int32)
  # lax.select, not jnp.where (a jit): on jax 0.12 frexp's exponent of a 0-d
  # input under vmap loses an Explicit mesh, and jnp.where's batching rule then
  # fails with spmd_axis_name (test_ghost_multi_device's spmd check).
  return jax.lax.select(ok, e, jnp.zeros_like(m, jnp.int32))


def scaled_down(x: jax.Array, e: jax.Array) -> jax.Array:
  """``x / 2**e`` in the accumulation dtype (complex stays complex); ``e`` broadcasts."""
  x = _platform.reduction_input(jnp.asarray(x))
  acc = accumulation_dtype(x.dtype)
  if jnp.iscomplexobj(x):
    x = x.astype(jnp.complex128 if acc == jnp.float64 else jnp.complex64)
  else:
    x = _convert(x, acc)
  return times_pow2(x, -e)


def scaled_norm(m: jax.Array, s: jax.Array, e: jax.Array, ord: float = 2) -> jax.Array:
  """The norm ``2**e * sqrt(s)`` (``2**e * s`` for ``ord=1``), saturated at ``finfo.max``.

  ``m`` is the maximum magnitude, ``e`` its :func:`scale_exponent` and ``s``
  the sum of the terms of the entries divided by ``2**e``. ``m == 0`` gives
  ``0``, a non-finite ``m`` itself (an ``inf`` or NaN entry).
  """
  root = safe_sqrt(s) if ord == 2 else s
  finite = jnp.isfinite(m)
  # Where m == 0 a constant 0, so that the derivative at zero is 0 (as safe_sqrt's).
  norm = jnp.where(finite & (m > 0), times_pow2(root, e), jnp.where(finite, 0, m))
  return jnp.where(finite, jnp.minimum(norm, jnp.finfo(norm.dtype).max), norm)


def combine_scaled(
  maxima: jax.Array, exps: jax.Array, sums: jax.Array, ord: float = 2
) -> jax.Array:
  """The norm of parts each scaled on its own: ``sums[i]`` of entries divided by ``2**exps[i]``.

  Each part's sum is brought to the largest part's exponent (a part of only
  zeros counts for nothing), then :func:`scaled_norm`.
  """
  m = jnp.max(maxima)
  nonzero = maxima > 0
  floor = jnp.iinfo(jnp.int32).min // 4
  exps = jnp.where(nonzero, exps, floor)
  top = jnp.max(exps)
  shift = exps - top
  shifted = times_pow2(sums, 2 * shift if ord == 2 else shift)
  total = jnp.sum(jnp.where(nonzero, shifted, 0))
  return scaled_norm(m, total, jnp.where(jnp.any(nonzero), top, 0), ord)


def max_term(x: jax.Array) -> jax.Array:
  """A magnitude that cannot overflow, within ``sqrt(2)`` of ``|x|``: ``max(|re|, |im|)``.

  What the rescaled norms divide by: for a complex ``x`` the modulus itself
  overflows where its squares do.
  """
  x = _platform.reduction_input(jnp.asarray(x))
  if jnp.iscomplexobj(x):
    acc = accumulation_dtype(x.dtype)
    re, im = _convert(jax.lax.real(x), acc), _convert(jax.lax.imag(x), acc)
    return jax.lax.max(jax.lax.abs(re), jax.lax.abs(im))
  return safe_abs(x)


def rescued_norm(
  total: jax.Array, ord: float, size: int | None, rescue: Callable[[], jax.Array]
) -> jax.Array:
  """The norm from a fast ``total``, recomputed by ``rescue()`` where needed.

  ``total`` holds fast sums (of squares for ``ord=2``, of ``|x|`` for
  ``ord=1``; maxima for ``ord=inf``, returned as they are: a maximum cannot
  overflow). Where :func:`needs_rescaling` holds, the norm is ``rescue()``'s
  (an array of ``total``'s shape, normally :func:`scaled_norm`), elsewhere the
  root of ``total``. ``rescue`` is only run (``lax.cond``) when some entry
  needs it.
  """
  total = jnp.asarray(total)
  if ord == math.inf:
    return total
  root = safe_sqrt(total) if ord == 2 else total
  needs = needs_rescaling(total, size)
  flag = needs if needs.ndim == 0 else jnp.any(needs)

  def slow(root, needs):
    return jnp.where(needs, rescue().astype(root.dtype), root)

  return _platform.cond(flag, slow, lambda root, needs: root, root, needs)


def leaf_norm_rescued(
  x: jax.Array, ord: float, axes: tuple[int, ...] | None, keepdims: bool, fast: jax.Array
) -> jax.Array:
  """:func:`leaf_norm` from its fast ``total`` (same ``axes``, ``keepdims``), rescued."""
  size = constant_size_of(x, axes)

  def rescue():
    norm = _rescued(x, ord, axes)
    return norm if keepdims else jnp.reshape(norm, fast.shape)

  return rescued_norm(fast, ord, size, rescue)


def _rescued(x: jax.Array, ord: float, axes: tuple[int, ...] | None) -> jax.Array:
  """``x``'s ``ord``-norm over ``axes`` (kept dims), recomputed scaled by a power of two.

  The bits of the largest magnitude pick the power of two (:func:`_pow2_pair`;
  no derivative goes through them); a finite leaf whose norm overflows
  saturates at ``finfo.max``, an ``inf`` or NaN entry stays visible.
  """
  half = x.dtype == jnp.float16  # reduced so that no float32 copy of the leaf is made
  m = _platform.reduce(max_term(x), "max", axes, True, of_float16=half)
  up, down = _pow2_pair(m)
  xa = _convert(x, _wider(m.dtype, x.dtype))  # complex stays complex
  s = _platform.reduce(
    norm_term(ord)(xa * _convert(up, xa.dtype)), "sum", axes, True, of_float16=half
  )
  norm = (safe_sqrt(s) if ord == 2 else s) * down
  big = jnp.full_like(norm, jnp.finfo(norm.dtype).max)
  return jax.lax.select(jax.lax.is_finite(m), jax.lax.min(norm, big), norm)


def _wider(real: Any, dtype: Any) -> jnp.dtype:
  """The wider of float dtype ``real`` and ``dtype``'s precision, complex where ``dtype`` is.

  Explicit, as ``jnp.result_type`` refuses mixed float widths under strict promotion.
  """
  real, dtype = jnp.dtype(real), jnp.dtype(dtype)
  width = max(jnp.finfo(real).bits, jnp.finfo(dtype).bits)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.dtype(jnp.complex128 if width == 64 else jnp.complex64)
  return real if jnp.finfo(real).bits >= jnp.finfo(dtype).bits else dtype


def _pow2_pair(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(2**k, 2**-k)`` that bring ``m >= 0`` into ``[0.5, 4)`` as ``m * 2**k``, from its bits.

  Both are normal (``|k| <= bias - 1``): an ``m`` at the top of the range lands in
  ``[2, 4)``, a zero or subnormal ``m`` is multiplied by ``2**(bias - 1)``, an ``inf`` or
  NaN stays what it is. A few integer ops, where :func:`scale_exponent` is a ``frexp``:
  the rescue of :func:`leaf_norm` is traced once per leaf.
  """
  info = jnp.finfo(m.dtype)
  bias, bits = info.maxexp - 1, info.nmant
  itype = jnp.int32 if m.dtype.itemsize == 4 else jnp.int64
  field = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(m, itype), itype(bits))
  # The biased exponent of 2**k is 2 * bias - 1 - field, kept within [1, 2 * bias - 1].
  biased = jax.lax.clamp(itype(1), itype(2 * bias - 1) - field, itype(2 * bias - 1))
  up = jax.lax.bitcast_convert_type(jax.lax.shift_left(biased, itype(bits)), m.dtype)
  down = jax.lax.bitcast_convert_type(
    jax.lax.shift_left(itype(2 * bias) - biased, itype(bits)), m.dtype
  )
  return up, down


def constant_size_of(x: jax.Array, axes: tuple[int, ...] | None) -> int | None:
  """The number of entries of ``x`` over ``axes`` (all if ``None``); ``None`` if symbolic."""
  return _dims_size(x.shape if axes is None else [x.shape[a] for a in axes])


def _dims_size(dims) -> int | None:
  if any(_validation.is_symbolic(d) for d in dims):
    return None
  return math.prod(dims)


class ScaledNorms(NamedTuple):
  """Per-example norms in scaled form: ``norm = 2**exponent * sqrt(sumsq)``.

  ``exponent`` (int32) is ``0`` where the fast sum was trusted, else that of
  the example's largest magnitude (:func:`scale_exponent`); ``sumsq`` is the
  sum of squares of the entries divided by ``2**exponent``; ``norms`` are
  the reported norms, saturated at ``finfo.max``.
  """

  exponent: jax.Array
  sumsq: jax.Array
  norms: jax.Array

  def clip_factor(self, max_norm: Any) -> jax.Array:
    """``min(1, max_norm / norm)`` from the scaled form, finite even where ``norm > finfo.max``.

    Computed as ``(max_norm / sqrt(sumsq)) * 2**-exponent``; a factor below
    the dtype's normal range is ``0`` on XLA:CPU, which flushes subnormals
    (the clipped example's norm is then ``0``, within the bound). ``nan`` for a
    non-finite norm, as :func:`clip_scale`; ``max_norm < 0`` acts as ``0``.
    """
    root = safe_sqrt(self.sumsq)
    c = jnp.maximum(jnp.asarray(max_norm, root.dtype), 0)
    clipping = self.norms >= c
    num = jnp.where(jnp.isfinite(self.norms), jnp.where(clipping, c, 1), jnp.nan)
    ratio = safe_divide(num, root, clipping & (root > 0))
    scale = jnp.where(clipping & (root > 0), -self.exponent, 0)
    return times_pow2(ratio, scale).astype(root.dtype)


def per_example_scaled_norms(leaves: Sequence[Any], acc: Any = None) -> ScaledNorms:
  """Each example's L2 norm over ``leaves`` that share a leading batch axis, overflow-safe.

  The fast pass sums each example's squares over every leaf. Where an
  example's sum :func:`needs_rescaling` (``inf``, or so small that squares
  were lost to subnormals) while its entries are finite, every example is
  recomputed scaled (one ``lax.cond`` on the batch's flag) and the rescaled
  examples take the scaled values.

  Args:
    leaves: arrays of shape ``(batch, ...)`` (at least one).
    acc: the accumulation dtype (default: the leaves' shared one).

  Returns:
    A :class:`ScaledNorms`; ``.norms`` is a ``(batch,)`` array.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxclip._kernel._numerics import per_example_scaled_norms
    >>> g = [jnp.array([[3e20, 4e20], [3.0, 4.0]]), jnp.zeros((2, 1))]
    >>> per_example_scaled_norms(g).norms
    Array([5.e+20, 5.e+00], dtype=float32)
  """
  leaves = [jnp.asarray(g) for g in leaves]
  acc = jnp.dtype(acc) if acc is not None else tree_accumulation_dtype(leaves)
  batch = leaves[0].shape[0]

  def per_example(term, op, arrays):
    parts = [
      _platform.reduce(term(g).reshape(batch, -1), op, (1,), False).astype(acc) for g in arrays
    ]
    stacked = jnp.stack(parts)
    return jnp.max(stacked, 0) if op == "max" else jnp.sum(stacked, 0)

  fast = per_example(abs_sq, "sum", leaves)
  size = sum(_dims_size(g.shape[1:]) or 2**31 for g in leaves)
  needs = needs_rescaling(fast, size)
  zeros = jnp.zeros_like(fast, jnp.int32)  # varying as fast is, inside shard_map

  def slow(fast, needs):
    m = per_example(max_term, "max", leaves)
    e = scale_exponent(m)
    scaled = [scaled_down(g, jnp.reshape(e, (batch,) + (1,) * (g.ndim - 1))) for g in leaves]
    s = per_example(abs_sq, "sum", scaled)
    return (
      jnp.where(needs, e, 0),
      jnp.where(needs, s, fast),
      jnp.where(needs, scaled_norm(m, s, e), safe_sqrt(fast)),
    )

  def quick(fast, needs):
    return zeros, fast, safe_sqrt(fast)

  exponent, sumsq, norms = _platform.cond(jnp.any(needs), slow, quick, fast, needs)
  return ScaledNorms(exponent, sumsq, norms)


def saturated_float32(x: Any) -> jax.Array:
  """``x`` as float32, a finite value beyond float32's range saturated at its ``finfo.max``.

  A norm of float64 leaves kept by a float32 statistic stays finite; ``inf``
  and NaN stay what they are.
  """
  x = jnp.asarray(x)
  if x.dtype == jnp.float32:
    return x
  big = float(jnp.finfo(jnp.float32).max)
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x).astype(jnp.float32)


def saturate(x: Any) -> jax.Array:
  """``x`` with finite overflows held at its dtype's largest magnitude: ``inf`` -> ``finfo.max``.

  For statistics (EMAs of norms and of their squares) fed only finite
  values: a sum that overflowed is saturated, so that one huge finite norm
  cannot leave a statistic ``inf`` for good. NaN stays NaN.
  """
  x = jnp.asarray(x)
  big = jnp.finfo(x.dtype).max
  # One clamp: a per-tensor rule runs this once per leaf on other platforms
  # (jnp's where and clip are nested jits). XLA's clamp is max then min, both
  # NaN-propagating, so NaN stays NaN.
  return jax.lax.clamp(jnp.asarray(-big, x.dtype), x, jnp.asarray(big, x.dtype))


def per_example_norms(leaves: Sequence[Any], acc: Any = None) -> jax.Array:
  """The ``(batch,)`` overflow-safe L2 norms of :func:`per_example_scaled_norms`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxclip._kernel._numerics import per_example_norms
    >>> per_example_norms([jnp.array([[1e-30, 0.0], [3e30, 4e30]])])
    Array([1.e-30, 5.e+30], dtype=float32)
  """
  return per_example_scaled_norms(leaves, acc).norms
