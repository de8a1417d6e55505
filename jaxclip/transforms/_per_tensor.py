"""The scaffolding shared by the per-tensor adaptive transforms: AdaGC and its two siblings.

A per-tensor rule keeps a few float32 statistics per leaf of the params and
a step count. Each step it reads one number per leaf of the updates (its
norm or its largest ``|x|``), updates the statistics, and rescales each leaf
by a coefficient or two. :func:`per_tensor_transform` does everything but
the rule's arithmetic: validation, matching the statistics to the updates'
leaves by path, the reduction (across devices too), the non-finite guard,
and writing the state back in the structure ``init`` gave it.

The rule's arithmetic is written once, on scalars, and runs on every leaf's
scalars at once: on XLA:CPU on vectors of every leaf's statistics, read back
at opaque indices so that the leaves of one shape share one kernel
(:func:`_stacked_rule`); elsewhere on each leaf's own scalars, which XLA fuses
into that leaf's kernels (:func:`_leaf_rule`). The non-finite guard is one
flag for the whole step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _platform, _reduction, _validation


class Step(NamedTuple):
  """What a rule's step sees for one leaf of the updates: float32 scalars.

  Attributes:
    stat: The leaf's statistic (its ``ord``-norm), across devices with
      ``axis_name``.
    total: The statistic of the whole tree (the global norm, or the largest
      ``|x|``), a float32 scalar.
    stats: The leaf's state statistics, one scalar per field.
    prev_count: The step count before this step (int32).
    count: The step count after it (int32, counted from 1).
  """

  stat: jax.Array
  total: jax.Array
  stats: tuple[jax.Array, ...]
  prev_count: jax.Array
  count: jax.Array


class Rule(NamedTuple):
  """A per-tensor rule.

  Attributes:
    fn_name: The public name, for error messages.
    state_type: Its state: one per-leaf statistic per field, then the count.
    ord: The per-leaf statistic read from the updates: ``2`` or ``inf``.
    step: ``step(Step) -> (coefficients, new_stats)``: tuples of the leaf's
      scalars.
    apply: ``apply(x, *coefficients) -> x``: one leaf rescaled by its
      coefficients (scalars), in ``x``'s dtype.
  """

  fn_name: str
  state_type: type
  ord: float
  step: Callable[[Step], tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]]
  apply: Callable[..., jax.Array]


def _path(path: Any) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _positions(stat: Any, updates: Any, rule: Rule, field: str) -> list[int]:
  """Where each leaf of ``updates`` finds its statistic among ``stat``'s leaves (by path).

  ``ValueError`` naming the path for a leaf of the updates that the params
  given to ``init`` had not, or a float leaf of theirs the updates lack.
  """
  flat = jax.tree_util.tree_flatten_with_path(stat)[0]
  where = {_path(p): i for i, (p, _) in enumerate(flat)}
  optional = {i for i, (_, v) in enumerate(flat) if jnp.shape(v) == _NOT_FLOAT}
  positions = []
  for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]:
    i = where.get(_path(path))
    if i is None:
      raise ValueError(
        f"{rule.fn_name} keeps one {field} per leaf of the params given to init, "
        f"but the updates have a leaf at {_path(path)} that the params have not; "
        "init it with params of the updates' structure."
      )
    positions.append(i)
  used = set(positions)
  missing = [p for p, i in where.items() if i not in used and i not in optional]
  if missing:
    raise ValueError(
      f"{rule.fn_name} keeps one {field} per leaf of the params given to init, "
      f"but the updates lack the leaves at {', '.join(missing[:5])}"
      f"{' ...' if len(missing) > 5 else ''}; pass updates of the params' structure "
      "(optax.masked hands its inner transform the same masked tree at init and "
      "update)."
    )
  return positions


# The shape of the statistic init keeps for a params leaf that is not a
# float (an integer step, a flag, a PRNG key): the updates may leave such a
# leaf out (its statistic is then kept), where a missing float leaf is an
# error. Its shape tells the two apart when the state is traced.
_NOT_FLOAT = (1,)


def _init_stat(leaf: Any) -> jax.Array:
  dtype = getattr(leaf, "dtype", None)
  try:
    is_float = jnp.issubdtype(dtype if dtype is not None else jnp.result_type(leaf), jnp.inexact)
  except TypeError:
    is_float = False
  return jnp.zeros(() if is_float else _NOT_FLOAT, jnp.float32)


def _reshaped(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``x`` reshaped, with no op traced where it has the shape already."""
  return x if jnp.shape(x) == shape else jnp.reshape(x, shape)


def _vector(scalars: Sequence[jax.Array]) -> jax.Array:
  """The scalars (or 1-vectors) as one float32 vector: one op, whatever their number."""
  if not scalars:
    return jnp.zeros((0,), jnp.float32)
  return jnp.stack([_reshaped(jnp.asarray(s), ()).astype(jnp.float32) for s in scalars])


