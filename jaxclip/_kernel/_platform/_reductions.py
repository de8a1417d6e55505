"""Norm reductions for XLA:CPU: half-precision leaves, and many small leaves at once.

* One leaf: a bfloat16 leaf reaches its reduction behind an optimization
  barrier, and a float16 leaf is reduced by a two-output reduction, so that
  neither gets a float32 copy (:func:`reduce`, :func:`share`).
* A tree: small leaves are reduced together, a few reductions per thousand
  leaves (:func:`shares_by_group`, on every platform: it changes no value),
  or every leaf's sum comes as one vector from one segment reduction
  (:func:`share_vector`, :func:`count_all`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _sharding
from jaxclip._kernel._platform._stacks import flat_concatenate
from jaxclip._kernel._platform._switch import is_small, on_cpu, segmentable
from jaxclip._kernel._platform._tricks import is_on
from jaxclip._kernel._validation import constant_size

Term = Callable[[jax.Array], jax.Array]

# Small leaves of at most _TINY_LEAF elements are added elementwise _GROUP at
# a time, the others concatenated _CHUNK_LEAVES at a time (shares_by_group).
_TINY_LEAF = 64
_GROUP = 32
_CHUNK_LEAVES = 128
# The two-output float16 reduction accumulates sequentially, so it runs over
# blocks of at most this many terms.
_SEQUENTIAL_BLOCK = 1024


def reduction_input(x: jax.Array) -> jax.Array:
  """``x`` as the input of a norm reduction: behind an optimization barrier if bfloat16 (CPU).

  On XLA:CPU a bfloat16 leaf that feeds both the norm and the scale gets its
  float32 conversion materialised (the reduction kernel cannot absorb a
  convert whose operand has a second user). The barrier gives the reduction
  its own operand, so the convert fuses into it. It is an identity for
  values and gradients. Trick ``bf16_barrier``: off, ``x`` as it is.
  """
  if x.dtype != jnp.bfloat16 or not is_on("bf16_barrier"):
    return x
  return on_cpu(jax.lax.optimization_barrier, lambda y: y, x)


def reduce(
  terms: jax.Array,
  op: str,
  axes: tuple[int, ...] | None = None,
  keepdims: bool = False,
  *,
  of_float16: bool = False,
) -> jax.Array:
  """The sum (``op="sum"``) or max of non-negative ``terms`` over ``axes``.

  ``of_float16`` says that the terms are computed from float16 values, which
  XLA:CPU reduces faster another way (:func:`float16_reduce`).
  """
  if of_float16:
    return float16_reduce(terms, op, axes, keepdims)
  return plain_reduce(terms, op, axes, keepdims)


def plain_reduce(
  terms: jax.Array, op: str, axes: tuple[int, ...] | None, keepdims: bool
) -> jax.Array:
  """``jnp.sum`` (``op="sum"``) or ``jnp.max`` (0 for empty) of ``terms``."""
  if op == "sum":
    return jnp.sum(terms, axis=axes, keepdims=keepdims)
  if all(terms.shape[a] for a in (range(terms.ndim) if axes is None else axes)):
    # No ``initial``: it changes nothing for non-negative terms and adds an op.
    return jnp.max(terms, axis=axes, keepdims=keepdims)
  return jnp.max(terms, axis=axes, keepdims=keepdims, initial=0.0)  # an empty leaf's 0


def float16_reduce(
  terms: jax.Array, op: str, axes: tuple[int, ...] | None, keepdims: bool
) -> jax.Array:
  """:func:`plain_reduce` of terms computed from float16 values.

  XLA:CPU never fuses the float32 conversion of a float16 leaf into a plain
  reduction: it materialises a float32 copy. A two-output reduction keeps
  the conversion inside the reduction kernel (:func:`_float16_reduce_cpu`).
  Trick ``f16_two_output``: off, :func:`plain_reduce`.
  """
  if not constant_size(terms) or not is_on("f16_two_output"):  # empty, or of a symbolic size
    return plain_reduce(terms, op, axes, keepdims)
  axes = tuple(range(terms.ndim)) if axes is None else tuple(axes)
  return on_cpu(
    lambda t: _float16_reduce_cpu(t, op, axes, keepdims),
    lambda t: plain_reduce(t, op, axes, keepdims),
    terms,
  )


def _two_output_reduce(terms: jax.Array, op: str, axes: tuple[int, ...]) -> jax.Array:
  """``op`` over ``axes`` as a reduction with a second output (the max) XLA cannot drop."""
  zero = jnp.zeros((), terms.dtype)
  first = jax.lax.add if op == "sum" else jax.lax.max

  def combine(a, b):
    return first(a[0], b[0]), jax.lax.max(a[1], b[1])

  total, peak = jax.lax.reduce((terms, terms), (zero, zero), combine, axes)
  return jnp.where(peak == 0, zero, total)  # peak is 0 only where every term is


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _float16_reduce_cpu(
  terms: jax.Array, op: str, axes: tuple[int, ...], keepdims: bool
) -> jax.Array:
  """:func:`plain_reduce` of float16-derived terms without a float32 copy (XLA:CPU).

  At most ``_SEQUENTIAL_BLOCK`` terms are one two-output reduction. A whole
  large leaf is reduced in blocks of a divisor of its size (or zero-padded
  to whole blocks), and the block results plainly. A reduction over part of
  the axes of a large leaf is plain. Derivatives are the plain reduction's.
  """
  if math.prod(terms.shape[a] for a in axes) <= _SEQUENTIAL_BLOCK:
    total = _two_output_reduce(terms, op, axes)
  elif len(axes) < terms.ndim:
    return plain_reduce(terms, op, axes, keepdims)
  else:
    flat = jax.lax.reshape(terms, (terms.size,))
    low = _SEQUENTIAL_BLOCK // 8
    block = next((b for b in range(_SEQUENTIAL_BLOCK, low - 1, -1) if terms.size % b == 0), None)
    if block is None:  # zero-pad to whole blocks: no sum or maximum changes
      block = _SEQUENTIAL_BLOCK
      flat = jax.lax.pad(flat, jnp.zeros((), flat.dtype), ((0, -terms.size % block, 0),))
    blocks = jax.lax.reshape(flat, (flat.size // block, block))
    total = plain_reduce(_two_output_reduce(blocks, op, (1,)), op, None, False)
  return jax.lax.expand_dims(total, axes) if keepdims else total


@_float16_reduce_cpu.defjvp
def _float16_reduce_cpu_jvp(op, axes, keepdims, primals, tangents):
  return jax.jvp(lambda t: plain_reduce(t, op, axes, keepdims), primals, tangents)


def share(x: jax.Array, term: Term, op: str) -> jax.Array:
  """One leaf's share of a tree norm: ``op`` over every ``term(x)``."""
  return reduce(term(x), op, of_float16=x.dtype == jnp.float16)


