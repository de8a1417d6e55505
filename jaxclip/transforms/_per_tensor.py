"""The scaffolding shared by the per-tensor adaptive transforms: AdaGC and its two siblings.

A per-tensor rule keeps a few float32 statistics per leaf of the params and
a step count. Each step it reads one number per leaf of the updates (its
norm or its largest ``|x|``), updates the statistics, and rescales each leaf
by a coefficient or two. :func:`per_tensor_transform` does everything but
the rule's arithmetic: validation, matching the statistics to the updates'
leaves by path, the reduction (across devices too), the non-finite guard,
and writing the state back in the structure ``init`` gave it.

The rule's arithmetic is written once, elementwise: on XLA:CPU it runs on
vectors with one entry per leaf (a few ops whatever the number of leaves),
elsewhere on each leaf's scalars. The non-finite guard is one flag computed
once, so that no per-leaf op reads a value combined from every leaf (which
made XLA's compile time grow with the square of the leaf count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _platform, _reduction, _validation


class Step(NamedTuple):
  """What a rule's step sees: vectors with one float32 entry per leaf of the updates.

  Attributes:
    stat: Each leaf's statistic (its ``ord``-norm), across devices with
      ``axis_name``.
    total: The statistic of the whole tree (the global norm, or the largest
      ``|x|``), a float32 scalar.
    stats: The rule's per-leaf state statistics, one vector per field.
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
    step: ``step(Step) -> (coefficients, new_stats)``: tuples of per-leaf
      vectors.
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


def _vector(scalars: Sequence[jax.Array]) -> jax.Array:
  """The float32 scalars (or 1-vectors) as one vector."""
  if not scalars:
    return jnp.zeros((0,), jnp.float32)
  return jnp.concatenate([jnp.reshape(s, (1,)).astype(jnp.float32) for s in scalars])


def _entries(vector: jax.Array) -> list[jax.Array]:
  """The entries of ``vector`` as scalars, one static slice each."""
  return [jax.lax.index_in_dim(vector, i, keepdims=False) for i in range(vector.shape[0])]


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
    zeros = jax.tree.map(_init_stat, params)
    return rule.state_type(*([zeros] * len(stat_fields)), jnp.zeros((), jnp.int32))

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
    stat, total = _reduction.tree_leaf_parts(
      updates, rule.ord, axis_name, replicated, partition_specs
    )
    stat = [jnp.asarray(x).astype(jnp.float32) for x in stat]  # before the square roots
    total = jnp.asarray(_numerics.safe_sqrt(total) if rule.ord == 2 else total).astype(jnp.float32)
    prev_count = state[-1]
    count = optax.safe_increment(prev_count)
    read = [[jnp.reshape(values[i], ()) for i in positions] for values, _ in flat_stats]
    # The guard: one flag for the whole step, read by every new statistic.
    finite = jnp.all(jnp.isfinite(_vector(stat))) & jnp.isfinite(total)
    finite = _numerics.computed_once(finite)
    per_leaf, new = _platform.on_cpu(
      lambda *a: _vector_step(rule, *a),
      lambda *a: _scalar_step(rule, *a),
      stat,
      total,
      read,
      prev_count,
      count,
      finite,
    )
    count = jnp.where(finite, count, prev_count)

    out = [rule.apply(x, *cs) for x, *cs in zip(leaves, *per_leaf, strict=True)]
    written = []
    for (values, stat_def), entries in zip(flat_stats, new, strict=True):
      values = list(values)
      for i, v in zip(positions, entries, strict=True):
        values[i] = jnp.reshape(v, jnp.shape(values[i]))
      written.append(jax.tree.unflatten(stat_def, values))
    return jax.tree.unflatten(treedef, out), rule.state_type(*written, count)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _vector_step(
  rule: Rule,
  stat: list[jax.Array],
  total: jax.Array,
  read: list[list[jax.Array]],
  prev_count: jax.Array,
  count: jax.Array,
  finite: jax.Array,
) -> tuple[list[list[jax.Array]], list[list[jax.Array]]]:
  """``(coefficients, new_stats)``, lists (one per field) of per-leaf scalars.

  On XLA:CPU the rule's arithmetic runs once on vectors of all the leaves:
  a few kernels whatever their number, where one set of scalar ops per leaf
  costs many small kernels to compile. Each leaf then reads its entries
  through a slice. XLA copies cheap elementwise ops into the kernel of each
  of their consumers, so the whole vector arithmetic would be recomputed in
  every leaf's slice (compile time quadratic in the leaves); it does not
  copy a division, and one by a one it cannot fold (``min(count, 1)``, the
  count being at least 1) makes each vector one kernel, read by all, with
  its bits unchanged.
  """
  stat = _vector(stat)
  stat = _numerics.safe_sqrt(stat) if rule.ord == 2 else stat  # one square root for all
  step = Step(stat, total, tuple(_vector(r) for r in read), prev_count, count)
  coefficients, new = rule.step(step)
  new = [jnp.where(finite, n, o) for n, o in zip(new, step.stats, strict=True)]
  one = jax.lax.convert_element_type(jnp.minimum(count, 1), jnp.float32)
  return ([_entries(c / one) for c in coefficients], [_entries(n / one) for n in new])


def _scalar_step(
  rule: Rule,
  stat: list[jax.Array],
  total: jax.Array,
  read: list[list[jax.Array]],
  prev_count: jax.Array,
  count: jax.Array,
  finite: jax.Array,
) -> tuple[list[list[jax.Array]], list[list[jax.Array]]]:
  """What :func:`_vector_step` computes, leaf by leaf (other platforms)."""
  coefficients: list[list[jax.Array]] = []
  new: list[list[jax.Array]] = [[] for _ in read]
  for j, n in enumerate(stat):
    n = _numerics.safe_sqrt(n) if rule.ord == 2 else n
    old = tuple(r[j] for r in read)
    cs, ns = rule.step(Step(n, total, old, prev_count, count))
    if not coefficients:
      coefficients = [[] for _ in cs]
    for lst, c in zip(coefficients, cs, strict=True):
      lst.append(c)
    for lst, x, o in zip(new, ns, old, strict=True):
      lst.append(jnp.where(finite, x, o))
  return coefficients, new
