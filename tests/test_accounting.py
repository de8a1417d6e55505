"""dp_epsilon and calibrate_noise against dp_accounting, the adaptive clip's budget split, errors.

Kept cheap: few steps and noise multipliers of 2 and more (epsilons below 0.5),
where dp_accounting's PLD takes tens to hundreds of milliseconds; at sigma = 1.3 on the
same 60 steps it took 3.9 s on the 2-core test machine (loaded).
"""

from __future__ import annotations

import math
import sys

import pytest

import jaxclip

dp_accounting = pytest.importorskip("dp_accounting")

Q, STEPS, DELTA = 0.02, 60, 1e-5


def _reference(z, q, steps, delta, accountant):
  """dp_accounting composed step by step (not as one SelfComposedDpEvent)."""
  event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
  account = {"pld": dp_accounting.pld.PLDAccountant, "rdp": dp_accounting.rdp.RdpAccountant}[
    accountant
  ]()
  account.compose(event, steps)
  return account.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_dp_epsilon_is_dp_accountings(accountant):
  for z in (2.0, 3.0):
    got = jaxclip.dp_epsilon(z, Q, STEPS, DELTA, accountant=accountant)
    assert got == pytest.approx(_reference(z, Q, STEPS, DELTA, accountant), rel=1e-6)
  # More noise, fewer steps, a lower rate or a larger delta: a smaller epsilon.
  base = jaxclip.dp_epsilon(2.0, Q, STEPS, DELTA, accountant=accountant)
  for other in ((2.5, Q, STEPS, DELTA), (2.0, Q, 30, DELTA), (2.0, Q / 2, STEPS, DELTA)):
    assert jaxclip.dp_epsilon(*other, accountant=accountant) < base, other
  assert jaxclip.dp_epsilon(2.0, Q, STEPS, 1e-3, accountant=accountant) < base


def test_pld_is_tighter_than_rdp():
  pld = jaxclip.dp_epsilon(2.0, Q, STEPS, DELTA)
  rdp = jaxclip.dp_epsilon(2.0, Q, STEPS, DELTA, accountant="rdp")
  assert 0.2 < pld < rdp


def test_the_adaptive_clips_count_is_accounted_as_andrew_et_als_theorem_1():
  sigma, count = 2.0, 3.0  # the count's multiplier is 2 * 3 = 6
  z = (sigma**-2 + (2 * count) ** -2) ** -0.5
  for accountant in ("pld", "rdp"):
    got = jaxclip.dp_epsilon(sigma, Q, STEPS, DELTA, accountant=accountant, count_stddev=count)
    assert got == pytest.approx(jaxclip.dp_epsilon(z, Q, STEPS, DELTA, accountant=accountant))
    assert got > jaxclip.dp_epsilon(sigma, Q, STEPS, DELTA, accountant=accountant)
  # An exact count (count_stddev = 0) is not private.
  assert jaxclip.dp_epsilon(sigma, Q, STEPS, DELTA, count_stddev=0.0) == math.inf


def test_edge_cases_of_the_table():
  assert jaxclip.dp_epsilon(1.0, Q, 0, DELTA) == 0.0
  assert jaxclip.dp_epsilon(1.0, 0.0, STEPS, DELTA) == 0.0
  assert jaxclip.dp_epsilon(0.0, Q, STEPS, DELTA) == math.inf
  assert jaxclip.calibrate_noise(1.0, DELTA, Q, 0) == 0.0
  assert jaxclip.calibrate_noise(1.0, DELTA, 0.0, STEPS) == 0.0


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrate_noise_returns_the_smallest_multiplier_within_one_percent(accountant):
  for target in (0.3,) if accountant == "pld" else (0.3, 2.0):
    sigma = jaxclip.calibrate_noise(target, DELTA, Q, STEPS, accountant=accountant)
    assert jaxclip.dp_epsilon(sigma, Q, STEPS, DELTA, accountant=accountant) <= target
    # 1% less noise misses the target: sigma is within 1% of the smallest one.
    assert jaxclip.dp_epsilon(sigma / 1.01, Q, STEPS, DELTA, accountant=accountant) > target


def test_calibrate_noise_with_the_count_raises_the_gradient_noise():
  target, count = 2.0, 3.0
  plain = jaxclip.calibrate_noise(target, DELTA, Q, STEPS, accountant="rdp")
  sigma = jaxclip.calibrate_noise(target, DELTA, Q, STEPS, accountant="rdp", count_stddev=count)
  eps = lambda s: jaxclip.dp_epsilon(s, Q, STEPS, DELTA, accountant="rdp", count_stddev=count)
  assert eps(sigma) <= target < eps(sigma / 1.01)
  assert sigma > plain
  # The count alone must leave room: at multiplier 2 * 0.2 the budget is spent.
  with pytest.raises(ValueError, match="count_stddev.*too small"):
    jaxclip.calibrate_noise(target, DELTA, Q, STEPS, accountant="rdp", count_stddev=0.2)
  with pytest.raises(ValueError, match="count_stddev"):
    jaxclip.calibrate_noise(target, DELTA, Q, STEPS, count_stddev=0.0)


def test_without_dp_accounting_the_error_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "dp_accounting", None)  # "import dp_accounting" now fails
  with pytest.raises(ImportError, match=r"dp_epsilon.*pip install jaxclip\[dp\]"):
    jaxclip.dp_epsilon(1.0, Q, STEPS, DELTA)
  with pytest.raises(ImportError, match=r"calibrate_noise.*pip install jaxclip\[dp\]"):
    jaxclip.calibrate_noise(1.0, DELTA, Q, STEPS)


@pytest.mark.parametrize(
  "kwargs, error, name",
  [
    (dict(noise_multiplier=-1.0), ValueError, "noise_multiplier"),
    (dict(noise_multiplier="1"), TypeError, "noise_multiplier"),
    (dict(sampling_rate=1.5), ValueError, "sampling_rate"),
    (dict(sampling_rate=-0.1), ValueError, "sampling_rate"),
    (dict(steps=-1), ValueError, "steps"),
    (dict(steps=1.5), TypeError, "steps"),
    (dict(steps=True), TypeError, "steps"),
    (dict(delta=0.0), ValueError, "delta"),
    (dict(delta=1.0), ValueError, "delta"),
    (dict(accountant="gdp"), ValueError, "accountant"),
    (dict(count_stddev=-1.0), ValueError, "count_stddev"),
  ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, name):
  args = {**dict(noise_multiplier=1.0, sampling_rate=Q, steps=STEPS, delta=DELTA), **kwargs}
  with pytest.raises(error, match=name):
    jaxclip.dp_epsilon(
      args.pop("noise_multiplier"),
      args.pop("sampling_rate"),
      args.pop("steps"),
      args.pop("delta"),
      **args,
    )
  if "noise_multiplier" not in kwargs:
    args = {**dict(sampling_rate=Q, steps=STEPS, delta=DELTA), **kwargs}
    with pytest.raises(error, match=name):
      jaxclip.calibrate_noise(
        1.0, args.pop("delta"), args.pop("sampling_rate"), args.pop("steps"), **args
      )
  for target in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="target_epsilon"):
      jaxclip.calibrate_noise(target, DELTA, Q, STEPS)
