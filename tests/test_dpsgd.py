"""PrivacyAccountant and DPSGD (issue #48): the steps that ran, accounted; the pieces, consistent.

Kept cheap: small step counts, the RDP accountant for the object (its PLD
calibration takes seconds on the 2-core test machine) and rows that no draw
reaches (``max_batch_size`` at the dataset size), except where truncation and
PLD are the point (that test is slow: tests/conftest.py's SLOW_TESTS).
"""

from __future__ import annotations

import json
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip

dp_accounting = pytest.importorskip("dp_accounting")

Q, DELTA = 0.02, 1e-5


# --- PrivacyAccountant -----------------------------------------------------------------


def _by_hand(runs, accountant="pld", delta=DELTA):
  """dp_accounting composed by hand: each (sigma, q, steps) a Poisson-subsampled Gaussian."""
  account = {"pld": dp_accounting.pld.PLDAccountant, "rdp": dp_accounting.rdp.RdpAccountant}[
    accountant
  ]()
  for sigma, q, steps in runs:
    account.compose(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
  return account.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_the_accountant_composes_the_steps_that_ran(accountant):
  acc = jaxclip.PrivacyAccountant(DELTA, accountant=accountant)
  assert acc.epsilon() == 0.0 and acc.steps == 0
  for _ in range(3):
    acc.record(3.0, Q, steps=10)
  acc.record(2.0, Q / 2, steps=5)  # lowered noise and rate, later in the run
  assert acc.steps == 35
  assert len(acc.state_dict()["steps"]) == 2  # identical records merged
  want = _by_hand([(3.0, Q, 30), (2.0, Q / 2, 5)], accountant)
  assert acc.epsilon() == pytest.approx(want, rel=1e-6)
  # One step without noise: nothing is private any more.
  acc.record(0.0, Q)
  assert acc.epsilon() == float("inf")


def test_the_accountant_counts_k_counts_and_truncation_as_dp_epsilon_does():
  acc = jaxclip.PrivacyAccountant(DELTA)
  kw = dict(count_stddev=3.0, num_counts=4, max_batch_size=26, num_examples=1000)
  acc.record(3.0, Q, steps=20, **kw)
  assert acc.epsilon() == pytest.approx(jaxclip.dp_epsilon(3.0, Q, 20, DELTA, **kw), rel=1e-9)


@pytest.mark.parametrize("codec", ["json", "pickle"])
def test_the_accountant_resumes_from_a_checkpoint(codec):
  dumps, loads = (json.dumps, json.loads) if codec == "json" else (pickle.dumps, pickle.loads)
  whole = jaxclip.PrivacyAccountant(DELTA)
  first = jaxclip.PrivacyAccountant(DELTA)
  for acc in (whole, first):
    acc.record(3.0, Q, steps=20, count_stddev=2.0)
    acc.record(2.5, Q, steps=10)
  saved = dumps(first.state_dict())
  resumed = jaxclip.PrivacyAccountant(DELTA).load_state_dict(loads(saved))
  assert resumed.steps == 30 and resumed.epsilon() == first.epsilon()
  # Later steps add to it as to the run that never stopped.
  for acc in (whole, resumed):
    acc.record(2.5, Q, steps=10)
  assert resumed.state_dict() == whole.state_dict()
  assert resumed.epsilon() == whole.epsilon()
  # The state is a pytree of numbers (orbax saves it as one).
  leaves = jax.tree.leaves(resumed.state_dict())
  assert leaves and all(isinstance(x, (int, float)) for x in leaves)


def test_the_accountant_refuses_bad_arguments_naming_them():
  with pytest.raises(ValueError, match="delta"):
    jaxclip.PrivacyAccountant(0.0)
  with pytest.raises(ValueError, match="accountant"):
    jaxclip.PrivacyAccountant(DELTA, accountant="prv")
  acc = jaxclip.PrivacyAccountant(DELTA)
  with pytest.raises(ValueError, match="noise_multiplier"):
    acc.record(-1.0, Q)
  with pytest.raises(ValueError, match="sampling_rate"):
    acc.record(1.0, 1.5)
  with pytest.raises(TypeError, match="steps"):
    acc.record(1.0, Q, steps=1.5)
  with pytest.raises(ValueError, match="max_batch_size and num_examples"):
    acc.record(1.0, Q, max_batch_size=10)
  with pytest.raises(ValueError, match="keys"):
    acc.load_state_dict({"steps": [1]})
  with pytest.raises(ValueError, match="differ in length"):
    state = acc.state_dict() | {"steps": [1]}
    acc.load_state_dict(state)
  assert acc.steps == 0  # nothing was recorded by the refused calls


# --- DPSGD ---------------------------------------------------------------------------


N, B, STEPS = 1000, 20, 30


def _dp(**kwargs):
  args = dict(
    num_examples=N,
    expected_batch_size=B,
    steps=STEPS,
    target_epsilon=1.0,
    delta=DELTA,
    l2_norm_clip=1.0,
    max_batch_size=N,  # never cut
    accountant="rdp",
  )
  return jaxclip.DPSGD(**{**args, **kwargs})


def test_dpsgd_calibrates_to_the_target_and_hands_out_consistent_pieces():
  dp = _dp(key=jax.random.key(7), method="vmap")
  q = B / N
  assert dp.sampling_rate == q
  kw = dict(max_batch_size=N, num_examples=N, accountant="rdp")
  assert dp.noise_multiplier == jaxclip.calibrate_noise(1.0, DELTA, q, STEPS, **kw)
  assert jaxclip.dp_epsilon(dp.noise_multiplier, q, STEPS, DELTA, **kw) <= 1.0
  # The noise reads its sensitivity from the clip: C = 1, sigma C noise on a zero sum, / B.
  tx = dp.noise()
  zeros = {"w": jnp.zeros(20_000)}
  noisy, _ = tx.update(zeros, tx.init(zeros))
  assert np.std(np.asarray(noisy["w"])) * B == pytest.approx(dp.noise_multiplier, rel=0.03)
  # The batches: rate q, max_batch_size rows, a fresh draw per step, the same for the same step.
  b0, b1 = dp.batch(0), dp.batch(1)
  assert b0.indices.shape == (N,) and not np.array_equal(b0.indices, b1.indices)
  np.testing.assert_array_equal(dp.batch(0).indices, b0.indices)
  sizes = jax.vmap(lambda t: dp.batch(t).mask.sum())(jnp.arange(30))
  assert abs(float(sizes.mean()) - B) < 3.5  # the mean of 30 draws: sd 0.8
  # The clipped gradient: per_example_clipped_grad at the same clip.
  xs = jax.random.normal(jax.random.key(0), (N, 3)) * 10
  loss = lambda w, x: jnp.dot(w, x)
  got = dp.clipped_grad(loss)(jnp.zeros(3), xs[b0.indices], example_mask=b0.mask)
  want = jaxclip.per_example_clipped_grad(loss, 1.0)(
    jnp.zeros(3), xs[b0.indices], example_mask=b0.mask
  )
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert int(got[1]) == int(want[1]) == int(b0.mask.sum())


def test_per_layer_clip_noise_reads_the_whole_sensitivity():
  dp = _dp(l2_norm_clip={"a": 3.0, "b": 4.0}, key=jax.random.key(3))  # S = 5
  tx = dp.noise()
  zeros = {"a": jnp.zeros(20_000), "b": jnp.zeros(20_000)}
  noisy, _ = tx.update(zeros, tx.init(zeros))
  std = np.std(np.asarray(noisy["a"])) * B
  assert std == pytest.approx(5 * dp.noise_multiplier, rel=0.03)


def test_dpsgd_keys_are_secret_and_drawn_from_the_os():
  a, b = _dp(), _dp()  # no key: each from the OS's entropy
  assert not np.array_equal(a.batch(0).indices, b.batch(0).indices)
  zeros = {"w": jnp.zeros(64)}
  na = a.noise().update(zeros, a.noise().init(zeros))[0]["w"]
  nb = b.noise().update(zeros, b.noise().init(zeros))[0]["w"]
  assert not np.allclose(na, nb)
  # A given key gives the same run; the repr shows no key.
  c, d = _dp(key=jax.random.key(11)), _dp(key=jax.random.key(11))
  np.testing.assert_array_equal(c.batch(5).indices, d.batch(5).indices)
  assert "key" not in repr(c)
  # The noise key is the run's, not dp_noise's 32-bit seed: not the key of any small seed.
  state = c.noise().init(zeros)
  seeds = {tuple(np.asarray(jax.random.key_data(jax.random.key(s)))) for s in range(4)}
  assert tuple(np.asarray(state.dp_noise_key)) not in seeds


def test_dpsgd_records_the_steps_that_ran_and_reaches_the_target():
  dp = _dp(key=jax.random.key(1))
  assert dp.epsilon() == 0.0
  dp.record(10)
  dp.record(STEPS - 10)
  assert dp.accountant.steps == STEPS
  assert dp.epsilon() == pytest.approx(
    jaxclip.dp_epsilon(
      dp.noise_multiplier, B / N, STEPS, DELTA, max_batch_size=N, num_examples=N, accountant="rdp"
    ),
    rel=1e-9,
  )
  assert dp.epsilon() <= 1.0
  state = json.loads(json.dumps(dp.accountant.state_dict()))
  resumed = jaxclip.PrivacyAccountant(DELTA, accountant="rdp").load_state_dict(state)
  assert resumed.epsilon() == dp.epsilon()


def test_dpsgd_accounts_for_truncation_exactly_by_pld():
  """26 rows (a tenth of the batches cut) cost noise, accounted by PLD (slow: about 30 s)."""
  dp = jaxclip.DPSGD(N, B, 10, 1.0, DELTA, 1.0, key=jax.random.key(0), max_batch_size=26)
  plain = jaxclip.calibrate_noise(1.0, DELTA, B / N, 10)
  assert dp.noise_multiplier > 1.05 * plain
  assert dp.batch(0).indices.shape == (26,)
  dp.record(10)
  cut = jaxclip.dp_epsilon(dp.noise_multiplier, B / N, 10, DELTA)
  assert dp.epsilon() <= 1.0 and dp.epsilon() > cut  # the truncation is charged


def test_dpsgd_adaptive_clip_accounts_for_k_counts():
  clip = {"a": 1.0, "b": 1.0, "c": 1.0}
  dp = _dp(l2_norm_clip=clip, count_stddev=5.0, key=jax.random.key(2))
  assert dp.num_counts == 3
  want = jaxclip.calibrate_noise(
    1.0,
    DELTA,
    B / N,
    STEPS,
    accountant="rdp",
    count_stddev=5.0,
    num_counts=3,
    max_batch_size=N,
    num_examples=N,
  )
  assert dp.noise_multiplier == want
  # update_clip: one noisy count per group, keys of the step.
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2), "c": jnp.zeros(2)}
  loss = lambda p, x: jnp.dot(p["a"] + 2 * p["b"] + 3 * p["c"], x)
  batch = dp.batch(0)
  xs = jax.random.normal(jax.random.key(0), (N, 2))
  fn = dp.clipped_grad(loss, l2_norm_clip=clip, return_norms=True)
  _, _, norms = fn(params, xs[batch.indices], example_mask=batch.mask)
  new = dp.update_clip(clip, norms, 0, example_mask=batch.mask)
  assert jax.tree.structure(new) == jax.tree.structure(clip)
  assert len({float(v) for v in jax.tree.leaves(new)}) == 3  # each group its own count
  jitted = jax.jit(lambda c, n, t: dp.update_clip(c, n, t, example_mask=batch.mask))
  again = jitted(clip, norms, 0)
  for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(again), strict=True):
    assert float(x) == pytest.approx(float(y), rel=1e-6)
  tx = dp.noise(new)  # the adaptive clip's current value sets the sensitivity
  zeros = jax.tree.map(jnp.zeros_like, params)
  tx.update(zeros, tx.init(zeros))
  dp.record()
  assert dp.accountant.state_dict()["num_counts"] == [3]
  with pytest.raises(ValueError, match="structure"):
    dp.noise({"a": 1.0})


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(num_examples=0), ValueError, "num_examples"),
    (dict(num_examples=10.5), TypeError, "num_examples"),
    (dict(expected_batch_size=0), ValueError, "expected_batch_size"),
    (dict(expected_batch_size=N + 1), ValueError, "expected_batch_size"),
    (dict(steps=0), ValueError, "steps"),
    (dict(target_epsilon=0.0), ValueError, "target_epsilon"),
    (dict(delta=1.0), ValueError, "delta"),
    (dict(l2_norm_clip=-1.0), ValueError, "l2_norm_clip"),
    (dict(l2_norm_clip=float("inf")), ValueError, "l2_norm_clip"),
    (dict(method="jacobian"), ValueError, "method"),
    (dict(accountant="prv"), ValueError, "accountant"),
    (dict(max_batch_size=0), ValueError, "max_batch_size"),
    (dict(count_stddev=0.0), ValueError, "count_stddev"),
    (dict(key=7), TypeError, "key"),
  ],
)
def test_dpsgd_refuses_bad_arguments_naming_them(kwargs, error, match):
  with pytest.raises(error, match=match):
    _dp(**kwargs)


