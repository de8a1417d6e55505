"""One scaffolding for every skip rule: decide, update, zero, select, count."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _reduction, _sharding, _validation


def _zeros_like_maker():
  """``zeros_like(x)``, made once per shape, dtype and layout: one traced op for many leaves.

  On an Explicit mesh the zeros take the leaf's sharding, so leaves of one
  shape but different shardings get zeros of their own.
  """
  made: dict[tuple[Any, ...], jax.Array] = {}

  def zeros_like(x: jax.Array) -> jax.Array:
    key = (x.shape, x.dtype, _sharding.layout(x))
    if key not in made:
      made[key] = jnp.zeros_like(x)
    return made[key]

  return zeros_like


def _selector(skip: jax.Array):
  """``select(old, new)``: ``old`` where ``skip`` else ``new``, keeping ``new``'s dtype.

  ``skip`` is computed once for all the leaves (see
  :func:`jaxclip._kernel._numerics.computed_once`) and broadcast once per shape (and
  known sharding: see :func:`jaxclip._kernel._sharding.layout`), so that a leaf costs
  one traced op, which counts at thousands of leaves.
  """
  skip = _numerics.computed_once(skip)
  masks: dict[tuple[Any, ...], jax.Array] = {}

  def select(old: Any, new: Any) -> jax.Array:
    old, new = _numerics.as_array(old), _numerics.as_array(new)
    if (
      old.shape != new.shape
      or old.dtype != new.dtype
      or jnp.issubdtype(new.dtype, jax.dtypes.extended)
    ):
      return jnp.where(skip, old, new).astype(jnp.result_type(new))
    where = _sharding.layout(new)
    mask = masks.get((new.shape, where))
    if mask is None:
      sharding = None if where is None or where is _sharding.LOCAL else where
      mask = masks[new.shape, where] = jax.lax.broadcast_in_dim(
        skip, new.shape, (), out_sharding=sharding
      )
    return jax.lax.select(mask, old, new)

  return select


def select_tree(skip: jax.Array, old: Any, new: Any) -> Any:
  """``old`` where ``skip`` else ``new``, leaf by leaf, keeping ``new``'s dtypes.

  A select copies the chosen operand's bits, so a skipped step leaves the
  selected tree bit-identical.
  """
  return jax.tree.map(_selector(skip), old, new)


def zero_updates_where(skip: jax.Array, updates: Any) -> Any:
  """Zeros (of each leaf's dtype) where ``skip``, else ``updates``."""
  select, zeros_like = _selector(skip), _zeros_like_maker()

  def zero_or_update(u: Any) -> jax.Array:
    u = _numerics.as_array(u)
    return select(zeros_like(u), u)

  return jax.tree.map(zero_or_update, updates)


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
  """Whether every entry of every leaf is finite (across ``axis_name`` too).

  That is whether the largest ``|x|`` over the tree is finite: a NaN or an
  infinity carries through every maximum. The maxima are grouped over the
  leaves as for a norm (see :func:`jaxclip._kernel._reduction.tree_norm`), a few
  kernels for thousands of small leaves, where one ``isfinite`` and
  reduction per leaf (as ``optax.apply_if_finite`` does) makes thousands.
  Integer and boolean leaves are always finite.
  """
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  ok = jnp.isfinite(_reduction.tree_norm(leaves, math.inf)) if leaves else jnp.array(True)
  # Finite everywhere: not non-finite on any device.
  return jnp.logical_not(_reduction.any_across_devices(jnp.logical_not(ok), axis_name))


def skip_transform(
  inner: optax.GradientTransformationExtraArgs,
  state_type: type,
  fn_name: str,
  count_field: str,
  init_fields: Callable[[Any], dict[str, Any]],
  decide: Callable[[Any, Any, dict[str, Any]], tuple[jax.Array, dict[str, Any]]],
) -> optax.GradientTransformationExtraArgs:
  """The scaffolding of the skip family (:func:`skip_nonfinite`, :func:`skip_above`, ...).

  ``decide(updates, state, extra_args)`` returns ``(skip, fields)``: whether
  to skip the step (a boolean scalar, the same on every device) and the
  state's fields of its own. The rest is shared: ``inner`` runs, its updates
  become zeros and its state is kept bit-identical where ``skip``, and
  ``count_field`` counts the skipped steps. ``init_fields(params)`` gives the
  state's own fields at init.
  """

  def init_fn(params):
    return state_type(
      inner_state=inner.init(params),
      **{count_field: jnp.zeros((), jnp.int32)},
      **init_fields(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _validation.check_state(state, state_type, fn_name)
    skip, fields = decide(updates, state, extra_args)
    new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    count = getattr(state, count_field)
    return zero_updates_where(skip, new_updates), state_type(
      inner_state=select_tree(skip, state.inner_state, inner_state),
      **{count_field: jnp.where(skip, optax.safe_increment(count), count)},
      **fields,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