def per_tensor_transform(
  rule: Rule, axis_name: Any, replicated: Any, partition_specs: Any
) -> optax.GradientTransformationExtraArgs:
  """The :class:`optax.GradientTransformationExtraArgs` of ``rule``.

  A step whose statistics are not all finite (a NaN or inf gradient) keeps
  the state as it was, count included; its updates pass through.
  """
  fields = rule.state_type._fields
  stat_fields = fields[:-1]

  def init_fn(params):
    # A tree of its own per field: a state whose fields share a buffer cannot
    # be donated (jax.jit(..., donate_argnums=...) refuses to donate it twice).
    stats = [jax.tree.map(_init_stat, params) for _ in stat_fields]
    return rule.state_type(*stats, jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, rule.state_type, rule.fn_name)
    updates = _validation.numeric_leaves(updates, rule.fn_name)
    old_stats = [getattr(state, f) for f in stat_fields]
    positions = _positions(old_stats[0], updates, rule, stat_fields[0])
    flat_stats = [jax.tree.flatten(s) for s in old_stats]
    for (values, _), field in zip(flat_stats, stat_fields, strict=True):
      if len(values) != len(flat_stats[0][0]):
        raise ValueError(
          f"{rule.fn_name}'s state has a {field} of another structure than its {stat_fields[0]}."
        )
    leaves, treedef = jax.tree.flatten(updates)
    # Across devices the parts are summed outside the platform choice; on one
    # device each branch reads them its own way.
    parts = (
      None
      if axis_name is None
      else _reduction.tree_leaf_parts(updates, rule.ord, axis_name, replicated, partition_specs)
    )
    prev_count = state[-1]
    count = optax.safe_increment(prev_count)
    olds = [[_reshaped(values[i], ()) for i in positions] for values, _ in flat_stats]
    coefficients, news, finite = (
      _platform.on_cpu(
        lambda ls, ps, ol: _stacked_rule(rule, ls, ps, ol, prev_count, count),
        lambda ls, ps, ol: _leaf_rule(rule, ls, ps, ol, prev_count, count),
        leaves,
        parts,
        olds,
      )
      if positions
      else ([], [[] for _ in olds], jnp.ones((), jnp.bool_))
    )
    written = [list(values) for values, _ in flat_stats]
    for f, values in enumerate(written):
      for j, i in enumerate(positions):
        values[i] = _reshaped(news[f][j], jnp.shape(values[i]))
    count = jnp.where(finite, count, prev_count)
    out = [rule.apply(x, *cs) for x, cs in zip(leaves, coefficients, strict=True)]
    new_stats = [
      jax.tree.unflatten(stat_def, values)
      for (_, stat_def), values in zip(flat_stats, written, strict=True)
    ]
    return jax.tree.unflatten(treedef, out), rule.state_type(*new_stats, count)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _read(rule, leaves, parts):
  """``(stat, total)``: each leaf's part (float32 scalars, or a vector) and the tree's statistic."""
  if parts is None:
    parts = _reduction.tree_leaf_parts(leaves, rule.ord)
  stat, total = parts
  total = jnp.asarray(_numerics.safe_sqrt(total) if rule.ord == 2 else total).astype(jnp.float32)
  return stat, total


def _guard(n, total):
  """The non-finite guard: one flag for the whole step, read by every new statistic."""
  return _numerics.computed_once(jnp.all(jnp.isfinite(n)) & jnp.isfinite(total))


def _leaf_rule(rule, leaves, parts, olds, prev_count, count):
  """The rule on each leaf's own scalars: ``(coefficients per leaf, new stats per field, finite)``.

  XLA fuses each leaf's arithmetic into that leaf's kernels. The rule is
  traced once, as a jitted function that each leaf calls (one equation per
  leaf, and XLA inlines it).
  """
  stat, total = _read(rule, leaves, parts)
  finite = _guard(_vector(stat), total)

  @jax.jit
  def leaf_step(n, old, total, prev_count, count, finite):
    n = n.astype(jnp.float32)
    n = _numerics.safe_sqrt(n) if rule.ord == 2 else n
    cs, ns = rule.step(Step(n, total, old, prev_count, count))
    return tuple(cs), tuple(jnp.where(finite, x, o) for x, o in zip(ns, old, strict=True))

  coefficients = []
  news: list[list[jax.Array]] = [[] for _ in olds]
  for j, n in enumerate(stat):
    old = tuple(jnp.asarray(o[j], jnp.float32) for o in olds)
    cs, ns = leaf_step(jnp.asarray(n), old, total, prev_count, count, finite)
    coefficients.append(cs)
    for out, x in zip(news, ns, strict=True):
      out.append(x)
  return coefficients, news, finite


def _stacked_rule(rule, leaves, parts, olds, prev_count, count):
  """:func:`_leaf_rule` on vectors of every leaf's scalars, read back at opaque indices (XLA:CPU).

  On one device the parts are read as one vector
  (:func:`jaxclip._kernel._numerics.part_vector`: the small leaves' by one
  segment reduction, where a reduction kernel per leaf is slow to compile).
  The rule runs once on vectors, and each result vector is computed by one
  kernel that its readers share: XLA copies cheap elementwise ops into each
  consumer's kernel, so without it every leaf's kernel would recompute the
  whole rule (:func:`jaxclip._kernel._platform.materialized`). Each leaf
  then reads its coefficients and new statistics at indices XLA cannot fold
  (:func:`jaxclip._kernel._platform.entries`), so all the leaves share one
  kernel instead of one per leaf.
  """
  if parts is None:
    vector = _numerics.part_vector(leaves, rule.ord, _numerics.tree_accumulation_dtype(leaves))
    total = jnp.max(vector) if rule.ord == math.inf else jnp.sum(vector)
    parts = (vector, total)
  n, total = _read(rule, leaves, parts)
  n = _vector(n) if isinstance(n, list) else n.astype(jnp.float32)
  finite = _guard(n, total)
  k = n.shape[0]
  n = _numerics.safe_sqrt(n) if rule.ord == 2 else n
  old = tuple(_vector(o) for o in olds)
  cs, ns = rule.step(Step(n, total, old, prev_count, count))
  vectors = [jnp.broadcast_to(c, (k,)) for c in cs] + [
    jnp.broadcast_to(jnp.where(finite, x, o), (k,)) for x, o in zip(ns, old, strict=True)
  ]
  index = _platform.entry_indices(k, n)
  vectors = [_platform.entries(_platform.materialized(v), index) for v in vectors]
  cs, news = vectors[: len(cs)], vectors[len(cs) :]
  return [tuple(c[j] for c in cs) for j in range(k)], news, finite
