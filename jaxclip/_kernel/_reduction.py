"""Sharding-aware reductions: one norm of a tree whose leaves are spread over devices."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _platform, _shapes, _sharding
from jaxclip._kernel._typing import AxisName, PyTree


def _leaf_groups(
  tree: PyTree, axis_name: AxisName, replicated: Any, partition_specs: Any
) -> dict[tuple[Any, ...], list[int]]:
  """Leaf indices grouped by the axes they are summed over (and, typed, their vma).

  Leaves of one group can be reduced together: under ``check_vma=True`` they
  also share their type's varying axes, so no cast is needed to add them.
  """
  axes = _sharding.leaf_reduction_axes(tree, axis_name, replicated, partition_specs)
  leaves = jax.tree.leaves(tree)
  typed = _sharding.vma_checked()
  groups: dict[tuple[Any, ...], list[int]] = {}
  for i, (a, x) in enumerate(zip(axes, leaves, strict=True)):
    groups.setdefault((a, _sharding.varying_axes(x) if typed else frozenset()), []).append(i)
  return groups


def sum_across_devices(
  tree: PyTree,
  partials: Callable[[list[Any]], list[jax.Array]],
  axis_name: AxisName,
  replicated: Any = None,
  partition_specs: Any = None,
  *,
  op: str = "sum",
  dtype: Any = jnp.float32,
) -> jax.Array:
  """The total over every device of scalars computed from the leaves of ``tree``.

  ``partials(leaves)`` maps a list of leaves to a list of scalars whose sum
  (``op="max"``: maximum) is theirs. Leaves are grouped by the axes they are
  shards over (see :func:`leaf_reduction_axes`); each group's local sum is
  ``psum``-ed over its axes, one scalar all-reduce per group, and a
  replicated leaf is added once. A maximum takes one ``pmax`` over every
  axis, since a maximum is unchanged by repeats. ``dtype`` is the dtype of an
  empty tree's zero.
  """
  leaves = jax.tree.leaves(tree)
  totals = []
  for (axes, _), members in _leaf_groups(tree, axis_name, replicated, partition_specs).items():
    parts = partials([leaves[i] for i in members])
    if not parts:
      continue
    local = _platform.combine_scalars(parts, op)
    totals.append(jax.lax.psum(local, axes) if axes and op == "sum" else local)
  if not totals:
    return jnp.zeros((), dtype)
  total = _platform.combine_scalars(totals, op)
  return jax.lax.pmax(total, _sharding.axis_names(axis_name)) if op == "max" else total


def tree_norm(
  tree: Any,
  ord: float = 2,
  axis_name: AxisName | None = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> jax.Array:
  """The global ``ord``-norm of every leaf of ``tree`` together.

  For ``ord=2`` this is ``sqrt(sum_leaves(sum(|x|**2)))`` with one square root
  at the end (never a norm per leaf squared back). Empty trees give ``0``.
  The partial sums are :func:`jaxclip._kernel._platform.shares_by_group`.
  On CUDA GPUs a 2-norm of float32/bfloat16 leaves whole on one device is
  :func:`jaxclip._kernel._platform.cuda_norm` instead (one kernel, no
  conditional), in processes that have a CUDA backend.

  With ``axis_name`` the partial sums (max for ``ord=inf``) are combined by a
  scalar ``psum`` (``pmax``) before the root, replicated leaves counted once;
  see ``docs/sharding_args.md`` and :func:`leaf_reduction_axes`.
  """
  if axis_name is None:
    _no_device_args(replicated, partition_specs)
    if ord == 2 and _platform.cuda_in_process() and _platform.is_on("cuda_norm"):
      arrays = [_numerics.as_array(x) for x in jax.tree.leaves(tree)]
      if _platform.cuda_norm_applies(arrays):
        # A new function per trace: jax caches a branch's trace by its function, and the
        # kernel's form depends on the tricks switched off (jaxclip.platform.without).
        return _platform.on_cuda(
          lambda a: _platform.cuda_norm(a),
          lambda a: _plain_tree_norm(a, ord, None, None, None),
          arrays,
        )
  return _plain_tree_norm(tree, ord, axis_name, replicated, partition_specs)


def _plain_tree_norm(
  tree: Any,
  ord: float,
  axis_name: AxisName | None,
  replicated: Any,
  partition_specs: Any,
) -> jax.Array:
  """:func:`tree_norm` as XLA's reductions, rescued by a ``lax.cond`` (every platform)."""
  acc = _numerics.tree_accumulation_dtype(tree)
  op, term = _numerics.norm_op(ord), _numerics.norm_term(ord)

  def total_of(tree, term, op, scale=None):
    def partials(leaves):
      return _platform.shares_by_group(
        [_numerics.as_array(x) for x in leaves], term, op, acc, scale
      )

    if axis_name is None:
      parts = partials(jax.tree.leaves(tree))
      return _platform.combine_scalars(parts, op) if parts else jnp.zeros((), acc)
    return sum_across_devices(
      tree, partials, axis_name, replicated, partition_specs, op=op, dtype=acc
    )

  total = total_of(tree, term, op)
  leaves = jax.tree.leaves(tree)
  if ord == math.inf or _tree_size(leaves) == 0:
    return total if ord != 2 else _numerics.safe_sqrt(total)

  def rescue():
    if axis_name is None:
      return _numerics.combine_scaled(
        *_platform.scaled_sums(
          [_numerics.as_array(x) for x in leaves],
          term,
          _numerics.max_term,
          acc,
          _numerics.scaled_down,
          _numerics.scale_exponent,
        ),
        ord,
      )
    # The maximum only picks the power of two (the norm is 2**e * sqrt(s) for
    # any e), so no derivative goes through it, nor through its pmax.
    m = total_of(jax.lax.stop_gradient(tree), _numerics.max_term, "max")
    e = _numerics.scale_exponent(m)
    s = total_of(tree, term, "sum", (_numerics.scaled_down, e))
    return _numerics.scaled_norm(m, s, e, ord)

  return _numerics.rescued_norm(total, ord, _tree_size(leaves), rescue)


