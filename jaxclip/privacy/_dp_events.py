"""DP-SGD's steps as Google's dp_accounting events: the accountants' shared checks and the ε
of a composition of identical-step segments."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from jaxclip._kernel import _validation

_ACCOUNTANTS = ("pld", "rdp")
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
