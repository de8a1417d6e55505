"""dp_noise: its documented draws and statistics, per-layer sensitivity, dtypes, optax wrappers.

Sharded leaves (``md_*``) run in a subprocess on 8 virtual CPU devices.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from tests.helpers import assert_tree_allclose, multi_device_checks

N_DEVICES = 8


def _tree(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(7), 3)
  return {
    "w": jax.random.normal(k[0], (16, 8)).astype(dtype),
    "b": jax.random.normal(k[1], (8,)).astype(dtype),
    "layer": {"v": jax.random.normal(k[2], (5,)).astype(dtype)},
  }


def _expected(tree, key, stddev, batch):
  """The documented draws: split the state's key, then one key per leaf, float32 for halves."""
  _, noise_key = jax.random.split(key)
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(noise_key, len(leaves))
  out = []
  for leaf, k in zip(leaves, keys, strict=True):
    dtype = jnp.float32 if leaf.dtype in (jnp.bfloat16, jnp.float16) else leaf.dtype
    noisy = leaf.astype(dtype) + jnp.asarray(stddev, dtype) * jax.random.normal(
      k, leaf.shape, dtype
    )
    out.append((noisy / jnp.asarray(batch, dtype)).astype(leaf.dtype))
  return treedef.unflatten(out)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_each_step_adds_the_keys_normal_draws_times_z_s_over_b(dtype):
  tree = _tree(dtype)
  tx = jaxclip.dp_noise(2.0, 1.5, seed=3, expected_batch_size=4)
  state = tx.init(tree)
  key = jax.random.key(3)
  for _ in range(2):  # a fresh key each step: the second step's draws come from the split
    out, state = tx.update(tree, state)
    want = _expected(tree, key, 1.5 * 2.0, 4)
    jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), out, want
    )
    assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, tree)
    key = jax.random.split(key)[0]
  # Without expected_batch_size the noisy sum comes out; with z = 0 the sum itself.
  tx = jaxclip.dp_noise(2.0, 1.5, seed=3)
  out, _ = tx.update(tree, tx.init(tree))
  assert_tree_allclose(out, _expected(tree, jax.random.key(3), 3.0, 1), rtol=0)
  tx = jaxclip.dp_noise(2.0, 0.0, expected_batch_size=4)
  out, _ = tx.update(tree, tx.init(tree))
  assert_tree_allclose(out, jax.tree.map(lambda g: g / jnp.asarray(4, g.dtype), tree), rtol=0)


def test_noise_statistics_fresh_each_step_independent_across_leaves_and_seeded():
  zeros = {"a": jnp.zeros(40_000), "b": jnp.zeros(40_000)}
  tx = jaxclip.dp_noise({"a": 3.0, "b": 4.0}, 0.5, seed=11, expected_batch_size=2.0)
  step = jax.jit(tx.update)
  first, state = step(zeros, tx.init(zeros))
  second, _ = step(zeros, state)
  # Per-layer clip norms 3 and 4: S = 5, so each entry ~ N(0, (0.5 * 5 / 2)^2).
  for leaf in (*first.values(), *second.values()):
    x = np.asarray(leaf)
    assert abs(x.std() / 1.25 - 1) < 0.02 and abs(x.mean()) < 0.03  # 40,000 draws: 5 sd
  corr = lambda u, v: float(np.corrcoef(np.asarray(u), np.asarray(v))[0, 1])
  assert abs(corr(first["a"], first["b"])) < 0.025  # independent leaves (5 sd of 1/200)
  assert abs(corr(first["a"], second["a"])) < 0.025  # fresh each step
  again, _ = step(zeros, jaxclip.dp_noise({"a": 3.0, "b": 4.0}, 0.5, seed=11).init(zeros))
  assert_tree_allclose(again, first, rtol=0)  # the seed reproduces it
  other, _ = step(zeros, jaxclip.dp_noise(1.0, 1.0, seed=12).init(zeros))
  assert abs(corr(other["a"], first["a"])) < 0.025


def test_per_layer_clip_norms_are_a_prefix_of_the_updates():
  tree = _tree()
  clip = {"w": 1.0, "b": 2.0, "layer": 2.0}  # S = 3
  tx = jaxclip.dp_noise(clip, 1.0, seed=0)
  out, _ = tx.update(tree, tx.init(tree))
  assert_tree_allclose(out, _expected(tree, jax.random.key(0), 3.0, 1), rtol=1e-6)
  with pytest.raises(ValueError, match="prefix"):
    tx.update({"w": tree["w"], "c": tree["b"]}, tx.init(tree))
  with pytest.raises(ValueError, match=r"l2_norm_clip\['b'\]"):
    jaxclip.dp_noise({"w": 1.0, "b": -1.0}, 1.0)
  with pytest.raises(ValueError, match="l2_norm_clip"):
    jaxclip.dp_noise({}, 1.0)


