"""DPSGD: one object that keeps DP-SGD's clip, noise, sampler and accounting consistent."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxclip._kernel import _validation
from jaxclip.privacy import (
  _calibration,
  _clip_batch,
  _dp_events,
  _ghost,
  _noise,
  _per_example,
  _poisson,
  _quantile,
)
from jaxclip.privacy._accountant import PrivacyAccountant
from jaxclip.privacy._poisson import PoissonBatch

_STATIC = "it fixes the run's accounting"


def default_max_batch_size(
  num_examples: int, sampling_rate: float, steps: int, delta: float
) -> int:
  """The smallest row count whose truncation costs next to nothing in ε.

  ``steps · P[Binomial(N + 1, q) > rows] <= δ / 1000``: the truncated-Poisson
  accounting (which charges the truncation whatever happens) then gives
  about the Poisson ε, and RDP's bound holds up to ε = 6.2. Fewer rows cost
  less compute and more noise: at ``N = 1,000``, ``qN = 50``, 20 steps, rows
  with ``steps · P = 1%`` (74) need 7% more noise for ε = 1.
  """
  from scipy import stats  # a dependency of dp_accounting

  mean = num_examples * sampling_rate
  std = math.sqrt(mean * (1 - sampling_rate))
  rows = max(1, math.ceil(mean + 3 * std))
  step = max(1, math.ceil(std / 8))
  limit, size = delta / 1000, num_examples + 1
  while rows < num_examples and steps * stats.binom.sf(rows, size, sampling_rate) > limit:
    rows += step
  return min(rows, num_examples)


class DPSGD:
  r"""DP-SGD's pieces from one description of the run, consistent by construction.

  Built from what defines the guarantee, the dataset size :math:`N`, the
  expected batch size :math:`\bar B` (sampling rate :math:`q = \bar B / N`),
  the number of steps :math:`T`, the target :math:`(\varepsilon, \delta)` and
  the clip norm :math:`C`, it calibrates the noise multiplier :math:`\sigma`
  (:func:`jaxclip.calibrate_noise`, with the truncation of the batches to
  ``max_batch_size`` rows and the adaptive clip's counts accounted for) and
  hands out the pieces of a step, each reading the same numbers:

  * :meth:`clipped_grad`: :func:`jaxclip.per_example_clipped_grad` at the
    clip :math:`C`;
  * :meth:`noise`: :func:`jaxclip.dp_noise` at :math:`\sigma`, its
    sensitivity read from the same clip, dividing by :math:`\bar B`, its key
    derived from ``key``;
  * :meth:`batch`: :func:`jaxclip.poisson_batch` of step ``t``, at rate
    :math:`q`, cut to the ``max_batch_size`` rows that were accounted for;
  * :attr:`accountant`: a :class:`jaxclip.PrivacyAccountant`; :meth:`record`
    adds the steps that ran, :meth:`epsilon` reports :math:`\varepsilon` so far;
  * with ``count_stddev``, :meth:`update_clip`: the quantile-adaptive clip
    norm (:func:`jaxclip.quantile_clip_norm_update`), one noisy count per leaf
    of ``l2_norm_clip``, all :math:`K` of them accounted for.

  **The key is secret.** The Poisson batches and the noise come from
  ``key``; whoever holds it can regenerate both, take the noise off the
  released updates and see which examples each step used. ``key=None`` (the
  default) draws it from the operating system's entropy (:mod:`secrets`),
  so two runs never share noise; in a job of several processes all take
  process 0's key (as :func:`jaxclip.dp_noise` does), so that they draw the
  same batches and noise. A key passed in must be as secret as the
  data (not ``jax.random.key(0)``); so are the noise states in checkpoints.

  Opacus's ``PrivacyEngine.make_private_with_epsilon`` does the same job for
  torch (a target :math:`\varepsilon` to a noise multiplier, wrapped model,
  optimizer and loader); jax_privacy's execution plans pair a batch
  selection strategy and noise with the ``dp_event`` they are accounted as.
  See ``docs/privacy.md``.

  Args:
    num_examples: :math:`N \ge 1`, the dataset size.
    expected_batch_size: :math:`\bar B \in (0, N]`: each example joins a
      batch with probability :math:`q = \bar B / N`.
    steps: :math:`T \ge 1`, the number of steps the noise is calibrated for.
    target_epsilon: :math:`\varepsilon > 0` after ``steps`` steps.
    delta: :math:`\delta \in (0, 1)`.
    l2_norm_clip: :math:`C \ge 0` finite, or a pytree prefix of the params,
      one clip norm per group (per-layer clipping: sensitivity
      :math:`\sqrt{\sum_k C_k^2}`); with ``count_stddev``, the adaptive clip's
      starting values.
    key: The secret ``jax.random`` key of the batches, the noise and the
      counts; ``None`` (default): drawn from the OS's entropy.
    method: ``"ghost"`` (default), ``"vmap"`` or ``"auto"``, for
      :meth:`clipped_grad`.
    max_batch_size: The rows a batch is cut to (accounted for); ``None``
      (default): the smallest size that truncates a batch of the run with
      probability at most :math:`\delta / 1000` (so truncation costs next to
      nothing in :math:`\varepsilon`).
    accountant: ``"pld"`` (default) or ``"rdp"``, for the calibration and
      the accountant.
    count_stddev: :math:`\sigma_b > 0`, the noise of the adaptive clip's
      counts (Andrew et al. use :math:`\bar B / 20`), or ``None`` (default):
      a fixed clip.

  Attributes:
    noise_multiplier: :math:`\sigma`, from :func:`jaxclip.calibrate_noise`.
    sampling_rate: :math:`q = \bar B / N`.
    max_batch_size: The rows of every batch.
    num_counts: :math:`K`, the counts released per step (0 for a fixed clip).
    accountant: The :class:`jaxclip.PrivacyAccountant` of the steps recorded.

  Raises:
    ValueError: for an argument outside its range (named), an unknown
      ``method`` or ``accountant``, or a target no noise reaches.
    TypeError: for an argument of the wrong type (named).
    ImportError: without ``dp_accounting`` (``pip install jaxclip[dp]``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jaxclip
    >>> dp = jaxclip.DPSGD(1000, 50, steps=20, target_epsilon=1.0, delta=1e-5,
    ...                    l2_norm_clip=1.0, max_batch_size=1000)  # N rows: never cut
    >>> round(dp.noise_multiplier, 2), dp.sampling_rate
    (1.37, 0.05)
    >>> xs = jax.random.normal(jax.random.key(1), (1000, 3))
    >>> grad_fn = dp.clipped_grad(lambda w, x: jnp.dot(w, x))
    >>> tx = optax.chain(dp.noise(), optax.sgd(0.1))
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for t in range(2):
    ...   batch = dp.batch(t)
    ...   total, num_clipped = grad_fn(params, xs[batch.indices], example_mask=batch.mask)
    ...   updates, state = tx.update(total, state, params)
    ...   params = optax.apply_updates(params, updates)
    ...   dp.record()
    >>> dp.accountant.steps, bool(0 < dp.epsilon() < 2.0)
    (2, True)

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016

    Andrew et al., `Differentially Private Learning with Adaptive Clipping
    <https://arxiv.org/abs/1905.03871>`_, 2021
  """

  def __init__(
    self,
    num_examples: int,
    expected_batch_size: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    l2_norm_clip: Any,
    *,
    key: jax.Array | None = None,
    method: str = "ghost",
    max_batch_size: int | None = None,
    accountant: str = "pld",
    count_stddev: float | None = None,
  ) -> None:
    n = _validation.check_size(num_examples, "num_examples", 1, static=_STATIC)
    _validation.check_hparam(
      expected_batch_size,
      "expected_batch_size",
      lo=0,
      hi=n,
      lo_open=True,
      scalar=True,
      static=_STATIC,
    )
    t = _validation.check_size(steps, "steps", 1, static=_STATIC)
    _validation.check_hparam(
      target_epsilon, "target_epsilon", lo=0, lo_open=True, scalar=True, static=_STATIC
    )
    _validation.check_hparam(
      delta, "delta", lo=0, hi=1, lo_open=True, hi_open=True, scalar=True, static=_STATIC
    )
    _clip_batch.check_clip(l2_norm_clip, scalar=True, finite=True)
    if method not in _ghost.METHODS:
      raise ValueError(f"DPSGD's method must be one of {_ghost.METHODS}, got {method!r}.")
    if accountant not in _dp_events._ACCOUNTANTS:
      raise ValueError(
        f"DPSGD's accountant must be one of {_dp_events._ACCOUNTANTS}, got {accountant!r}."
      )
    if count_stddev is not None:
      _validation.check_hparam(
        count_stddev, "count_stddev", lo=0, lo_open=True, scalar=True, finite=True, static=_STATIC
      )
    if key is None:
      key = jax.random.wrap_key_data(_noise.secret_key_data())
    else:
      _validation.check_key(key)
      if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a legacy uint32 key
    self.num_examples = n
    self.expected_batch_size = float(expected_batch_size)
    self.steps = t
    self.target_epsilon = float(target_epsilon)
    self.delta = float(delta)
    self.l2_norm_clip = l2_norm_clip
    self.method = method
    self.sampling_rate = self.expected_batch_size / n
    if max_batch_size is None:
      self.max_batch_size = default_max_batch_size(n, self.sampling_rate, t, float(delta))
    else:
      self.max_batch_size = _validation.check_size(
        max_batch_size, "max_batch_size", 1, static=_STATIC
      )
    self.count_stddev = None if count_stddev is None else float(count_stddev)
    self.num_counts = 0 if count_stddev is None else len(jax.tree.leaves(l2_norm_clip))
    self.accountant_name = accountant
    self.noise_multiplier = _calibration.calibrate_noise(
      self.target_epsilon,
      self.delta,
      self.sampling_rate,
      t,
      accountant=accountant,
      count_stddev=self.count_stddev,
      num_counts=max(self.num_counts, 1),
      max_batch_size=self.max_batch_size,
      num_examples=n,
    )
    self.accountant = PrivacyAccountant(self.delta, accountant=accountant)
    with jax.ensure_compile_time_eval():  # concrete even if built under a trace
      self._batch_key, self._noise_key, self._count_key = jax.random.split(key, 3)
      # An int seed for dp_noise's argument check; noise() then sets the state's key to
      # the run's noise key (all of its bits, where an int seed gives jax 32).
      self._seed = int(np.asarray(jax.random.bits(self._noise_key, (), jnp.uint32)))

  def __repr__(self) -> str:  # the key is secret: not shown
    return (
      f"DPSGD(num_examples={self.num_examples}, expected_batch_size={self.expected_batch_size:g}, "
      f"steps={self.steps}, target_epsilon={self.target_epsilon:g}, delta={self.delta:g}, "
      f"noise_multiplier={self.noise_multiplier:.4g}, max_batch_size={self.max_batch_size}, "
      f"num_counts={self.num_counts}, accountant={self.accountant_name!r})"
    )

  def _clip(self, l2_norm_clip: Any) -> Any:
    """The constructor's clip, or a current adaptive one of the same structure."""
    if l2_norm_clip is None:
      return self.l2_norm_clip
    if self.count_stddev is None:
      raise ValueError(
        "DPSGD was built with a fixed clip (no count_stddev): its clip is the constructor's "
        "l2_norm_clip, so pass none here (an adaptive clip needs count_stddev=)."
      )
    if jax.tree.structure(l2_norm_clip) != jax.tree.structure(self.l2_norm_clip):
      raise ValueError(
        "the clip passed must have the structure of DPSGD's l2_norm_clip (one adaptive "
        f"clip norm per group): {jax.tree.structure(l2_norm_clip)} against "
        f"{jax.tree.structure(self.l2_norm_clip)}."
      )
    return l2_norm_clip

  def clipped_grad(
    self, loss_fn: Callable[..., jax.Array], *, l2_norm_clip: Any = None, **kwargs: Any
  ) -> Callable[..., tuple[Any, ...]]:
    """:func:`jaxclip.per_example_clipped_grad` of ``loss_fn`` at the run's clip.

    ``l2_norm_clip`` is only for an adaptive clip (``count_stddev``): the
    current value, of the constructor's structure. ``kwargs`` go to
    ``per_example_clipped_grad`` (``method`` defaults to the run's; keep
    ``group_size`` at 1 unless the examples are users' groups).
    """
    if kwargs.get("normalize") is not None and self.count_stddev is not None:
      raise ValueError("normalize= has no threshold to adapt: use it with a fixed clip.")
    kwargs.setdefault("method", self.method)
    return _per_example.per_example_clipped_grad(loss_fn, self._clip(l2_norm_clip), **kwargs)

  def noise(self, l2_norm_clip: Any = None) -> optax.GradientTransformationExtraArgs:
    """:func:`jaxclip.dp_noise` at the run's noise multiplier, sensitivity and batch size.

    Its state's key is the run's secret noise key. ``l2_norm_clip`` is only for
    an adaptive clip (build the transform inside the step with the current
    clip, carry the state of ``noise().init(params)``).
    """
    inner = _noise.dp_noise(
      self._clip(l2_norm_clip),
      self.noise_multiplier,
      seed=self._seed,
      expected_batch_size=self.expected_batch_size,
    )
    noise_key = jax.random.key_data(self._noise_key)

    def init_fn(params):
      return inner.init(params)._replace(dp_noise_key=noise_key)

    return optax.GradientTransformationExtraArgs(init_fn, inner.update)

  def batch(self, step: Any) -> PoissonBatch:
    """Step ``step``'s Poisson batch: :func:`jaxclip.poisson_batch` at the run's rate and rows.

    ``step`` (an int, may be traced) picks the key: each step's batch is
    fresh, and the same step gives the same batch.
    """
    return _poisson.poisson_batch(
      jax.random.fold_in(self._batch_key, step),
      self.num_examples,
      self.sampling_rate,
      self.max_batch_size,
    )

  def update_clip(
    self,
    l2_norm_clip: Any,
    norms: Any,
    step: Any,
    *,
    example_mask: Any = None,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
  ) -> Any:
    """The adaptive clip's next value: one :func:`jaxclip.quantile_clip_norm_update` per group.

    ``norms`` are :meth:`clipped_grad`'s (``return_norms=True``): one array,
    or a pytree like the clip. Each group's count gets noise ``count_stddev``
    from its own key of step ``step``; all :math:`K` are accounted for.
    """
    if self.count_stddev is None:
      raise ValueError("update_clip needs an adaptive clip: build DPSGD with count_stddev=.")
    clip = self._clip(l2_norm_clip)
    leaves, treedef = jax.tree.flatten(clip)
    norm_leaves = [norms] if treedef.num_nodes == 1 else treedef.flatten_up_to(norms)
    keys = jax.random.split(jax.random.fold_in(self._count_key, step), len(leaves))
    new = [
      _quantile.quantile_clip_norm_update(
        c,
        n,
        target_quantile=target_quantile,
        learning_rate=learning_rate,
        count_stddev=self.count_stddev,
        key=k,
        example_mask=example_mask,
        expected_batch_size=self.expected_batch_size,
      )
      for c, n, k in zip(leaves, norm_leaves, keys, strict=True)
    ]
    return treedef.unflatten(new)

  def record(self, steps: int = 1) -> None:
    """Records ``steps`` steps that ran (after they ran) in :attr:`accountant`."""
    self.accountant.record(
      self.noise_multiplier,
      self.sampling_rate,
      steps=steps,
      count_stddev=self.count_stddev,
      num_counts=max(self.num_counts, 1),
      max_batch_size=self.max_batch_size,
      num_examples=self.num_examples,
    )

  def epsilon(self) -> float:
    r""":math:`\varepsilon` of the steps recorded so far, at the run's :math:`\delta`."""
    return self.accountant.epsilon()
