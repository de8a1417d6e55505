"""The skip and repair rules: non-finite gradients, norms above a bound."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _reduction, _validation
from jaxclip._kernel._typing import ArrayLike
from jaxclip.skipping import _scaffold


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner_state: The wrapped transform's state, untouched by skipped steps.
    num_nonfinite_skipped: int32, how many steps were skipped in total.
    num_consecutive_nonfinite: int32, how many of the latest steps in a row
      had non-finite updates (``0`` after a finite step).
    nonfinite_step_skipped: bool, whether the last step was skipped.
  """

  inner_state: Any
  num_nonfinite_skipped: jax.Array
  num_consecutive_nonfinite: jax.Array
  nonfinite_step_skipped: jax.Array


def skip_nonfinite(
  inner: optax.GradientTransformation,
  *,
  max_consecutive: ArrayLike | None = None,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Skips every step whose updates hold a NaN or an inf.

  On such a step the wrapped transform is not applied: the updates returned
  are zeros (parameters do not move) and ``inner``'s state is returned
  bit-identical, so an Adam moment or a step count is never polluted by one
  bad batch. A finite step is passed to ``inner`` unchanged.

  After ``max_consecutive`` non-finite steps *in a row* the next ones are
  let through, NaNs included, so a run that is broken for good fails loudly
  (NaN parameters and loss) instead of silently standing still; the count
  restarts at the first finite step. With ``max_consecutive=None`` (default)
  non-finite steps are always skipped: watch ``num_consecutive_nonfinite``.
  This is ``optax.apply_if_finite`` with an optional limit, a skipped-step
  flag in the state, and ``axis_name`` for sharded updates.

  Args:
    inner: The transform (typically the whole optimizer) to protect.
    max_consecutive: ``None`` or the number of non-finite steps in a row to
      skip before letting them through: a positive int (may be traced).
    axis_name: Inside ``shard_map``/``pmap``, the axis over which the updates
      are sharded: a step that is non-finite on any device is skipped on
      all, so every device makes the same decision and keeps the same state.
      (Which leaves are replicated does not matter here.)

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipNonfiniteState`; extra arguments are forwarded to ``inner``.

  Raises:
    TypeError: for a ``max_consecutive`` that is not an int (``2.5``,
      ``True``), or updates with a leaf that holds no number (a PRNG key).
    ValueError: for a concrete ``max_consecutive < 1``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.skip_nonfinite(optax.adam(0.1))
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.array([jnp.nan, 1.]), state, params)
    >>> updates
    Array([0., 0.], dtype=float32)
    >>> int(optax.tree.get(state, 'num_nonfinite_skipped'))
    1
  """
  if max_consecutive is not None:
    _validation.check_size(max_consecutive, "max_consecutive")
  _validation.check_transform(inner, "inner")
  inner = optax.with_extra_args_support(inner)

  def decide(updates, state, extra_args):
    del extra_args
    _validation.numeric_leaves(updates, "skip_nonfinite", promote=False)
    finite = _scaffold.all_finite(updates, axis_name)
    in_a_row = jnp.where(finite, 0, optax.safe_increment(state.num_consecutive_nonfinite))
    skip = jnp.logical_not(finite)
    if max_consecutive is not None:
      skip = skip & (in_a_row <= jnp.asarray(max_consecutive))
    return skip, {
      "num_consecutive_nonfinite": in_a_row.astype(jnp.int32),
      "nonfinite_step_skipped": skip,
    }

  return _scaffold.skip_transform(
    inner,
    SkipNonfiniteState,
    "skip_nonfinite",
    "num_nonfinite_skipped",
    lambda params: {
      "num_consecutive_nonfinite": jnp.zeros((), jnp.int32),
      "nonfinite_step_skipped": jnp.array(False),
    },
    decide,
  )


class ZeroNonfiniteState(NamedTuple):
  """State of :func:`zero_nonfinite`.

  Attributes:
    num_nonfinite_zeroed: int32, how many entries were replaced by zero at the
      last step (in the whole tree across devices with ``axis_name``).
    num_steps_with_nonfinite: int32, how many steps so far had at least one.
  """

  num_nonfinite_zeroed: jax.Array
  num_steps_with_nonfinite: jax.Array


def zero_nonfinite(
  *, axis_name: Any = None, replicated: Any = None, partition_specs: Any = None
) -> optax.GradientTransformationExtraArgs:
  r"""Replaces every NaN, ``inf`` and ``-inf`` entry of the updates by ``0``.

  Unlike :func:`skip_nonfinite`, the finite entries of the step are kept.
  This suits rare, local overflows (one row of an embedding, one expert)
  better than a broken batch: a NaN that comes from a bad loss usually
  poisons every entry, and then the step is all zeros anyway. Leaves keep
  their dtype; integer leaves are returned unchanged.

  Args:
    axis_name: Inside ``shard_map``/``pmap``, the axis over which the updates
      are sharded, so the counts in the state are those of the whole tree,
      the same on every device.
    replicated: Which leaves every device of ``axis_name`` holds in full.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``. The three are explained in ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`ZeroNonfiniteState`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.zero_nonfinite()
    >>> updates, state = tx.update(jnp.array([1., jnp.inf, jnp.nan]), tx.init(None))
    >>> updates
    Array([1., 0., 0.], dtype=float32)
    >>> int(optax.tree.get(state, 'num_nonfinite_zeroed'))
    2
  """

  def init_fn(params):
    del params
    return ZeroNonfiniteState(
      num_nonfinite_zeroed=jnp.zeros((), jnp.int32),
      num_steps_with_nonfinite=jnp.zeros((), jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, ZeroNonfiniteState, "zero_nonfinite")
    _validation.numeric_leaves(updates, "zero_nonfinite", promote=False)
    # lax ops, a few per leaf: jnp's nested functions make tracing thousands
    # of leaves slow.
    bad, zeros_like = {}, _scaffold._zeros_like_maker()

    def repair(leaf):
      x = _numerics.as_array(leaf)
      if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
      finite = (
        jax.lax.is_finite(x) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.isfinite(x)
      )  # complex: both parts finite
      bad[id(leaf)] = jax.lax.convert_element_type(jax.lax.bitwise_not(finite), jnp.int32)
      return jax.lax.select(finite, x, zeros_like(x))

    repaired = jax.tree.map(repair, updates)
    if axis_name is None:
      count = _numerics.count_sum(list(bad.values()))
    else:  # a replicated leaf's entries count once
      count = _reduction.sum_across_devices(
        updates,
        lambda leaves: [
          jax.lax.reduce_sum(bad[id(x)], tuple(range(bad[id(x)].ndim)))
          for x in leaves
          if id(x) in bad
        ],
        axis_name,
        replicated,
        partition_specs,
        dtype=jnp.int32,
      )
    return repaired, ZeroNonfiniteState(
      num_nonfinite_zeroed=count,
      num_steps_with_nonfinite=jnp.where(
        count > 0,
        optax.safe_increment(state.num_steps_with_nonfinite),
        state.num_steps_with_nonfinite,
      ),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SkipAboveState(NamedTuple):
  """State of :func:`skip_above`.

  Attributes:
    inner_state: The wrapped transform's state, untouched by skipped steps.
    skip_above_norm: The global norm of the last incoming updates (float32,
      or float64 for float64 params; ``nan``/``inf`` if they held one), the
      same on every device with ``axis_name``; ``0`` before the first step.
    num_above_skipped: int32, how many steps were skipped in total.
    above_step_skipped: bool, whether the last step was skipped.
  """

  inner_state: Any
  skip_above_norm: jax.Array
  num_above_skipped: jax.Array
  above_step_skipped: jax.Array


def skip_above(
  inner: optax.GradientTransformation,
  max_norm: ArrayLike,
  *,
  ord: int | float | str | None = None,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Skips every step whose incoming global norm is above ``max_norm`` or not finite.

  A step is skipped if not :math:`\|g\| \le d` (so a ``nan`` or ``inf``
  norm is skipped too): the updates returned are zeros (parameters do not
  move) and ``inner``'s state is returned bit-identical. Other steps go
  through ``inner`` unchanged. The norm is that of the updates *coming in*
  (the gradient), read once, as :func:`jaxclip.ops.global_norm` computes it.

  Where :func:`clip_by_global_norm` shrinks a large gradient, this drops it:
  a gradient a hundred times the usual size is more often a bad batch than a
  direction worth following. The two compose; with ``d > c``,
  ``skip_above(optax.chain(clip_by_global_norm(c), opt), d)`` skips a step
  above ``d`` and clips one between ``c`` and ``d`` to ``c``.

  ==============================  ==========================================
  incoming norm                   result
  ==============================  ==========================================
  ``norm <= max_norm``            ``inner``'s updates and state
  ``norm > max_norm``             zeros; ``inner``'s state unchanged
  ``nan`` or ``inf``              zeros; ``inner``'s state unchanged
  ==============================  ==========================================

  Args:
    inner: The transform (typically the whole optimizer) to protect.
    max_norm: The largest global norm a step may have, a positive finite
      scalar; may be traced (e.g. under ``optax.inject_hyperparams``).
    ord: The norm: ``None`` (L2, default), ``2``, ``1`` or ``inf``; a static
      choice (list it in ``static_args`` under ``optax.inject_hyperparams``).
    axis_name: Inside ``shard_map``/``pmap``, the axis over which the updates
      are sharded: the norm is reduced across it, so every device takes the
      same decision and keeps the same state.
    replicated: Which leaves every device of ``axis_name`` holds in full.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``. The three are explained in ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipAboveState`; extra arguments are forwarded to ``inner``.

  Raises:
    ValueError: if a concrete ``max_norm`` is not a positive finite scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.skip_above(optax.chain(jaxclip.clip_by_global_norm(1.0),
    ...                                     optax.sgd(1.0)), 10.0)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.array([3., 4.]), state, params)  # clipped
    >>> updates
    Array([-0.6, -0.8], dtype=float32)
    >>> updates, state = tx.update(jnp.array([30., 40.]), state, params)  # skipped
    >>> updates
    Array([0., 0.], dtype=float32)
    >>> int(optax.tree.get(state, 'num_above_skipped'))
    1
  """
  _validation.check_transform(inner, "inner")
  _validation.check_hparam(max_norm, "max_norm", lo=0, lo_open=True, scalar=True, finite=True)
  ord = _validation.check_ord(ord)
  inner = optax.with_extra_args_support(inner)

  def decide(updates, state, extra_args):
    del extra_args
    numbers = _validation.numeric_leaves(updates, "skip_above")
    norm = _reduction.tree_norm(numbers, ord, axis_name, replicated, partition_specs)
    norm = (
      _numerics.saturated_float32(norm)
      if state.skip_above_norm.dtype == jnp.float32
      else norm.astype(state.skip_above_norm.dtype)
    )
    # Written so that a NaN norm fails the comparison and is skipped.
    skip = jnp.logical_not(norm <= jnp.asarray(max_norm).astype(norm.dtype))
    return skip, {"skip_above_norm": norm, "above_step_skipped": skip}

  return _scaffold.skip_transform(
    inner,
    SkipAboveState,
    "skip_above",
    "num_above_skipped",
    lambda params: {
      "skip_above_norm": jnp.zeros((), _numerics.tree_accumulation_dtype(params)),
      "above_step_skipped": jnp.array(False),
    },
    decide,
  )
