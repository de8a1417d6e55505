"""DP-SGD's privacy accounting, through Google's dp_accounting: ε of a run, and noise for an ε."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

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


def _check(
  fn_name: str, sampling_rate: Any, steps: Any, delta: Any, accountant: Any, count_stddev: Any
) -> int:
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
  return n


def _step_multiplier(noise_multiplier: float, count_stddev: float | None) -> float:
  """``z`` of one step: the gradient's ``σ``, with the count's ``2σ_b`` if it is released.

  Andrew et al., Theorem 1: ``z = (σ⁻² + (2σ_b)⁻²)^(-1/2)`` (the centred count
  has sensitivity ½, so its multiplier is ``2σ_b``).
  """
  if count_stddev is None:
    return noise_multiplier
  if noise_multiplier == 0 or count_stddev == 0:
    return 0.0
  return (noise_multiplier**-2 + (2 * count_stddev) ** -2) ** -0.5


def _epsilon(dp_accounting: Any, z: float, q: float, steps: int, delta: float, name: str) -> float:
  if steps == 0 or q == 0 or math.isinf(z):
    return 0.0
  if z == 0:
    return math.inf
  event = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
  )
  if name == "rdp":
    accountant = dp_accounting.rdp.RdpAccountant()
  else:  # "pld", or "pld_coarse" (calibrate_noise's first search)
    interval = 1e-3 if name == "pld_coarse" else 1e-4  # 1e-4: dp_accounting's default
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
  with _quiet():
    return float(accountant.compose(event).get_epsilon(delta))


def dp_epsilon(
  noise_multiplier: float,
  sampling_rate: float,
  steps: int,
  delta: float,
  *,
  accountant: str = "pld",
  count_stddev: float | None = None,
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

  Returns:
    :math:`\varepsilon`, a float (``inf`` if unbounded).

  Raises:
    ImportError: if ``dp_accounting`` is not installed (``pip install
      jaxclip[dp]``).
    ValueError: for an argument outside its range, or an unknown
      ``accountant``.
    TypeError: for an argument that is not a number (``steps``: an int).

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

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016

    Andrew et al., `Differentially Private Learning with Adaptive Clipping
    <https://arxiv.org/abs/1905.03871>`_, 2021

    Mironov, Talwar and Zhang, `Rényi Differential Privacy of the Sampled
    Gaussian Mechanism <https://arxiv.org/abs/1908.10530>`_, 2019

    Doroshenko et al., `Connect the Dots: Tighter Discrete Approximations of
    Privacy Loss Distributions <https://arxiv.org/abs/2207.04380>`_, 2022
  """
  dp_accounting = _dp_accounting("dp_epsilon")
  n = _check("dp_epsilon", sampling_rate, steps, delta, accountant, count_stddev)
  _validation.check_hparam(noise_multiplier, "noise_multiplier", lo=0, scalar=True, static=_PYTHON)
  z = _step_multiplier(
    float(noise_multiplier), None if count_stddev is None else float(count_stddev)
  )
  return _epsilon(dp_accounting, z, float(sampling_rate), n, float(delta), accountant)


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
  a looser bound), narrows the bracket to 0.5% with a PLD of a 10x coarser
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
  ``ValueError`` says so.

  Args:
    target_epsilon: The :math:`\varepsilon` to reach, ``> 0``.
    delta: :math:`\delta \in (0, 1)`.
    sampling_rate: :math:`q \in [0, 1]`.
    steps: The number of steps, an int ``>= 0``.
    accountant: ``"pld"`` (default) or ``"rdp"``.
    count_stddev: :math:`\sigma_b`, or ``None`` (default): no count.

  Returns:
    :math:`\sigma`, a float (``0.0`` when nothing is released: ``steps = 0``
    or ``sampling_rate = 0``).

  Raises:
    ImportError: if ``dp_accounting`` is not installed (``pip install
      jaxclip[dp]``).
    ValueError: for an argument outside its range, an unknown
      ``accountant``, or a target the count noise alone exceeds.
    TypeError: for an argument that is not a number (``steps``: an int).

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
  n = _check("calibrate_noise", sampling_rate, steps, delta, accountant, count_stddev)
  _validation.check_hparam(
    target_epsilon, "target_epsilon", lo=0, lo_open=True, scalar=True, static=_PYTHON
  )
  q, d, target = float(sampling_rate), float(delta), float(target_epsilon)
  count = None if count_stddev is None else float(count_stddev)
  if n == 0 or q == 0:
    return 0.0

  def epsilon(name: str) -> Callable[[float], float]:
    return lambda sigma: _epsilon(dp_accounting, _step_multiplier(sigma, count), q, n, d, name)

  if count is not None:
    floor = math.inf if count == 0 else _epsilon(dp_accounting, 2 * count, q, n, d, accountant)
    if floor > target:
      raise ValueError(
        f"count_stddev={count_stddev!r} is too small for ε = {target_epsilon}: the "
        f"adaptive clip norm's count alone spends ε = {floor:.4g} at any gradient noise. "
        "Raise count_stddev (Andrew et al. use B / 20) or the target."
      )
  if accountant == "rdp":
    return _search(epsilon("rdp"), target, 1.0, 2.0, _TOLERANCE)[1]
  # PLD: from RDP's answer, a search with a 10x coarser discretisation (10x
  # faster, ε larger by about 0.1-0.5%), then the default one's last steps.
  start = _search(epsilon("rdp"), target, 1.0, 2.0, _TOLERANCE)[1]
  hi = _search(epsilon("pld_coarse"), target, start, 1.1, 1.005)[1]
  exact = epsilon("pld")
  if exact(hi) > target:  # not expected (a coarser PLD bounds ε from above): go up
    hi *= _TOLERANCE
    while exact(hi) > target:
      hi *= _TOLERANCE
    return hi
  while exact(hi / _TOLERANCE) <= target:
    hi /= _TOLERANCE
  return hi