def _tree_size(leaves: list[Any]) -> int | None:
  """The number of entries of ``leaves`` together (``None`` if one is symbolic)."""
  sizes = [_shapes.constant_size(x) for x in leaves]
  return None if None in sizes else sum(sizes)


def _no_device_args(replicated: Any, partition_specs: Any) -> None:
  if replicated is not None or partition_specs is not None:
    raise ValueError(
      "replicated= and partition_specs= only have a meaning together with axis_name=."
    )


def mean_across_devices(x: jax.Array, axis_name: AxisName | None) -> jax.Array:
  """``x`` averaged over the devices of ``axis_name`` (``x`` itself without one)."""
  return x if axis_name is None else jax.lax.pmean(x, _sharding.axis_names(axis_name))


def any_across_devices(flag: jax.Array, axis_name: AxisName | None) -> jax.Array:
  """Whether the boolean ``flag`` is true on any device of ``axis_name``."""
  if axis_name is None:
    return flag
  return jax.lax.pmax(jnp.asarray(flag).astype(jnp.int32), _sharding.axis_names(axis_name)) > 0


def tree_leaf_norms(
  tree: Any,
  ord: float = 2,
  axis_name: AxisName | None = None,
  replicated: Any = None,
  partition_specs: Any = None,
  *,
  as_vector: bool = False,
) -> tuple[Any, jax.Array]:
  """``(norms, global_norm)``: each leaf's ``ord``-norm and the norm of them all.

  From :func:`tree_leaf_shares` (one pass), their roots for ``ord=2``. Where a
  leaf's share or the total overflowed or underflowed
  (:func:`jaxclip._kernel._numerics.needs_rescaling`), every leaf is
  recomputed scaled by its own maximum magnitude (one ``lax.cond``), and
  the total from the scaled shares: no norm of finite leaves is ``inf``.
  With ``as_vector`` (programs lowered for CPU) the norms come as one vector,
  rescued by segment reductions (:func:`jaxclip._kernel._platform.scaled_leaf_sums`);
  otherwise as a list of scalars, each leaf rescued by its own plain math.
  """
  totals, total = tree_leaf_shares(
    tree, ord, axis_name, replicated, partition_specs, as_vector=as_vector
  )
  leaves = jax.tree.leaves(tree)
  if ord == math.inf or not leaves:
    return totals, total
  needs_total = _numerics.needs_rescaling(total, _tree_size(leaves))
  if not isinstance(totals, jax.Array):  # a list: other platforms, or across devices
    return _leaf_norms_one_by_one(
      tree, ord, axis_name, replicated, partition_specs, totals, total, needs_total
    )
  root = _numerics.safe_sqrt if ord == 2 else (lambda t: t)
  vector = totals
  needs = _numerics.needs_rescaling(vector, [_shapes.constant_size(x) for x in leaves])

  def fast(vector, total, needs):
    return root(vector), root(total)

  def slow(vector, total, needs):
    m, e, s = _platform.scaled_leaf_sums(
      [_numerics.as_array(x) for x in leaves],
      _numerics.norm_term(ord),
      _numerics.max_term,
      vector.dtype,
      _numerics.scaled_down,
      _numerics.scale_exponent,
    )
    norms = jnp.where(needs, _numerics.scaled_norm(m, s, e, ord), root(vector))
    # The total from the scaled shares, each relative to the largest maximum's exponent.
    big = jnp.max(m)
    top = _numerics.scale_exponent(big)
    power = e - top if ord == 1 else 2 * (e - top)
    shares = jnp.where(m > 0, _numerics.times_pow2(s, power), 0)
    return norms, _numerics.scaled_norm(big, jnp.sum(shares), top, ord)

  return _platform.cond(jnp.any(needs) | needs_total, slow, fast, vector, total, needs)


