"""DP-SGD to a guarantee: masks, padding, user-level clipping, Poisson batches, the accountant.

The checks that need several devices (``md_*``) run in a subprocess (this
file run as a script) on 8 virtual CPU devices, as in ``test_per_example.py``.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from tests.helpers import mlp_loss, mlp_problem, multi_device_checks

N_DEVICES = 8
CLIP = 30.0  # clips some examples of the test problem, not all
METHODS = ("vmap", "ghost")


def _loss_aux(params, x, y):
  loss = mlp_loss(params, x, y)
  return loss, loss


def _reference(params, x, y, clip, keep):
  """The clipped sum, count and norms of the kept examples only (per-example grads, by hand)."""
  total, count, flat = _clipped_by_hand(params, x[keep], y[keep], clip)
  return total, int(count), np.linalg.norm(np.asarray(flat), axis=1)


@jax.jit  # compiled once per number of kept examples
def _clipped_by_hand(params, x, y, clip):
  grads = jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0))(params, x, y)
  total, count = jaxclip.per_example_global_norm_clip(grads, clip)
  flat = jnp.concatenate([g.reshape(g.shape[0], -1) for g in jax.tree.leaves(grads)], axis=1)
  return total, count, flat


def _close(actual, expected, rtol=2e-5, atol=2e-5):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def _poisoned(x, mask):
  """``x`` with every masked-out row NaN: those rows must not reach the results."""
  return jnp.where(mask[:, None], x, jnp.nan)


# ----------------------------------------------------------------------------
# padding and masks, on one device
# ----------------------------------------------------------------------------


def test_padding_is_finite_when_the_loss_divides_by_the_data():
  # Padded with zeros, w / x would make the padding's gradient inf (and ghost's sum NaN).
  loss = lambda w, x: jnp.sum(w / x)
  x = jnp.array([[1.0, 2.0], [4.0, 0.5], [2.0, 2.0]])
  grads = 1.0 / x  # each example's gradient
  ref, ref_count = jaxclip.per_example_global_norm_clip([grads], 1.0)
  for method in METHODS:
    fn = jaxclip.per_example_clipped_grad(
      loss, 1.0, microbatch_size=2, method=method, return_norms=True
    )
    total, count, norms = fn(jnp.ones(2), x)
    np.testing.assert_allclose(total, ref[0], rtol=1e-6, err_msg=method)
    assert int(count) == int(ref_count) == 2, method
    np.testing.assert_allclose(norms, np.linalg.norm(grads, axis=1), rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_mask_drops_examples_with_microbatches_and_aux(method):
  params, x, y = mlp_problem(batch=12)
  mask = jnp.array([True, False, True, True, False, False, True, True, True, False, True, True])
  keep = np.asarray(mask)
  ref_total, ref_count, ref_norms = _reference(params, x, y, CLIP, keep)
  assert 0 < ref_count < keep.sum()
  real_losses = jax.jit(jax.vmap(mlp_loss, in_axes=(None, 0, 0)))(params, x[keep], y[keep])
  for microbatch_size in (None, 5):  # 5: chunks with a padded last one
    fn = jax.jit(
      jaxclip.per_example_clipped_grad(
        _loss_aux,
        CLIP,
        microbatch_size=microbatch_size,
        method=method,
        return_norms=True,
        has_aux=True,
      )
    )
    total, count, norms, losses = fn(params, _poisoned(x, mask), y, example_mask=mask)
    _close(total, ref_total)
    assert int(count) == ref_count, (microbatch_size, int(count), ref_count)
    np.testing.assert_allclose(np.asarray(norms)[keep], ref_norms, rtol=2e-5)
    assert np.all(np.asarray(norms)[~keep] == 0)
    np.testing.assert_allclose(np.asarray(losses)[keep], real_losses, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(losses)))  # masked rows hold a stand-in's loss
  # Nothing real: zeros, even though every row is NaN.
  none = jnp.zeros(12, bool)
  total, count, norms, _ = fn(params, _poisoned(x, none), y, example_mask=none)
  assert all(np.all(np.asarray(t) == 0) for t in jax.tree.leaves(total))
  assert int(count) == 0 and np.all(np.asarray(norms) == 0)


def test_mask_under_vmap_with_axis_name():
  # vmap with axis_name stands in for a device axis: 3 "devices" of 4 examples.
  params, x, y = mlp_problem(batch=12, seed=3)
  mask = jnp.arange(12) % 3 != 1
  ref_total, ref_count, _ = _reference(params, x, y, CLIP, np.asarray(mask))
  split = lambda a: a.reshape((3, 4) + a.shape[1:])
  for method in METHODS:
    fn = jaxclip.per_example_clipped_grad(
      mlp_loss, CLIP, microbatch_size=3, axis_name="i", method=method
    )
    total, count = jax.jit(
      jax.vmap(
        lambda p, a, b, m, fn=fn: fn(p, a, b, example_mask=m),
        in_axes=(None, 0, 0, 0),
        axis_name="i",
      )
    )(params, split(_poisoned(x, mask)), split(y), split(mask))
    _close(jax.tree.map(lambda t: t[1], total), ref_total)
    assert list(np.asarray(count)) == [ref_count] * 3, method


def test_mask_errors():
  fn = jaxclip.per_example_clipped_grad(lambda w, x: jnp.dot(w, x), 1.0)
  with pytest.raises(ValueError, match="example_mask must be a boolean array of shape"):
    fn(jnp.ones(2), jnp.ones((3, 2)), example_mask=jnp.ones(3))
  with pytest.raises(ValueError, match=r"shape \(batch,\) = \(3,\)"):
    fn(jnp.ones(2), jnp.ones((3, 2)), example_mask=jnp.ones(4, bool))


def test_empty_batch_and_empty_params_agree_across_methods():
  results = {}
  for method in METHODS:
    for mb in (None, 2):
      fn = jaxclip.per_example_clipped_grad(
        lambda w, x: jnp.sum(w * x), 0.5, method=method, microbatch_size=mb, return_norms=True
      )
      total, count, norms = fn(jnp.ones(2), jnp.ones((0, 2)))
      results[method, mb, "batch"] = (np.asarray(total).tolist(), int(count), norms.shape)
      fn = jaxclip.per_example_clipped_grad(
        lambda p, x: jnp.sum(x), 0.5, method=method, microbatch_size=mb, return_norms=True
      )
      total, count, norms = fn({}, jnp.ones((3, 2)))
      results[method, mb, "params"] = (total, int(count), np.asarray(norms).tolist())
  for key, value in results.items():
    expected = ([0.0, 0.0], 0, (0,)) if key[2] == "batch" else ({}, 0, [0.0, 0.0, 0.0])
    assert value == expected, (key, value)


# ----------------------------------------------------------------------------
# the default batch: every argument after params
# ----------------------------------------------------------------------------


def test_default_batch_is_every_argument_and_shared_ones_warn_once():
  params, x, y = mlp_problem(batch=6)
  ref_total, _, _ = _reference(params, x, y, CLIP, np.ones(6, bool))
  _close(jaxclip.per_example_clipped_grad(mlp_loss, CLIP)(params, x, y)[0], ref_total)
  # A shared argument shaped like the batch: a warning, once per function.
  loss = lambda p, xb, yb, table: mlp_loss(p, xb, yb) + 0.0 * jnp.sum(table)
  fn = jaxclip.per_example_clipped_grad(loss, CLIP, batch_argnums=(1, 2))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn(params, x, y, jnp.ones((6, 2)))
    fn(params, x, y, jnp.ones((6, 2)))
  assert len(caught) == 1 and "argument 3 is shared" in str(caught[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning for a shared argument of another size
    jaxclip.per_example_clipped_grad(loss, CLIP, batch_argnums=(1, 2))(
      params, x, y, jnp.ones((4, 2))
    )


# ----------------------------------------------------------------------------
# user-level clipping
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_group_size_clips_each_users_summed_gradient(method):
  params, x, y = mlp_problem(batch=12, seed=4)
  mask = jnp.array([True, True, True, False, True, True, False, False, True, True, True, True])
  grads = jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0))(params, x, y)
  # Users of 3 consecutive examples: the gradient of their masked summed loss.
  per_user = jax.tree.map(
    lambda g: jnp.sum(
      jnp.where(mask.reshape((12,) + (1,) * (g.ndim - 1)), g, 0).reshape((4, 3) + g.shape[1:]),
      axis=1,
    ),
    grads,
  )
  flat = jnp.concatenate([g.reshape(4, -1) for g in jax.tree.leaves(per_user)], axis=1)
  clip = float(np.median(np.linalg.norm(flat, axis=1)))
  ref_total, ref_count = jaxclip.per_example_global_norm_clip(per_user, clip)
  assert 0 < int(ref_count) < 4
  fn = jax.jit(
    jaxclip.per_example_clipped_grad(
      _loss_aux,
      clip,
      group_size=3,
      microbatch_size=6,
      method=method,
      return_norms=True,
      has_aux=True,
    )
  )
  total, count, norms, losses = fn(params, _poisoned(x, mask), y, example_mask=mask)
  _close(total, ref_total, rtol=1e-4, atol=1e-4)
  assert int(count) == int(ref_count)
  np.testing.assert_allclose(norms, np.linalg.norm(flat, axis=1), rtol=1e-5)
  assert losses.shape == (12,)
  with pytest.raises(ValueError, match="group_size=5 must divide"):
    jaxclip.per_example_clipped_grad(mlp_loss, clip, group_size=5, method=method)(params, x, y)
  with pytest.raises(ValueError, match="multiple of group_size"):
    jaxclip.per_example_clipped_grad(mlp_loss, clip, group_size=3, microbatch_size=4)


# ----------------------------------------------------------------------------
# quantile_clip_norm_update with a mask
# ----------------------------------------------------------------------------


def test_quantile_update_counts_real_examples_only():
  norms = jnp.array([0.5, jnp.nan, 1.5, 0.2, jnp.inf, 4.0])
  mask = jnp.array([True, False, True, True, False, True])
  real = jnp.array([0.5, 1.5, 0.2, 4.0])  # 2 of 4 at or below C = 1
  kw = {"target_quantile": 0.0, "learning_rate": 1.0, "geometric": False}
  # Linear, q = 0, lr = 1: C - fraction below.
  got = jaxclip.quantile_clip_norm_update(1.0, norms, example_mask=mask, **kw)
  assert float(got) == pytest.approx(1.0 - 0.5)
  assert float(got) == float(jaxclip.quantile_clip_norm_update(1.0, real, **kw))
  # Centred and over the expected batch size: (2 - 4 / 2) / 8 + 1/2 below.
  got = jaxclip.quantile_clip_norm_update(
    1.0, norms, example_mask=mask, expected_batch_size=8, **kw
  )
  assert float(got) == pytest.approx(1.0 - 0.5)
  got = jaxclip.quantile_clip_norm_update(
    1.0, norms, example_mask=mask, expected_batch_size=2, **kw
  )
  assert float(got) == pytest.approx(1.0 - 0.5)
  # 3 real, the NaN among them (counted as above C): sum(b - 1/2) = -1/2, over 4, plus 1/2.
  three = jnp.array([True, True, True, False, False, False])
  got = jaxclip.quantile_clip_norm_update(
    1.0, norms, example_mask=three, expected_batch_size=4, **kw
  )
  assert float(got) == pytest.approx(1.0 - (-0.5 / 4 + 0.5))
  # The noise scale stays the caller's: σ_b N(0, 1) / B on the fraction.
  key = jax.random.key(0)
  noisy = jaxclip.quantile_clip_norm_update(
    1.0, norms, example_mask=mask, expected_batch_size=8, count_stddev=2.0, key=key, **kw
  )
  expected = 1.0 - (0.5 + 2.0 * float(jax.random.normal(key, (), jnp.float32)) / 8)
  assert float(noisy) == pytest.approx(expected, rel=1e-6)
  with pytest.raises(ValueError, match="example_mask must be a boolean array"):
    jaxclip.quantile_clip_norm_update(1.0, norms, example_mask=mask[:3])
  with pytest.raises(ValueError, match="expected_batch_size"):
    jaxclip.quantile_clip_norm_update(1.0, norms, expected_batch_size=0.0)


# ----------------------------------------------------------------------------
# poisson_batch
# ----------------------------------------------------------------------------


def test_poisson_batch_draws_each_example_independently():
  n, q, rows = 200, 0.1, 40
  draw = jax.jit(jax.vmap(lambda k: jaxclip.poisson_batch(k, n, q, rows)))
  batches = draw(jax.random.split(jax.random.key(0), 2000))
  assert batches.indices.shape == (2000, rows) and batches.indices.dtype == jnp.int32
  mask, idx = np.asarray(batches.mask), np.asarray(batches.indices)
  sizes = mask.sum(axis=1)
  # Binomial(200, 0.1): mean 20, variance 18; the mean of 2000 draws is within 0.5 of 20.
  assert abs(sizes.mean() - 20) < 0.5 and abs(sizes.var() - 18) < 3
  # Every example is drawn with probability q (counts over draws: Binomial(2000, 0.1)).
  counts = np.bincount(idx[mask], minlength=n)
  assert counts.min() > 140 and counts.max() < 265
  # Real rows are distinct examples; every index is in range; no draw overflowed 40.
  for row, m in zip(idx[:50], mask[:50], strict=True):
    assert len(set(row[m].tolist())) == m.sum()
  assert idx.min() >= 0 and idx.max() < n and not np.asarray(batches.overflow).any()


def test_poisson_batch_overflow_keeps_a_random_subset():
  b = jaxclip.poisson_batch(jax.random.key(1), 100, 0.5, 10)
  assert bool(b.overflow) and bool(b.mask.all()) and len(set(np.asarray(b.indices))) == 10
  # Which 10 are kept is random, not the lowest indices.
  kept = [
    set(np.asarray(jaxclip.poisson_batch(jax.random.key(s), 100, 0.5, 10).indices))
    for s in range(5)
  ]
  assert max(max(k) for k in kept) > 50 and len(set.union(*kept)) > 30
  # More rows than examples: padded, masked rows; q traced; q = 0 and q = 1.
  full = jax.jit(lambda q: jaxclip.poisson_batch(jax.random.key(2), 5, q, 8))(1.0)
  assert full.mask.tolist() == [True] * 5 + [False] * 3
  assert sorted(np.asarray(full.indices[:5]).tolist()) == list(range(5))
  assert not jaxclip.poisson_batch(jax.random.key(3), 5, 0.0, 4).mask.any()
  with pytest.raises(ValueError, match="sampling_rate"):
    jaxclip.poisson_batch(jax.random.key(0), 10, 1.5, 4)
  with pytest.raises(ValueError, match="max_batch_size"):
    jaxclip.poisson_batch(jax.random.key(0), 10, 0.5, 0)
  with pytest.raises(TypeError, match="key"):
    jaxclip.poisson_batch(0, 10, 0.5, 4)


# ----------------------------------------------------------------------------
# dp_epsilon and calibrate_noise against dp_accounting and jax_privacy
# ----------------------------------------------------------------------------


def test_dp_epsilon_matches_dp_accounting_and_jax_privacy_on_abadi_et_als_setting():
  dp_accounting = pytest.importorskip("dp_accounting")
  # Abadi et al.'s MNIST setting: batches of 256 of 60,000, σ = 1.1, 15 epochs, δ = 1e-5.
  q, z, delta = 256 / 60000, 1.1, 1e-5
  steps = 15 * 60000 // 256
  event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
  rdp = dp_accounting.rdp.RdpAccountant()
  rdp.compose(event, steps)  # composed step by step, not as a SelfComposedDpEvent
  pld = dp_accounting.pld.PLDAccountant()
  pld.compose(event, steps)
  ref_rdp, ref_pld = rdp.get_epsilon(delta), pld.get_epsilon(delta)
  got_rdp = jaxclip.dp_epsilon(z, q, steps, delta, accountant="rdp")
  got_pld = jaxclip.dp_epsilon(z, q, steps, delta)
  assert got_rdp == pytest.approx(ref_rdp, rel=1e-9)
  assert got_pld == pytest.approx(ref_pld, rel=1e-6)
  assert 0.5 < got_pld < got_rdp < 3  # PLD is the tighter bound
  # Calibrated the other way: dp_accounting's own search and calibrate_noise agree within 1%.
  target = 1.0
  ref_sigma = dp_accounting.calibrate_dp_mechanism(
    dp_accounting.rdp.RdpAccountant,
    lambda s: dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), steps
    ),
    target,
    delta,
  )
  sigma = jaxclip.calibrate_noise(target, delta, q, steps, accountant="rdp")
  assert ref_sigma / 1.001 <= sigma <= ref_sigma * 1.01
  # The same figure from jax_privacy's DP-SGD accountant, if it is installed.
  if importlib.util.find_spec("jax_privacy") is not None:
    from jax_privacy.accounting import accountants, analysis

    params = analysis.DpParams(noise_multipliers=z, num_samples=60000, delta=delta, batch_size=256)
    accountant = analysis.DpsgdTrainingAccountant(accountants.RdpAccountantConfig())
    assert float(accountant.compute_epsilon(steps, params)) == pytest.approx(ref_rdp, rel=1e-3)
  print(
    f"reference: q={q:.5g} z={z} steps={steps} delta={delta}: "
    f"RDP eps={ref_rdp:.4f} PLD eps={ref_pld:.4f}"
  )


def test_jax_privacy_noise_on_jaxclip_ghost_sum():
  noise_addition = pytest.importorskip("jax_privacy.noise_addition")
  params, x, y = mlp_problem(batch=8)
  mask = jnp.arange(8) < 6
  # One program for both ways in.
  fn = jax.jit(
    lambda p, a, b, m: jaxclip.per_example_clipped_grad(
      mlp_loss, CLIP, method="ghost", return_norms=True
    )(p, a, b, example_mask=m)
  )
  total, _, norms = fn(params, x, y, mask)
  assert np.all(np.asarray(norms)[6:] == 0)
  # jax_privacy's Gaussian privatizer on the clipped sum in units of C.
  sigma = 1.5
  privatizer = noise_addition.gaussian_privatizer(stddev=sigma, prng_key=jax.random.key(0))
  unit = jax.tree.map(lambda g: g / CLIP, total)
  noisy, _ = jax.jit(privatizer.update)(unit, privatizer.init(unit))
  noise = np.concatenate(
    [np.ravel(a - b) for a, b in zip(jax.tree.leaves(noisy), jax.tree.leaves(unit), strict=True)]
  )
  assert noise.size > 50 and abs(noise.std() / sigma - 1) < 0.3 and abs(noise.mean()) < 0.5
  # The other way in: jax_privacy's Poisson batches, padded with -1, as a jaxclip mask.
  batch_selection = pytest.importorskip("jax_privacy.batch_selection")
  strategy = batch_selection.CyclicPoissonSampling(sampling_prob=0.5, iterations=1)
  (indices,) = list(strategy.batch_iterator(8, rng=0))
  padded = batch_selection.pad_to_multiple_of(indices, 8)
  real = jnp.asarray(padded >= 0)
  rows = jnp.asarray(np.maximum(padded, 0))
  total, count, norms = fn(params, x[rows], y[rows], real)
  ref_total, ref_count, ref_norms = _reference(params, x, y, CLIP, np.asarray(indices))
  _close(total, ref_total)
  assert int(count) == ref_count and 0 < len(indices) < 8
  np.testing.assert_allclose(np.asarray(norms)[: len(indices)], ref_norms, rtol=2e-5)


# ----------------------------------------------------------------------------
# 8 devices (run in the subprocess)
# ----------------------------------------------------------------------------


def md_mask_in_shard_map_and_under_spmd_axis_name():
  params, x, y = mlp_problem(batch=64, seed=5)
  mask = jnp.asarray(np.random.default_rng(0).random(64) < 0.7)
  ref_total, ref_count, ref_norms = _reference(params, x, y, CLIP, np.asarray(mask))
  xs_bad = _poisoned(x, mask)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  with jax.set_mesh(mesh):
    sharded = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (xs_bad, y, mask)]
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    for method in METHODS:
      local = jaxclip.per_example_clipped_grad(
        mlp_loss, CLIP, microbatch_size=3, axis_name="data", method=method
      )
      total, count = jax.jit(
        jax.shard_map(
          lambda p, a, b, m, local=local: local(p, a, b, example_mask=m),
          mesh=mesh,
          in_specs=(P(), P("data"), P("data"), P("data")),
          out_specs=(P(), P()),
        )
      )(params, *sharded)
      _close(total, ref_total)
      assert int(count) == ref_count, (method, int(count), ref_count)
      for microbatch_size in (None, 24):  # 24: a padded last chunk
        fn = jaxclip.per_example_clipped_grad(
          mlp_loss,
          CLIP,
          microbatch_size=microbatch_size,
          spmd_axis_name="data",
          method=method,
          return_norms=True,
        )
        total, count, norms = jax.jit(lambda p, a, b, m, fn=fn: fn(p, a, b, example_mask=m))(
          ps, *sharded
        )
        _close(total, ref_total)
        assert int(count) == ref_count, (method, microbatch_size)
        np.testing.assert_allclose(np.asarray(norms)[np.asarray(mask)], ref_norms, rtol=2e-5)
        assert math.isclose(float(jnp.sum(jnp.where(mask, 0, norms))), 0.0)


def md_nonfinite_example_contributes_zero_in_shard_map_and_under_spmd_axis_name():
  """A real (unmasked) example whose gradient is inf: zero in the sum, counted once across the
  devices (issue #48), under shard_map with axis_name and under jit with spmd_axis_name."""
  params, x, y = mlp_problem(batch=64, seed=6)
  bad = x.at[21, 0].set(jnp.inf)
  keep = np.arange(64) != 21
  ref_total, ref_count, _ = _reference(params, x, y, CLIP, keep)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  with jax.set_mesh(mesh):
    sharded = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (bad, y)]
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    for method in METHODS:
      local = jaxclip.per_example_clipped_grad(
        mlp_loss,
        CLIP,
        microbatch_size=3,
        axis_name="data",
        method=method,
        return_num_nonfinite=True,
      )
      total, count, num_bad = jax.jit(
        jax.shard_map(
          lambda p, a, b, local=local: local(p, a, b),
          mesh=mesh,
          in_specs=(P(), P("data"), P("data")),
          out_specs=(P(), P(), P()),
        )
      )(params, *sharded)
      _close(total, ref_total)
      assert (int(count), int(num_bad)) == (ref_count + 1, 1), (method, int(count), int(num_bad))
      fn = jaxclip.per_example_clipped_grad(
        mlp_loss,
        CLIP,
        microbatch_size=16,
        spmd_axis_name="data",
        method=method,
        return_num_nonfinite=True,
      )
      total, count, num_bad = jax.jit(fn)(ps, *sharded)
      _close(total, ref_total)
      assert int(num_bad) == 1, method


test_multi_device = multi_device_checks(
  globals(), N_DEVICES, setup=lambda: jax.config.update("jax_numpy_dtype_promotion", "strict")
)