# ----------------------------------------------------------------------------
# A tree norm's partial sums: small leaves reduced together (every platform)
# ----------------------------------------------------------------------------


def shares_by_group(
  leaves: list[jax.Array],
  term: Term,
  op: str,
  acc: Any,
  scale: tuple[Callable[..., jax.Array], jax.Array] | None = None,
) -> list[jax.Array]:
  """Partial sums (maxima for ``op="max"``) of ``term`` over ``leaves``, a few per tree, in ``acc``.

  One reduction per leaf makes XLA build one fusion per leaf and a chain of
  thousands of scalar adds, which compiles in time quadratic in the number
  of leaves. Instead:

  * local leaves of more than ``_TINY_LEAF`` and at most ``SMALL_LEAF``
    entries are flattened and concatenated per dtype, ``_CHUNK_LEAVES`` at a
    time, and each chunk is reduced once;
  * local leaves of at most ``_TINY_LEAF`` entries have their terms flattened,
    zero-padded to the next power of two and combined elementwise ``_GROUP``
    at a time before one reduction per group (XLA:CPU unrolls the copy of a
    tiny concatenated operand; this copies nothing);
  * small leaves of one multi-device sharding (an Explicit mesh) are combined
    elementwise by shape, never reshaped, so grouping adds no collective.

  Larger leaves, and leaves whose layout is not known when the program is
  traced, keep one reduction each. ``jax.jvp`` and ``jax.grad`` differentiate
  the plain per-leaf sums, so no concatenate or pad is transposed.

  ``scale=(fn, e)`` takes the terms of ``fn(x, e)`` rather than of ``x``,
  applied after the leaves are joined (the rescaled norms: ``fn`` scales by
  ``2**-e``), so that XLA fuses the join into the reduction as it does the
  plain one, rather than materialising the joined scaled leaves.

  Trick ``grouped_parts``: off, one :func:`share` per leaf.
  """
  fn, e = scale if scale is not None else (None, None)
  if not is_on("grouped_parts"):
    return [share(_prescaled(x, fn, e), term, op).astype(acc) for x in leaves]
  plan = _group_plan(leaves)
  if all(len(members) == 1 for _, members in plan):
    return [_prescaled_share(leaves[m[0]], term, op, fn, e).astype(acc) for _, m in plan]
  return list(_grouped_sums(plan, term, op, acc, fn, leaves, e))