@pytest.mark.parametrize(
  "kwargs, error, name",
  [
    (dict(l2_norm_clip=-1.0), ValueError, "l2_norm_clip"),
    (dict(l2_norm_clip=float("inf")), ValueError, "l2_norm_clip"),
    (dict(l2_norm_clip=float("nan")), ValueError, "l2_norm_clip"),
    (dict(l2_norm_clip="1"), TypeError, "l2_norm_clip"),
    (dict(noise_multiplier=-0.1), ValueError, "noise_multiplier"),
    (dict(noise_multiplier=float("inf")), ValueError, "noise_multiplier"),
    (dict(noise_multiplier=jnp.ones(2)), ValueError, "noise_multiplier"),
    (dict(expected_batch_size=0), ValueError, "expected_batch_size"),
    (dict(expected_batch_size=-3.0), ValueError, "expected_batch_size"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=True), TypeError, "seed"),
    (dict(seed="0"), TypeError, "seed"),
  ],
)
def test_bad_hyperparameters_are_refused_at_build_naming_them(kwargs, error, name):
  args = {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, **kwargs}
  with pytest.raises(error, match=name):
    jaxclip.dp_noise(**args)


def test_bad_updates_and_state_are_refused():
  tx = jaxclip.dp_noise(1.0, 1.0)
  with pytest.raises(TypeError, match=r"\['z'\].*complex"):
    tx.update({"z": jnp.ones(2, jnp.complex64)}, tx.init(None))
  with pytest.raises(TypeError, match="dp_noise.*state"):
    tx.update({"w": jnp.ones(2)}, optax.EmptyState())
  # Integer leaves are numbers, promoted as optax does; None leaves stay None.
  out, _ = tx.update({"n": jnp.arange(3), "none": None}, tx.init(None))
  assert out["none"] is None and jnp.issubdtype(out["n"].dtype, jnp.floating)


@functools.cache
def _traced_step():
  def step(clip, z, batch, grads, state):
    return jaxclip.dp_noise(clip, z, expected_batch_size=batch).update(grads, state)

  return jax.jit(step)


def test_traced_hyperparameters_and_inject_hyperparams_match_the_concrete_transform():
  tree = _tree()
  tx = jaxclip.dp_noise(2.0, 0.7, expected_batch_size=8)
  want, want_state = tx.update(tree, tx.init(tree))
  got, got_state = _traced_step()(
    jnp.float32(2.0), jnp.float32(0.7), jnp.float32(8), tree, tx.init(tree)
  )
  assert_tree_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert_tree_allclose(got_state, want_state, rtol=0)
  # A schedule of the noise multiplier: the third step adds the third key's draws at z(2).
  sched = optax.linear_schedule(1.0, 2.0, 10)
  injected = optax.inject_hyperparams(jaxclip.dp_noise, static_args=("seed",))(
    l2_norm_clip=1.0, noise_multiplier=sched, expected_batch_size=4.0, seed=0
  )
  state = injected.init(tree)
  plain_state = jaxclip.dp_noise(1.0, 1.0, seed=0).init(tree)
  for _ in range(3):
    out, state = jax.jit(injected.update)(tree, state)
    want, plain_state = jaxclip.dp_noise(1.0, float(sched(2)), expected_batch_size=4.0).update(
      tree, plain_state
    )
  assert_tree_allclose(out, want, rtol=1e-5, atol=1e-7)


