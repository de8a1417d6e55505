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
import numpy as np

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


def tree_accumulation_dtype(tree: Any) -> jnp.dtype:
  """The accumulation dtype shared by all leaves of ``tree`` (float32 if empty)."""
  dtypes = {accumulation_dtype(jnp.result_type(x)) for x in jax.tree.leaves(tree)}
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
  every leaf's kernel: compile time quadratic in the number of leaves (five
  minutes at a thousand leaves, measured). XLA does not copy a square root,
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


def _reduction_input(x: jax.Array) -> jax.Array:
  """``x`` as the input of a norm reduction.

  On XLA:CPU a bfloat16 leaf that feeds both the norm reduction and the
  scale pass gets its float32 conversion materialised as a full-size buffer
  (the reduction kernel cannot absorb a convert whose operand has a second
  user). An optimization barrier gives the reduction its own operand, so the
  convert fuses into it: no float32 copy, and about 3x faster on a 4M-entry
  leaf. The barrier is an identity for values and gradients; it is applied
  only where it was measured to help.
  """
  if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
    return jax.lax.optimization_barrier(x)
  return x


def _convert(x: jax.Array, dtype: Any) -> jax.Array:
  """``x.astype(dtype)`` as one primitive, nothing when the dtype matches.

  The hot per-leaf paths use ``lax`` directly: ``jnp`` functions are nested
  ``jit`` calls, and thousands of them make tracing a big tree slow.
  """
  return x if x.dtype == dtype else jax.lax.convert_element_type(x, dtype)


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|**2`` elementwise, in ``x``'s accumulation dtype."""
  x = _reduction_input(jnp.asarray(x))
  acc = accumulation_dtype(x.dtype)
  if jnp.iscomplexobj(x):
    re, im = _convert(jax.lax.real(x), acc), _convert(jax.lax.imag(x), acc)
    return jax.lax.add(jax.lax.mul(re, re), jax.lax.mul(im, im))
  x = _convert(x, acc)
  return jax.lax.mul(x, x)


def safe_abs(x: jax.Array) -> jax.Array:
  """``|x|`` elementwise in the accumulation dtype; finite gradient at 0."""
  x = _reduction_input(jnp.asarray(x))
  if jnp.iscomplexobj(x):
    return safe_sqrt(abs_sq(x))
  return jax.lax.abs(_convert(x, accumulation_dtype(x.dtype)))


def _plain_reduce(terms: jax.Array, op: str, axes: tuple[int, ...] | None,
                  keepdims: bool) -> jax.Array:
  if op == "sum":
    return jnp.sum(terms, axis=axes, keepdims=keepdims)
  # ``initial`` makes the max of an empty leaf 0, as its norm.
  return jnp.max(terms, axis=axes, keepdims=keepdims, initial=0.0)


def _reduce(terms: jax.Array, op: str, axes: tuple[int, ...] | None = None,
            keepdims: bool = False, *, of_float16: bool = False) -> jax.Array:
  """``jnp.sum`` (``op="sum"``) or ``jnp.max`` of non-negative ``terms``.

  ``of_float16`` says that the terms are computed from float16 values. On
  XLA:CPU the float32 conversion of a float16 leaf is never fused into a
  plain reduction: it is materialised as a full-size float32 copy (twice the
  leaf's bytes). A two-output reduction keeps the conversion inside the
  reduction kernel, so no copy is made (see :func:`_float16_reduce`).
  """
  if of_float16 and jax.default_backend() == "cpu" and terms.size:
    return _float16_reduce(terms, op, tuple(range(terms.ndim)) if axes is None else axes,
                           keepdims)
  return _plain_reduce(terms, op, axes, keepdims)


# The two-output reduction accumulates sequentially, so it runs over blocks of
# at most this many terms; the block results are reduced by a plain reduction.
_SEQUENTIAL_BLOCK = 1024


def _two_output_reduce(terms: jax.Array, op: str, axes: tuple[int, ...]) -> jax.Array:
  """``op`` over ``axes`` as a reduction with a second output XLA cannot drop.

  The second output is the maximum, which is ``0`` only where every
  (non-negative) term is, so selecting on it leaves the value unchanged.
  """
  zero = jnp.zeros((), terms.dtype)
  first = jax.lax.add if op == "sum" else jax.lax.max

  def combine(a, b):
    return first(a[0], b[0]), jax.lax.max(a[1], b[1])

  total, peak = jax.lax.reduce((terms, terms), (zero, zero), combine, axes)
  return jnp.where(peak == 0, zero, total)


