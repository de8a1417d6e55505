"""Small leaves of one shape scaled as stacks (XLA:CPU), and the rows read back.

A per-leaf clip written leaf by leaf is one reduction and one multiply per
leaf: thousands of kernels for a tree of thousands of small leaves. On
XLA:CPU the small leaves of one shape are stacked, the per-leaf function's
stacked form scales each stack (:func:`scale_each_leaf`), and each leaf reads its
row back (:func:`rows`) at an index XLA cannot fold (:func:`opaque_indices`),
so that the leaves of one shape share one kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _sharding
from jaxclip._kernel._platform._switch import SMALL_LEAF, on_cpu
from jaxclip._kernel._platform._tricks import is_on
from jaxclip._kernel._shapes import constant_size

# Small leaves of one shape and dtype are stacked: all in one stack when
# there are at most _FLAT_STACK, else _STACK at a time. Rows are taken at
# constant offsets when the shape has at least _STATIC_ROWS leaves, else at
# opaque indices.
_STACK = 64
_FLAT_STACK = 128
_STATIC_ROWS = 512

# scaler(shape) scales one leaf of shape; scaler(shape, stacked=True) a stack of
# them (a new leading axis), each row by its own norms.
Scaler = Callable[..., Callable[..., jax.Array]]


def scale_each_leaf(
  scaler: Scaler,
  leaves: list[jax.Array],
  companions: list[jax.Array] | None,
  operands: tuple,
  together: Callable[[list[jax.Array], list[jax.Array] | None], list[jax.Array]] | None = None,
) -> list[jax.Array]:
  """``scaler(x.shape)(x, companion, operands)`` for each leaf ``x``.

  ``scaler(shape)`` is the plain math of one leaf of ``shape``: what every
  other platform runs, and what ``jax.jvp`` and ``jax.grad`` differentiate
  everywhere. In programs lowered for CPU the small local leaves of one
  shape and dtype are stacked and ``scaler(shape, stacked=True)`` scales each
  stack (:func:`_by_stacks`): one reduction and one multiply per stack, where
  one per leaf is thousands of kernels. Large and sharded leaves are scaled
  one by one, so their multiply fuses into their consumer and keeps their
  sharding.

  ``together(leaves, companions, operands, stacks)``, where given, computes the same
  values for a list of leaves at once (one rescue of every norm under one
  ``lax.cond``; with ``stacks``, small leaves rescued by stacks): it replaces
  the per-leaf calls of the leaves scaled one by one, with stacks in programs
  lowered for CPU, and is what other platforms run for every leaf.
  """
  others = [None] * len(leaves) if companions is None else companions
  alone, groups = [], {}
  for i, x in enumerate(leaves):
    size = constant_size(x)
    pair = (x,) if others[i] is None else (x, others[i])
    if size is not None and size <= SMALL_LEAF and all(_local(a) for a in pair):
      groups.setdefault(tuple((a.shape, a.dtype) for a in pair), []).append(i)
    else:
      alone.append(i)
  alone += [g[0] for g in groups.values() if len(g) == 1]
  if together is not None and alone:
    alone.sort()
    pick = None if companions is None else [companions[i] for i in alone]
    scaled = on_cpu(
      lambda xs, cs, ops: together(xs, cs, ops, True),
      lambda xs, cs, ops: together(xs, cs, ops, False),
      [leaves[i] for i in alone],
      pick,
      operands,
    )
    out = dict(zip(alone, scaled, strict=True))
  else:
    out = {i: scaler(leaves[i].shape)(leaves[i], others[i], operands) for i in alone}
  stacked = [i for g in groups.values() if len(g) > 1 for i in g]
  if stacked:
    sizes = tuple(len(g) for g in groups.values() if len(g) > 1)
    companions = None if companions is None else [companions[i] for i in stacked]
    scaled = _scale_stacked(
      scaler, sizes, together, [leaves[i] for i in stacked], companions, operands
    )
    out.update(zip(stacked, scaled, strict=True))
  return [out[i] for i in range(len(leaves))]


def _local(x: jax.Array) -> bool:
  return _sharding.layout(x) is _sharding.LOCAL


def _one_by_one(scaler, leaves, companions, operands):
  return [
    scaler(x.shape)(x, None if companions is None else companions[j], operands)
    for j, x in enumerate(leaves)
  ]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _scale_stacked(scaler, sizes, together, leaves, companions, operands):
  """:func:`_by_stacks` on CPU; elsewhere ``together`` without stacks (or :func:`_one_by_one`).

  Under ``jax.jvp`` the tangents are :func:`_one_by_one`'s.
  """

  def plain(leaves, companions, operands):
    if together is None:
      return _one_by_one(scaler, leaves, companions, operands)
    return together(leaves, companions, operands, False)

  return on_cpu(lambda *args: _by_stacks(scaler, sizes, *args), plain, leaves, companions, operands)


@_scale_stacked.defjvp
def _scale_stacked_jvp(scaler, sizes, together, primals, tangents):
  # Each leaf's tangent is its own plain math's: transposed (for jax.grad),
  # a stack's rows would each become a full-stack update.
  _, tangent_out = jax.jvp(lambda *a: _one_by_one(scaler, *a), primals, tangents)
  return _scale_stacked(scaler, sizes, together, *primals), tangent_out


def _by_stacks(scaler, sizes, leaves, companions, operands) -> list[jax.Array]:
  """The groups of leaves of one shape (one after the other, ``sizes`` long) scaled by stacks.

  A group of at most ``_FLAT_STACK`` leaves is one stack, a larger one is
  stacked ``_STACK`` at a time (its last stack overlaps the one before, so
  that all its stacks are alike). XLA:CPU compiles one kernel per distinct
  fusion, so a group of at least ``_STATIC_ROWS`` leaves takes its rows at
  constant offsets (one kernel per offset, shared by all its stacks), and a
  smaller group at :func:`opaque_indices` (one kernel for all its rows).

  Tricks: ``stacked_scales`` off, the leaves scaled one by one
  (:func:`_one_by_one`); ``opaque_indices`` off, every row at a constant offset.
  """
  if not is_on("stacked_scales"):
    return _one_by_one(scaler, leaves, companions, operands)
  opaque = is_on("opaque_indices")
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
    # Constant offsets: with the trick off, for a large group, or an empty shape (an index
    # needs an element).
    static = not opaque or size >= _STATIC_ROWS or math.prod(shape) == 0
    plans.append((shape, members, k, starts, static))
  dynamic = [(k, members[0]) for _, members, k, _, static in plans if not static]
  if dynamic:
    index = opaque_indices(max(k for k, _ in dynamic), leaves[dynamic[0][1]])
  for shape, members, k, starts, static in plans:
    scale = scaler(shape, stacked=True)
    done = 0
    for start in starts:
      batch = members[start : start + k]
      others = None if companions is None else stack([companions[i] for i in batch], shape)
      scaled = scale(stack([leaves[i] for i in batch], shape), others, operands)
      # Rows an earlier stack gave are skipped.
      out.extend(rows(scaled, done - start, None if static else index[:k]))
      done = start + k
  return out


def join_plan(
  arrays: list[jax.Array], extras: list[jax.Array], keys: list[Any], flat_key: Any
) -> list[tuple[Any, list[int]]]:
  """How :func:`map_joined` groups ``arrays``: ``(group, members)`` pairs, every index once.

  Small local arrays of one shape, dtype and ``key`` (and extras of one
  shape) form a stack. Arrays of key ``flat_key`` (one whose function reduces
  the whole array to ``extra``'s one entry, with the same value for the array
  flattened and zero-padded, as a norm's) of up to ``_PADDED_LEAF`` entries
  are flattened, zero-padded to a power-of-two width and stacked by dtype and
  width, whatever their shapes. Every other array is a group of its own.
  """
  groups: dict[Any, list[int]] = {}
  for i, (x, e) in enumerate(zip(arrays, extras, strict=True)):
    size = constant_size(x)
    local = size and _local(x) and _local(e)
    if local and keys[i] == flat_key and size <= _PADDED_LEAF and e.size == 1:
      groups.setdefault(("padded", _padded_width(size), x.dtype, e.dtype, keys[i]), []).append(i)
    elif local and size <= SMALL_LEAF:
      groups.setdefault(("stack", x.shape, x.dtype, e.shape, e.dtype, keys[i]), []).append(i)
    else:
      groups[("alone", i)] = [i]
  return list(groups.items())


def map_joined(
  fn_of: Callable[[Any], Callable[..., jax.Array]],
  plan: list[tuple[Any, list[int]]],
  arrays: list[jax.Array],
  extras: list[jax.Array],
  keys: list[Any],
) -> list[jax.Array]:
  """``fn_of(key)(array, extra)`` (of ``extra``'s shape) for every array, by the groups of ``plan``.

  One flat vector per group: its members' results flattened, one after the
  other. A group's function is vmapped over its stack once, so the program
  holds one copy of it per group, not per array: what a rarely taken branch
  (a norm's rescue, in programs lowered for CPU) is made of, compiled with
  every step. A padded stack at most doubles the entries read.
  """
  out = []
  for group, members in plan:
    key = keys[members[0]]
    if len(members) == 1:
      i = members[0]
      r = fn_of(key)(arrays[i], extras[i])
      out.append(jax.lax.reshape(r, (r.size,)))
      continue
    if group[0] == "padded":
      width = group[1]
      xs = stack([_padded(arrays[i], width) for i in members], (width,))
      es = stack([jax.lax.reshape(extras[i], (1,)) for i in members], (1,))
    else:
      xs = stack([arrays[i] for i in members], arrays[members[0]].shape)
      es = stack([extras[i] for i in members], extras[members[0]].shape)
    r = jax.vmap(fn_of(key))(xs, es)
    out.append(jax.lax.reshape(r, (r.size,)))
  return out


# join_plan's flattened arrays: at most this many entries (16 KiB of float32), padded to a
# power of two. The padded stacks are copies, held while the rescue runs.
_PADDED_LEAF = 4_096


def _padded_width(size: int) -> int:
  return 1 << max(size - 1, 0).bit_length()


def _padded(x: jax.Array, width: int) -> jax.Array:
  flat = jax.lax.reshape(x, (x.size,))
  if x.size == width:
    return flat
  return jax.lax.pad(flat, jnp.zeros((), x.dtype), ((0, width - x.size, 0),))


def flat_concatenate(arrays: Sequence[jax.Array]) -> jax.Array:
  """``arrays`` flattened and joined into one vector (one concatenate; one array: its reshape)."""
  flat = [jax.lax.reshape(a, (a.size,)) for a in arrays]
  return flat[0] if len(flat) == 1 else jax.lax.concatenate(flat, 0)


def stack(leaves: Sequence[jax.Array], shape: tuple[int, ...]) -> jax.Array:
  """``leaves`` (all of ``shape``) stacked on a new leading axis, by one concatenate.

  Leaves are concatenated along their own first axis, so no leaf (but a 0-d
  one) needs a reshape of its own. Its transpose is one slice per leaf.
  """
  if not shape:
    stacked = stack([jax.lax.reshape(x, (1,)) for x in leaves], (1,))
    return jax.lax.reshape(stacked, (len(leaves),))
  joined = leaves[0] if len(leaves) == 1 else jax.lax.concatenate(list(leaves), 0)
  return jax.lax.reshape(joined, (len(leaves),) + shape)


def opaque_indices(k: int, like: jax.Array) -> tuple[jax.Array, ...]:
  """The int32 scalars ``0, 1, ..., k - 1``, computed so that XLA cannot fold them.

  Why: a leaf that takes row ``j`` of a stacked result at a constant offset
  gets its own kernel for every (shape, offset). At an index XLA only knows
  at run time, all the leaves of one shape share one kernel.

  How: each index is one output of a single multi-output reduction (XLA fuses
  no reduction into its consumers), and depends on ``like`` through a
  comparison that is false for every value, NaN included. Were a compiler
  ever to fold it, only the compile time would change.
  """
  like = jax.lax.stop_gradient(like)
  first = jax.lax.reshape(like, (like.size,))[0]
  false = jax.lax.bitwise_and(jax.lax.ne(first, first), jax.lax.eq(first, first))
  zero = jax.lax.convert_element_type(false, jnp.int32)
  operands = tuple(
    jax.lax.broadcast_in_dim(jax.lax.add(zero, np.int32(j)), (2,), ()) for j in range(k)
  )
  lowest = tuple(np.int32(np.iinfo(np.int32).min) for _ in range(k))
  return tuple(jax.lax.reduce(operands, lowest, _each_max, (0,)))


def _each_max(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """The maxima of a multi-output reduction, one function for every call: jax caches the
  reduction's jaxpr by this function, so an eager call (no ``jit``) reuses its compiled kernel."""
  return tuple(map(jax.lax.max, a, b))


def rows(stacked: jax.Array, first: int, indices: tuple[jax.Array, ...] | None) -> list[jax.Array]:
  """Rows ``first, first + 1, ...`` of ``stacked``, at ``indices`` (opaque) or constant offsets.

  The rows cost no more than the plain per-leaf math under transformations:
  the tangent rows are one static split of the tangent stack, whose transpose
  is one concatenate (a slice per row would transpose to a full-stack update
  per row), and a batched stack is split statically under ``jax.vmap`` (an
  indexed row of a batched operand would become a gather).
  """
  return list(_rows(stacked, first, indices))


def _split(stacked: jax.Array, first: int, axis: int) -> list[jax.Array]:
  shape = stacked.shape[:axis] + stacked.shape[axis + 1 :]
  k = stacked.shape[axis]
  parts = jax.lax.split(stacked, (first,) + (1,) * (k - first) if first else (1,) * k, axis)
  return [jax.lax.reshape(p, shape) for p in parts[1 if first else 0 :]]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _rows(stacked, first, indices):
  if indices is None:
    return tuple(_split(stacked, first, 0))
  return tuple(_indexed_rows_from(first)(stacked, indices))


@_rows.defjvp
def _rows_jvp(first, primals, tangents):
  stacked, indices = primals
  return _rows(stacked, first, indices), tuple(_split(tangents[0], first, 0))


@functools.cache
def _indexed_rows_from(first: int) -> Callable[..., list[jax.Array]]:
  """Rows ``first, ...`` of a stack at opaque indices, split statically under vmap."""

  @jax.custom_batching.custom_vmap
  def indexed_rows(stacked, indices):
    shape = stacked.shape[1:]
    zero = jnp.zeros((), jnp.int32)  # an array: dynamic_slice stages no conversion of it
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
