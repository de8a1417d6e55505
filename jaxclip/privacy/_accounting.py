"""DP-SGD's privacy accounting, through Google's dp_accounting: the ε of a run."""

from __future__ import annotations

from jaxclip._kernel import _validation
from jaxclip.privacy._dp_events import (
  _PYTHON,
  _check,
  _dp_accounting,
  _epsilon,
  _step_multiplier,
)


def dp_epsilon(
  noise_multiplier: float,
  sampling_rate: float,
  steps: int,
  delta: float,
  *,
  accountant: str = "pld",
  count_stddev: float | None = None,
  num_counts: int = 1,
  max_batch_size: int | None = None,
  num_examples: int | None = None,
) -> float:
  r"""The :math:`\varepsilon` of DP-SGD after ``steps`` steps, at :math:`\delta`.

  Each step releases the clipped sum of a Poisson batch (each example in
  with probability :math:`q`, :func:`jaxclip.poisson_batch`) with Gaussian
  noise of multiplier :math:`\sigma` (:func:`jaxclip.dp_noise`): a
  Poisson-subsampled Gaussian mechanism, composed ``steps`` times, under the
  add-or-remove-one adjacency. Google's ``dp_accounting`` gives its
  :math:`\varepsilon` with its PLD accountant (privacy loss distributions,
  the tighter bound) or its RDP one (Rényi DP, faster).

  **The adaptive clip norm.** With ``count_stddev`` :math:`\sigma_b`, each
  step also releases the noisy count of
  :func:`jaxclip.quantile_clip_norm_update` with ``expected_batch_size``
  (the centred count, sensitivity :math:`\tfrac12`, so of multiplier
  :math:`2\sigma_b`). The two together are one Gaussian mechanism of
  multiplier (Andrew et al., Theorem 1)

  .. math::

    z = \big(\sigma^{-2} + (2\sigma_b)^{-2}\big)^{-1/2},

  which is accounted for. The uncentred count (no ``expected_batch_size``)
  has sensitivity 1: pass ``count_stddev=`` :math:`\sigma_b / 2` for it.

  **K counts.** An adaptive clip norm per layer or group (a pytree
  ``l2_norm_clip``, one :func:`jaxclip.quantile_clip_norm_update` per group)
  releases :math:`K` noisy counts of the same batch each step, each of
  sensitivity :math:`\tfrac12` and its own noise :math:`\sigma_b`: with
  ``num_counts=`` :math:`K` the step is the Gaussian mechanism of multiplier
  :math:`z = \big(\sigma^{-2} + K (2\sigma_b)^{-2}\big)^{-1/2}`.

  **Truncation.** :func:`jaxclip.poisson_batch` keeps at most
  ``max_batch_size`` :math:`B_{\max}` rows: a draw above it is cut to a
  random subset. Given ``max_batch_size`` and the dataset size
  ``num_examples`` :math:`N`, that is accounted for: with ``"pld"`` exactly,
  as ``dp_accounting``'s ``TruncatedSubsampledGaussianDpEvent`` on
  :math:`N + 1` examples (the dataset's neighbour with one example more,
  whose batches are cut more often; so :math:`N` is taken as public, as
  truncation's analysis needs); with
  ``"rdp"`` (which has no such event) by a bound: the Poisson steps'
  :math:`\varepsilon` at :math:`\delta/2`, valid if :math:`(1 +
  e^{\varepsilon})\, T p \le \delta/2`, :math:`p = P[\mathrm{Binomial}(N +
  1, q) > B_{\max}]` (else ``inf``): over :math:`T` steps the truncated and
  untruncated runs differ with probability at most :math:`Tp`.

  ==========================================  ==============================
  case                                        result
  ==========================================  ==============================
  ``steps = 0`` or ``sampling_rate = 0``      ``0.0``
  ``noise_multiplier = 0``                    ``inf``
  ``count_stddev = 0``                        ``inf`` (an exact count)
  ==========================================  ==============================

  Args:
    noise_multiplier: :math:`\sigma \ge 0`, the gradient noise's standard
      deviation in units of the clip norm (``dp_noise``'s).
    sampling_rate: :math:`q \in [0, 1]`, each example's probability of
      joining a batch.
    steps: The number of steps, an int ``>= 0``.
    delta: :math:`\delta \in (0, 1)`.
    accountant: ``"pld"`` (default) or ``"rdp"``.
    count_stddev: :math:`\sigma_b`, the count noise of the quantile-adaptive
      clip norm, or ``None`` (default): no count is released.
    num_counts: :math:`K \ge 1`, the noisy counts released each step (one
      per adaptive clip norm), each with noise ``count_stddev``; only with
      ``count_stddev``.
    max_batch_size: :math:`B_{\max} \ge 1`, the rows a Poisson batch is cut
      to (``poisson_batch``'s), or ``None`` (default): no truncation. Needs
      ``num_examples``.
    num_examples: :math:`N \ge 1`, the dataset size the batches are drawn
      from (with ``max_batch_size``).

  Returns:
    :math:`\varepsilon`, a float (``inf`` if unbounded).

  Raises:
    ImportError: if ``dp_accounting`` is not installed (``pip install
      jaxclip[dp]``).
    ValueError: for an argument outside its range, an unknown
      ``accountant``, ``num_counts`` without ``count_stddev``, or only one of
      ``max_batch_size`` and ``num_examples``.
    TypeError: for an argument that is not a number (``steps``,
      ``num_counts``, ``max_batch_size``, ``num_examples``: ints).

  Examples:
    >>> import jaxclip
    >>> # Abadi et al.'s MNIST: batches of 256 of 60,000, σ = 1.1, 15 epochs
    >>> round(jaxclip.dp_epsilon(1.1, 256 / 60_000, 3515, 1e-5), 3)
    1.134
    >>> round(jaxclip.dp_epsilon(1.1, 256 / 60_000, 3515, 1e-5, accountant="rdp"), 3)
    1.281

    With the adaptive clip norm's count, noised with :math:`\sigma_b = B/20`:

    >>> eps = jaxclip.dp_epsilon(
    ...     1.1, 256 / 60_000, 3515, 1e-5, accountant="rdp", count_stddev=256 / 20)
    >>> round(eps, 3)  # z = (1.1^-2 + 25.6^-2)^-1/2 = 1.0990
    1.284

    Batches of 128 expected of 10,000 examples, cut to 140 rows: about one
    step in eight is truncated, which nearly doubles ε (PLD, exact):

    >>> q = 128 / 10_000
    >>> round(jaxclip.dp_epsilon(3.0, q, 100, 1e-5), 3)
    0.147
    >>> round(jaxclip.dp_epsilon(3.0, q, 100, 1e-5, max_batch_size=140, num_examples=10_000), 3)
    0.277

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016

    Andrew et al., `Differentially Private Learning with Adaptive Clipping
    <https://arxiv.org/abs/1905.03871>`_, 2021

    Mironov, Talwar and Zhang, `Rényi Differential Privacy of the Sampled
    Gaussian Mechanism <https://arxiv.org/abs/1908.10530>`_, 2019

    Doroshenko et al., `Connect the Dots: Tighter Discrete Approximations of
    Privacy Loss Distributions <https://arxiv.org/abs/2207.04380>`_, 2022

    `arXiv:2508.15089 <https://arxiv.org/abs/2508.15089>`_, truncated Poisson
    sampling (``TruncatedSubsampledGaussianDpEvent``)
  """
  dp_accounting = _dp_accounting("dp_epsilon")
  n, k, truncation = _check(
    "dp_epsilon",
    sampling_rate,
    steps,
    delta,
    accountant,
    count_stddev,
    num_counts,
    max_batch_size,
    num_examples,
  )
  _validation.check_hparam(noise_multiplier, "noise_multiplier", lo=0, scalar=True, static=_PYTHON)
  z = _step_multiplier(
    float(noise_multiplier), None if count_stddev is None else float(count_stddev), k
  )
  return _epsilon(dp_accounting, z, float(sampling_rate), n, float(delta), accountant, truncation)
