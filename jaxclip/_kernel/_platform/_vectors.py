"""A function of one leaf's scalars on every leaf: the per-tensor rules' vector path (XLA:CPU).

A per-tensor rule (:mod:`jaxclip.transforms._per_tensor`) is written once,
on one leaf's scalars. Elsewhere it runs on each leaf's scalars and fuses
into that leaf's kernels; on XLA:CPU, where each distinct fusion is one more
kernel to compile, it is vmapped once over vectors of every leaf's scalars
and each leaf reads its entries at opaque indices (:func:`map_leaves`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel._platform._stacks import opaque_indices, rows

# At most this many opaque indices read a vector's entries (entry_indices): a
# reduction with thousands of outputs compiles in time quadratic in their
# number, so a longer vector is read in blocks.
_ENTRY_INDICES = 512


def map_leaves(fn: Callable[..., Any], columns: Sequence[Any], shared: tuple, *, vectors: bool):
  """``(per_leaf, stacked)``: ``fn(*row, *shared)`` for each leaf's ``row`` of ``columns``.

  ``columns`` holds one scalar per leaf each (a list, or a vector); ``fn``
  maps one leaf's scalars and the ``shared`` values to a pair of pytrees of
  scalars: the first is returned for each leaf (``per_leaf``, a list), the
  second as vectors of every leaf's entries (``stacked``, one pytree).

  With ``vectors=False`` (what other platforms run) ``fn`` is one jitted
  function called on each leaf's scalars, which XLA fuses into that leaf's
  kernels, and ``stacked`` stacks its scalars. With ``vectors=True``
  (XLA:CPU) ``fn`` is vmapped once over vectors of every leaf's scalars:
  ``stacked`` is its result, and each per-leaf result vector is computed by
  one kernel (:func:`materialized`) whose entries each leaf reads at opaque
  indices (:func:`entries`), so all the leaves share one kernel.
  """
  if not vectors:
    step = jax.jit(fn)
    outs = [step(*row, *shared) for row in zip(*columns, strict=True)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(s for _, s in outs))
    return [p for p, _ in outs], stacked
  columns = [jnp.stack(c) if isinstance(c, list) else c for c in columns]
  per_leaf, stacked = jax.vmap(fn, in_axes=(0,) * len(columns) + (None,) * len(shared))(
    *columns, *shared
  )
  k = columns[0].shape[0]
  flat, treedef = jax.tree.flatten(per_leaf)
  index = entry_indices(k, columns[0])
  read = [entries(materialized(v), index) for v in flat]
  return [jax.tree.unflatten(treedef, [r[j] for r in read]) for j in range(k)], stacked


def materialized(v: jax.Array) -> jax.Array:
  """``v``, computed by one kernel that all its readers share.

  XLA copies cheap elementwise ops into the kernel of each consumer: a
  vector read one entry per leaf would be recomputed in every leaf's kernel.
  A maximum over two equal copies is exact (NaN included) and is a
  reduction, which XLA does not copy.
  """
  return jnp.max(jnp.broadcast_to(v, (2,) + v.shape), axis=0)


def entry_indices(k: int, like: jax.Array) -> tuple[jax.Array, ...]:
  """The :func:`opaque_indices` with which :func:`entries` reads a ``k``-vector."""
  return opaque_indices(max(min(k, _ENTRY_INDICES), math.isqrt(k - 1) + 1), like)


def entries(v: jax.Array, index: tuple[jax.Array, ...]) -> list[jax.Array]:
  """The entries of the vector ``v``, each read at opaque indices: one kernel for all.

  A vector longer than ``index`` is read as a matrix of rows of
  ``len(index)``: a row at an opaque index, computed once by a kernel of its
  own (:func:`materialized`), then its entry at another. XLA:CPU orders its
  kernels by comparing each one's buffers with every earlier one's (time
  quadratic in the buffers a program's kernels read and write): a leaf's
  kernel that reads its row and one index, not the matrix and two, is one
  buffer fewer per read (``benchmarks/results/compile.md``).
  """
  k, b = v.shape[0], len(index)
  if k <= b:
    return rows(v, 0, index[:k])
  blocks = -(-k // b)
  matrix = jnp.reshape(jnp.pad(v, (0, blocks * b - k)), (blocks, b))
  # Each row is computed once (materialized): a leaf's kernel then reads its
  # row and one index, not the matrix and two.
  read = rows(matrix, 0, index[:blocks])
  return [x for row in read for x in rows(materialized(row), 0, index)][:k]