def _leaf_norms_one_by_one(
  tree, ord, axis_name, replicated, partition_specs, totals, total, needs_total
) -> tuple[list[jax.Array], jax.Array]:
  """:func:`tree_leaf_norms` as a list of scalars: no vector is stacked, split or segmented.

  What programs lowered for platforms other than CPU run (and every program
  with ``axis_name``): each leaf's rescue is its own plain math, under one
  ``lax.cond`` for the tree.
  """
  leaves, treedef = jax.tree.flatten(tree)
  root = _numerics.safe_sqrt if ord == 2 else (lambda t: t)
  needs = [
    _numerics.any_needs_rescaling(_shapes.constant_size(x))(t)
    for t, x in zip(totals, leaves, strict=True)
  ]
  flag = functools.reduce(jnp.logical_or, needs, needs_total)

  def fast(totals, total):
    return [root(t) for t in totals], root(total)

  def slow(totals, total):
    if axis_name is None:
      # One jitted call per leaf: a cached equation each, whatever the leaf.
      parts = [
        _one_leaf_scaled(ord)(_numerics.as_array(x), t) for x, t in zip(leaves, totals, strict=True)
      ]
      m, e, s = (list(p) for p in zip(*parts, strict=True))
    else:
      # The maxima only pick the powers of two: no derivative goes through them.
      m, _ = tree_leaf_shares(
        jax.lax.stop_gradient(tree),
        math.inf,
        axis_name,
        replicated,
        partition_specs,
        term=_numerics.max_term,
      )
      e = [_numerics.scale_exponent(mi) for mi in m]
      scaled = treedef.unflatten(
        [_numerics.scaled_down(_numerics.as_array(x), ei) for x, ei in zip(leaves, e, strict=True)]
      )
      s, _ = tree_leaf_shares(scaled, ord, axis_name, replicated, partition_specs)
      s = [si.astype(t.dtype) for si, t in zip(s, totals, strict=True)]
    # The total from the scaled shares, each relative to the largest maximum's exponent.
    big = functools.reduce(jax.lax.max, m)
    top = _numerics.scale_exponent(big)
    out = [
      _one_leaf_rescued(ord)(nd, mi, si, ei, t, top)
      for nd, mi, si, ei, t in zip(needs, m, s, e, totals, strict=True)
    ]
    norms, shares = (list(p) for p in zip(*out, strict=True))
    return norms, _numerics.scaled_norm(big, functools.reduce(jax.lax.add, shares), top, ord)

  return _platform.cond(flag, slow, fast, list(totals), total)


