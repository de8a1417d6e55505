"""AutoClip: clip to a percentile of the gradient norms seen so far."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _clip, _history, _numerics, _reduction, _validation
from jaxclip._kernel._typing import ArrayLike


class AutoClipState(NamedTuple):
  """State of :func:`autoclip`.

  Attributes:
    autoclip_norm_history: float32 ``(history,)`` ring buffer of the latest
      finite pre-clip global norms (slots ``>= autoclip_norm_count`` unused).
    autoclip_norm_count: int32, how many slots are in use.
    autoclip_norm_index: int32, the slot written next.
    autoclip_threshold: float32, the threshold used at the last step.
    autoclip_pre_clip_norm: float32, the global norm of the last updates
      before clipping (may be ``nan``/``inf``: it records what came in).
  """

  autoclip_norm_history: jax.Array
  autoclip_norm_count: jax.Array
  autoclip_norm_index: jax.Array
  autoclip_threshold: jax.Array
  autoclip_pre_clip_norm: jax.Array


def autoclip(
  percentile: ArrayLike = 10.0,
  history: int = 1000,
  *,
  ord: int | float | str | None = None,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""AutoClip: clips to the ``percentile``-th percentile of the norms seen so far.

  At step :math:`t` the global norm :math:`\|g_t\|` is added to the history
  :math:`H_t`, and the updates are clipped by global norm to

  .. math::

    c_t = \operatorname{percentile}_p(H_t), \qquad
    g_t \mapsto g_t \cdot \frac{c_t}{\max(\|g_t\|, c_t)},

  so only the steps whose norm is in the top :math:`100 - p` percent of the
  history are scaled down. The percentile interpolates linearly between ranks
  (``np.percentile``'s default, as the reference code). The first step is
  never clipped (its own norm is the whole history).

  The paper and its reference code keep *every* norm seen; here the history
  is a ring buffer of the latest ``history`` finite norms, so the state has a
  fixed size (checkpointable, a valid ``lax.scan`` carry) and the threshold
  follows the recent scale of the gradients. With ``history`` at least the
  number of steps the two agree exactly. A NaN or inf norm is not recorded;
  that step's updates come out NaN (as :func:`jaxclip.clip_by_global_norm`),
  so wrap the optimizer in :func:`jaxclip.skip_nonfinite` to skip such steps.

  Args:
    percentile: ``p`` in ``[0, 100]``; the paper's experiments use ``10``
      (default). May be traced.
    history: How many of the latest norms are kept (a Python int ``>= 1``; it
      fixes the state's shape).
    ord: The norm: ``None`` (L2, default), ``2``, ``1`` or ``inf``; a static
      choice (list it in ``static_args`` under ``optax.inject_hyperparams``).
    axis_name: Inside ``shard_map``/``pmap``, the mesh axis (or tuple of
      axes) the updates are sharded over; ``None`` (default) otherwise.
    replicated: Which leaves every device of ``axis_name`` holds in full
      (counted once); inferred under ``check_vma=True``.
    partition_specs: Where the leaves are sharded (``PartitionSpec`` leaves),
      instead of ``replicated``. The three are explained once in
      ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is an
    :class:`AutoClipState`.

  Raises:
    ValueError: for a concrete ``percentile`` outside ``[0, 100]`` or
      ``history < 1``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.autoclip(percentile=50, history=100)
    >>> state = tx.init(jnp.zeros(2))
    >>> for g in [3., 5., 1., 40.]:
    ...   updates, state = tx.update(jnp.array([g, 0.]), state)
    >>> optax.tree.get(state, 'autoclip_threshold')  # median of 1, 3, 5, 40
    Array(4., dtype=float32)
    >>> updates
    Array([4., 0.], dtype=float32)

  References:
    Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source
    Separation Networks <https://arxiv.org/abs/2007.14469>`_, 2020
  """
  _validation.check_hparam(percentile, "percentile", lo=0, hi=100, scalar=True)
  history = _validation.check_size(history, "history")
  ord = _validation.check_ord(ord)

  def init_fn(params):
    del params
    buf = _history.empty(_validation.require_size(history, "history"))
    return AutoClipState(
      autoclip_norm_history=buf.values,
      autoclip_norm_count=buf.size,
      autoclip_norm_index=buf.index,
      autoclip_threshold=jnp.array(jnp.inf, jnp.float32),
      autoclip_pre_clip_norm=jnp.zeros((), jnp.float32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, AutoClipState, "autoclip")
    updates = _validation.numeric_leaves(updates, "autoclip")
    norm = _reduction.tree_norm(updates, ord, axis_name, replicated, partition_specs)
    buf = _history.push(
      _history.History(
        state.autoclip_norm_history, state.autoclip_norm_count, state.autoclip_norm_index
      ),
      norm,
    )
    threshold = _history.percentile(buf, percentile)
    clipped = _clip.global_norm_clip(updates, threshold, norm)
    return clipped, AutoClipState(
      autoclip_norm_history=buf.values,
      autoclip_norm_count=buf.size,
      autoclip_norm_index=buf.index,
      autoclip_threshold=threshold,
      autoclip_pre_clip_norm=_numerics.saturated_float32(norm),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
