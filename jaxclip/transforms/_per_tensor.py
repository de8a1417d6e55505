"""The scaffolding shared by the per-tensor adaptive transforms: AdaGC and its two siblings.

A per-tensor rule keeps a few float32 statistics per leaf of the params and
a step count. Each statistic is one vector with an entry per leaf of the
params (:class:`LeafStats`): a tree of scalars would be thousands of buffers
in and out of the step, and XLA:CPU's compile time grows as the square of a
program's buffer uses (``benchmarks/results/compile.md``). Each step it
reads one number per leaf of the updates (its norm or its largest ``|x|``),
updates the statistics, and rescales each leaf by a coefficient or two.
:func:`per_tensor_transform` does everything but the rule's arithmetic:
validation, matching the statistics to the updates' leaves by path, the
reduction (across devices too), the non-finite guard, and writing the state
back in the layout ``init`` gave it.

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
import numpy as np
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


class _Layout:
  """Which leaf of the params each entry of a :class:`LeafStats` belongs to (static).

  Equal and hashed by the params' tree structure and which leaves are floats:
  the leaves' key paths (``keys``) and their strings (``paths``) follow from
  the structure.
  """

  __slots__ = ("treedef", "floats", "keys", "paths", "_hash")

  def __init__(self, treedef: Any, floats: bytes, keys: tuple[tuple[Any, ...], ...]):
    self.treedef, self.floats, self.keys = treedef, floats, keys
    self.paths = tuple(_path(k) for k in keys)
    self._hash = hash((treedef, floats))

  def __eq__(self, other: object) -> bool:
    return self is other or (
      isinstance(other, _Layout) and (self.treedef, self.floats) == (other.treedef, other.floats)
    )

  def __hash__(self) -> int:
    return self._hash

  def __repr__(self) -> str:
    return f"<{len(self.paths)} leaves>"


class LeafStats:
  """One float32 statistic per leaf of the params given to ``init``, in one vector.

  The per-tensor transforms (:func:`jaxclip.adagc`,
  :func:`jaxclip.adaptive_value_clip`, :func:`jaxclip.adaptive_norm_scale`)
  keep each statistic of their state as one of these. It is a pytree of one
  array leaf, ``values``; which leaf of the params each entry belongs to is
  its static structure, so it jits, scans, donates and checkpoints as an
  array does.

  Attributes:
    values: A float32 vector: entry ``i`` belongs to the ``i``-th leaf of the
      params (``jax.tree.leaves`` order).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> tx = jaxclip.adagc(warmup_steps=0)
    >>> state = tx.init({"w": jnp.zeros(2), "b": jnp.zeros(3)})
    >>> _, state = tx.update({"w": jnp.array([3., 4.]), "b": jnp.zeros(3)}, state)
    >>> state.adagc_gamma.values
    Array([0., 5.], dtype=float32)
    >>> state.adagc_gamma.as_tree()
    {'b': Array(0., dtype=float32), 'w': Array(5., dtype=float32)}
  """

  __slots__ = ("values", "layout")

  def __init__(self, values: Any, layout: _Layout):
    self.values, self.layout = values, layout

  def as_tree(self) -> Any:
    """The statistics as a tree of the params' structure, one scalar per leaf."""
    return jax.tree.unflatten(
      self.layout.treedef, [self.values[i] for i in range(len(self.layout.paths))]
    )

  def __eq__(self, other: object) -> bool:
    """Whether both are of one layout with equal values: a bool, for vectors of any length.

    ``values`` may be other than an array (a ``jax.tree.map`` of the state to
    shapes and dtypes): then it is compared by ``==``.
    """
    if not isinstance(other, LeafStats):
      return NotImplemented
    if self.layout != other.layout:
      return False
    a, b = self.values, other.values
    if isinstance(a, jax.Array | np.ndarray) or isinstance(b, jax.Array | np.ndarray):
      return bool(jnp.array_equal(a, b))
    return a == b

  __hash__ = None  # type: ignore[assignment]

  def __repr__(self) -> str:
    return f"LeafStats(values={self.values!r})"


jax.tree_util.register_pytree_with_keys(
  LeafStats,
  lambda s: (((jax.tree_util.GetAttrKey("values"), s.values),), s.layout),
  lambda layout, children: LeafStats(children[0], layout),
  lambda s: ((s.values,), s.layout),
)


def _init_stats(params: Any) -> LeafStats:
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  floats = bytes(_validation.is_float_leaf(leaf) for _, leaf in flat)
  layout = _Layout(treedef, floats, tuple(tuple(p) for p, _ in flat))
  return LeafStats(jnp.zeros(len(flat), jnp.float32), layout)


def _stats(state: Any, rule: Rule, fields: tuple[str, ...]) -> list[LeafStats]:
  """The state's statistics, checked: :class:`LeafStats` of one layout, vectors of its length."""
  stats = [getattr(state, f) for f in fields]
  for stat, field in zip(stats, fields, strict=True):
    if not isinstance(stat, LeafStats):
      raise TypeError(
        f"{rule.fn_name}'s state keeps its {field} as a jaxclip.LeafStats (one vector "
        f"per statistic), got {type(stat).__name__}: pass the state its init returned, "
        "or a checkpoint restored with that state as its target."
      )
    n = len(stat.layout.paths)
    if stat.layout != stats[0].layout or jnp.shape(stat.values) != (n,):
      raise ValueError(
        f"{rule.fn_name}'s state has a {field} of another structure than its {fields[0]}: "
        f"{jnp.shape(stat.values)} values for {n} leaves."
      )
  return stats