def test_in_optax_chain_multisteps_masked_and_scan():
  tree = _tree()
  noise = jaxclip.dp_noise(1.0, 0.5, expected_batch_size=2)
  # MultiSteps: the inner transform runs once per k microbatches, on their mean.
  ms = optax.MultiSteps(optax.chain(noise, optax.sgd(1.0)), every_k_schedule=2)
  state = ms.init(tree)
  u1, state = ms.update(tree, state, tree)
  u2, state = ms.update(tree, state, tree)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u1))
  want, _ = optax.chain(noise, optax.sgd(1.0)).update(
    tree, optax.chain(noise, optax.sgd(1.0)).init(tree)
  )
  assert_tree_allclose(u2, want, rtol=1e-6)
  # masked: the left-out leaves pass unchanged.
  mask = {"w": True, "b": False, "layer": {"v": False}}
  out, _ = optax.masked(noise, mask).update(tree, optax.masked(noise, mask).init(tree))
  np.testing.assert_array_equal(out["b"], tree["b"])
  assert not np.allclose(out["w"], tree["w"] / 2)

  # lax.scan over steps equals the Python loop.
  def body(state, _):
    out, state = noise.update(tree, state)
    return state, out["b"]

  _, scanned = jax.lax.scan(body, noise.init(tree), None, length=3)
  state = noise.init(tree)
  for i in range(3):
    out, state = noise.update(tree, state)
    np.testing.assert_allclose(scanned[i], out["b"], rtol=1e-6)


# ----------------------------------------------------------------------------
# sharded leaves, 8 devices (run in the subprocess)
# ----------------------------------------------------------------------------


def md_sharded_leaves_get_the_single_device_noise_the_same_on_every_replica():
  host = {"w": np.ones((16, 8), np.float32), "b": np.full((8,), 2.0, np.float32)}
  specs = {"w": P("data", "model"), "b": P()}
  tx = jaxclip.dp_noise(1.0, 1.0, seed=5, expected_batch_size=4)
  single = jax.tree.map(jnp.asarray, host)
  want, want_state = jax.jit(tx.update)(single, tx.init(single))
  for axis_types in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_types,) * 2)
    with jax.set_mesh(mesh):
      put = lambda x, s, mesh=mesh: jax.device_put(x, NamedSharding(mesh, s))
      tree = jax.tree.map(put, host, specs)
      got, state = jax.jit(tx.update)(tree, tx.init(tree))
    assert_tree_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert_tree_allclose(state, want_state, rtol=0)
    for leaf, x in zip(jax.tree.leaves(got), jax.tree.leaves(tree), strict=True):
      assert leaf.sharding.is_equivalent_to(x.sharding, leaf.ndim), (leaf.sharding, x.sharding)
    # The replicated leaf holds the same noise on every device.
    shards = [np.asarray(s.data) for s in got["b"].addressable_shards]
    assert len(shards) == N_DEVICES and all(np.array_equal(s, shards[0]) for s in shards)


test_multi_device = multi_device_checks(globals(), N_DEVICES)


# ----------------------------------------------------------------------------
# Secret randomness, and noise added before rounding (issue #48)
# ----------------------------------------------------------------------------


def test_no_constant_default_seed_two_transforms_add_independent_noise():
  assert inspect.signature(jaxclip.dp_noise).parameters["seed"].default is None
  tree = {"w": jnp.zeros(4096)}
  draws = []
  for _ in range(2):
    tx = jaxclip.dp_noise(1.0, 1.0)  # no seed: a key from the OS's entropy
    draws.append(np.asarray(tx.update(tree, tx.init(tree))[0]["w"]))
  # An attacker who regenerates the noise subtracts it: independent runs must not repeat it.
  assert abs(np.corrcoef(draws[0], draws[1])[0, 1]) < 0.1
  # An explicit seed, int or key, still reproduces a run; the key is as given.
  key = jax.random.key(1234)
  for seed in (7, key):
    a, b = jaxclip.dp_noise(1.0, 1.0, seed=seed), jaxclip.dp_noise(1.0, 1.0, seed=seed)
    np.testing.assert_array_equal(
      a.update(tree, a.init(tree))[0]["w"], b.update(tree, b.init(tree))[0]["w"]
    )
  state = jaxclip.dp_noise(1.0, 1.0, seed=key).init(tree)
  np.testing.assert_array_equal(state.dp_noise_key, jax.random.key_data(key))
  with pytest.raises(ValueError, match="one PRNG key"):
    jaxclip.dp_noise(1.0, 1.0, seed=jax.random.split(key, 2))


def _identity_grad(dtype, rows):
  """per_example_clipped_grad of ``w . x`` (its gradient is ``x``), params of ``dtype``."""
  fn = jaxclip.per_example_clipped_grad(lambda w, x: jnp.dot(w, x).astype(jnp.float32), 1.0)
  w = jnp.zeros(rows.shape[1:], dtype)
  return w, jax.jit(fn)(w, rows.astype(dtype))[0]


