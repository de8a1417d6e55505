"""DP-SGD's privacy accounting, through Google's dp_accounting: ε of a run, and noise for an ε."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from jaxclip._kernel import _validation

_ACCOUNTANTS = ("pld", "rdp")
# calibrate_noise returns a multiplier at most this factor above the smallest one.
_TOLERANCE = 1.01
_LARGEST = 2.0**40
# Why the accountants' arguments cannot be traced.
_PYTHON = "the accountant runs in Python"


def _dp_accounting(fn_name: str) -> Any:
  """The ``dp_accounting`` package, or an ``ImportError`` naming the extra that installs it."""
  try:
    import dp_accounting
    from dp_accounting import pld, rdp  # noqa: F401 - the submodules the accountants live in
  except ImportError as e:
    raise ImportError(
      f"jaxclip.{fn_name} accounts with Google's dp_accounting package, which is not "
      "installed: pip install jaxclip[dp] (or pip install dp-accounting)."
    ) from e
  return dp_accounting


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """dp_accounting's RDP logs a warning for each order it skips (a looser ε, not an error)."""
  import absl.logging  # a dependency of dp_accounting

  level = absl.logging.get_verbosity()
  absl.logging.set_verbosity(absl.logging.ERROR)
  try:
    yield
  finally:
    absl.logging.set_verbosity(level)


class _Truncation(NamedTuple):
  """A Poisson batch of rate ``q`` from ``num_examples`` examples cut to ``max_batch_size`` rows."""

  num_examples: int
  max_batch_size: int


def _check(
  fn_name: str,
  sampling_rate: Any,
  steps: Any,
  delta: Any,
  accountant: Any,
  count_stddev: Any,
  num_counts: Any = 1,
  max_batch_size: Any = None,
  num_examples: Any = None,
) -> tuple[int, int, _Truncation | None]:
  """The shared checks of the accounting functions: ``(steps, num_counts, truncation)``."""
  _validation.check_hparam(
    sampling_rate, "sampling_rate", lo=0.0, hi=1.0, scalar=True, static=_PYTHON
  )
  _validation.check_hparam(
    delta, "delta", lo=0.0, hi=1.0, lo_open=True, hi_open=True, scalar=True, static=_PYTHON
  )
  n = _validation.check_size(steps, "steps", minimum=0, static=_PYTHON)
  if accountant not in _ACCOUNTANTS:
    raise ValueError(f"{fn_name}'s accountant must be one of {_ACCOUNTANTS}, got {accountant!r}.")
  if count_stddev is not None:
    _validation.check_hparam(count_stddev, "count_stddev", lo=0, scalar=True, static=_PYTHON)
  k = _validation.check_size(num_counts, "num_counts", minimum=1, static=_PYTHON)
  if count_stddev is None and k != 1:
    raise ValueError(
      f"{fn_name}: num_counts={num_counts!r} counts the noisy counts of count_stddev, which "
      "is not given: pass count_stddev= (the counts' noise) too."
    )
  truncation = None
  if max_batch_size is not None or num_examples is not None:
    if max_batch_size is None or num_examples is None:
      raise ValueError(
        f"{fn_name}: max_batch_size and num_examples go together (a Poisson batch of "
        "num_examples examples cut to max_batch_size rows), got "
        f"max_batch_size={max_batch_size!r}, num_examples={num_examples!r}."
      )
    rows = _validation.check_size(max_batch_size, "max_batch_size", minimum=1, static=_PYTHON)
    size = _validation.check_size(num_examples, "num_examples", minimum=1, static=_PYTHON)
    truncation = _Truncation(size, rows)
  return n, k, truncation


def _step_multiplier(
  noise_multiplier: float, count_stddev: float | None, num_counts: int = 1
) -> float:
  """``z`` of one step: the gradient's ``σ``, with ``K`` counts' ``2σ_b`` if they are released.

  Andrew et al., Theorem 1, for ``K`` counts: ``z = (σ⁻² + K (2σ_b)⁻²)^(-1/2)``
  (each centred count has sensitivity ½, so its multiplier is ``2σ_b``; the
  ``K + 1`` releases of one batch are one Gaussian mechanism whose normalised
  sensitivities add in squares).
  """
  if count_stddev is None:
    return noise_multiplier
  if noise_multiplier == 0 or count_stddev == 0:
    return 0.0
  return (noise_multiplier**-2 + num_counts * (2 * count_stddev) ** -2) ** -0.5


