"""DP-SGD's noise for a target ε: the inverse of dp_epsilon, by bisection."""

from __future__ import annotations

import math
from collections.abc import Callable

from jaxclip._kernel import _validation
from jaxclip.privacy._dp_events import (
  _PYTHON,
  _check,
  _dp_accounting,
  _epsilon,
  _step_multiplier,
  _Truncation,
  _truncation_probability,
)

# calibrate_noise returns a multiplier at most this factor above the smallest one.
_TOLERANCE = 1.01
_LARGEST = 2.0**40


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
