"""ZClip: z-score spike clipping on EMAs of the gradient norm."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _clip, _history, _numerics, _reduction, _validation
from jaxclip._kernel._typing import ArrayLike


class ZClipState(NamedTuple):
  """State of :func:`zclip`.

  Attributes:
    zclip_warmup_norms: float32 ``(warmup_steps,)``, the first finite norms,
      from which the statistics are initialised.
    zclip_warmup_count: int32, how many of them were collected (the EMAs are
      in use once it equals ``warmup_steps``).
    zclip_norm_ema: float32, the EMA of the norm's mean (``0`` in warm-up).
    zclip_norm_var_ema: float32, the EMA of the norm's variance.
    zclip_z_score: float32, the z-score of the last norm (``0`` in warm-up).
    zclip_threshold: float32, the threshold used at the last step (``inf``
      when nothing was clipped and ``max_norm`` is ``None``).
    zclip_pre_clip_norm: float32, the global norm of the last updates before
      clipping (may be ``nan``/``inf``: it records what came in).
  """

  zclip_warmup_norms: jax.Array
  zclip_warmup_count: jax.Array
  zclip_norm_ema: jax.Array
  zclip_norm_var_ema: jax.Array
  zclip_z_score: jax.Array
  zclip_threshold: jax.Array
  zclip_pre_clip_norm: jax.Array


_MODES = ("zscore", "percentile")
_CLIP_OPTIONS = ("adaptive_scaling", "mean")


def zclip(
  alpha: ArrayLike = 0.97,
  z_thresh: ArrayLike = 2.5,
  max_norm: ArrayLike | None = None,
  warmup_steps: int = 25,
  *,
  mode: str = "zscore",
  clip_option: str = "adaptive_scaling",
  clip_factor: ArrayLike = 1.0,
  skip_update_on_spike: bool = False,
  eps: ArrayLike = 1e-6,
  ord: int | float | str | None = None,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""ZClip: clips global-norm spikes detected by a z-score on EMA statistics.

  The first ``warmup_steps`` finite norms are collected (clipped only by
  ``max_norm``, if given); their mean and population variance initialise
  :math:`\mu, v`. From then on, with :math:`s = \sqrt v` and
  :math:`z_t = (\|g_t\| - \mu) / (s + \epsilon)`, a step with
  :math:`z_t > z_{thr}` is a spike and is clipped by global norm to

  .. math::

    c_t = \Big(\mu + \frac{z_{thr}^2\, s}{z_t}\Big) \cdot \text{clip\_factor}
    \ \ (\texttt{"adaptive\_scaling"}), \qquad c_t = \mu \ \ (\texttt{"mean"}),

  and ``mode="percentile"`` instead clips any norm above :math:`\mu + z_{thr}
  s` to it. ``max_norm`` further caps the threshold at every step. Then the
  statistics move towards :math:`x_t = c_t` on a spike, :math:`\|g_t\|`
  otherwise, in the reference code's order (the variance uses the *new*
  mean):

  .. math::

    \mu \leftarrow \alpha \mu + (1 - \alpha) x_t, \qquad
    v \leftarrow \alpha v + (1 - \alpha) (x_t - \mu)^2 .

  With ``skip_update_on_spike=True`` a spike leaves them unchanged.

  This follows the reference implementation (names and defaults included)
  with two deliberate differences: a NaN or inf norm is neither collected
  nor averaged in (the reference would poison its statistics; here that step
  comes out NaN, as :func:`jaxclip.clip_by_global_norm`, and the EMAs are
  untouched), and the clip factor is :math:`c / \max(\|g\|, c)` without the
  reference's ``+ 1e-6`` in the denominator.

  Args:
    alpha: EMA smoothing factor in ``[0, 1]``. May be traced.
    z_thresh: The z-score above which a norm is a spike, ``>= 0``. May be
      traced.
    max_norm: ``None`` or a fixed global-norm cap applied at every step.
    warmup_steps: How many norms initialise the statistics (a Python int
      ``>= 1``; it fixes the state's shape).
    mode: ``"zscore"`` (default) or ``"percentile"`` (the reference's name for
      clipping to :math:`\mu + z_{thr} s`).
    clip_option: In ``"zscore"`` mode, ``"adaptive_scaling"`` (default) or
      ``"mean"``.
    clip_factor: Multiplies the whole adaptive-scaling threshold (``< 1``
      clips harder), as the reference code does.
    skip_update_on_spike: Keep the statistics unchanged on a spike.
    eps: Added to the standard deviation in the z-score.
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
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`ZClipState`.

  Raises:
    ValueError: for an unknown ``mode``/``clip_option``, ``warmup_steps < 1``
      or a concrete hyperparameter out of range.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.zclip(warmup_steps=4)
    >>> state = tx.init(jnp.zeros(2))
    >>> for g in [1., 3., 1., 3., 10.]:  # warm-up: mean 2, std 1
    ...   updates, state = tx.update(jnp.array([g, 0.]), state)
    >>> print(f"{optax.tree.get(state, 'zclip_z_score'):.3f}")  # (10 - 2) / 1
    8.000
    >>> print(f"{updates[0]:.4f}")  # clipped to 2 + 2.5**2 * 1 / 8
    2.7813

  References:
    Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
    <https://arxiv.org/abs/2504.02507>`_, 2025
  """
  if not isinstance(mode, str) or mode not in _MODES:
    raise ValueError(f"zclip: mode must be one of {_MODES}, got {mode!r}.")
  if not isinstance(clip_option, str) or clip_option not in _CLIP_OPTIONS:
    raise ValueError(f"zclip: clip_option must be one of {_CLIP_OPTIONS}, got {clip_option!r}.")
  _validation.check_hparam(alpha, "alpha", lo=0, hi=1, scalar=True)
  for value, name in ((z_thresh, "z_thresh"), (clip_factor, "clip_factor"), (eps, "eps")):
    _validation.check_hparam(value, name, lo=0, scalar=True)
  if max_norm is not None:
    _validation.check_hparam(max_norm, "max_norm", lo=0, scalar=True)
  warmup_steps = _validation.check_size(warmup_steps, "warmup_steps")
  ord = _validation.check_ord(ord)
  cap = jnp.inf if max_norm is None else max_norm

  def init_fn(params):
    del params
    size = _validation.require_size(warmup_steps, "warmup_steps")
    # Every field an array of its own, so that the state can be donated.
    zero = lambda: jnp.zeros((), jnp.float32)
    return ZClipState(
      zclip_warmup_norms=jnp.zeros((size,), jnp.float32),
      zclip_warmup_count=jnp.zeros((), jnp.int32),
      zclip_norm_ema=zero(),
      zclip_norm_var_ema=zero(),
      zclip_z_score=zero(),
      zclip_threshold=jnp.array(jnp.inf, jnp.float32),
      zclip_pre_clip_norm=zero(),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, ZClipState, "zclip")
    updates = _validation.numeric_leaves(updates, "zclip")
    norm = _reduction.tree_norm(updates, ord, axis_name, replicated, partition_specs)
    x = _numerics.saturated_float32(norm)
    finite = jnp.isfinite(x)
    count = state.zclip_warmup_count
    size = state.zclip_warmup_norms.shape[0]  # warmup_steps, static
    warming = count < size
    a, zt, cap32 = (
      _numerics.hparam_float32(alpha),
      _numerics.hparam_float32(z_thresh),
      _numerics.hparam_float32(cap),
    )

    # Warm-up: collect finite norms; the last one initialises the EMAs.
    collect = warming & finite
    slot = jnp.minimum(count, size - 1)
    buf = state.zclip_warmup_norms
    buf = buf.at[slot].set(jnp.where(collect, x, buf[slot]))
    new_count = jnp.where(collect, count + 1, count)
    init_now = collect & (new_count == size)
    # The warm-up's statistics on the norms scaled by a power of two, and the
    # EMAs saturated: one finite norm of 1e20 squares to inf in float32, which
    # would leave the variance inf (and spikes unclipped) for good.
    w_mean, w_std = _history.mean_std(
      _history.History(buf, jnp.asarray(size, jnp.int32), jnp.zeros((), jnp.int32)), ddof=0
    )
    w_var = _numerics.saturate(jnp.square(w_std))

    # After warm-up: z-score against the current EMAs.
    mean, var = state.zclip_norm_ema, state.zclip_norm_var_ema
    std = jnp.sqrt(var)
    z = (x - mean) / (std + _numerics.hparam_float32(eps))
    if mode == "zscore":
      spike = z > zt
      if clip_option == "adaptive_scaling":
        adaptive = (mean + zt * zt * std / jnp.where(spike, z, 1)) * _numerics.hparam_float32(
          clip_factor
        )
      else:
        adaptive = mean
    else:
      adaptive = _numerics.saturate(mean + zt * std)
      spike = x > adaptive
    spike = spike & jnp.logical_not(warming) & finite
    threshold = jnp.minimum(jnp.where(spike, adaptive, jnp.inf), cap32)

    target = jnp.where(spike, adaptive, x)
    ema_mean = _numerics.saturate(a * mean + (1 - a) * target)
    ema_var = _numerics.saturate(
      a * var + (1 - a) * _numerics.saturate(jnp.square(target - ema_mean))
    )
    move = jnp.logical_not(warming) & finite
    if skip_update_on_spike:
      move = move & jnp.logical_not(spike)
    new_mean = jnp.where(init_now, w_mean, jnp.where(move, ema_mean, mean))
    new_var = jnp.where(init_now, w_var, jnp.where(move, ema_var, var))

    clipped = _clip.global_norm_clip(updates, threshold, norm)
    return clipped, ZClipState(
      zclip_warmup_norms=buf,
      zclip_warmup_count=new_count,
      zclip_norm_ema=new_mean,
      zclip_norm_var_ema=new_var,
      zclip_z_score=jnp.where(warming, 0, z),
      zclip_threshold=threshold,
      zclip_pre_clip_norm=x,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