def _largest_divisor(n: int, at_most: int, at_least: int) -> int | None:
  return next((b for b in range(min(n, at_most), at_least - 1, -1) if n % b == 0), None)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _float16_reduce(terms: jax.Array, op: str, axes: tuple[int, ...],
                    keepdims: bool) -> jax.Array:
  """:func:`_plain_reduce` of float16-derived terms without a float32 copy (XLA:CPU).

  A reduction over at most ``_SEQUENTIAL_BLOCK`` terms is one two-output
  reduction. A whole large leaf is reduced in blocks of a divisor of its size
  (or, with no such divisor, zero-padded to whole blocks) and the block
  results, one per up to ``_SEQUENTIAL_BLOCK`` terms, are reduced plainly: as
  accurate as the plain float32 reduction, and faster on CPU. A reduction over part of
  the axes of a large leaf falls back to the plain reduction. Derivatives are
  taken through the plain reduction.
  """
  reduced = math.prod(terms.shape[a] for a in axes)
  if reduced <= _SEQUENTIAL_BLOCK:
    total = _two_output_reduce(terms, op, axes)
  elif len(axes) < terms.ndim:
    return _plain_reduce(terms, op, axes, keepdims)
  else:
    flat = jax.lax.reshape(terms, (terms.size,))
    block = _largest_divisor(terms.size, _SEQUENTIAL_BLOCK, _SEQUENTIAL_BLOCK // 8)
    if block is None:  # zero-pad to whole blocks: no sum or maximum changes
      block = _SEQUENTIAL_BLOCK
      flat = jax.lax.pad(flat, jnp.zeros((), flat.dtype), ((0, -terms.size % block, 0),))
    blocks = jax.lax.reshape(flat, (flat.size // block, block))
    total = _plain_reduce(_two_output_reduce(blocks, op, (1,)), op, None, False)
  return jax.lax.expand_dims(total, axes) if keepdims else total


@_float16_reduce.defjvp
def _float16_reduce_jvp(op, axes, keepdims, primals, tangents):
  return jax.jvp(lambda t: _plain_reduce(t, op, axes, keepdims), primals, tangents)


def leaf_sumsq(x: jax.Array, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """``sum(|x|**2)`` over ``axis`` (all axes if ``None``), accumulated in float32+."""
  x = jnp.asarray(x)
  return _reduce(abs_sq(x), "sum", _canonical_axes(x.ndim, axis), keepdims,
                 of_float16=x.dtype == jnp.float16)


def leaf_norm(
    x: jax.Array, ord: float = 2, axis: Axes = None, keepdims: bool = False
) -> jax.Array:
  """The ``ord``-norm of ``x`` over ``axis`` (all axes if ``None``).

  Returned in the accumulation dtype of ``x``. ``ord`` must already be
  normalised by :func:`check_ord` (1, 2 or ``inf``).
  """
  x = jnp.asarray(x)
  axes = _canonical_axes(x.ndim, axis)
  if ord == 2:
    return safe_sqrt(leaf_sumsq(x, axes, keepdims))
  return _reduce(safe_abs(x), "sum" if ord == 1 else "max", axes, keepdims,
                 of_float16=x.dtype == jnp.float16)


# Leaves of at most _SMALL_LEAF elements are reduced together (see
# _grouped_parts): those of at most _TINY_LEAF elements added elementwise
# _GROUP at a time, the others concatenated _CHUNK_LEAVES at a time.
_SMALL_LEAF = 1024
_TINY_LEAF = 64
_GROUP = 32
_CHUNK_LEAVES = 128
# scale_by_leaf_norms stacks the small leaves of one shape and dtype: all in
# one stack when there are at most _FLAT_STACK, else _STACK at a time; by one
# concatenate where the shape fills fewer than _NESTED_STACKS stacks, else by
# nested concatenates of at most _FAN_IN operands (the most XLA:CPU fuses; one
# kernel then serves every stack of the shape). Rows are taken at constant
# offsets when the shape has at least _STATIC_ROWS leaves, else at opaque
# indices.
_STACK = 64
_FLAT_STACK = 128
_NESTED_STACKS = 4
_FAN_IN = 8
_STATIC_ROWS = 512


def _leaf_part(x: jax.Array, ord: float) -> jax.Array:
  """One leaf's share of a tree norm: ``sum |x|**2``, ``sum |x|`` or ``max |x|``."""
  return leaf_sumsq(x) if ord == 2 else leaf_norm(x, ord)


def _on_mesh(x: jax.Array) -> bool:
  """Whether ``x`` carries a mesh sharding (sharded arrays under ``jax.set_mesh``)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  return sharding is not None and not sharding.mesh.empty


def _grouped_parts(leaves: list[Any], ord: float, acc: jnp.dtype) -> list[jax.Array]:
  """Partial sums (maxima for ``ord=inf``) of ``leaves``, a few per tree.

  One scalar per leaf would make XLA build one fusion per leaf and then one
  chain of thousands of scalar adds, which compiles in time quadratic in the
  number of leaves (optax's clip takes minutes at 5,000 leaves). Instead
  small leaves are reduced together, a few kernels per thousand leaves:

  * leaves of more than ``_TINY_LEAF`` and at most ``_SMALL_LEAF``
    elements (biases, norm scales) are flattened and concatenated per dtype,
    ``_CHUNK_LEAVES`` at a time, and each chunk is reduced once. The copy is
    of small leaves only (at most ``_CHUNK_LEAVES * _SMALL_LEAF`` elements
    at a time), and compiles fast whatever the mix of shapes;
  * leaves of at most ``_TINY_LEAF`` elements are flattened, their
    ``|x|**2`` (``|x|``) zero-padded to the next power of two and added
    (maxed) elementwise ``_GROUP`` at a time before one reduction per group
    (zero padding changes no sum or maximum of non-negative terms). XLA:CPU
    unrolls the copy of a tiny concatenated operand, which makes compiling
    thousands of them slow; this path copies nothing.

  Larger leaves, which hold the bytes, keep one reduction each and are never
  copied (grouping them, padded or concatenated, measured slower). Leaves
  that carry a mesh (sharded arrays under ``jax.set_mesh``) are never
  reshaped: those of one shape and sharding are added elementwise ``_GROUP``
  at a time, so grouping adds no collective.
  """
  term = abs_sq if ord == 2 else safe_abs
  combine = jax.lax.max if ord == math.inf else jax.lax.add
  parts, chunks, groups = [], {}, {}
  for x in leaves:
    x = jnp.asarray(x)
    if x.size == 0:
      continue
    if x.size > _SMALL_LEAF:
      parts.append(_leaf_part(x, ord))
    elif _on_mesh(x):
      groups.setdefault((x.shape, x.dtype, jax.typeof(x).sharding), []).append(x)
    elif x.size <= _TINY_LEAF:
      groups.setdefault((1 << (x.size - 1).bit_length(), accumulation_dtype(x.dtype)), []).append(x)
    else:
      chunk = chunks.setdefault(x.dtype, [[]])
      if len(chunk[-1]) == _CHUNK_LEAVES:
        chunk.append([])
      chunk[-1].append(x)
  for dtype_chunks in chunks.values():
    for chunk in dtype_chunks:
      flat = [jax.lax.reshape(y, (y.size,)) for y in chunk]
      parts.append(_leaf_part(flat[0] if len(flat) == 1 else jax.lax.concatenate(flat, 0), ord))
  for key, group in groups.items():
    for start in range(0, len(group), _GROUP):
      total = None
      for x in group[start:start + _GROUP]:
        t = term(x)
        if isinstance(key[0], int):  # flatten and pad to the group's width
          t = jax.lax.reshape(t, (t.size,))
          if t.size < key[0]:
            t = jax.lax.pad(t, jnp.zeros((), t.dtype), ((0, key[0] - t.size, 0),))
        total = t if total is None else combine(total, t)
      of_float16 = any(x.dtype == jnp.float16 for x in group[start:start + _GROUP])
      parts.append(_reduce(total, "max" if ord == math.inf else "sum", of_float16=of_float16))
  return [p.astype(acc) for p in parts]


def scale_by_leaf_norms(
    fn: Callable[..., jax.Array], leaves: Sequence[Any], ord: float = 2,
    axis: Axes | Callable[[tuple[int, ...]], Axes] = None,
    companions: Sequence[Any] | None = None,
) -> list[jax.Array]:
  """Each leaf times ``fn`` of its norm, batched over leaves of one shape.

  The result is ``[apply_scale(x, fn(norm(x), x.size)) for x in leaves]``,
  where ``norm(x)`` is ``leaf_norm(x, ord, axis, keepdims=True)``: ``fn`` maps
  a norm (with kept dimensions) and the leaf's size to a factor broadcastable
  against the leaf, e.g. a clip factor. ``axis`` may also be a function of
  the leaf's shape. With ``companions``, one array of the leaf's shape per
  leaf (a parameter for its gradient), the factor is ``fn(norm(x), x.size,
  norm(c))``.

  Why: one reduction and one multiply per leaf is thousands of kernels for a
  tree of thousands of small leaves, and XLA:CPU then compiles for minutes.
  Here the small leaves of one shape and dtype are stacked: all at once up
  to ``_FLAT_STACK`` of them, else ``_STACK`` at a time (the last stack of a
  shape overlaps the one before, so that all its stacks are alike). One
  reduction, one call of ``fn`` and one multiply serve a whole stack, and
  each leaf is then one row of the scaled stack.

  How the kernels stay few (XLA:CPU compiles one kernel per distinct fusion,
  and emits every concatenate of more than eight operands as a kernel of its
  own):

  * a shape that fills at least ``_NESTED_STACKS`` stacks is stacked by
    nested concatenates of at most ``_FAN_IN`` operands, which fuse: one
    kernel for all the stacks of the shape. A rarer shape is stacked by one
    concatenate, which compiles faster than a nested one used once or twice;
  * a shape with at least ``_STATIC_ROWS`` leaves takes its rows at constant
    offsets: one kernel per offset, shared by all its stacks. A rarer shape
    takes them at :func:`_opaque_indices`: one kernel for all its rows;
  * ``fn`` should end in a division (or another op that XLA deems expensive):
    XLA copies cheap elementwise ops (selects, comparisons, maxima) into
    each of their consumers, so a factor ending in one is recomputed in the
    kernel of every row of its stack.

  Only small leaves are stacked (copies of at most ``_SMALL_LEAF`` elements
  each); large and mesh-sharded leaves are scaled one by one, so that their
  multiply fuses into whatever consumes them (an optimizer's update).
  """
  leaves = [as_array(x) for x in leaves]
  others = None if companions is None else [as_array(c) for c in companions]
  axes_of = axis if callable(axis) else lambda shape: axis

  def factor(norms, size, companion=None, axes=None):
    if companion is None:
      return fn(norms, size)
    return fn(norms, size, leaf_norm(companion, ord, axes, keepdims=True))

  def one(i):
    x = leaves[i]
    axes = axes_of(x.shape)
    companion = None if others is None else others[i]
    return apply_scale(x, factor(leaf_norm(x, ord, axes, keepdims=True), x.size, companion,
                                 axes))

  out: list[Any] = [None] * len(leaves)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    if x.size > _SMALL_LEAF or _on_mesh(x) or (others is not None and _on_mesh(others[i])):
      out[i] = one(i)
    else:
      key = (x.shape, x.dtype, None if others is None else others[i].dtype)
      groups.setdefault(key, []).append(i)
  plans = []
  for (shape, _, _), members in groups.items():
    if len(members) == 1:
      out[members[0]] = one(members[0])
      continue
    k = len(members) if len(members) <= _FLAT_STACK else _STACK
    starts = list(range(0, len(members) - k + 1, k))
    if starts[-1] + k < len(members):
      starts.append(len(members) - k)
    static = len(members) >= _STATIC_ROWS or math.prod(shape) == 0  # (an index needs an element)
    plans.append((shape, members, k, starts, static))
  dynamic = [(k, members[0]) for _, members, k, _, static in plans if not static]
  if dynamic:
    index = _opaque_indices(max(k for k, _ in dynamic), leaves[dynamic[0][1]])
    # An array, not a Python 0: dynamic_slice then stages no conversion of it.
    zero = jnp.zeros((), jnp.int32)
  for shape, members, k, starts, static in plans:
    axes = _canonical_axes(len(shape), axes_of(shape))
    axes = tuple(range(1, len(shape) + 1)) if axes is None else tuple(a + 1 for a in axes)
    nested = len(starts) >= _NESTED_STACKS
    zeros = (0 if static else zero,) * len(shape)
    done = 0
    for start in starts:
      batch = members[start:start + k]
      stacked = _stack([leaves[i] for i in batch], shape, nested)
      companion = None if others is None else _stack([others[i] for i in batch], shape, nested)
      norms = leaf_norm(stacked, ord, axes, keepdims=True)
      scaled = apply_scale(stacked, factor(norms, math.prod(shape), companion, axes))
      for j in range(done - start, k):  # rows an earlier stack gave are skipped
        if static:
          row = jax.lax.slice(scaled, (j,) + zeros, (j + 1,) + shape)
        else:
          row = jax.lax.dynamic_slice(scaled, (index[j],) + zeros, (1,) + shape,
                                      allow_negative_indices=False)
        out[members[start + j]] = jax.lax.reshape(row, shape)
      done = start + k
  return out


def _stack(leaves: list[jax.Array], shape: tuple[int, ...], nested: bool) -> jax.Array:
  """``leaves`` (all of ``shape``) stacked on a new leading axis, by concatenates.

  With ``nested``, no concatenate has more than ``_FAN_IN`` operands, so XLA:CPU
  fuses them all into one kernel. Leaves are concatenated along their own
  first axis, so no leaf (but a 0-d one) needs a reshape of its own.
  """
  if not shape:
    stacked = _stack([jax.lax.reshape(x, (1,)) for x in leaves], (1,), nested)
    return jax.lax.reshape(stacked, (len(leaves),))
  if nested and len(leaves) > _FAN_IN:
    width = _FAN_IN
    while width * _FAN_IN < len(leaves):
      width *= _FAN_IN
    return jax.lax.concatenate([_stack(leaves[i:i + width], shape, True)
                                for i in range(0, len(leaves), width)], 0)
  joined = leaves[0] if len(leaves) == 1 else jax.lax.concatenate(leaves, 0)
  return jax.lax.reshape(joined, (len(leaves),) + shape)


def _opaque_indices(k: int, like: jax.Array) -> tuple[jax.Array, ...]:
  """The int32 scalars ``0, 1, ..., k - 1``, computed so that XLA cannot fold them.

  Why: a leaf that takes row ``j`` of a stacked result at a constant offset
  gets its own kernel for every (shape, offset), and a tree of many shapes
  then compiles thousands of distinct kernels. At an index XLA only knows at
  run time, all the leaves of one shape share one kernel.

  How: each index is one output of a single multi-output reduction (XLA fuses
  no reduction into its consumers), and depends on ``like`` through a
  comparison that is false for every value, NaN included. Were a compiler
  ever to fold it, the offsets would be constants again: same results, only
  the compile time changes.
  """
  first = jax.lax.reshape(like, (like.size,))[0]
  false = jax.lax.bitwise_and(jax.lax.ne(first, first), jax.lax.eq(first, first))
  zero = jax.lax.convert_element_type(false, jnp.int32)
  operands = tuple(jax.lax.broadcast_in_dim(jax.lax.add(zero, np.int32(j)), (2,), ())
                   for j in range(k))
  lowest = tuple(np.int32(np.iinfo(np.int32).min) for _ in range(k))
  return tuple(jax.lax.reduce(operands, lowest,
                              lambda a, b: tuple(map(jax.lax.max, a, b)), (0,)))


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
  # One division last: XLA then computes the factor once instead of copying
  # the selects into every leaf's kernel (which slows compiling big trees).
  numerator = jnp.where(jnp.isfinite(norm), jnp.where(clipping, max_norm, 1), jnp.nan)
  denominator = jnp.where(clipping & (norm > 0), norm, 1)
  return (numerator / denominator).astype(norm.dtype)


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
    return _ORDS[ord]
  except (KeyError, TypeError):
    pass
  raise ValueError(
      f"Unsupported ord={ord!r}: jaxclip norms support ord=1, ord=2 and "
      "ord=inf (as torch.nn.utils.get_total_norm)."
  )