@_platform.cache(maxsize=8)
def _one_leaf_scaled(ord):
  """``(max, exponent, scaled share)`` of one leaf, in its fast share ``t``'s dtype (jitted)."""

  def scaled(x, t):
    m = _platform.share(jax.lax.stop_gradient(x), _numerics.max_term, "max").astype(t.dtype)
    e = _numerics.scale_exponent(m)
    s = _platform.share(_numerics.scaled_down(x, e), _numerics.norm_term(ord), "sum")
    return m, e, s.astype(t.dtype)

  return jax.jit(scaled)


@_platform.cache(maxsize=8)
def _one_leaf_rescued(ord):
  """``(norm, share of the total at exponent top)`` of one leaf from its scaled parts (jitted)."""

  def rescued(needs, m, s, e, t, top):
    root = _numerics.safe_sqrt(t) if ord == 2 else t
    norm = jnp.where(needs, _numerics.scaled_norm(m, s, e, ord), root)
    power = e - top if ord == 1 else 2 * (e - top)
    return norm, jnp.where(m > 0, _numerics.times_pow2(s, power), 0)

  return jax.jit(rescued)


def tree_leaf_shares(
  tree: Any,
  ord: float = 2,
  axis_name: AxisName | None = None,
  replicated: Any = None,
  partition_specs: Any = None,
  *,
  as_vector: bool = False,
  term: Any = None,
) -> tuple[Any, jax.Array]:
  """``(shares, total)``: each leaf's share of the ``ord``-norm, and the tree's.

  The shares are ``sum |x|**2`` (no square root yet: a caller may take it
  once, on a vector of them), ``sum |x|`` or ``max |x|``
  (:func:`jaxclip._kernel._numerics.leaf_norm_shares`), one read of the
  leaves: the total is computed from them, not by a second pass. With
  ``as_vector`` (for programs lowered for CPU, without ``axis_name``) they
  come as one vector (:func:`jaxclip._kernel._platform.share_vector`).

  With ``axis_name`` each leaf's share is that of the whole leaf across the
  devices, as :func:`tree_norm` counts it (``replicated``,
  ``partition_specs``): the shares of one group of leaves are ``psum``-ed as
  one vector, one all-reduce per group (one ``pmax`` of every leaf's maximum
  for ``ord=inf``).
  """
  acc = _numerics.tree_accumulation_dtype(tree)
  leaves = jax.tree.leaves(tree)
  op = _numerics.norm_op(ord)
  if axis_name is None:
    _no_device_args(replicated, partition_specs)
    if as_vector:
      leaves = [_numerics.as_array(x) for x in leaves]
      vector = _platform.share_vector(leaves, term or _numerics.norm_term(ord), op, acc)
      return vector, jnp.max(vector) if op == "max" else jnp.sum(vector)
    totals = _numerics.leaf_norm_shares(leaves, ord, acc, term)
  else:
    totals: list[Any] = [None] * len(leaves)
    for (axes, _), members in _leaf_groups(tree, axis_name, replicated, partition_specs).items():
      parts = _numerics.leaf_norm_shares([leaves[i] for i in members], ord, acc, term)
      if axes and op == "sum":
        summed = jax.lax.psum(jnp.stack(parts), axes)
        parts = [summed[j] for j in range(len(members))]
      for i, p in zip(members, parts, strict=True):
        totals[i] = p
    if op == "max" and totals:
      maxed = jax.lax.pmax(jnp.stack(totals), _sharding.axis_names(axis_name))
      totals = [maxed[j] for j in range(len(totals))]
  total = _platform.combine_scalars(totals, op) if totals else jnp.zeros((), acc)
  return list(totals), total
