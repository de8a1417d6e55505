"""Per-tensor adaptive clipping: AdaGC, and Stable-SPAM's AdaClip and AdaGN."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip._kernel import _numerics, _validation
from jaxclip._kernel._typing import ArrayLike
from jaxclip.transforms import _per_tensor


def _bias_correction(beta: jax.Array, count: jax.Array) -> jax.Array:
  """``1 - beta**t`` in float32."""
  return 1 - jnp.power(beta, count.astype(jnp.float32))


# ---------------------------------------------------------------- AdaGC


class AdaGCState(NamedTuple):
  """State of :func:`adagc`.

  Attributes:
    adagc_gamma: A :class:`jaxclip.LeafStats`, one float32 per leaf of
      the params: the EMA :math:`\\gamma_i` of that tensor's clipped norm
      (its minimum during warm-up).
    adagc_count: int32, the number of steps taken.
  """

  adagc_gamma: Any
  adagc_count: jax.Array


def adagc(
  beta: ArrayLike = 0.98,
  lambda_abs: ArrayLike = 1.0,
  lambda_rel: ArrayLike = 1.05,
  warmup_steps: int = 100,
  eps: ArrayLike = 1e-8,
  *,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""AdaGC: clips each tensor relative to an EMA of its own clipped norms.

  At step :math:`t` (counted from 1), each leaf :math:`g_i` with norm
  :math:`\|g_i\|`. For :math:`t <` ``warmup_steps``, global clipping to
  ``lambda_abs``, and :math:`\gamma_i` tracks the smallest clipped norm:

  .. math::

    g_i \leftarrow g_i \min\Big(1, \frac{\lambda_{abs}}{\|g\| + \epsilon}\Big),
    \qquad \gamma_i \leftarrow \min(\gamma_i, \|g_i\|)
    \ \ (\gamma_i \leftarrow \|g_i\| \text{ at } t = 1).

  From then on, each tensor is clipped to ``lambda_rel`` times its
  :math:`\gamma_i`, which follows the clipped norms:

  .. math::

    g_i \leftarrow g_i \min\Big(1, \frac{\lambda_{rel}\, \gamma_i}{\|g_i\|}\Big),
    \qquad \gamma_i \leftarrow \beta \gamma_i + (1 - \beta) \|g_i\| .

  ======================================  ===============================
  case                                    result
  ======================================  ===============================
  a tensor is all zeros                   it stays zeros (no ``0/0``)
  ``warmup_steps <= 1``                   :math:`\gamma_i` starts at the first
                                          step's norm
  :math:`\gamma_i = 0` after warm-up      that tensor is zeroed from then on
  a NaN/inf gradient                      it passes through; the state is
                                          kept as it was (count included):
                                          wrap the optimizer in
                                          :func:`jaxclip.skip_nonfinite`
  ======================================  ===============================

  Norms are accumulated in float32 for half-precision leaves, whose dtypes
  are kept. :math:`\gamma_i` is stored per leaf of the params given to
  ``init``, so the updates must have the params' leaves (matched by path;
  a missing or an extra leaf is a ``ValueError`` naming it).

  Args:
    beta: EMA decay of :math:`\gamma_i`, in ``[0, 1)``. May be traced.
    lambda_abs: The global-norm threshold during warm-up, ``>= 0``. May be
      traced.
    lambda_rel: The relative threshold after warm-up, ``>= 0``. May be
      traced.
    warmup_steps: Steps ``t < warmup_steps`` clip by global norm (a
      non-negative int; may be traced).
    eps: Added to the global norm during warm-up, ``>= 0``.
    axis_name: Inside ``shard_map``/``pmap``/a named ``vmap``, the axis (or
      tuple of axes) the updates are sharded over; ``None`` (default)
      otherwise.
    replicated: Which leaves every device of ``axis_name`` holds in full.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``. The three are explained in ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is an
    :class:`AdaGCState`.

  Raises:
    ValueError: for a concrete ``beta`` outside ``[0, 1)``, a negative
      ``lambda_abs``/``lambda_rel``/``eps`` or a negative ``warmup_steps``.
    TypeError: for a hyperparameter that is not a real number (an int, for
      ``warmup_steps``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.adagc(beta=0.5, lambda_rel=1.0, warmup_steps=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> u, state = tx.update({'w': jnp.array([0.6, 0.8])}, state)  # warm-up
    >>> optax.tree.get(state, 'adagc_gamma').as_tree()['w']
    Array(1., dtype=float32)
    >>> u, state = tx.update({'w': jnp.array([6., 8.])}, state)  # clipped to 1
    >>> u['w']
    Array([0.6, 0.8], dtype=float32)

  References:
    Wang et al., `AdaGC: Improving Training Stability for Large Language
    Model Pretraining <https://arxiv.org/abs/2502.11034>`_, 2025
  """
  _validation.check_hparam(beta, "beta", lo=0, hi=1, hi_open=True, scalar=True)
  for value, name in ((lambda_abs, "lambda_abs"), (lambda_rel, "lambda_rel"), (eps, "eps")):
    _validation.check_hparam(value, name, lo=0, scalar=True)
  _validation.check_size(warmup_steps, "warmup_steps", minimum=0)

  def step(s: _per_tensor.Step):
    (gamma,), n = s.stats, s.norm
    first = s.prev_count == 0
    warming = s.count < jnp.asarray(warmup_steps)
    b, rel, abs_ = (
      _numerics.hparam_float32(beta),
      _numerics.hparam_float32(lambda_rel),
      _numerics.hparam_float32(lambda_abs),
    )
    denominator = s.global_norm + _numerics.hparam_float32(eps)
    global_scale = _numerics.safe_divide(abs_, denominator, denominator > abs_, otherwise=1)
    warm_norm = n * global_scale
    warm_gamma = jnp.where(first, warm_norm, jnp.minimum(gamma, warm_norm))
    gamma = jnp.where(first, n, gamma)
    threshold = rel * gamma
    scale = _numerics.safe_divide(threshold, n, n > threshold, otherwise=1)
    ada_gamma = b * gamma + (1 - b) * jnp.minimum(n, threshold)
    return (
      (jnp.where(warming, global_scale, scale),),
      (jnp.where(warming, warm_gamma, ada_gamma),),
    )

  rule = _per_tensor.Rule("adagc", AdaGCState, 2, step, _numerics.apply_scale)
  return _per_tensor.per_tensor_transform(rule, axis_name, replicated, partition_specs)


