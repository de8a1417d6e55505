"""Gradient accumulation: dropping bad microbatches in ``optax.MultiSteps``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _reduction, _validation
from jaxclip._kernel._typing import ArrayLike
from jaxclip.skipping import _scaffold


def skip_bad_microbatches(
  max_norm: ArrayLike | None = None,
  *,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> Callable[[Any, jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]]:
  r"""A ``should_skip_update_fn`` for ``optax.MultiSteps`` that drops bad microbatches.

  ``optax.MultiSteps(opt, every_k_schedule=k, should_skip_update_fn=fn)``
  calls ``fn(updates, gradient_step, params)`` on every microbatch's
  gradient before accumulating it. The function returned here answers
  "skip" for a gradient that holds a NaN or an inf, and, when ``max_norm``
  is given, for one whose global L2 norm is above it. ``MultiSteps`` then
  leaves its whole state as it was: the microbatch never reaches the
  accumulator and does not count towards ``k``, so the step is still the
  mean of ``k`` good microbatches, taken one microbatch later.

  This is the place to catch a bad microbatch. A NaN that reaches the
  accumulator stays there: ``MultiSteps`` resets it by multiplying it by
  zero, and ``0 * nan`` is ``nan``, so every later step is non-finite, and a
  :func:`jaxclip.skip_nonfinite` inside ``MultiSteps`` skips every step from
  then on.

  The decision reads the microbatch once (its largest ``|x|`` without
  ``max_norm``, its L2 norm with it). The second value returned, which
  ``MultiSteps`` keeps as ``skip_state``, describes the last microbatch:
  ``{"microbatch_skipped": bool}``, plus ``"microbatch_norm"`` (float32, its
  global L2 norm) when ``max_norm`` is given; read them with
  ``optax.tree.get(state, "microbatch_skipped")``.

  Args:
    max_norm: ``None`` (drop non-finite microbatches only) or the largest
      global L2 norm a microbatch's gradient may have, a positive finite
      scalar (may be traced).
    axis_name: Inside ``shard_map``/``pmap``, the axis over which the
      gradients are sharded: the norm is reduced across it, so every device
      drops the same microbatches (``MultiSteps`` branches on the decision,
      so devices must agree).
    replicated: Which leaves every device of ``axis_name`` holds in full.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``. The three are explained in ``docs/sharding_args.md``.

  Returns:
    A function ``(updates, gradient_step, params) -> (should_skip,
    skip_state)`` for ``optax.MultiSteps``' ``should_skip_update_fn``.

  Raises:
    ValueError: if a concrete ``max_norm`` is not a positive finite scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2,
    ...                       should_skip_update_fn=jaxclip.skip_bad_microbatches())
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for g in ([1., 1.], [jnp.nan, 1.], [3., 1.]):
    ...   updates, state = tx.update(jnp.array(g), state, params)
    >>> updates  # minus the mean of the two finite microbatches
    Array([-2., -1.], dtype=float32)
    >>> bool(optax.tree.get(state, 'microbatch_skipped'))
    False
  """
  if max_norm is not None:
    _validation.check_hparam(max_norm, "max_norm", lo=0, lo_open=True, scalar=True, finite=True)

  def should_skip(updates, gradient_step, params):
    del gradient_step, params
    updates = _validation.numeric_leaves(updates, "skip_bad_microbatches")
    if max_norm is None:
      skip = jnp.logical_not(_scaffold.all_finite(updates, axis_name))
      return skip, {"microbatch_skipped": skip}
    norm = _numerics.saturated_float32(
      _reduction.tree_norm(updates, 2, axis_name, replicated, partition_specs)
    )
    # Written so that a NaN norm fails the comparison and is skipped.
    skip = jnp.logical_not(norm <= jnp.asarray(max_norm).astype(jnp.float32))
    return skip, {"microbatch_skipped": skip, "microbatch_norm": norm}

  return should_skip