class _Segment(NamedTuple):
  """``steps`` identical steps: multiplier ``z``, rate ``q``, and the truncation if any."""

  z: float
  q: float
  steps: int
  truncation: _Truncation | None = None


def _truncation_probability(q: float, truncation: _Truncation) -> float:
  """``P[Binomial(N + 1, q) > B_max]``: a batch of a neighbouring dataset is truncated."""
  from scipy import stats  # a dependency of dp_accounting

  return float(stats.binom.sf(truncation.max_batch_size, truncation.num_examples + 1, q))


# Kept: calibrate_noise's last evaluation, dp_epsilon at the σ it returned, and a
# PrivacyAccountant that recorded those steps ask for the same ε, and one exact
# (truncated-Poisson) PLD takes seconds. Its arguments are numbers, so a hit is the same ε.
@functools.lru_cache(maxsize=256)
def _compose(dp_accounting: Any, segments: tuple[_Segment, ...], delta: float, name: str) -> float:
  """ε at ``delta`` of the segments run one after the other (``name``: the accountant).

  A truncated segment is dp_accounting's ``TruncatedSubsampledGaussianDpEvent``
  under PLD. RDP has no such event: its segments are accounted as plain Poisson
  at ``δ/2``, and the other ``δ/2`` must cover ``(1 + e^ε) Σ T_i p_i``, ``p_i``
  the probability that a step's batch is truncated on a neighbouring dataset
  (the truncated and untruncated runs differ with probability at most
  ``Σ T_i p_i``); else ε is ``inf``.
  """
  live = [s for s in segments if s.steps and s.q and not math.isinf(s.z)]
  if not live:
    return 0.0
  if any(s.z == 0 for s in live):
    return math.inf
  events, spill = [], 0.0
  for s in live:
    if s.truncation is None or name == "rdp":
      event = dp_accounting.PoissonSampledDpEvent(s.q, dp_accounting.GaussianDpEvent(s.z))
      if s.truncation is not None:
        spill += s.steps * _truncation_probability(s.q, s.truncation)
    else:
      # N + 1 examples: the dataset and its neighbour with one more, whose batches are
      # cut more often (the neighbour with one fewer gives a smaller ε).
      event = dp_accounting.TruncatedSubsampledGaussianDpEvent(
        s.truncation.num_examples + 1, s.q, s.truncation.max_batch_size, s.z
      )
    events.append(dp_accounting.SelfComposedDpEvent(event, s.steps))
  event = events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)
  if name == "rdp":
    accountant = dp_accounting.rdp.RdpAccountant()
  else:  # "pld", or "pld_coarse" (calibrate_noise's first search)
    interval = 1e-3 if name == "pld_coarse" else 1e-4  # 1e-4: dp_accounting's default
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
  truncated_rdp = name == "rdp" and any(s.truncation is not None for s in live)
  with _quiet():
    eps = float(accountant.compose(event).get_epsilon(delta / 2 if truncated_rdp else delta))
  if truncated_rdp and (1 + math.exp(min(eps, 700.0))) * spill > delta / 2:
    return math.inf
  return eps


def _epsilon(
  dp_accounting: Any,
  z: float,
  q: float,
  steps: int,
  delta: float,
  name: str,
  truncation: _Truncation | None = None,
) -> float:
  return _compose(dp_accounting, (_Segment(z, q, steps, truncation),), delta, name)


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


