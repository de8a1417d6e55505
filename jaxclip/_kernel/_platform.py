"""Every backend-specific code path of jaxclip, chosen where the program is lowered.

jaxclip's kernel was tuned on XLA:CPU, where a few workarounds each buy at
least 1.2x on a row a user sees (``benchmarks/tricks.md`` measures each with
and without): an optimization barrier before a bfloat16 norm and a
two-output reduction for float16 norms (no float32 copy of the leaf), and
stacks of small leaves of one shape whose rows are read at opaque indices
(the per-leaf clips, and the per-tensor rules of
:mod:`jaxclip.transforms._per_tensor`: fewer distinct kernels to compile).
None was measured on GPU or TPU, so none runs there: each is staged with
:func:`on_cpu`, a :func:`jax.lax.platform_dependent` whose other branch is
the plain math. The choice is made when the program is *lowered*, not from
:func:`jax.default_backend` at trace time, so a program exported with
``jax.export(..., platforms=('cuda',))`` or ``('tpu',)`` on a CPU-only
machine carries none of these workarounds. (Lowered for one platform, the
choice is a ``case`` on a constant index with only that platform's branch,
which XLA folds away: the compiled program holds no conditional.)

This module depends on nothing else in jaxclip.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def constant_size(x: Any) -> int | None:
  """The number of entries of ``x``, or ``None`` if a dimension is symbolic.

  Under ``jax.export`` with a symbolic shape (``jax.export.symbolic_shape``)
  a size is an expression that cannot be compared with a constant. Every
  choice of a trick by size reads it here, and a size that is not a
  constant counts as large: such a leaf takes the plain path, whose ops
  accept any shape.
  """
  shape = x.shape if hasattr(x, "shape") else np.shape(x)
  if not all(isinstance(d, (int, np.integer)) for d in shape):
    return None
  return math.prod(shape)


def on_cpu(cpu: Callable[..., Any], default: Callable[..., Any], *args: Any) -> Any:
  """``cpu(*args)`` in programs lowered for CPU, ``default(*args)`` elsewhere.

  Both callables must compute the same values; only their speed differs.
  Both are traced, and only the one for the lowering platform is compiled.
  """
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


# ----------------------------------------------------------------------------
# bfloat16 norms: an optimization barrier (XLA:CPU)
# ----------------------------------------------------------------------------


def reduction_input(x: jax.Array) -> jax.Array:
  """``x`` as the input of a norm reduction.

  On XLA:CPU a bfloat16 leaf that feeds both the norm reduction and the
  scale pass gets its float32 conversion materialised as a full-size buffer
  (the reduction kernel cannot absorb a convert whose operand has a second
  user). An optimization barrier gives the reduction its own operand, so the
  convert fuses into it: no float32 copy, and a faster norm. The barrier is
  an identity for values and gradients.
  """
  if x.dtype != jnp.bfloat16:
    return x
  return on_cpu(jax.lax.optimization_barrier, lambda y: y, x)


# ----------------------------------------------------------------------------
# float16 norms: a two-output reduction (XLA:CPU)
# ----------------------------------------------------------------------------

# The two-output reduction accumulates sequentially, so it runs over blocks of
# at most this many terms; the block results are reduced by a plain reduction.
_SEQUENTIAL_BLOCK = 1024


def plain_reduce(
  terms: jax.Array, op: str, axes: tuple[int, ...] | None, keepdims: bool
) -> jax.Array:
  """``jnp.sum`` (``op="sum"``) or ``jnp.max`` (0 for empty) of ``terms``."""
  if op == "sum":
    return jnp.sum(terms, axis=axes, keepdims=keepdims)
  if all(terms.shape[a] for a in (range(terms.ndim) if axes is None else axes)):
    # No ``initial``: its ``max(m, 0)`` changes nothing for non-negative terms
    # and adds an op after every reduction.
    return jnp.max(terms, axis=axes, keepdims=keepdims)
  # ``initial`` makes the max of an empty leaf 0, as its norm.
  return jnp.max(terms, axis=axes, keepdims=keepdims, initial=0.0)


def float16_reduce(
  terms: jax.Array, op: str, axes: tuple[int, ...] | None, keepdims: bool
) -> jax.Array:
  """:func:`plain_reduce` of terms computed from float16 values.

  On XLA:CPU the float32 conversion of a float16 leaf is never fused into a
  plain reduction: it is materialised as a full-size float32 copy (twice the
  leaf's bytes). A two-output reduction keeps the conversion inside the
  reduction kernel, so no copy is made (see :func:`_float16_reduce_cpu`).
  """
  size = constant_size(terms)
  if not size:  # empty, or of a symbolic size
    return plain_reduce(terms, op, axes, keepdims)
  axes = tuple(range(terms.ndim)) if axes is None else tuple(axes)
  return on_cpu(
    lambda t: _float16_reduce_cpu(t, op, axes, keepdims),
    lambda t: plain_reduce(t, op, axes, keepdims),
    terms,
  )


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
def _float16_reduce_cpu(
  terms: jax.Array, op: str, axes: tuple[int, ...], keepdims: bool
) -> jax.Array:
  """:func:`plain_reduce` of float16-derived terms without a float32 copy (XLA:CPU).

  A reduction over at most ``_SEQUENTIAL_BLOCK`` terms is one two-output
  reduction. A whole large leaf is reduced in blocks of a divisor of its size
  (or, with no such divisor, zero-padded to whole blocks) and the block
  results, one per up to ``_SEQUENTIAL_BLOCK`` terms, are reduced plainly: as
  accurate as the plain float32 reduction, and faster on CPU. A reduction
  over part of the axes of a large leaf falls back to the plain reduction.
  Derivatives are taken through the plain reduction.
  """
  reduced = math.prod(terms.shape[a] for a in axes)
  if reduced <= _SEQUENTIAL_BLOCK:
    total = _two_output_reduce(terms, op, axes)
  elif len(axes) < terms.ndim:
    return plain_reduce(terms, op, axes, keepdims)
  else:
    flat = jax.lax.reshape(terms, (terms.size,))
    block = _largest_divisor(terms.size, _SEQUENTIAL_BLOCK, _SEQUENTIAL_BLOCK // 8)
    if block is None:  # zero-pad to whole blocks: no sum or maximum changes
      block = _SEQUENTIAL_BLOCK
      flat = jax.lax.pad(flat, jnp.zeros((), flat.dtype), ((0, -terms.size % block, 0),))
    blocks = jax.lax.reshape(flat, (flat.size // block, block))
    total = plain_reduce(_two_output_reduce(blocks, op, (1,)), op, None, False)
  return jax.lax.expand_dims(total, axes) if keepdims else total


@_float16_reduce_cpu.defjvp
def _float16_reduce_cpu_jvp(op, axes, keepdims, primals, tangents):
  return jax.jvp(lambda t: plain_reduce(t, op, axes, keepdims), primals, tangents)


# ----------------------------------------------------------------------------
# Every small leaf's sum or max, one segment reduction for all (XLA:CPU)
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def small_parts(terms: tuple[jax.Array, ...], op: str) -> jax.Array:
  """The sum (``op="sum"``) or max of each non-empty array of ``terms``, as one vector (XLA:CPU).

  For the many small leaves of a tree whose every leaf's norm is needed.
  XLA:CPU compiles a reduction kernel per leaf slowly (about 3 ms each at
  400 leaves, more than twice an elementwise kernel); here every leaf's terms
  are concatenated into one vector and reduced by segment, in one kernel for
  all. Derivatives are the plain reductions'.
  """
  sizes = [t.size for t in terms]
  flat = jnp.concatenate([jnp.ravel(t) for t in terms])
  segments = np.repeat(np.arange(len(terms), dtype=np.int32), sizes)
  reduce = jax.ops.segment_sum if op == "sum" else jax.ops.segment_max
  return reduce(flat, segments, len(terms), indices_are_sorted=True)


@small_parts.defjvp
def _small_parts_jvp(op, primals, tangents):
  return jax.jvp(
    lambda ts: jnp.stack([plain_reduce(t, op, None, False) for t in ts]), primals, tangents
  )


# ----------------------------------------------------------------------------
# Many small leaves of one shape: stacks and their rows (XLA:CPU)
# ----------------------------------------------------------------------------


def stack(leaves: Sequence[jax.Array], shape: tuple[int, ...]) -> jax.Array:
  """``leaves`` (all of ``shape``) stacked on a new leading axis, by one concatenate.

  Leaves are concatenated along their own first axis, so no leaf (but a 0-d
  one) needs a reshape of its own. Its transpose (under ``jax.grad``) is one
  slice per leaf.
  """
  if not shape:
    stacked = stack([jax.lax.reshape(x, (1,)) for x in leaves], (1,))
    return jax.lax.reshape(stacked, (len(leaves),))
  joined = leaves[0] if len(leaves) == 1 else jax.lax.concatenate(list(leaves), 0)
  return jax.lax.reshape(joined, (len(leaves),) + shape)


def opaque_indices(k: int, like: jax.Array) -> tuple[jax.Array, ...]:
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
  like = jax.lax.stop_gradient(like)
  first = jax.lax.reshape(like, (like.size,))[0]
  false = jax.lax.bitwise_and(jax.lax.ne(first, first), jax.lax.eq(first, first))
  zero = jax.lax.convert_element_type(false, jnp.int32)
  operands = tuple(
    jax.lax.broadcast_in_dim(jax.lax.add(zero, np.int32(j)), (2,), ()) for j in range(k)
  )
  lowest = tuple(np.int32(np.iinfo(np.int32).min) for _ in range(k))
  return tuple(jax.lax.reduce(operands, lowest, lambda a, b: tuple(map(jax.lax.max, a, b)), (0,)))


# At most this many opaque indices read a vector's entries (entry_indices):
# a single reduction with thousands of outputs compiles in time quadratic in
# their number (0.75 s for 400, 8.8 s for 1,600), so a longer vector is read
# in blocks.
_ENTRY_INDICES = 512


def materialized(v: jax.Array) -> jax.Array:
  """``v``, computed by one kernel that all its readers share (XLA:CPU).

  XLA copies cheap elementwise ops into the kernel of each consumer: a
  vector made from every leaf's scalars, read one entry per leaf, would be
  recomputed in every leaf's kernel. A maximum over two equal copies is exact
  (NaN included) and is a reduction, which XLA does not copy.
  """
  return jnp.max(jnp.broadcast_to(v, (2,) + v.shape), axis=0)


def entry_indices(k: int, like: jax.Array) -> tuple[jax.Array, ...]:
  """The :func:`opaque_indices` with which :func:`entries` reads a ``k``-vector."""
  return opaque_indices(max(min(k, _ENTRY_INDICES), math.isqrt(k - 1) + 1), like)


def entries(v: jax.Array, index: tuple[jax.Array, ...]) -> list[jax.Array]:
  """The entries of the vector ``v``, each read at opaque indices: one kernel for all.

  A vector longer than ``index`` is read as a matrix of rows of
  ``len(index)``: a row at an opaque index, then its entry at another.
  """
  k, b = v.shape[0], len(index)
  if k <= b:
    return rows(v, 0, index[:k])
  blocks = -(-k // b)
  matrix = jnp.reshape(jnp.pad(v, (0, blocks * b - k)), (blocks, b))
  return [x for row in rows(matrix, 0, index[:blocks]) for x in rows(row, 0, index)][:k]


def rows(stacked: jax.Array, first: int, indices: tuple[jax.Array, ...] | None) -> list[jax.Array]:
  """Rows ``first, first + 1, ...`` of ``stacked``, each of the stack's row shape.

  With ``indices`` (from :func:`opaque_indices`) row ``j`` is taken at
  ``indices[j]``, so XLA:CPU compiles one kernel for all the rows of a shape;
  with ``None`` at constant offsets.

  The rows cost no more than the plain per-leaf math under transformations:

  * ``jax.grad`` / ``jax.jvp``: the tangent rows are one static split of the
    tangent stack, whose transpose is one concatenate (the transpose of a
    slice per row would be a full-stack update per row: quadratic);
  * ``jax.vmap``: a batched stack is split statically (an indexed row of a
    batched operand would become a gather).
  """
  return list(_rows(stacked, first, indices))


def _split(stacked: jax.Array, first: int, axis: int) -> list[jax.Array]:
  shape = stacked.shape[:axis] + stacked.shape[axis + 1 :]
  k = stacked.shape[axis]
  parts = jax.lax.split(stacked, (first,) + (1,) * (k - first) if first else (1,) * k, axis)
  return [jax.lax.reshape(p, shape) for p in parts[1 if first else 0 :]]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _rows(stacked, first, indices):
  return tuple(_indexed_rows(stacked, first, indices))


@_rows.defjvp
def _rows_jvp(first, primals, tangents):
  stacked, indices = primals
  return _rows(stacked, first, indices), tuple(_split(tangents[0], first, 0))


def _indexed_rows(stacked, first, indices):
  if indices is None:
    return _split(stacked, first, 0)
  return _indexed_rows_from(first)(stacked, indices)


@functools.cache
def _indexed_rows_from(first: int) -> Callable[..., list[jax.Array]]:
  """Rows ``first, ...`` of a stack at opaque indices, split statically under vmap."""

  @jax.custom_batching.custom_vmap
  def indexed_rows(stacked, indices):
    shape = stacked.shape[1:]
    # An array, not a Python 0: dynamic_slice then stages no conversion of it.
    zero = jnp.zeros((), jnp.int32)
    return [
      jax.lax.reshape(
        jax.lax.dynamic_slice(
          stacked, (indices[j],) + (zero,) * len(shape), (1,) + shape, allow_negative_indices=False
        ),
        shape,
      )
      for j in range(first, stacked.shape[0])
    ]

  @indexed_rows.def_vmap
  def indexed_rows_vmap(axis_size, in_batched, stacked, indices):
    del axis_size, indices
    batched = bool(in_batched[0])
    # Batched, the stack's batch axis is axis 0 and its rows run along axis 1.
    out = _split(stacked, first, 1 if batched else 0)
    return out, [batched] * len(out)

  return indexed_rows


# ----------------------------------------------------------------------------
# Ghost norms: the cost model of per_example_clipped_grad(method="auto")
# ----------------------------------------------------------------------------

# On XLA:CPU the ghost rules pay (against method="vmap"'s program) where
# their norms cost at most this share of the flops of every per-example
# gradient: they also hold each layer's inputs and output gradients for a
# book-keeping matmul that per-example gradients do not need. Measured on the
# whole loss, ghost rules forced against method="vmap" (benchmarks/ghost_zoo.md,
# ghost.md): at shares 0.79 and 0.81 ghost took 0.73-1.01x vmap's time; at 1.0,
# 1.04-1.27x; at 1.06, 1.10-1.13x. Per layer, the rules' own switch between
# the Gram form and the per-example gradient formed from a layer's inputs
# and output gradients compares flops too.
GHOST_FLOPS_SHARE_CPU = 0.9


def ghost_cost_model(platform: str | None) -> str:
  """How ``method="auto"`` weighs a layer's ghost rule against its per-example gradient.

  ``"flops"`` where the program is lowered for CPU (the share above, measured
  on XLA:CPU, for the whole loss); ``"memory"`` on any other platform
  (``None``: any but CPU), where no cost was measured: per layer, the form
  that holds fewer floats per example, which is why ghost norms are used.
  """
  return "flops" if platform == "cpu" else "memory"