# ---------------------------------------------------------------- AdaClip


class AdaptiveValueClipState(NamedTuple):
  """State of :func:`adaptive_value_clip`.

  Attributes:
    value_clip_max_ema: A :class:`jaxclip.LeafStats`, one float32 per leaf
      of the params: the EMA :math:`m_i` of that tensor's largest absolute
      entry (not bias-corrected).
    value_clip_count: int32, the number of steps taken.
  """

  value_clip_max_ema: Any
  value_clip_count: jax.Array


def adaptive_value_clip(
  beta: ArrayLike = 0.999,
  *,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Stable-SPAM's AdaClip: clips entries above an EMA of each tensor's largest one.

  At step :math:`t` (counted from 1), for each leaf :math:`g_i`:

  .. math::

    m_i \leftarrow \beta m_i + (1 - \beta) \max|g_i|, \qquad
    \hat m_i = \frac{m_i}{1 - \beta^t}, \qquad
    g_{i,j} \leftarrow \frac{g_{i,j}}{\max|g_i|}\, \hat m_i
    \ \text{ where } |g_{i,j}| > \hat m_i,

  and the other entries are kept. As in the reference code the clipped
  entries are rescaled by the tensor's largest entry, so they keep their
  order and the largest one becomes :math:`\hat m_i` (an entry just above
  :math:`\hat m_i` may end below one just under it).

  ======================================  ===============================
  case                                    result
  ======================================  ===============================
  a tensor is all zeros                   it stays zeros (no ``0/0``)
  ``beta = 0``                            nothing is clipped
  a NaN/inf gradient                      it passes through; the state is
                                          kept as it was (count included):
                                          wrap the optimizer in
                                          :func:`jaxclip.skip_nonfinite`
  ======================================  ===============================

  The maxima are taken in float32 for half-precision leaves, whose dtypes
  are kept; :math:`m_i` is stored per leaf of the params given to ``init``.

  Args:
    beta: EMA decay of the maxima (the reference code's ``theta``), in
      ``[0, 1)``. May be traced.
    axis_name: Inside ``shard_map``/``pmap``/a named ``vmap``, the axis (or
      tuple of axes) the updates are sharded over; ``None`` (default)
      otherwise.
    replicated: Which leaves every device of ``axis_name`` holds in full.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``. The three are explained in ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is an
    :class:`AdaptiveValueClipState`.

  Raises:
    ValueError: for a concrete ``beta`` outside ``[0, 1)``.
    TypeError: for a ``beta`` that is not a real number.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.adaptive_value_clip(beta=0.5)
    >>> state = tx.init(jnp.zeros(3))
    >>> u, state = tx.update(jnp.array([1., -2., 0.5]), state)  # m = 1, m^ = 2
    >>> u, state = tx.update(jnp.array([10., -2., 0.5]), state)  # m = 5.5, m^ = 7.33
    >>> u
    Array([ 7.3333335, -2.       ,  0.5      ], dtype=float32)

  References:
    Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than
    16-Bit Adam <https://arxiv.org/abs/2502.17055>`_, 2025
  """
  _validation.check_hparam(beta, "beta", lo=0, hi=1, hi_open=True, scalar=True)

  def step(s: _per_tensor.Step):
    (m,), top = s.stats, s.norm
    b = _numerics.hparam_float32(beta)
    m = b * m + (1 - b) * top
    bound = m / _bias_correction(b, s.count)
    return (bound, _numerics.safe_divide(bound, top, top > 0, otherwise=1)), (m,)

  rule = _per_tensor.Rule(
    "adaptive_value_clip", AdaptiveValueClipState, math.inf, step, _numerics.scale_entries_above
  )
  return _per_tensor.per_tensor_transform(rule, axis_name, replicated, partition_specs)


# ---------------------------------------------------------------- AdaGN


class AdaptiveNormScaleState(NamedTuple):
  """State of :func:`adaptive_norm_scale`.

  Attributes:
    norm_scale_mu: A :class:`jaxclip.LeafStats`, one float32 per leaf of
      the params: the EMA of that tensor's norm (not bias-corrected).
    norm_scale_nu: A :class:`jaxclip.LeafStats`: the EMA of each tensor's
      squared norm.
    norm_scale_count: int32, the number of steps taken.
  """

  norm_scale_mu: Any
  norm_scale_nu: Any
  norm_scale_count: jax.Array


def adaptive_norm_scale(
  beta1: ArrayLike = 0.7,
  beta2: ArrayLike = 0.9,
  eps: ArrayLike = 1e-8,
  *,
  axis_name: Any = None,
  replicated: Any = None,
  partition_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Stable-SPAM's AdaGN: rescales each tensor to an Adam-like ratio of its norm's moments.

  At step :math:`t` (counted from 1), for each leaf :math:`g_i` with
  :math:`n = \|g_i\|`:

  .. math::

    m \leftarrow \beta_1 m + (1 - \beta_1) n, \qquad
    v \leftarrow \beta_2 v + (1 - \beta_2) n^2, \qquad
    g_i \leftarrow \frac{g_i}{n} \cdot
    \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon} .

  The new norm is about ``1`` while the norms are steady and falls below it
  after a spike (then :math:`\sqrt{\hat v}` outgrows :math:`\hat m`), so put
  the transform before the optimizer whose step size it should leave alone
  (Adam's update is invariant to this scale).

  ======================================  ===============================
  case                                    result
  ======================================  ===============================
  a tensor is all zeros (:math:`n = 0`)   it stays zeros; the moments
                                          still decay
  a NaN/inf gradient                      it passes through; the state is
                                          kept as it was (count included):
                                          wrap the optimizer in
                                          :func:`jaxclip.skip_nonfinite`
  ======================================  ===============================

  Norms are accumulated in float32 for half-precision leaves, whose dtypes
  are kept; the moments are stored per leaf of the params given to
  ``init``.

  Args:
    beta1: Decay of the norm's EMA (the reference code's ``gamma1``), in
      ``[0, 1)``. May be traced.
    beta2: Decay of the squared norm's EMA (``gamma2``), in ``[0, 1)``. May
      be traced.
    eps: Added to :math:`\sqrt{\hat v}`, ``>= 0``. May be traced.
    axis_name: Inside ``shard_map``/``pmap``/a named ``vmap``, the axis (or
      tuple of axes) the updates are sharded over; ``None`` (default)
      otherwise.
    replicated: Which leaves every device of ``axis_name`` holds in full.
    partition_specs: Where the leaves are sharded, instead of
      ``replicated``. The three are explained in ``docs/sharding_args.md``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is an
    :class:`AdaptiveNormScaleState`.

  Raises:
    ValueError: for a concrete ``beta1``/``beta2`` outside ``[0, 1)`` or a
      negative ``eps``.
    TypeError: for a hyperparameter that is not a real number.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax, jaxclip
    >>> tx = jaxclip.adaptive_norm_scale(eps=0.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> u, state = tx.update(jnp.array([3., 4.]), state)  # m^ = 5, v^ = 25
    >>> u
    Array([0.6, 0.8], dtype=float32)
    >>> u, state = tx.update(jnp.array([30., 40.]), state)  # a spike: scaled below 1
    >>> print(f"{jnp.linalg.norm(u):.3f}")
    0.864

  References:
    Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than
    16-Bit Adam <https://arxiv.org/abs/2502.17055>`_, 2025
  """
  _validation.check_hparam(beta1, "beta1", lo=0, hi=1, hi_open=True, scalar=True)
  _validation.check_hparam(beta2, "beta2", lo=0, hi=1, hi_open=True, scalar=True)
  _validation.check_hparam(eps, "eps", lo=0, scalar=True)

  def step(s: _per_tensor.Step):
    (mu, nu), n = s.stats, s.norm
    b1, b2 = _numerics.hparam_float32(beta1), _numerics.hparam_float32(beta2)
    # Saturated: a finite norm past ~1.8e19 squares to inf in float32.
    mu = _numerics.saturate(b1 * mu + (1 - b1) * n)
    nu = _numerics.saturate(b2 * nu + (1 - b2) * _numerics.saturate(n * n))
    denominator = _numerics.safe_sqrt(
      _numerics.saturate(nu / _bias_correction(b2, s.count))
    ) + _numerics.hparam_float32(eps)
    mu_hat = _numerics.saturate(mu / _bias_correction(b1, s.count))
    target = _numerics.safe_divide(mu_hat, denominator, denominator > 0, otherwise=1)
    return (_numerics.safe_divide(target, n, n > 0, otherwise=1),), (mu, nu)

  rule = _per_tensor.Rule(
    "adaptive_norm_scale", AdaptiveNormScaleState, 2, step, _numerics.apply_scale
  )
  return _per_tensor.per_tensor_transform(rule, axis_name, replicated, partition_specs)
