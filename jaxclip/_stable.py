"""Per-tensor adaptive clipping: AdaGC, and Stable-SPAM's AdaClip and AdaGN."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxclip import _distributed, _numerics, _validation

ArrayLike = jax.typing.ArrayLike


def _f32(x: Any) -> jax.Array:
  # Hyperparameters may arrive as bfloat16 arrays from inject_hyperparams.
  return jnp.asarray(x).astype(jnp.float32)


def _per_leaf_zeros(params: Any) -> Any:
  """One float32 zero per leaf of ``params`` (the shape of a per-tensor statistic)."""
  return jax.tree.map(lambda _: jnp.zeros((), jnp.float32), params)


class _PerLeaf(NamedTuple):
  """A per-tensor statistic's leaves, and where each leaf of the updates reads its own."""

  values: list[jax.Array]
  positions: list[int]
  treedef: Any

  def read(self) -> list[jax.Array]:
    return [self.values[i] for i in self.positions]

  def write(self, new: list[jax.Array]) -> Any:
    values = list(self.values)
    for i, v in zip(self.positions, new, strict=True):
      values[i] = v
    return jax.tree.unflatten(self.treedef, values)


def _per_leaf(stat: Any, updates: Any, fn_name: str, field: str) -> _PerLeaf:
  """The statistic ``stat`` (one scalar per leaf of the params given to init), matched
  to the leaves of ``updates`` by their paths.

  The updates may leave out leaves of the params (integer or key leaves,
  say): their statistics are kept as they are.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(stat)
  where = {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(flat)}
  positions = []
  for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]:
    i = where.get(jax.tree_util.keystr(path))
    if i is None:
      raise ValueError(
          f"{fn_name} keeps one {field} per leaf of the params given to init, but "
          f"the updates have a leaf at {jax.tree_util.keystr(path) or '<root>'} that "
          "the params have not; init it with params of the updates' structure.")
    positions.append(i)
  return _PerLeaf([v for _, v in flat], positions, treedef)


def _bias_correction(beta: jax.Array, count: jax.Array) -> jax.Array:
  """``1 - beta**t`` in float32."""
  return 1 - jnp.power(beta, count.astype(jnp.float32))


def _ratio(num: jax.Array, den: jax.Array, cond: jax.Array) -> jax.Array:
  """``num / den`` where ``cond`` (then ``den > 0``), else ``1``; finite gradients."""
  return jnp.where(cond, num / jnp.where(cond, den, 1), 1)


# ---------------------------------------------------------------- AdaGC


class AdaGCState(NamedTuple):
  """State of :func:`adagc`.

  Attributes:
    adagc_gamma: A float32 scalar per leaf of the params: the EMA
      :math:`\\gamma_i` of that tensor's clipped norm (its minimum during
      warm-up).
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
  ``init``; the updates may leave some of them out (matched by path).

  Args:
    beta: EMA decay of :math:`\gamma_i`, in ``[0, 1)``. May be traced.
    lambda_abs: The global-norm threshold during warm-up, ``>= 0``. May be
      traced.
    lambda_rel: The relative threshold after warm-up, ``>= 0``. May be
      traced.
    warmup_steps: Steps ``t < warmup_steps`` clip by global norm (a
      non-negative int; may be traced).
    eps: Added to the global norm during warm-up, ``>= 0``.
    axis_name: Inside ``shard_map``/``pmap``/a named ``vmap``, the axis over
      which the updates are sharded: each leaf's statistic is reduced across
      it, so every device takes the same decision and keeps the same state.
    replicated: Which leaves are the same on every device of ``axis_name``
      (inferred inside ``shard_map`` with ``check_vma=True``), as for
      :func:`jaxclip.ops.global_norm`.
    partition_specs: Where the leaves are sharded (``PartitionSpec``
      leaves, e.g. ``shard_map``'s ``in_specs``), instead of ``replicated``.

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
    >>> optax.tree.get(state, 'adagc_gamma')['w']
    Array(1., dtype=float32)
    >>> u, state = tx.update({'w': jnp.array([6., 8.])}, state)  # clipped to 1
    >>> u['w']
    Array([0.6, 0.8], dtype=float32)

  References:
    Wang et al., `AdaGC: Improving Training Stability for Large Language
    Model Pretraining <https://arxiv.org/abs/2502.11034>`_, 2025
  """
  _validation.check_decay(beta, "beta")
  for value, name in ((lambda_abs, "lambda_abs"), (lambda_rel, "lambda_rel"), (eps, "eps")):
    _validation.check_threshold(value, name)
    _validation.check_scalar(value, name)
  _validation.check_size(warmup_steps, "warmup_steps", minimum=0)

  def init_fn(params):
    return AdaGCState(adagc_gamma=_per_leaf_zeros(params),
                      adagc_count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, AdaGCState, "adagc")
    updates = _validation.numeric_leaves(updates, "adagc")
    leaves, treedef = jax.tree.flatten(updates)
    gammas = _per_leaf(state.adagc_gamma, updates, "adagc", "adagc_gamma")
    norms, global_norm = _distributed.tree_leaf_norms(
        updates, 2, axis_name, replicated, partition_specs)
    first = state.adagc_count == 0
    count = optax.safe_increment(state.adagc_count)
    warming = count < jnp.asarray(warmup_steps)
    b, rel = _f32(beta), _f32(lambda_rel)
    abs_ = _f32(lambda_abs)
    denominator = global_norm.astype(jnp.float32) + _f32(eps)
    global_scale = _ratio(abs_, denominator, denominator > abs_)

    out, new_gammas = [], []
    for x, n, gamma in zip(leaves, norms, gammas.read(), strict=True):
      n = n.astype(jnp.float32)
      warm_norm = n * global_scale
      warm_gamma = jnp.where(first, warm_norm, jnp.minimum(gamma, warm_norm))
      gamma = jnp.where(first, n, gamma)
      threshold = rel * gamma
      scale = _ratio(threshold, n, n > threshold)
      ada_gamma = b * gamma + (1 - b) * jnp.minimum(n, threshold)
      out.append(_numerics.apply_scale(x, jnp.where(warming, global_scale, scale)))
      new_gammas.append(jnp.where(warming, warm_gamma, ada_gamma))
    new_state = AdaGCState(gammas.write(new_gammas), count)
    return jax.tree.unflatten(treedef, out), _keep_if_nonfinite(
        [*norms, global_norm], new_state, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _keep_if_nonfinite(norms: list[jax.Array], new_state: Any, state: Any) -> Any:
  """``new_state``, or ``state`` unchanged (step count included) if a norm is not finite.

  A NaN or inf gradient never reaches an adaptive statistic: the step's
  updates pass through (non-finite, for a :func:`jaxclip.skip_nonfinite`
  around the optimizer to skip) and the statistics are those of the last
  finite step. The norms are reduced across ``axis_name`` already, so every
  replica takes the same decision.
  """
  finite = jnp.all(jnp.stack([jnp.isfinite(n) for n in norms])) if norms else jnp.array(True)
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_state, state)


# ---------------------------------------------------------------- AdaClip


class AdaptiveValueClipState(NamedTuple):
  """State of :func:`adaptive_value_clip`.

  Attributes:
    value_clip_max_ema: A float32 scalar per leaf of the params: the EMA
      :math:`m_i` of that tensor's largest absolute entry (not bias-corrected).
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
    axis_name: Inside ``shard_map``/``pmap``/a named ``vmap``, the axis over
      which the updates are sharded: each leaf's statistic is reduced across
      it, so every device takes the same decision and keeps the same state.
    replicated: Which leaves are the same on every device of ``axis_name``
      (inferred inside ``shard_map`` with ``check_vma=True``), as for
      :func:`jaxclip.ops.global_norm`.
    partition_specs: Where the leaves are sharded (``PartitionSpec``
      leaves, e.g. ``shard_map``'s ``in_specs``), instead of ``replicated``.

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
  _validation.check_decay(beta, "beta")

  def init_fn(params):
    return AdaptiveValueClipState(value_clip_max_ema=_per_leaf_zeros(params),
                                  value_clip_count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, AdaptiveValueClipState, "adaptive_value_clip")
    updates = _validation.numeric_leaves(updates, "adaptive_value_clip")
    leaves, treedef = jax.tree.flatten(updates)
    emas = _per_leaf(state.value_clip_max_ema, updates, "adaptive_value_clip",
                     "value_clip_max_ema")
    maxima, _ = _distributed.tree_leaf_norms(
        updates, math.inf, axis_name, replicated, partition_specs)
    count = optax.safe_increment(state.value_clip_count)
    b = _f32(beta)
    correction = _bias_correction(b, count)

    out, new_emas = [], []
    for x, top, m in zip(leaves, maxima, emas.read(), strict=True):
      top = top.astype(jnp.float32)
      m = b * m + (1 - b) * top
      bound = m / correction
      factor = _ratio(bound, top, top > 0)
      dtype = _numerics.compute_dtype(x.dtype)
      xc = x.astype(dtype)
      magnitude = jnp.abs(xc)
      over = magnitude > bound.astype(magnitude.dtype)
      out.append(jnp.where(over, xc * factor.astype(dtype), xc).astype(x.dtype))
      new_emas.append(m)
    new_state = AdaptiveValueClipState(emas.write(new_emas), count)
    return jax.tree.unflatten(treedef, out), _keep_if_nonfinite(maxima, new_state, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---------------------------------------------------------------- AdaGN


class AdaptiveNormScaleState(NamedTuple):
  """State of :func:`adaptive_norm_scale`.

  Attributes:
    norm_scale_mu: A float32 scalar per leaf of the params: the EMA of that
      tensor's norm (not bias-corrected).
    norm_scale_nu: A float32 scalar per leaf: the EMA of its squared norm.
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
    axis_name: Inside ``shard_map``/``pmap``/a named ``vmap``, the axis over
      which the updates are sharded: each leaf's statistic is reduced across
      it, so every device takes the same decision and keeps the same state.
    replicated: Which leaves are the same on every device of ``axis_name``
      (inferred inside ``shard_map`` with ``check_vma=True``), as for
      :func:`jaxclip.ops.global_norm`.
    partition_specs: Where the leaves are sharded (``PartitionSpec``
      leaves, e.g. ``shard_map``'s ``in_specs``), instead of ``replicated``.

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
  _validation.check_decay(beta1, "beta1")
  _validation.check_decay(beta2, "beta2")
  _validation.check_threshold(eps, "eps")
  _validation.check_scalar(eps, "eps")

  def init_fn(params):
    return AdaptiveNormScaleState(norm_scale_mu=_per_leaf_zeros(params),
                                  norm_scale_nu=_per_leaf_zeros(params),
                                  norm_scale_count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _validation.check_state(state, AdaptiveNormScaleState, "adaptive_norm_scale")
    updates = _validation.numeric_leaves(updates, "adaptive_norm_scale")
    leaves, treedef = jax.tree.flatten(updates)
    mus = _per_leaf(state.norm_scale_mu, updates, "adaptive_norm_scale", "norm_scale_mu")
    nus = _per_leaf(state.norm_scale_nu, updates, "adaptive_norm_scale", "norm_scale_nu")
    norms, _ = _distributed.tree_leaf_norms(updates, 2, axis_name, replicated, partition_specs)
    count = optax.safe_increment(state.norm_scale_count)
    b1, b2 = _f32(beta1), _f32(beta2)
    c1, c2 = _bias_correction(b1, count), _bias_correction(b2, count)
    e = _f32(eps)

    out, new_mus, new_nus = [], [], []
    for x, n, mu, nu in zip(leaves, norms, mus.read(), nus.read(), strict=True):
      n = n.astype(jnp.float32)
      mu = b1 * mu + (1 - b1) * n
      nu = b2 * nu + (1 - b2) * n * n
      denominator = _numerics.safe_sqrt(nu / c2) + e
      target = _ratio(mu / c1, denominator, denominator > 0)
      out.append(_numerics.apply_scale(x, _ratio(target, n, n > 0)))
      new_mus.append(mu)
      new_nus.append(nu)
    new_state = AdaptiveNormScaleState(mus.write(new_mus), nus.write(new_nus), count)
    return jax.tree.unflatten(treedef, out), _keep_if_nonfinite(norms, new_state, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