def _search(
  epsilon: Callable[[float], float], target: float, start: float, factor: float, tol: float
) -> tuple[float, float]:
  """``(lo, hi)``, ``hi <= tol * lo``, with ``epsilon(lo) > target >= epsilon(hi)``.

  ``epsilon`` decreases in its argument. From ``start``, steps by ``factor``
  until ``lo`` misses the target and ``hi`` meets it, then bisects
  (geometric means).
  """
  if epsilon(start) <= target:
    hi, lo = start, start / factor
    while epsilon(lo) <= target:
      hi, lo = lo, lo / factor
  else:
    lo, hi = start, start * factor
    while epsilon(hi) > target:
      if hi > _LARGEST:
        raise ValueError(f"no noise multiplier up to {_LARGEST:g} reaches ε = {target}.")
      lo, hi = hi, hi * factor
  while hi > tol * lo:
    mid = math.sqrt(lo * hi)
    if epsilon(mid) <= target:
      hi = mid
    else:
      lo = mid
  return lo, hi


def calibrate_noise(
  target_epsilon: float,
  delta: float,
  sampling_rate: float,
  steps: int,
  *,
  accountant: str = "pld",
  count_stddev: float | None = None,
  num_counts: int = 1,
  max_batch_size: int | None = None,
  num_examples: int | None = None,
) -> float:
  r"""The smallest DP-SGD noise multiplier whose :math:`\varepsilon` is at most a target.

  The inverse of :func:`jaxclip.dp_epsilon`: the noise multiplier
  :math:`\sigma` for :func:`jaxclip.dp_noise` such that ``steps`` steps of
  Poisson rate :math:`q` are :math:`(\varepsilon, \delta)`-DP with
  :math:`\varepsilon \le` ``target_epsilon``, and no more than 1% above the
  smallest such :math:`\sigma`: :math:`\varepsilon` decreases in
  :math:`\sigma`, and a bisection (over geometric means) stops once its
  bracket is 1% wide, returning the end that meets the target. With the PLD
  accountant the search starts from the RDP accountant's answer (fast, and
  a looser bound; from 1 where RDP cannot reach the target, which a count
  can cause), narrows the bracket to 0.5% with a PLD of a 10x coarser
  discretisation (``value_discretization_interval=1e-3``: 10x faster, and
  its :math:`\varepsilon` a little larger), and ends with two evaluations of
  the PLD :func:`jaxclip.dp_epsilon` uses (dp_accounting's default
  ``1e-4``): the answer meets the target there, and 1% less noise does not.

  With ``count_stddev`` :math:`\sigma_b` (the quantile-adaptive clip norm's
  count, see :func:`jaxclip.dp_epsilon`) the returned :math:`\sigma` is the
  gradient noise's, raised so that the step's multiplier
  :math:`z = (\sigma^{-2} + (2\sigma_b)^{-2})^{-1/2}` meets the target, as
  Andrew et al. do. The count alone must leave room: if even
  :math:`z = 2\sigma_b` (infinite gradient noise) exceeds the target, a
  ``ValueError`` says so. ``num_counts`` :math:`K` counts :math:`K` such
  counts, and ``max_batch_size`` with ``num_examples`` the truncation of
  each batch, as :func:`jaxclip.dp_epsilon` accounts for them.

  Args:
    target_epsilon: The :math:`\varepsilon` to reach, ``> 0``.
    delta: :math:`\delta \in (0, 1)`.
    sampling_rate: :math:`q \in [0, 1]`.
    steps: The number of steps, an int ``>= 0``.
    accountant: ``"pld"`` (default) or ``"rdp"``.
    count_stddev: :math:`\sigma_b`, or ``None`` (default): no count.
    num_counts: :math:`K \ge 1`, the counts released each step (with
      ``count_stddev``).
    max_batch_size: :math:`B_{\max}`, the rows a batch is cut to, or
      ``None`` (default). Needs ``num_examples``.
    num_examples: :math:`N`, the dataset size (with ``max_batch_size``).

  Returns:
    :math:`\sigma`, a float (``0.0`` when nothing is released: ``steps = 0``
    or ``sampling_rate = 0``).

  Raises:
    ImportError: if ``dp_accounting`` is not installed (``pip install
      jaxclip[dp]``).
    ValueError: for an argument outside its range, an unknown
      ``accountant``, a target the count noise alone exceeds, or a target
      no noise reaches (a truncation that spends it).
    TypeError: for an argument that is not a number (``steps``,
      ``num_counts``, ``max_batch_size``, ``num_examples``: ints).

  Examples:
    >>> import jaxclip
    >>> sigma = jaxclip.calibrate_noise(1.0, 1e-5, 0.01, 100, accountant="rdp")
    >>> bool(jaxclip.dp_epsilon(sigma, 0.01, 100, 1e-5, accountant="rdp") <= 1.0)
    True
    >>> bool(jaxclip.dp_epsilon(sigma / 1.01, 0.01, 100, 1e-5, accountant="rdp") > 1.0)
    True

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016

    Andrew et al., `Differentially Private Learning with Adaptive Clipping
    <https://arxiv.org/abs/1905.03871>`_, 2021
  """
  dp_accounting = _dp_accounting("calibrate_noise")
  n, k, truncation = _check(
    "calibrate_noise",
    sampling_rate,
    steps,
    delta,
    accountant,
    count_stddev,
    num_counts,
    max_batch_size,
    num_examples,
  )
  _validation.check_hparam(
    target_epsilon, "target_epsilon", lo=0, lo_open=True, scalar=True, static=_PYTHON
  )
  q, d, target = float(sampling_rate), float(delta), float(target_epsilon)
  count = None if count_stddev is None else float(count_stddev)
  if n == 0 or q == 0:
    return 0.0

  def epsilon(name: str, cut: _Truncation | None = truncation) -> Callable[[float], float]:
    return lambda sigma: _epsilon(
      dp_accounting, _step_multiplier(sigma, count, k), q, n, d, name, cut
    )

  if count is not None:
    # Infinite gradient noise: the K counts alone, z = 2 σ_b / √K (under PLD, the exact
    # accountant only if the 10x coarser one, whose ε is a little larger, misses).
    def floor_of(name: str) -> float:
      z = 2 * count / math.sqrt(k)
      return math.inf if count == 0 else _epsilon(dp_accounting, z, q, n, d, name, truncation)

    floor = floor_of("pld_coarse" if accountant == "pld" else accountant)
    if floor > target and accountant == "pld":
      floor = floor_of("pld")
    if floor > target:
      raise ValueError(
        f"count_stddev={count_stddev!r} is too small for ε = {target_epsilon}: the "
        f"adaptive clip norm's {k} count(s) alone spend ε = {floor:.4g} at any gradient "
        "noise. Raise count_stddev (Andrew et al. use B / 20) or the target."
      )
  if accountant == "rdp":
    if truncation is not None and 2 * n * _truncation_probability(q, truncation) > d / 2:
      raise ValueError(
        f"max_batch_size={max_batch_size!r} truncates too many of the {n} batches for the "
        "RDP accountant's bound ((1 + e^ε) T p <= δ/2 fails even at ε = 0): raise "
        'max_batch_size, or account exactly with accountant="pld".'
      )
    return _search(epsilon("rdp"), target, 1.0, 2.0, _TOLERANCE)[1]
  # PLD: from RDP's answer for untruncated batches (RDP is looser: where even its
  # count alone misses the target, from 1), a search with a 10x coarser
  # discretisation (10x faster, ε larger by about 0.1-0.5%), then the default
  # one's last steps.
  rdp_floor = (
    0.0 if count is None else _epsilon(dp_accounting, 2 * count / math.sqrt(k), q, n, d, "rdp")
  )
  if rdp_floor < target:
    start, factor = _search(epsilon("rdp", None), target, 1.0, 2.0, _TOLERANCE)[1], 1.1
  else:
    start, factor = 1.0, 2.0
  hi = _search(epsilon("pld_coarse"), target, start, factor, 1.005)[1]
  exact = epsilon("pld")
  if exact(hi) > target:  # not expected (a coarser PLD bounds ε from above): go up
    hi *= _TOLERANCE
    while exact(hi) > target:
      if hi > _LARGEST:
        raise ValueError(f"no noise multiplier up to {_LARGEST:g} reaches ε = {target}.")
      hi *= _TOLERANCE
    return hi
  while exact(hi / _TOLERANCE) <= target:
    hi /= _TOLERANCE
  return hi