def test_bfloat16_one_small_example_moves_the_sum_by_its_clipped_norm_only():
  # D sums to just below a bfloat16 rounding midpoint (1012 | 1016); x, of norm 0.01, crosses it.
  base = np.zeros((1014, 2))
  base[:1013, 0], base[1013, 0] = 1.0, 0.99609375
  x = np.array([[0.010009765625, 0.0]])
  w, without = _identity_grad(jnp.bfloat16, jnp.asarray(base))
  _, with_x = _identity_grad(jnp.bfloat16, jnp.asarray(np.concatenate([base, x])))
  assert without.dtype == with_x.dtype == jnp.float32  # the sum the noise is added to
  delta = np.linalg.norm(np.asarray(with_x, np.float64) - np.asarray(without, np.float64))
  assert delta <= 0.010009765625 * (1 + 1e-3)  # rounded to bfloat16 first, it moved by 4
  # dp_noise adds the noise to the float32 sum, then casts to the params' dtype.
  tx = jaxclip.dp_noise(1.0, 1.0, seed=0, expected_batch_size=1015)
  noisy, _ = tx.update(with_x, tx.init(w), w)
  assert noisy.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(noisy, np.float32)))


def test_float16_sum_past_65504_is_finite_before_the_noise():
  w, total = _identity_grad(jnp.float16, jnp.ones((65_520, 1)))
  assert total.dtype == jnp.float32 and float(total[0]) == 65_520.0  # float16 made it inf
  tx = jaxclip.dp_noise(1.0, 1.0, seed=0, expected_batch_size=65_520)
  mean, _ = tx.update(total, tx.init(w), w)
  assert mean.dtype == jnp.float16 and abs(float(mean[0]) - 1.0) < 1e-3


def _dense_grad(dtype, method, firsts, width=128):
  """``per_example_clipped_grad`` of ``sum((x @ W) * y)`` with ``method``: example ``b``'s
  gradient is ``outer(x_b, y_b)``, here ``firsts[b]`` at ``W[0, 0]`` and zeros elsewhere.

  ``W`` is 128 x ``width`` (at least 2), so that ``method="auto"``'s cost model takes ghost
  norms too (an instantiated per-example gradient then costs more floats than the norm's two
  factors): the sum is book-kept through the dense site (its weighted output gradients pulled
  back through ``x``).
  """
  loss = lambda w, x, y: jnp.sum(jnp.dot(x, w) * y).astype(jnp.float32)
  fn = jax.jit(jaxclip.per_example_clipped_grad(loss, 1.0, method=method))
  n = len(firsts)
  x = jnp.zeros((n, 128), dtype).at[:, 0].set(jnp.asarray(firsts, dtype))
  y = jnp.zeros((n, width), dtype).at[:, 0].set(1)
  return fn(jnp.zeros((128, width), dtype), x, y)[0]


@pytest.mark.parametrize("method", ["ghost", "auto"])
def test_ghost_bfloat16_one_small_example_moves_the_sum_by_its_clipped_norm_only(method):
  # As above, through ghost norms' book-keeping: D sums to just below a bfloat16 rounding
  # midpoint (1012 | 1016) and x, of norm 0.01, crosses it. The site's weighted batch sum
  # was pulled back in bfloat16, and x moved the sum by 4.
  base = [1.0] * 1013 + [0.99609375]
  without = _dense_grad(jnp.bfloat16, method, base)
  with_x = _dense_grad(jnp.bfloat16, method, base + [0.010009765625])
  assert without.dtype == with_x.dtype == jnp.float32
  delta = np.linalg.norm(np.asarray(with_x, np.float64) - np.asarray(without, np.float64))
  assert delta <= 0.010009765625 * (1 + 1e-3)
  assert float(without[0, 0]) == 1013.99609375  # the float32 sum, not bfloat16's 1012


@pytest.mark.parametrize("method", ["ghost", "auto"])
def test_ghost_float16_sum_past_65504_is_finite(method):
  # W of 128 x 4 (auto's cost model still takes its dot rule): auto's measurement also runs
  # vmap's program, whose per-example gradients take 65,520 x 128 x width floats (4.3 GB at
  # width 128, where this test took 33 s on 2 idle cores and 103 s on 2 busy ones).
  total = _dense_grad(jnp.float16, method, [1.0] * 65_520, width=4)
  assert total.dtype == jnp.float32 and float(total[0, 0]) == 65_520.0  # was inf
  assert float(jnp.sum(jnp.abs(total))) == 65_520.0
