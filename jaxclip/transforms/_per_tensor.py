"""The scaffolding shared by the per-tensor adaptive transforms: AdaGC and its two siblings.

A per-tensor rule keeps a few float32 statistics per leaf of the params and
a step count. Each step it reads one number per leaf of the updates (its
norm or its largest ``|x|``), updates the statistics, and rescales each leaf
by a coefficient or two. :func:`per_tensor_transform` does everything but
the rule's arithmetic: validation, matching the statistics to the updates'
leaves by path, the reduction (across devices too), the non-finite guard,
and writing the state back in the structure ``init`` gave it.

The rule's arithmetic is written once, on one leaf's scalars
(:func:`_apply_rule`), and :func:`jaxclip._kernel._platform.map_leaves` runs
it on every leaf: on each leaf's own scalars, which XLA fuses into that
leaf's kernels, or (on XLA:CPU) vmapped once over vectors of every leaf's
scalars. The non-finite guard is one flag for the whole step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _platform, _reduction, _validation


class Step(NamedTuple):
  """What a rule's step sees for one leaf of the updates: float32 scalars.

  Attributes:
    norm: The leaf's ``ord``-norm (its largest ``|x|`` for ``ord=inf``),
      across devices with ``axis_name``.
    global_norm: The ``ord``-norm of the whole tree.
    stats: The leaf's state statistics, one scalar per field.
    prev_count: The step count before this step (int32).
    count: The step count after it (int32, counted from 1).
  """

  norm: jax.Array
  global_norm: jax.Array
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
    # Across devices the shares are summed outside the platform choice; on one
    # device each branch reads them its own way.
    shares = (
      None
      if axis_name is None
      else _reduction.tree_leaf_norms(updates, rule.ord, axis_name, replicated, partition_specs)
    )
    prev_count = state[-1]
    count = optax.safe_increment(prev_count)
    olds = [[_reshaped(values[i], ()) for i in positions] for values, _ in flat_stats]
    args = (leaves, shares, olds, prev_count, count)
    coefficients, news, finite = (
      _platform.on_cpu(
        lambda *a: _apply_rule(rule, *a, on_cpu=True),
        lambda *a: _apply_rule(rule, *a, on_cpu=False),
        *args,
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


def _apply_rule(rule, leaves, shares, olds, prev_count, count, *, on_cpu):
  """``(coefficients per leaf, new stats per field, finite)``: ``rule.step`` on every leaf.

  ``leaf_step`` is the rule on one leaf's scalars, written once;
  :func:`jaxclip._kernel._platform.map_leaves` calls it on each leaf's
  scalars, or (``on_cpu``) vmaps it over vectors of every leaf's, whose
  shares then come from one segment reduction
  (:func:`jaxclip._kernel._platform.share_vector`). Trick ``stacked_rules``:
  off, the rule on each leaf's scalars (``on_cpu`` as if false).
  """
  on_cpu = on_cpu and _platform.is_on("stacked_rules")
  if shares is None:
    shares = _reduction.tree_leaf_norms(leaves, rule.ord, as_vector=on_cpu)
  norms, total = shares
  total = _numerics.saturated_float32(total)
  stacked = _numerics.saturated_float32(jnp.stack(norms) if isinstance(norms, list) else norms)
  finite = _numerics.computed_once(jnp.all(jnp.isfinite(stacked)) & jnp.isfinite(total))

  def leaf_step(share, *old_and_shared):
    *old, total, prev_count, count, finite = old_and_shared
    n = _numerics.saturated_float32(share)
    cs, ns = rule.step(Step(n, total, tuple(old), prev_count, count))
    return tuple(cs), tuple(jnp.where(finite, x, o) for x, o in zip(ns, old, strict=True))

  shared = (total, prev_count, count, finite)
  per_leaf = _platform.map_leaves(leaf_step, [norms, *olds], shared, vectors=on_cpu)
  news = [[ns[f] for _, ns in per_leaf] for f in range(len(olds))]
  return [cs for cs, _ in per_leaf], news, finite
