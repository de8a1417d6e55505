"""Quantile-adaptive clipping: a DP-SGD clip norm that tracks a quantile of the norms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _validation
from jaxclip._kernel._typing import ArrayLike


def _check_norms(norms: Any) -> jax.Array:
  """``norms`` as a 1-D, non-empty array of real numbers (shapes are static, even traced)."""
  try:
    dtype = norms.dtype if isinstance(norms, jax.Array) else np.asarray(norms).dtype
  except (TypeError, ValueError):
    dtype = None
  if dtype is None or not _validation.is_real(dtype):
    raise TypeError(
      "norms must be an array of real numbers (the per-example gradient norms), got "
      f"{norms!r:.100}."
    )
  norms = _numerics.as_array(norms)
  if norms.ndim != 1 or norms.shape[0] == 0:
    raise ValueError(
      "norms must be a non-empty 1-D array of the batch's per-example norms, got shape "
      f"{norms.shape}."
    )
  return norms


def _check_flag(value: Any, name: str) -> None:
  """Raises ``TypeError`` unless a concrete ``value`` is a bool (or a 0/1 number)."""
  v = _validation.concrete_value(value)
  if v is None:
    return
  if not (
    v.dtype == np.bool_
    or (
      jnp.issubdtype(v.dtype, jnp.number) and not np.iscomplexobj(v) and np.all((v == 0) | (v == 1))
    )
  ):
    raise TypeError(f"{name} must be a bool, got {value!r}.")


def quantile_clip_norm_update(
  clip_norm: ArrayLike,
  norms: ArrayLike,
  *,
  target_quantile: ArrayLike = 0.5,
  learning_rate: ArrayLike = 0.2,
  count_stddev: ArrayLike = 0.0,
  key: jax.Array | None = None,
  geometric: ArrayLike = True,
  example_mask: ArrayLike | None = None,
  expected_batch_size: ArrayLike | None = None,
) -> jax.Array:
  r"""Moves a DP-SGD clip norm towards a quantile of the per-example gradient norms.

  One step of the quantile-adaptive clipping of Andrew et al.: with the
  batch's :math:`B` per-example pre-clip norms :math:`n_i`, the fraction of
  them at or below the clip norm :math:`C` is counted with Gaussian noise,

  .. math::

    \bar b = \frac{1}{B}\Big(\sum_{i=1}^{B} \mathbb{1}[n_i \le C]
    + \mathcal{N}(0, \sigma_b^2)\Big),

  and :math:`C` takes a step on the quantile loss, whose gradient is
  :math:`\bar b - q`:

  .. math::

    C \leftarrow C \, e^{-\eta (\bar b - q)} \ \text{(geometric)}, \qquad
    C \leftarrow \max\big(0,\ C - \eta (\bar b - q)\big) \ \text{(linear)}.

  When more than a fraction :math:`q` of the norms lie below :math:`C` it
  shrinks, when fewer it grows, so it settles where a fraction :math:`q` of
  the examples are left unclipped: near the :math:`q`-quantile of their norms.
  Call it once per step with the norms of that step's batch, and clip the
  next batch with the returned value. The geometric update (the paper's
  choice, with :math:`\eta = 0.2`) moves by a factor of at most
  :math:`e^{\eta}` per step, whatever the scale of the norms; the linear one by
  at most :math:`\eta` in absolute terms, and is clamped at ``0`` so the clip
  norm never goes negative (the paper's linear rule has no clamp).
  As in the paper, :math:`\bar b` is used as it comes out, noise included
  (TF Privacy's ``QuantileEstimatorQuery`` clips it to ``[0, 1]`` first).

  **Privacy.** The noisy count :math:`\bar b` is released, so it has a
  privacy cost of its own, to be accounted for together with that of the
  noised gradient sum: each example moves the count by at most one, and the
  paper sets ``count_stddev`` to about :math:`B/20`, raising the gradient
  noise slightly so that the total budget is unchanged. With
  ``count_stddev=0`` the update reads the exact count and is not private.
  Account for it with :func:`jaxclip.dp_epsilon` or choose the gradient
  noise with :func:`jaxclip.calibrate_noise`, both given ``count_stddev``
  (``pip install jaxclip[dp]``), or let :class:`jaxclip.DPSGD` do it, as
  ``examples/dp_sgd.py`` does. One update per layer or group (a clip norm
  each) releases :math:`K` counts a step: pass ``num_counts=`` :math:`K`
  too (:meth:`jaxclip.DPSGD.update_clip` makes the :math:`K` updates, each
  with its own key).
  :math:`B` is the number of real examples (the length of ``norms``, or the
  ``True`` entries of ``example_mask``).

  **Poisson batches.** With ``expected_batch_size`` :math:`\bar B` given, the
  count is the centred one of Andrew et al. and TF Privacy's
  ``QuantileEstimatorQuery``:

  .. math::

    \bar b = \frac{1}{\bar B}\Big(\sum_{i\ \mathrm{real}}
    \big(\mathbb{1}[n_i \le C] - \tfrac12\big) + \mathcal{N}(0, \sigma_b^2)\Big)
    + \tfrac12 .

  Adding or removing one example then moves the noised sum by at most
  :math:`\tfrac12` (not 1), so the count is a Gaussian mechanism of noise
  multiplier :math:`2\sigma_b`, and dividing by :math:`\bar B` (public)
  rather than by the drawn batch size (private) keeps it so. Together with
  gradient noise of multiplier :math:`\sigma` the step is one Gaussian
  mechanism of multiplier :math:`z = (\sigma^{-2} + (2\sigma_b)^{-2})^{-1/2}`
  (the paper's Theorem 1). Without ``expected_batch_size`` the count is
  uncentred, its sensitivity is 1, and the multiplier is :math:`\sigma_b`;
  it is divided by the number of real examples, itself private under
  Poisson sampling, so pass ``expected_batch_size`` there.

  **An empty batch.** Without ``expected_batch_size``, a batch with no real
  example (every entry of ``example_mask`` False, which a small Poisson
  batch can be) has no fraction to measure: ``clip_norm`` comes back
  unchanged, noise or not (dividing the noise alone by 1 would move
  :math:`C` by a factor up to :math:`e^{\eta q}` each time, upward at
  :math:`q = 0.5`). With ``expected_batch_size`` the centred count of an
  empty batch is :math:`\tfrac12 + \mathcal{N}(0, \sigma_b^2) / \bar B`,
  and :math:`C` moves by :math:`\eta (\tfrac12 - q)` plus the noise's part,
  as the mechanism that is accounted for requires.

  ======================================  ===============================
  case                                    result
  ======================================  ===============================
  a NaN or ``+inf`` norm                  it is not :math:`\le C`, so it
                                          counts as above the clip norm:
                                          the result stays finite
  ``clip_norm = 0``, geometric            stays ``0``: start from a
                                          positive clip norm
  ``clip_norm = inf``                     stays ``inf``
  ``learning_rate = 0``                   ``clip_norm`` is returned
  every ``example_mask`` entry False      without ``expected_batch_size``:
                                          ``clip_norm`` is returned
  a traced negative ``clip_norm``         acts as ``0``
  ======================================  ===============================

  The update is computed in float32 (float64 for a float64 ``clip_norm``) and
  cast back to ``clip_norm``'s dtype (an integer one gives float32). In
  bfloat16 a step smaller than the dtype's spacing rounds away, so keep the
  clip norm in float32 across steps.

  Args:
    clip_norm: The current clip norm :math:`C`, a scalar ``>= 0``. May be
      traced.
    norms: The 1-D array of the batch's :math:`B` per-example gradient norms
      before clipping, as returned by
      ``jaxclip.per_example_clipped_grad(..., return_norms=True)``.
    target_quantile: The fraction :math:`q` of examples to leave unclipped, in
      ``[0, 1]``. May be traced.
    learning_rate: The step size :math:`\eta`, ``>= 0`` and finite. May be
      traced.
    count_stddev: The standard deviation :math:`\sigma_b` of the Gaussian
      noise added to the count, ``>= 0`` and finite. May be traced (then a
      ``key`` is required, as it may be positive).
    key: A ``jax.random`` key: the noise is ``count_stddev *
      jax.random.normal(key)`` (float32). Required unless ``count_stddev`` is
      a concrete ``0``; use a fresh key each step.
    geometric: The geometric update if true, else the linear one. May be
      traced.
    example_mask: A boolean array like ``norms``, True for a real example
      (as passed to ``per_example_clipped_grad(...)(..., example_mask=)``):
      only those are counted. ``None``: all are.
    expected_batch_size: The expected batch size :math:`\bar B` of Poisson
      sampling, ``> 0``: divide by it and centre the count (above). May be
      traced. ``None``: divide by the number of real examples; with none,
      ``clip_norm`` is returned unchanged.

  Returns:
    The new clip norm, a scalar of ``clip_norm``'s dtype.

  Raises:
    ValueError: for a concrete ``clip_norm`` that is negative or NaN, a
      ``target_quantile`` outside ``[0, 1]``, a negative or non-finite
      ``learning_rate`` or ``count_stddev``, a hyperparameter that is not a
      scalar, ``norms`` that are not a non-empty 1-D array, or a
      ``count_stddev`` that is positive or traced without a ``key``, an
      ``example_mask`` that is not boolean of the norms' shape, or a
      non-positive ``expected_batch_size``.
    TypeError: for a hyperparameter or ``norms`` that are not real numbers, a
      ``geometric`` that is not a bool, or a ``key`` that is not one key.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jaxclip
    >>> norms = jnp.array([0.5, 1.5, 2.0, 4.0])  # 1 of 4 at or below 1.0
    >>> jaxclip.quantile_clip_norm_update(1.0, norms)  # 1.0 * exp(-0.2 * (0.25 - 0.5))
    Array(1.0512711, dtype=float32)
    >>> jaxclip.quantile_clip_norm_update(1.0, norms, geometric=False)  # 1.0 + 0.2 * 0.25
    Array(1.05, dtype=float32)

    With a noisy count, as DP-SGD needs (the paper's :math:`\sigma_b = B/20`):

    >>> new = jaxclip.quantile_clip_norm_update(
    ...     1.0, norms, count_stddev=len(norms) / 20, key=jax.random.key(0))
    >>> bool(jnp.exp(-0.2) <= new <= jnp.exp(0.2))
    True

    With a Poisson batch padded to a fixed shape, only the real examples
    count, divided by the expected batch size (here 4, so the same as above):

    >>> padded = jnp.array([0.5, 1.5, 9.0, 2.0, 4.0, 9.0])
    >>> mask = jnp.array([True, True, False, True, True, False])
    >>> jaxclip.quantile_clip_norm_update(1.0, padded, example_mask=mask, expected_batch_size=4)
    Array(1.0512711, dtype=float32)

    Iterated over steps, it settles near the ``target_quantile`` of the norms:

    >>> step = lambda c, n: (jaxclip.quantile_clip_norm_update(c, n), None)
    >>> batches = jnp.exp(jax.random.normal(jax.random.key(1), (500, 64)))
    >>> c, _ = jax.lax.scan(step, jnp.float32(0.1), batches)  # median of exp(N(0, 1)) is 1
    >>> bool(0.8 < c < 1.25)
    True

  References:
    Andrew et al., `Differentially Private Learning with Adaptive Clipping
    <https://arxiv.org/abs/1905.03871>`_, 2021
  """
  for value, name in (
    (clip_norm, "clip_norm"),
    (learning_rate, "learning_rate"),
    (count_stddev, "count_stddev"),
  ):
    _validation.check_hparam(value, name, lo=0, scalar=True, finite=name != "clip_norm")
  _validation.check_hparam(target_quantile, "target_quantile", lo=0.0, hi=1.0, scalar=True)
  _validation.check_scalar(geometric, "geometric")
  _check_flag(geometric, "geometric")
  norms = _check_norms(norms)
  example_mask = _validation.check_mask(example_mask, norms.shape[0])
  if expected_batch_size is not None:
    _validation.check_hparam(
      expected_batch_size, "expected_batch_size", lo=0, lo_open=True, scalar=True, finite=True
    )
  if key is not None:
    _validation.check_key(key)
  else:
    stddev = _validation.concrete_value(count_stddev)
    if stddev is None:
      raise ValueError(
        "count_stddev is traced, so it may be positive, and the noise needs a key: pass "
        "key=jax.random.key(...) (or a concrete count_stddev=0.0 for no noise)."
      )
    if stddev > 0:
      raise ValueError(
        f"count_stddev={count_stddev!r} > 0 adds noise to the count, which needs a key: "
        "pass key=jax.random.key(...), a fresh one each step."
      )

  c = _numerics.as_array(clip_norm)
  out_dtype = c.dtype if jnp.issubdtype(c.dtype, jnp.inexact) else jnp.dtype(jnp.float32)
  dtype = _numerics.compute_dtype(out_dtype)
  c = jnp.maximum(c.astype(dtype), jnp.zeros((), dtype))
  # Compared in the wider of the two dtypes, so a half-precision side is not rounded.
  cmp = jnp.promote_types(
    dtype,
    _numerics.compute_dtype(
      norms.dtype if jnp.issubdtype(norms.dtype, jnp.inexact) else jnp.float32
    ),
  )
  below = norms.astype(cmp) <= c.astype(cmp)  # NaN and +inf norms are not below
  real = jnp.ones(norms.shape, jnp.bool_) if example_mask is None else example_mask
  half = jnp.asarray(0.0 if expected_batch_size is None else 0.5, dtype)
  count = jnp.sum(jnp.where(real, below.astype(dtype) - half, jnp.zeros((), dtype)))
  if key is not None:
    noise = jax.random.normal(key, (), jnp.float32).astype(dtype)
    count = count + jnp.asarray(count_stddev).astype(dtype) * noise
  if expected_batch_size is None:
    denominator = (
      jnp.asarray(norms.shape[0], dtype)
      if example_mask is None
      else jnp.maximum(jnp.sum(real.astype(dtype)), jnp.ones((), dtype))
    )
  else:
    denominator = jnp.asarray(expected_batch_size).astype(dtype)
  fraction = count / denominator + half
  step = jnp.asarray(learning_rate).astype(dtype) * (
    fraction - jnp.asarray(target_quantile).astype(dtype)
  )
  geometric_c = c * jnp.exp(-step)
  linear_c = jnp.maximum(c - step, jnp.zeros((), dtype))
  new = jnp.where(jnp.asarray(geometric).astype(jnp.bool_), geometric_c, linear_c)
  if expected_batch_size is None and example_mask is not None:
    new = jnp.where(jnp.any(real), new, c)  # no real example: nothing measured
  return new.astype(out_dtype)