def _positions(layout: _Layout, updates: Any, rule: Rule, field: str) -> list[int]:
  """Which entry of the statistics each leaf of ``updates`` reads (by path).

  ``ValueError`` naming the path for a leaf of the updates that the params
  given to ``init`` had not, or a float leaf of theirs the updates lack.
  Updates that unwrap containers the params had (``flax.nnx.Optimizer``
  inits with the params' ``nnx.Variable`` s, at ``['w'].value``, and updates
  with their arrays, at ``['w']``) are read leaf by leaf in order, where
  every leaf's keys are the other's with some left out.
  """
  flat = jax.tree_util.tree_flatten_with_path(updates)[0]
  if len(flat) == len(layout.keys) and all(
    _nested(tuple(path), keys) for (path, _), keys in zip(flat, layout.keys, strict=True)
  ):
    return list(range(len(flat)))
  where = {p: i for i, p in enumerate(layout.paths)}
  positions = []
  for path, _ in flat:
    i = where.get(_path(path))
    if i is None:
      raise ValueError(
        f"{rule.fn_name} keeps one {field} per leaf of the params given to init, "
        f"but the updates have a leaf at {_path(path)} that the params have not; "
        "init it with params of the updates' structure."
      )
    positions.append(i)
  used = set(positions)
  missing = [p for i, p in enumerate(layout.paths) if i not in used and layout.floats[i]]
  if missing:
    raise ValueError(
      f"{rule.fn_name} keeps one {field} per leaf of the params given to init, "
      f"but the updates lack the leaves at {', '.join(missing[:5])}"
      f"{' ...' if len(missing) > 5 else ''}; pass updates of the params' structure "
      "(optax.masked hands its inner transform the same masked tree at init and "
      "update)."
    )
  return positions


def _nested(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
  """Whether one of the key paths ``a`` and ``b`` is the other with some keys left out."""
  short, long = (a, b) if len(a) <= len(b) else (b, a)
  rest = iter(long)
  return all(key in rest for key in short)


def _whole(values: jax.Array, positions: list[int]) -> bool:
  """Whether ``positions`` are every entry of ``values``, in order."""
  return positions == list(range(values.shape[0]))


def _read(values: jax.Array, positions: list[int]) -> jax.Array:
  """The entries at ``positions``, in their order: the vector itself where they are all of it."""
  if _whole(values, positions):
    return values
  return values[np.asarray(positions, np.int32)]


def _written(values: jax.Array, positions: list[int], new: jax.Array) -> jax.Array:
  """``values`` with ``new`` at ``positions``: ``new`` itself where they are all of it."""
  if _whole(values, positions):
    return new
  return values.at[np.asarray(positions, np.int32)].set(new, unique_indices=True)


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
    # A vector of its own per field: a state whose fields share a buffer cannot
    # be donated (jax.jit(..., donate_argnums=...) refuses to donate it twice).
    stats = [_init_stats(params) for _ in stat_fields]
    return rule.state_type(*stats, jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, rule.state_type, rule.fn_name)
    updates = _validation.numeric_leaves(updates, rule.fn_name)
    old_stats = _stats(state, rule, stat_fields)
    positions = _positions(old_stats[0].layout, updates, rule, stat_fields[0])
    prev_count = state[-1]
    count = optax.safe_increment(prev_count)
    if not positions:
      return updates, rule.state_type(*old_stats, count)
    leaves, treedef = jax.tree.flatten(updates)
    # Across devices the shares are summed outside the platform choice; on one
    # device each branch reads them its own way.
    shares = (
      None
      if axis_name is None
      else _reduction.tree_leaf_norms(updates, rule.ord, axis_name, replicated, partition_specs)
    )
    olds = [_read(s.values, positions) for s in old_stats]
    coefficients, news, finite = _platform.on_cpu(
      lambda *a: _apply_rule(rule, *a, on_cpu=True),
      lambda *a: _apply_rule(rule, *a, on_cpu=False),
      leaves,
      shares,
      olds,
      prev_count,
      count,
    )
    count = jnp.where(finite, count, prev_count)
    out = [rule.apply(x, *cs) for x, cs in zip(leaves, coefficients, strict=True)]
    new_stats = [
      LeafStats(_written(s.values, positions, new), s.layout)
      for s, new in zip(old_stats, news, strict=True)
    ]
    return jax.tree.unflatten(treedef, out), rule.state_type(*new_stats, count)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _apply_rule(rule, leaves, shares, olds, prev_count, count, *, on_cpu):
  """``(coefficients per leaf, new statistics as vectors, finite)``: ``rule.step`` on every leaf.

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
  columns = [norms, *(o if on_cpu else list(o) for o in olds)]
  coefficients, news = _platform.map_leaves(leaf_step, columns, shared, vectors=on_cpu)
  return coefficients, list(news), finite
