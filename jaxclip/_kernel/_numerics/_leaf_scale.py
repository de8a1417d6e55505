"""Each leaf times a function of its own norm: one per-leaf math, every norm rescued at once."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _platform, _shapes, _sharding
from jaxclip._kernel._numerics._dtypes import as_array
from jaxclip._kernel._numerics._leaf_norms import leaf_norm
from jaxclip._kernel._numerics._rescue import (
  any_needs_rescaling,
  leaf_rescue,
  needs_rescaling,
  rescued,
)
from jaxclip._kernel._numerics._scale import apply_scale
from jaxclip._kernel._numerics._terms import (
  Axes,
  canonical_axes,
  constant_size_of,
  norm_term,
  safe_sqrt,
)


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
    return _leaf_scaler(fn, ord, canonical_axes(len(shape), axes_of(shape)), stacked)

  leaves = [as_array(x) for x in leaves]
  others = None if companions is None else [as_array(c) for c in companions]
  together = None
  arrays = leaves + (others or [])
  if ord != math.inf and all(_shapes.constant_size(a) is not None for a in arrays):

    def together(xs, cs, ops, stacks):  # closes over no traced value (a custom_jvp's argument)
      axes = [canonical_axes(x.ndim, axes_of(x.shape)) for x in xs]
      return _scaled_with_one_rescue(fn, ord, axes, xs, cs, tuple(ops), stacks)

  return _platform.scale_each_leaf(scaler, leaves, others, tuple(operands), together)


def _scaled_with_one_rescue(fn, ord, axes, leaves, companions, operands, stacks) -> list[jax.Array]:
  """:func:`scale_by_leaf_norms`' result, every norm rescued under one ``lax.cond``.

  Each leaf's (and companion's) fast sums come from one pass; where any of
  them :func:`needs_rescaling`, the slow branch recomputes the norms scaled
  (:func:`leaf_rescue`). Each leaf is then scaled by ``fn`` of its norms
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
      lambda ax: leaf_rescue(ord, ax),
      plan,
      [arrays[i] for i in joined],
      [sums[i] for i in joined],
      [axes[i] for i in joined],
    )
    by_part: dict[Any, list[jax.Array]] = {}
    for dtype, part in zip(group_dtypes, parts, strict=True):
      by_part.setdefault(dtype, []).append(part)
    rows = [_platform.flat_concatenate(by_part[dtype]) for dtype in by_dtype]
    return rows, [leaf_rescue(ord, axes[i])(arrays[i], sums[i]) for i in single]

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
  (:func:`rescued`: a maximum, then the sum of the terms scaled by a power of
  two; the same value as the fast sum's wherever that one is exact). Two
  reductions per stack and no ``lax.cond``: a ``cond`` per stack was six
  kernels per stack on XLA:CPU, and a ``vmap`` of the one-leaf function
  batches the ``cond``'s predicate, which makes it a ``select``.
  """

  def norm(x, ax):
    if stacked and ord != math.inf:
      return rescued(x, ord, ax)
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