def test_dpsgd_with_a_fixed_clip_refuses_another_clip():
  dp = _dp(key=jax.random.key(0))
  with pytest.raises(ValueError, match="fixed clip"):
    dp.noise(2.0)
  with pytest.raises(ValueError, match="fixed clip"):
    dp.clipped_grad(lambda w, x: jnp.dot(w, x), l2_norm_clip=2.0)
  with pytest.raises(ValueError, match="count_stddev"):
    dp.update_clip(1.0, jnp.ones(3), 0)


def test_dpsgd_trains_under_jit():
  dp = _dp(key=jax.random.key(4))
  xs = jax.random.normal(jax.random.key(0), (N, 3))
  ys = xs @ jnp.array([1.0, -2.0, 0.5])
  loss = lambda w, x, y: (jnp.dot(w, x) - y) ** 2
  grad_fn = dp.clipped_grad(loss)
  tx = optax.chain(dp.noise(), optax.sgd(0.05))

  @jax.jit
  def step(params, state, t):
    batch = dp.batch(t)
    total, _ = grad_fn(params, xs[batch.indices], ys[batch.indices], example_mask=batch.mask)
    updates, state = tx.update(total, state, params)
    return optax.apply_updates(params, updates), state

  params, state = jnp.zeros(3), tx.init(jnp.zeros(3))
  for t in range(STEPS):
    params, state = step(params, state, t)
  dp.record(STEPS)
  assert np.all(np.isfinite(params)) and dp.epsilon() <= 1.0


def test_the_accountants_state_round_trips_through_orbax(tmp_path):
  """Slow (an orbax checkpoint: tests/conftest.py's SLOW_TESTS)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  acc = jaxclip.PrivacyAccountant(DELTA, accountant="rdp")
  acc.record(3.0, Q, steps=20, count_stddev=2.0, num_counts=3)
  acc.record(2.5, Q, steps=10, max_batch_size=60, num_examples=1000)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"accountant": acc.state_dict()})
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt")
  resumed = jaxclip.PrivacyAccountant(DELTA, accountant="rdp")
  resumed.load_state_dict(restored["accountant"])
  assert resumed.state_dict() == acc.state_dict() and resumed.epsilon() == acc.epsilon()
