"""Skipping steps whose gradient norm or loss spikes (OLMo-core's rule)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxclip._kernel import _history, _numerics, _reduction, _validation
from jaxclip._kernel._typing import ArrayLike
from jaxclip.skipping import _scaffold


class SkipOnSpikeState(NamedTuple):
  """State of :func:`skip_on_spike`.

  Attributes:
    inner_state: The wrapped transform's state, untouched by skipped steps.
    spike_norm_history: float32 ``(window,)`` ring buffer of the latest finite
      global norms of the updates (slots ``>= spike_norm_count`` unused).
    spike_norm_count: int32, how many slots of the norm history are in use.
    spike_norm_index: int32, the norm-history slot written next.
    spike_loss_history: float32 ``(window,)`` ring buffer of the latest finite
      losses passed as ``value=`` or ``loss=`` (empty if none was ever passed).
    spike_loss_count: int32, how many slots of the loss history are in use.
    spike_loss_index: int32, the loss-history slot written next.
    spike_grad_norm: float32, the global norm of the last updates (may be
      ``nan``/``inf``: it records what came in).
    spike_norm_threshold: float32, ``mean + sigma * std`` of the norm history
      used at the last step; ``inf`` while the rule is inactive.
    spike_loss_threshold: float32, the same for the loss.
    spike_step_skipped: bool, whether the last step was skipped.
    num_spike_skipped: int32, how many steps were skipped in total.
  """

  inner_state: Any
  spike_norm_history: jax.Array
  spike_norm_count: jax.Array
  spike_norm_index: jax.Array
  spike_loss_history: jax.Array
  spike_loss_count: jax.Array
  spike_loss_index: jax.Array
  spike_grad_norm: jax.Array
  spike_norm_threshold: jax.Array
  spike_loss_threshold: jax.Array
  spike_step_skipped: jax.Array
  num_spike_skipped: jax.Array


def _check(
  history: _history.History, value: jax.Array, sigma: Any, min_count: int
) -> tuple[jax.Array, jax.Array]:
  """``(is_spike, threshold)`` of ``value`` against ``history``."""
  # The reference counts the current value towards the warm-up; a standard
  # deviation also needs two previous values.
  active = (history.size + 1 >= min_count) & (history.size >= 2)
  mean, std = _history.mean_std(history, ddof=1)
  sigma = jnp.asarray(sigma).astype(jnp.float32)
  # Written as the reference: a NaN or inf value fails the comparison.
  within = (value - mean) <= sigma * std
  threshold = jnp.where(active, _numerics.saturate(mean + sigma * std), jnp.inf)
  return active & jnp.logical_not(within), threshold


def objective(extra_args: dict[str, Any], fn_name: str) -> Any:
  """The objective passed as ``loss=`` or as ``value=`` (optax's name), or ``None``.

  Both may be passed if they are the same value (the same traced array, or
  equal concrete ones); otherwise which one to use is ambiguous: ``ValueError``.
  """
  loss, value = extra_args.get("loss"), extra_args.get("value")
  if loss is None or value is None or loss is value:
    return value if loss is None else loss
  a, b = _validation.concrete_value(loss), _validation.concrete_value(value)
  try:
    same = a is not None and b is not None and np.array_equal(a, b, equal_nan=True)
  except TypeError:
    same = False
  if not same:
    raise ValueError(
      f"{fn_name} got both loss={loss!r:.80} and value={value!r:.80}, which may "
      "differ; pass the objective once (value= is optax's name, as in "
      "reduce_on_plateau and the line searches; loss= is accepted too)."
    )
  return loss


def _fields(
  norms: _history.History, losses: _history.History, **scalars: jax.Array
) -> dict[str, Any]:
  """The fields of a :class:`SkipOnSpikeState` of its own, from the two histories."""
  return dict(
    spike_norm_history=norms.values,
    spike_norm_count=norms.size,
    spike_norm_index=norms.index,
    spike_loss_history=losses.values,
    spike_loss_count=losses.size,
    spike_loss_index=losses.index,
    **scalars,
  )


def skip_on_spike(
  inner: optax.GradientTransformation,
  *,
  window: int = 128,
  sigma: ArrayLike = 6.0,
  ord: int | float | str | None = None,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Skips a step whose gradient norm (or loss) spikes above its recent history.

  OLMo-core's ``SkipStepOptimizer`` rule as an optax wrapper. With
  :math:`\mu, s` the mean and (unbiased) standard deviation of the previous
  ``window`` values of the global norm :math:`\|g\|`, the step is skipped if

  .. math::

    \|g_t\| - \mu > \sigma \, s \quad\text{or}\quad \|g_t\| \text{ is not finite,}

  and likewise for the loss when it is passed as ``tx.update(..., value=l)``
  (optax's name for the objective, as ``optax.contrib.reduce_on_plateau`` and
  the line searches read it) or as ``loss=l`` (each series is checked against
  its own history). A skipped step returns zero updates and ``inner``'s
  state bit-identical; the others go through ``inner`` unchanged. Every extra
  argument, ``value`` and ``loss`` included, is forwarded to ``inner``.

  The rule is inactive (nothing is skipped, not even a NaN step: compose with
  :func:`jaxclip.skip_nonfinite` for that) until the history holds
  ``max(2, window // 2)`` values counting the current one, as in OLMo-core.
  Values of skipped steps still enter the history (as in OLMo-core), so a
  lasting shift in scale is accepted after a while.

  Deliberate differences from OLMo-core: NaN and inf values are never
  recorded (OLMo-core records them and filters them out when computing the
  statistics), so the window holds the latest ``window`` *finite* values and
  only those count towards activation; and the rule also waits for two
  previous values, where the reference, with ``window <= 5``, would compute
  the standard deviation of a single value (NaN) and skip every step.

  Args:
    inner: The transform (typically the whole optimizer) to protect.
    window: How many previous values the statistics use (a Python int
      ``>= 2``, since a standard deviation needs two; it fixes the state's
      shape).
    sigma: How many standard deviations above the mean count as a spike
      (``>= 0``; may be traced).
    ord: The norm: ``None`` (L2, default), ``2``, ``1`` or ``inf``; a static
      choice (list it in ``static_args`` under ``optax.inject_hyperparams``).
    axis_name: Inside ``shard_map``/``pmap``, the axis over which the updates
      are sharded. The norm is reduced across it, the loss is averaged over
      it (``pmean``: pass each device's local loss), and a step skipped on
      any device is skipped on all, so every device takes the same decision
      and keeps the same state.
    replicated: Which leaves every device of ``axis_name`` holds in full.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``. The three are explained in ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipOnSpikeState`.

  Raises:
    ValueError: for ``window < 2``, a concrete negative or NaN ``sigma``, a
      loss that is not a scalar, or both ``loss=`` and ``value=`` with
      different values.
    TypeError: for a ``window`` that is not an int, or updates with a leaf
      that holds no number (a PRNG key).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.skip_on_spike(optax.sgd(1.0), window=8, sigma=3.0)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for g in [1., 2., 1., 2., 1., 2., 1., 2., 50.]:
    ...   updates, state = tx.update(jnp.array([g, 0.]), state, params, value=3.0)
    >>> updates  # the last step spiked: skipped
    Array([0., 0.], dtype=float32)
    >>> print(f"{optax.tree.get(state, 'spike_norm_threshold'):.4f}")
    3.1036
    >>> int(optax.tree.get(state, 'num_spike_skipped'))
    1

  References:
    Allen Institute for AI, `OLMo-core's SkipStepOptimizer
    <https://github.com/allenai/OLMo-core/blob/main/src/olmo_core/optim/skip_step_optimizer.py>`_,
    2024
  """
  window = _validation.check_size(window, "window", minimum=2)
  _validation.check_hparam(sigma, "sigma", lo=0, scalar=True)
  _validation.check_transform(inner, "inner")
  ord = _validation.check_ord(ord)
  inner = optax.with_extra_args_support(inner)

  def init_fields(params):
    del params
    size = _validation.require_size(window, "window")
    # Every field an array of its own, so that the state can be donated.
    inf = lambda: jnp.array(jnp.inf, jnp.float32)
    return _fields(
      _history.empty(size),
      _history.empty(size),
      spike_grad_norm=jnp.zeros((), jnp.float32),
      spike_norm_threshold=inf(),
      spike_loss_threshold=inf(),
      spike_step_skipped=jnp.array(False),
    )

  def decide(updates, state, extra_args):
    loss = objective(extra_args, "skip_on_spike")
    numbers = _validation.numeric_leaves(updates, "skip_on_spike")
    norm = _numerics.saturated_float32(
      _reduction.tree_norm(numbers, ord, axis_name, replicated, partition_specs)
    )
    min_count = max(2, state.spike_norm_history.shape[0] // 2)
    norms = _history.History(
      state.spike_norm_history, state.spike_norm_count, state.spike_norm_index
    )
    losses = _history.History(
      state.spike_loss_history, state.spike_loss_count, state.spike_loss_index
    )
    skip, norm_threshold = _check(norms, norm, sigma, min_count)
    norms = _history.push(norms, norm)
    loss_threshold = state.spike_loss_threshold
    if loss is not None:
      loss = jnp.asarray(loss)
      if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.number):
        raise ValueError(
          "skip_on_spike needs a real scalar loss (value= or loss=), got "
          f"{loss.dtype} of shape {loss.shape}."
        )
      loss = _reduction.mean_across_devices(loss.astype(jnp.float32), axis_name)
      loss_spike, loss_threshold = _check(losses, loss, sigma, min_count)
      skip = skip | loss_spike
      losses = _history.push(losses, loss)
    skip = _reduction.any_across_devices(skip, axis_name)
    return skip, _fields(
      norms,
      losses,
      spike_grad_norm=norm,
      spike_norm_threshold=norm_threshold,
      spike_loss_threshold=loss_threshold,
      spike_step_skipped=skip,
    )

  return _scaffold.skip_transform(
    inner, SkipOnSpikeState, "skip_on_spike", "num_spike_skipped", init_fields, decide
  )