def _prescaled(x, fn, e):
  return x if fn is None else fn(x, e)


def _prescaled_share(x, term, op, fn, e):
  """:func:`share` of ``fn(x, e)``, reduced as a float16 leaf's where ``x`` is one."""
  return reduce(term(_prescaled(x, fn, e)), op, of_float16=x.dtype == jnp.float16)


def _group_plan(leaves: list[jax.Array]) -> tuple[tuple[Any, tuple[int, ...]], ...]:
  """``(how, members)`` pairs: ``how`` is ``None`` (one leaf), ``"concat"`` or a padded width."""
  plan: list[Any] = []
  chunks: dict[Any, list[list[int]]] = {}
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    if constant_size(x) == 0:
      continue
    where = _sharding.layout(x) if is_small(x) else None
    if where is None:
      plan.append((None, (i,)))
    elif where is not _sharding.LOCAL:
      groups.setdefault((0, x.shape, x.dtype, where), []).append(i)  # width 0: no padding
    elif is_small(x, _TINY_LEAF):
      wide = jnp.finfo(x.dtype).dtype == jnp.float64  # the terms' dtype: float64 or float32
      groups.setdefault((1 << (x.size - 1).bit_length(), wide), []).append(i)
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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3, 4))
def _grouped_sums(plan, term, op, acc, fn, leaves, e):
  parts = []
  for how, members in plan:
    if how is None:
      parts.append(_prescaled_share(leaves[members[0]], term, op, fn, e))
    elif how == "concat":
      joined = flat_concatenate([leaves[i] for i in members])
      parts.append(_prescaled_share(joined, term, op, fn, e))
    else:
      total = _combined(how, [term(_prescaled(leaves[i], fn, e)) for i in members], op)
      of_float16 = any(leaves[i].dtype == jnp.float16 for i in members)
      parts.append(reduce(total, op, of_float16=of_float16))
  return tuple(p.astype(acc) for p in parts)


@_grouped_sums.defjvp
def _grouped_sums_jvp(plan, term, op, acc, fn, primals, tangents):
  def plain(leaves, e):
    shares = [
      [share(_prescaled(leaves[i], fn, e), term, op).astype(acc) for i in m] for _, m in plan
    ]
    return tuple(combine_scalars(s, op) for s in shares)

  _, tangent_out = jax.jvp(plain, primals, tangents)
  return _grouped_sums(plan, term, op, acc, fn, *primals), tangent_out


