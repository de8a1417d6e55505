"""Every leaf's sum as one vector, by one segment reduction (XLA:CPU).

XLA:CPU compiles a reduction kernel per leaf slowly; the small local leaves
are joined and reduced by segment instead: each leaf's share
(:func:`share_vector`), its rescued sums (:func:`scaled_leaf_sums`), a count
(:func:`count_all`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel._platform._reduce import (
  Term,
  combine_scalars,
  plain_reduce,
  prescaled_share,
  share,
)
from jaxclip._kernel._platform._stacks import flat_concatenate
from jaxclip._kernel._platform._switch import on_cpu, segmentable
from jaxclip._kernel._platform._tricks import is_on


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
      prescaled_share(leaves[i], term, "sum", scale_fn, k).astype(acc)
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
