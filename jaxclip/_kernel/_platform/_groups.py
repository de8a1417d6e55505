"""A tree norm's partial sums: small leaves reduced together, a few reductions per tree.

On every platform: it changes no value (:func:`shares_by_group`), and the
rescued norm's parts are scaled each on its own (:func:`scaled_sums`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _sharding
from jaxclip._kernel._platform._reduce import (
  Term,
  combine_scalars,
  prescaled,
  prescaled_share,
  reduce,
  share,
)
from jaxclip._kernel._platform._stacks import flat_concatenate
from jaxclip._kernel._platform._switch import is_small
from jaxclip._kernel._platform._tricks import is_on
from jaxclip._kernel._shapes import constant_size

# Small leaves of at most _TINY_LEAF elements are added elementwise _GROUP at
# a time, the others concatenated _CHUNK_LEAVES at a time (shares_by_group).
_TINY_LEAF = 64
_GROUP = 32
_CHUNK_LEAVES = 128


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
    return [share(prescaled(x, fn, e), term, op).astype(acc) for x in leaves]
  plan = _group_plan(leaves)
  if all(len(members) == 1 for _, members in plan):
    return [prescaled_share(leaves[m[0]], term, op, fn, e).astype(acc) for _, m in plan]
  return list(_grouped_sums(plan, term, op, acc, fn, leaves, e))


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
      parts.append(prescaled_share(leaves[members[0]], term, op, fn, e))
    elif how == "concat":
      joined = flat_concatenate([leaves[i] for i in members])
      parts.append(prescaled_share(joined, term, op, fn, e))
    else:
      total = _combined(how, [term(prescaled(leaves[i], fn, e)) for i in members], op)
      of_float16 = any(leaves[i].dtype == jnp.float16 for i in members)
      parts.append(reduce(total, op, of_float16=of_float16))
  return tuple(p.astype(acc) for p in parts)


@_grouped_sums.defjvp
def _grouped_sums_jvp(plan, term, op, acc, fn, primals, tangents):
  def plain(leaves, e):
    shares = [
      [share(prescaled(leaves[i], fn, e), term, op).astype(acc) for i in m] for _, m in plan
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