def scaled_sums(
  leaves: list[jax.Array],
  term: Term,
  max_term: Term,
  acc: Any,
  scale_fn: Callable[..., jax.Array],
  exponent_fn: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(maxima, exponents, sums)``: a rescaled norm's partial sums, each part scaled on its own.

  The parts are :func:`shares_by_group`'s. Each part's largest ``max_term``
  gives its own exponent ``e`` (``exponent_fn``), and its sum is that of
  ``term(scale_fn(x, e))``. Why each its own: leaves scaled by one shared
  scalar make XLA:CPU fuse their reductions as siblings (they share an
  operand), which reserves temporary buffers of a tenth of the tree's bytes;
  a part's exponent computed from its own values is shared by no other.
  """
  maxima, exps, sums = [], [], []
  for how, members in _rescue_plan(leaves):
    if how is None or how == "concat":
      if how is None:  # one leaf as it lies (it may be sharded: no reshape)
        x = leaves[members[0]]
      else:
        x = flat_concatenate([leaves[i] for i in members])
      half = x.dtype == jnp.float16
      m = reduce(max_term(jax.lax.stop_gradient(x)), "max", of_float16=half).astype(acc)
      e = exponent_fn(m)
      # The scaled terms are float32, but computed from float16 values.
      total = reduce(term(scale_fn(x, e)), "sum", of_float16=half)
    else:
      # The group's maximum as its sum: combined elementwise, one reduction.
      half = any(leaves[i].dtype == jnp.float16 for i in members)
      m = reduce(
        _combined(how, [max_term(jax.lax.stop_gradient(leaves[i])) for i in members], "max"),
        "max",
        of_float16=half,
      ).astype(acc)
      e = exponent_fn(m)
      total = _combined(how, [term(scale_fn(leaves[i], e)) for i in members], "sum")
      total = reduce(total, "sum", of_float16=half)
    maxima.append(m)
    exps.append(e)
    sums.append(total.astype(acc))
  return jnp.stack(maxima), jnp.stack(exps), jnp.stack(sums)


def _rescue_plan(leaves: list[jax.Array]) -> list[tuple[Any, tuple[int, ...]]]:
  """:func:`_group_plan` with the padded groups of one width and term dtype made one.

  The rescue runs rarely, but compiles with every step: a part per group of
  ``_GROUP`` tiny leaves is six kernels per group on XLA:CPU (a maximum and a
  sum, each a windowed and a final reduction), a part per width is six in all.
  """
  plan: list[tuple[Any, tuple[int, ...]]] = []
  merged: dict[Any, list[int]] = {}
  for how, members in _group_plan(leaves):
    if isinstance(how, int) and how > 0:
      wide = jnp.finfo(leaves[members[0]].dtype).dtype == jnp.float64
      merged.setdefault((how, wide), []).extend(members)
    else:
      plan.append((how, members))
  plan.extend((how, tuple(members)) for (how, _), members in merged.items())
  return plan


def _combined(how: int, terms: list[jax.Array], op: str) -> jax.Array:
  """A padded group's ``terms`` combined elementwise (flattened, zero-padded to ``how``)."""
  combine = jax.lax.max if op == "max" else jax.lax.add
  total = None
  for t in terms:
    if how:  # flatten and pad to the group's width
      t = jax.lax.reshape(t, (t.size,))
      if t.size < how:
        t = jax.lax.pad(t, jnp.zeros((), t.dtype), ((0, how - t.size, 0),))
    total = t if total is None else combine(total, t)
  return total


def scaled_leaf_sums(
  leaves: list[jax.Array],
  term: Term,
  max_term: Term,
  acc: Any,
  scale_fn: Callable[..., jax.Array],
  exponent_fn: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(maxima, exponents, sums)``, one entry per leaf: each leaf scaled by its own exponent.

  The rescued pass of the per-leaf norms: leaf ``i``'s largest ``max_term``
  gives its exponent ``e[i]`` (``exponent_fn``), and its sum is that of
  ``term(scale_fn(x, e[i]))``. Small local real leaves are joined: flattened
  and concatenated per dtype, their maxima and scaled sums taken by two
  segment reductions, each entry's exponent read by one gather. So the
  program grows by one reshape per leaf, not by a scaled pass per leaf (the
  rescue is compiled with every step, though it rarely runs). Other leaves
  (large, sharded, complex) are scaled one by one.
  """
  joined: dict[Any, list[int]] = {}
  alone: list[int] = []
  for i, x in enumerate(leaves):
    if segmentable(x) and not jnp.issubdtype(x.dtype, jnp.complexfloating):
      joined.setdefault(x.dtype, []).append(i)
    else:
      alone.append(i)
  order: list[int] = []
  maxima, exps, sums = [], [], []
  for members in joined.values():
    flat = flat_concatenate([leaves[i] for i in members])
    segments = np.repeat(np.arange(len(members), dtype=np.int32), [leaves[i].size for i in members])
    m = jax.ops.segment_max(
      max_term(jax.lax.stop_gradient(flat)), segments, len(members), indices_are_sorted=True
    )
    e = exponent_fn(m)
    s = jax.ops.segment_sum(
      term(scale_fn(flat, e[segments])), segments, len(members), indices_are_sorted=True
    )
    order += members
    maxima.append(m.astype(acc))
    exps.append(e)
    sums.append(s.astype(acc))
  if alone:
    m = [share(jax.lax.stop_gradient(leaves[i]), max_term, "max").astype(acc) for i in alone]
    e = [exponent_fn(x) for x in m]
    s = [
      _prescaled_share(leaves[i], term, "sum", scale_fn, k).astype(acc)
      for i, k in zip(alone, e, strict=True)
    ]
    order += alone
    maxima.append(jnp.stack(m))
    exps.append(jnp.stack(e))
    sums.append(jnp.stack(s))
  out = tuple(v[0] if len(v) == 1 else jnp.concatenate(v) for v in (maxima, exps, sums))
  if order == list(range(len(leaves))):
    return out
  back = np.argsort(np.asarray(order, np.int32)).astype(np.int32)
  return tuple(v[back] for v in out)


def combine_scalars(parts: list[jax.Array], op: str) -> jax.Array:
  """The sum (``op="sum"``) or max of scalars, as one reduction."""
  if len(parts) == 1:
    return parts[0]
  stacked = jnp.stack(parts)
  # dtype=: an int32 count stays int32 under jax_enable_x64.
  return jnp.max(stacked) if op == "max" else jnp.sum(stacked, dtype=stacked.dtype)


# ----------------------------------------------------------------------------
# Every leaf's share as one vector: one segment reduction (XLA:CPU)
# ----------------------------------------------------------------------------


def share_vector(leaves: list[jax.Array], term: Term, op: str, acc: Any) -> jax.Array:
  """Every leaf's :func:`share` as one vector in ``acc``, the small leaves' in one kernel.

  The small local leaves of one dtype are flattened and concatenated as they
  are, ``term`` is taken once on the joined vector, and one segment reduction
  gives their shares (:func:`joined_parts`): no kernel per leaf, where terms
  taken leaf by leaf and then concatenated make XLA:CPU compute each leaf's
  terms in a kernel of its own. Other leaves are reduced alone and enter the
  reduction as one term each. The values are those of the terms taken leaf
  by leaf and joined (:func:`small_parts`), bit for bit: the same terms, each
  leaf's summed in the same order. For programs lowered for CPU only.

  Trick ``segment_parts``: off, one :func:`share` per leaf, stacked.
  """
  if not is_on("segment_parts"):
    return jnp.stack([share(x, term, op).astype(acc) for x in leaves])
  return joined_parts(tuple(leaves), term, op, acc)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def joined_parts(leaves: tuple[jax.Array, ...], term: Term, op: str, acc: Any) -> jax.Array:
  """:func:`share_vector`'s vector, one kernel for the small leaves' terms.

  Derivatives are those of the plain per-leaf :func:`share`.
  """
  joined: dict[Any, list[int]] = {}
  pieces, owners, sizes = [], [], []
  for i, x in enumerate(leaves):
    if segmentable(x):
      joined.setdefault(x.dtype, []).append(i)
    else:
      pieces.append(jax.lax.reshape(share(x, term, op).astype(acc), (1,)))
      owners.append(i)
      sizes.append(1)
  for members in joined.values():
    pieces.append(term(flat_concatenate([leaves[i] for i in members])).astype(acc))
    owners += members
    sizes += [leaves[i].size for i in members]
  flat = pieces[0] if len(pieces) == 1 else jax.lax.concatenate(pieces, 0)
  segments = np.repeat(np.asarray(owners, np.int32), sizes)
  reduce_by = jax.ops.segment_sum if op == "sum" else jax.ops.segment_max
  ordered = owners == sorted(owners)
  return reduce_by(flat, segments, len(leaves), indices_are_sorted=ordered)


@joined_parts.defjvp
def _joined_parts_jvp(term, op, acc, primals, tangents):
  def plain(leaves):
    return jnp.stack([share(x, term, op).astype(acc) for x in leaves])

  return jax.jvp(plain, primals, tangents)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def small_parts(terms: tuple[jax.Array, ...], op: str) -> jax.Array:
  """The sum (``op="sum"``) or max of each non-empty array of ``terms``, as one vector.

  The arrays are concatenated and reduced by segment: one kernel for all,
  where XLA:CPU compiles a reduction kernel per array slowly. Derivatives are
  the plain reductions'.
  """
  flat = jnp.concatenate([jnp.ravel(t) for t in terms])
  segments = np.repeat(np.arange(len(terms), dtype=np.int32), [t.size for t in terms])
  reduce_by = jax.ops.segment_sum if op == "sum" else jax.ops.segment_max
  return reduce_by(flat, segments, len(terms), indices_are_sorted=True)


@small_parts.defjvp
def _small_parts_jvp(op, primals, tangents):
  plain = lambda ts: jnp.stack([plain_reduce(t, op, None, False) for t in ts])  # noqa: E731
  return jax.jvp(plain, primals, tangents)


def count_all(arrays: list[jax.Array]) -> jax.Array:
  """The sum of every entry of the non-empty integer ``arrays``, one scalar.

  One reduction per array makes XLA:CPU fuse them into one kernel, which
  compiles in time quadratic in their number; on CPU the small local arrays
  are summed by one segment reduction instead.
  """

  def plain(arrays):
    return combine_scalars([jax.lax.reduce_sum(x, tuple(range(x.ndim))) for x in arrays], "sum")

  def cpu(arrays):
    small = tuple(x for x in arrays if segmentable(x))
    if len(small) < 2:
      return plain(arrays)
    return plain([small_parts(small, "sum"), *(x for x in arrays if not segmentable(x))])

  return on_cpu(cpu, plain, arrays)
