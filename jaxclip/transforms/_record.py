"""Recording the norm of every leaf of the updates, for logging."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _reduction, _validation


class RecordNormsState(NamedTuple):
  """State of :func:`record_norms`.

  Attributes:
    leaf_norms: A pytree of the params' structure whose leaves are the norms
      of the last updates' leaves, scalars in float32 (float64 for float64
      params); zeros before the first step. Read it from any chain with
      ``optax.tree.get(opt_state, "leaf_norms")``.
    global_norm: The global norm of the last updates, a scalar of the same
      dtype.
  """

  leaf_norms: Any
  global_norm: jax.Array


def record_norms(
  *,
  ord: int | float | str | None = None,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Passes the updates through unchanged and records each leaf's norm and the global norm.

  .. math::

    \text{leaf\_norms} = (\|t\|)_{t \in g}, \qquad
    \text{global\_norm} = \Big(\textstyle\sum_t \|t\|^2\Big)^{1/2}

  Put it anywhere in a chain to log per-layer gradient norms (before a clip
  to see what comes in, after one to see what goes on). It costs one read of
  the updates: small leaves of one size are reduced together, a few kernels
  for thousands of leaves, and the global norm comes from the same partial
  sums. Sums accumulate in float32 for bfloat16 and float16 leaves.

  Under ``jax.jit`` with sharded updates nothing is needed: XLA all-reduces
  scalars, and every leaf keeps its sharding. Inside ``shard_map``/``pmap``
  pass ``axis_name`` (see ``docs/sharding_args.md``): each leaf's norm is
  then that of the whole leaf, the same on every device.

  Args:
    ord: ``None`` or ``2`` for L2 norms (default), ``1`` or ``inf``; a
      static choice (list it in ``static_args`` under
      ``optax.inject_hyperparams``).
    axis_name: Inside ``shard_map``/``pmap``, the mesh axis (or tuple of
      axes) the updates are sharded over; ``None`` (default) otherwise.
    replicated: Which leaves every device of ``axis_name`` holds in full
      (counted once); inferred under ``check_vma=True``.
    partition_specs: Where the leaves are sharded (``PartitionSpec`` leaves),
      instead of ``replicated``. The three are explained once in
      ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`RecordNormsState`.

  Raises:
    TypeError: if a leaf is an integer or boolean array (its path is named).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = optax.chain(jaxclip.record_norms(), optax.sgd(0.1))
    >>> params = {'w': jnp.zeros(2), 'b': jnp.zeros(1)}
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.array([3., 4.]), 'b': jnp.array([12.])}
    >>> _, state = tx.update(grads, state, params)
    >>> optax.tree.get(state, 'leaf_norms')
    {'b': Array(12., dtype=float32), 'w': Array(5., dtype=float32)}
    >>> optax.tree.get(state, 'global_norm')
    Array(13., dtype=float32)
  """
  ord = _validation.check_ord(ord)

  def init_fn(params):
    acc = _numerics.tree_accumulation_dtype(params)
    return RecordNormsState(
      leaf_norms=jax.tree.map(lambda _: jnp.zeros((), acc), params), global_norm=jnp.zeros((), acc)
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, RecordNormsState, "record_norms")
    numbers = _validation.numeric_leaves(updates, "record_norms")
    norms, total = _reduction.tree_leaf_norms(numbers, ord, axis_name, replicated, partition_specs)
    dtype = state.global_norm.dtype
    norms, total = [n.astype(dtype) for n in norms], total.astype(dtype)
    # In the state's own structure (a tuple stays a tuple when the updates
    # come as a list), so that the state is a lax.scan carry. Leaves are
    # matched by path; a leaf of the params the updates leave out (an
    # integer step, a PRNG key) keeps its last norm.
    flat, structure = jax.tree_util.tree_flatten_with_path(state.leaf_norms)
    where = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(flat)}
    values = [v for _, v in flat]
    for (path, _), n in zip(jax.tree_util.tree_flatten_with_path(updates)[0], norms, strict=True):
      i = where.get(jax.tree_util.keystr(path))
      if i is None:
        raise ValueError(
          "record_norms keeps one norm per leaf of the params given to init, but the "
          f"updates have a leaf at {jax.tree_util.keystr(path) or '<root>'} that the "
          "params have not; init it with params of the updates' structure."
        )
      values[i] = n.astype(jnp.result_type(values[i]))
    return updates, RecordNormsState(leaf_norms=structure.unflatten(values), global_norm=total)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
