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

from jaxclip._kernel import _platform, _sharding
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


def _reduce(
  terms: jax.Array,
  op: str,
  axes: tuple[int, ...] | None = None,
  keepdims: bool = False,
  *,
  of_float16: bool = False,
) -> jax.Array:
  """``jnp.sum`` (``op="sum"``) or ``jnp.max`` of non-negative ``terms``.

  ``of_float16`` says that the terms are computed from float16 values, which
  XLA:CPU reduces faster another way (:func:`jaxclip._kernel._platform.float16_reduce`).
  """
  if of_float16:
    return _platform.float16_reduce(terms, op, axes, keepdims)
  return _platform.plain_reduce(terms, op, axes, keepdims)


def leaf_sumsq(x: jax.Array, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """``sum(|x|**2)`` over ``axis`` (all axes if ``None``), accumulated in float32+."""
  x = jnp.asarray(x)
  return _reduce(
    abs_sq(x), "sum", _canonical_axes(x.ndim, axis), keepdims, of_float16=x.dtype == jnp.float16
  )


def leaf_norm(x: jax.Array, ord: float = 2, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """The ``ord``-norm of ``x`` over ``axis`` (all axes if ``None``).

  Returned in the accumulation dtype of ``x``. ``ord`` must already be
  normalised by :func:`check_ord` (1, 2 or ``inf``).
  """
  x = jnp.asarray(x)
  axes = _canonical_axes(x.ndim, axis)
  if ord == 2:
    return safe_sqrt(leaf_sumsq(x, axes, keepdims))
  return _reduce(
    safe_abs(x), "sum" if ord == 1 else "max", axes, keepdims, of_float16=x.dtype == jnp.float16
  )


# Leaves of at most _SMALL_LEAF elements are reduced together (see
# _grouped_parts): those of at most _TINY_LEAF elements added elementwise
# _GROUP at a time, the others concatenated _CHUNK_LEAVES at a time.
_SMALL_LEAF = 1024
_TINY_LEAF = 64
_GROUP = 32
_CHUNK_LEAVES = 128
# scale_by_leaf_norms stacks the small leaves of one shape and dtype (on
# XLA:CPU): all in one stack when there are at most _FLAT_STACK, else _STACK
# at a time. Rows are taken at constant offsets when the shape has at least
# _STATIC_ROWS leaves, else at opaque indices.
_STACK = 64
_FLAT_STACK = 128
_STATIC_ROWS = 512


def _leaf_part(x: jax.Array, ord: float) -> jax.Array:
  """One leaf's share of a tree norm: ``sum |x|**2``, ``sum |x|`` or ``max |x|``."""
  return leaf_sumsq(x) if ord == 2 else leaf_norm(x, ord)


def _grouped_parts(leaves: list[Any], ord: float, acc: jnp.dtype) -> list[jax.Array]:
  """Partial sums (maxima for ``ord=inf``) of ``leaves``, a few per tree.

  One scalar per leaf would make XLA build one fusion per leaf and then one
  chain of thousands of scalar adds, which compiles in time quadratic in the
  number of leaves (benchmarks/results.md has the figures). Instead small
  leaves are reduced together, a few kernels per thousand leaves:

  * local leaves (see :func:`layout`) of more than ``_TINY_LEAF`` and at most
    ``_SMALL_LEAF`` elements (biases, norm scales) are flattened and
    concatenated per dtype, ``_CHUNK_LEAVES`` at a time, and each chunk is
    reduced once. The copy is of small leaves only, and compiles fast
    whatever the mix of shapes;
  * local leaves of at most ``_TINY_LEAF`` elements are flattened, their
    ``|x|**2`` (``|x|``) zero-padded to the next power of two and added
    (maxed) elementwise ``_GROUP`` at a time before one reduction per group
    (zero padding changes no sum or maximum of non-negative terms). XLA:CPU
    unrolls the copy of a tiny concatenated operand, which makes compiling
    thousands of them slow; this path copies nothing;
  * small leaves of one known multi-device sharding (an Explicit mesh) are
    never reshaped: those of one shape, dtype and sharding are added
    elementwise ``_GROUP`` at a time, so grouping adds no collective.

  Larger leaves, which hold the bytes, and leaves whose layout is not known
  when the program is traced, keep one reduction each and are never copied.
  The partial sums of a sharded tree therefore need only scalar all-reduces.

  The grouping is for speed only: ``jax.jvp`` and ``jax.grad`` differentiate
  the plain per-leaf sums, so the tangent of each leaf is one fused
  elementwise term, and no concatenate or pad is transposed into per-leaf
  slices of a group.
  """
  leaves = [as_array(x) for x in leaves]
  plan = _group_plan(leaves)
  if all(len(members) == 1 for _, members in plan):
    return [_leaf_part(leaves[m[0]], ord).astype(acc) for _, m in plan]
  return list(_grouped_sums(plan, ord, acc, leaves))


def leaf_parts(leaves: list[Any], ord: float, acc: jnp.dtype) -> list[jax.Array]:
  """Each leaf's own share of a tree norm (``sum |x|**2``, ``sum |x|`` or ``max |x|``).

  The per-leaf counterpart of :func:`_grouped_parts`, for callers that need
  every leaf's norm as well as the tree's: one reduction per leaf, in
  ``acc``, with no leaf copied.
  """
  return [_leaf_part(as_array(x), ord).astype(acc) for x in leaves]


def _segmentable(x: jax.Array) -> bool:
  """Whether ``x`` goes whole into :func:`jaxclip._kernel._platform.small_parts`' concatenation.

  Non-empty, at most ``_SMALL_LEAF`` entries, and whole on this device:
  concatenating a sharded array would gather it, where a plain reduction
  sums its parts across devices.
  """
  return _is_small(x) and _sharding.layout(x) is _sharding.LOCAL


def _is_small(x: jax.Array, limit: int = _SMALL_LEAF) -> bool:
  """Non-empty with at most ``limit`` entries; a symbolic size counts as large."""
  size = _platform.constant_size(x)
  return size is not None and 0 < size <= limit


def part_vector(leaves: list[Any], ord: float, acc: jnp.dtype) -> jax.Array:
  """:func:`leaf_parts` as one vector in ``acc``, the small leaves' in one kernel (XLA:CPU).

  For the CPU branch of the per-tensor rules, which read every leaf's part
  from a vector: the leaves of at most ``_SMALL_LEAF`` elements that lie
  whole on this device are reduced together by
  :func:`jaxclip._kernel._platform.small_parts` (one segment reduction, where
  a reduction kernel per leaf is slow to compile); the others are reduced as
  :func:`leaf_parts` does and enter that reduction as one term each.
  """
  leaves = [as_array(x) for x in leaves]
  term = abs_sq if ord == 2 else safe_abs

  def terms(x):
    if _segmentable(x):
      return term(x).astype(acc)
    return jnp.reshape(_leaf_part(x, ord).astype(acc), (1,))  # its own reduced part

  return _platform.small_parts(tuple(terms(x) for x in leaves), "max" if ord == math.inf else "sum")


def _group_plan(leaves: list[jax.Array]) -> tuple[tuple[Any, tuple[int, ...]], ...]:
  """Which leaves :func:`_grouped_parts` reduces together: ``(how, members)`` pairs.

  ``how`` is ``None`` (one leaf alone), ``"concat"`` or the width an
  elementwise group is padded to (``0``: no padding, a sharded group).
  """
  plan: list[Any] = []
  chunks: dict[Any, list[list[int]]] = {}
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    if _platform.constant_size(x) == 0:
      continue
    where = _sharding.layout(x) if _is_small(x) else None
    if where is None:
      plan.append((None, (i,)))
    elif where is not _sharding.LOCAL:
      groups.setdefault((0, x.shape, x.dtype, where), []).append(i)
    elif _is_small(x, _TINY_LEAF):
      groups.setdefault((1 << (x.size - 1).bit_length(), accumulation_dtype(x.dtype)), []).append(i)
    else:
      chunk = chunks.setdefault(x.dtype, [[]])
      if len(chunk[-1]) == _CHUNK_LEAVES:
        chunk.append([])
      chunk[-1].append(i)
  for dtype_chunks in chunks.values():
    plan.extend(("concat", tuple(chunk)) for chunk in dtype_chunks)
  for key, group in groups.items():
    plan.extend((key[0], tuple(group[s : s + _GROUP])) for s in range(0, len(group), _GROUP))
  return tuple(plan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _grouped_sums(plan, ord, acc, leaves):
  term = abs_sq if ord == 2 else safe_abs
  combine = jax.lax.max if ord == math.inf else jax.lax.add
  parts = []
  for how, members in plan:
    if how is None:
      parts.append(_leaf_part(leaves[members[0]], ord))
    elif how == "concat":
      flat = [jax.lax.reshape(leaves[i], (leaves[i].size,)) for i in members]
      parts.append(_leaf_part(flat[0] if len(flat) == 1 else jax.lax.concatenate(flat, 0), ord))
    else:
      total = None
      for i in members:
        t = term(leaves[i])
        if how:  # flatten and pad to the group's width
          t = jax.lax.reshape(t, (t.size,))
          if t.size < how:
            t = jax.lax.pad(t, jnp.zeros((), t.dtype), ((0, how - t.size, 0),))
        total = t if total is None else combine(total, t)
      of_float16 = any(leaves[i].dtype == jnp.float16 for i in members)
      parts.append(_reduce(total, "max" if ord == math.inf else "sum", of_float16=of_float16))
  return tuple(p.astype(acc) for p in parts)


def _plain_sums(plan, ord, acc, leaves):
  """:func:`_grouped_sums` as one reduction per leaf, combined as scalars."""
  parts = []
  for _, members in plan:
    leaf_parts = [_leaf_part(leaves[i], ord).astype(acc) for i in members]
    if len(leaf_parts) == 1:
      parts.append(leaf_parts[0])
    elif ord == math.inf:
      parts.append(jnp.max(jnp.stack(leaf_parts)))
    else:
      parts.append(_sum_scalars(leaf_parts))
  return tuple(parts)


@_grouped_sums.defjvp
def _grouped_sums_jvp(plan, ord, acc, primals, tangents):
  _, tangent_out = jax.jvp(lambda xs: _plain_sums(plan, ord, acc, xs), primals, tangents)
  return _grouped_sums(plan, ord, acc, *primals), tangent_out


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
  ``operands``, never by closing over it: the derivative with respect to the
  operands is taken through them.

  That plain per-leaf math is what runs on every platform but CPU, and what
  ``jax.jvp`` and ``jax.grad`` differentiate on every platform (so their
  cost is that of the naive math). In programs lowered for CPU, many small
  local leaves of one shape and dtype are scaled as stacks instead
  (:func:`_scale_stacks`): one reduction, one call of ``fn`` and one multiply
  per stack, and each leaf one row of its scaled stack. One reduction and one
  multiply per leaf is thousands of kernels for a tree of thousands of small
  leaves, and XLA:CPU then compiles for minutes.

  ``fn`` should end in a division (or another op that XLA deems expensive):
  XLA copies cheap elementwise ops (selects, comparisons, maxima) into each
  of their consumers, so a factor ending in one is recomputed in the kernel
  of every row of its stack.

  Only small local leaves (:func:`layout`) are stacked; large and sharded
  leaves are scaled one by one, so that their multiply fuses into whatever
  consumes them (an optimizer's update) and keeps their sharding.
  """
  leaves = [as_array(x) for x in leaves]
  others = None if companions is None else [as_array(c) for c in companions]
  operands = tuple(operands)
  axes_of = axis if callable(axis) else lambda shape: axis

  out: list[Any] = [None] * len(leaves)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    if (
      _platform.constant_size(x) is not None
      and x.size <= _SMALL_LEAF
      and _sharding.layout(x) is _sharding.LOCAL
      and (others is None or _sharding.layout(others[i]) is _sharding.LOCAL)
    ):
      key = (x.shape, x.dtype, None if others is None else others[i].dtype)
      groups.setdefault(key, []).append(i)
    else:
      out[i] = _scale_one(fn, ord, axes_of, x, None if others is None else others[i], operands)
  for members in groups.values():
    if len(members) == 1:
      i = members[0]
      out[i] = _scale_one(
        fn, ord, axes_of, leaves[i], None if others is None else others[i], operands
      )
  stacked = tuple(members for members in groups.values() if len(members) > 1)
  if stacked:
    members = [i for group in stacked for i in group]
    scaled = _scale_grouped(
      fn,
      ord,
      axes_of,
      tuple(len(g) for g in stacked),
      [leaves[i] for i in members],
      None if others is None else [others[i] for i in members],
      operands,
    )
    for i, y in zip(members, scaled, strict=True):
      out[i] = y
  return out


def _scale_one(fn, ord, axes_of, x, companion, operands) -> jax.Array:
  """One leaf of :func:`scale_by_leaf_norms`, by the plain math."""
  return _leaf_scaler(fn, ord, _canonical_axes(x.ndim, axes_of(x.shape)))(x, companion, operands)


@functools.lru_cache(maxsize=256)
def _leaf_scaler(fn, ord, axes):
  """The plain math of one leaf as a jitted function, traced once per leaf type.

  Tracing the norm, ``fn`` and the multiply leaf by leaf costs Python time
  per leaf (and the plain math is traced on CPU too, as the other branch of
  a platform choice). A call of a
  jitted function whose argument types it has seen is one cached equation,
  and XLA inlines it: the compiled program is the same.
  """

  def scale(x, companion, operands):
    norms = leaf_norm(x, ord, axes, keepdims=True)
    if companion is None:
      return apply_scale(x, fn(norms, x.size, *operands))
    return apply_scale(
      x, fn(norms, x.size, leaf_norm(companion, ord, axes, keepdims=True), *operands)
    )

  return jax.jit(scale)


def _scale_plain(fn, ord, axes_of, leaves, companions, operands) -> list[jax.Array]:
  return [
    _scale_one(fn, ord, axes_of, x, None if companions is None else companions[j], operands)
    for j, x in enumerate(leaves)
  ]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _scale_grouped(fn, ord, axes_of, sizes, leaves, companions, operands):
  """:func:`_scale_stacks` on CPU, :func:`_scale_plain` elsewhere and under ``jax.jvp``."""
  return _platform.on_cpu(
    lambda xs, cs, ops: _scale_stacks(fn, xs, cs, sizes, ord, axes_of, ops),
    lambda xs, cs, ops: _scale_plain(fn, ord, axes_of, xs, cs, ops),
    leaves,
    companions,
    operands,
  )


@_scale_grouped.defjvp
def _scale_grouped_jvp(fn, ord, axes_of, sizes, primals, tangents):
  # The tangent of each leaf is that of its own plain math: transposed (for
  # jax.grad), a stack's rows would each become a full-stack update.
  _, tangent_out = jax.jvp(lambda *a: _scale_plain(fn, ord, axes_of, *a), primals, tangents)
  return _scale_grouped(fn, ord, axes_of, sizes, *primals), tangent_out


def _scale_stacks(fn, leaves, companions, sizes, ord, axes_of, operands) -> list[jax.Array]:
  """:func:`scale_by_leaf_norms` of groups of leaves of one shape, by stacks (XLA:CPU).

  ``leaves`` holds the groups one after the other, ``sizes`` their lengths.
  A group of at most ``_FLAT_STACK`` leaves is one stack, a larger one is
  stacked ``_STACK`` at a time (its last stack overlaps the one before, so
  that all its stacks are alike). XLA:CPU compiles one kernel per distinct
  fusion, so a group of at least ``_STATIC_ROWS`` leaves takes its rows at
  constant offsets (one kernel per offset, shared by all its stacks), and a
  smaller group takes them at opaque indices
  (:func:`jaxclip._kernel._platform.opaque_indices`): one kernel for all its rows.
  """
  out: list[Any] = []
  plans, begin = [], 0
  for size in sizes:
    members = list(range(begin, begin + size))
    begin += size
    shape = leaves[members[0]].shape
    k = size if size <= _FLAT_STACK else _STACK
    starts = list(range(0, size - k + 1, k))
    if starts[-1] + k < size:
      starts.append(size - k)
    static = size >= _STATIC_ROWS or math.prod(shape) == 0  # (an index needs an element)
    plans.append((shape, members, k, starts, static))
  dynamic = [(k, members[0]) for _, members, k, _, static in plans if not static]
  if dynamic:
    index = _platform.opaque_indices(max(k for k, _ in dynamic), leaves[dynamic[0][1]])
  for shape, members, k, starts, static in plans:
    axes = _canonical_axes(len(shape), axes_of(shape))
    axes = tuple(range(1, len(shape) + 1)) if axes is None else tuple(a + 1 for a in axes)
    done = 0
    for start in starts:
      batch = members[start : start + k]
      stacked = _platform.stack([leaves[i] for i in batch], shape)
      norms = leaf_norm(stacked, ord, axes, keepdims=True)
      if companions is None:
        factor = fn(norms, math.prod(shape), *operands)
      else:
        companion = _platform.stack([companions[i] for i in batch], shape)
        factor = fn(
          norms, math.prod(shape), leaf_norm(companion, ord, axes, keepdims=True), *operands
        )
      scaled = apply_scale(stacked, factor)
      # Rows an earlier stack gave are skipped.
      out.extend(_platform.rows(scaled, done - start, None if static else index[:k]))
      done = start + k
  return out


def count_sum(indicators: list[jax.Array]) -> jax.Array:
  """The sum of every entry of ``indicators`` (integer arrays), one int32 scalar.

  One reduction per array feeding one sum makes XLA:CPU fuse the reductions
  into one kernel (it also splits a reduction of a concatenation back into
  one per operand), which compiles in time quadratic in their number
  (``zero_nonfinite``'s count over 2,000 leaves took 32 of its 46 s). On CPU
  the arrays of at most ``_SMALL_LEAF`` entries that lie whole on this device
  are summed by one segment reduction
  (:func:`jaxclip._kernel._platform.small_parts`); elsewhere each array is
  reduced on its own.
  """
  arrays = [
    jax.lax.convert_element_type(x, jnp.int32)
    for x in indicators
    if _platform.constant_size(x) != 0
  ]

  def plain(arrays):
    return _sum_scalars([jax.lax.reduce_sum(x, tuple(range(x.ndim))) for x in arrays])

  def cpu(arrays):
    is_small = [_segmentable(x) for x in arrays]
    small = tuple(x for x, s in zip(arrays, is_small, strict=True) if s)
    if len(small) < 2:
      return plain(arrays)
    others = [x for x, s in zip(arrays, is_small, strict=True) if not s]
    return plain([_platform.small_parts(small, "sum"), *others])

  if not arrays:
    return jnp.zeros((), jnp.int32)
  return _platform.on_cpu(cpu, plain, arrays)


def _sum_scalars(parts: list[jax.Array]) -> jax.Array:
  return jnp.sum(jnp.stack(parts)) if len(parts) > 1 else parts[0]


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
  if hasattr(ord, "shape") and getattr(ord, "shape", None) == ():
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
