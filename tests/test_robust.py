"""skip_nonfinite, zero_nonfinite and skip_on_spike."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from tests import helpers
from tests.helpers import assert_tree_allclose

NAN, INF = float("nan"), float("inf")


def assert_bit_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes(), (x, y)


def assert_same_avals(a, b):
  """Same structure, shapes and dtypes (a state is a valid lax.scan carry)."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)


def run(tx, grads, params, jit=True, **extra_seq):
  """Steps ``tx`` over ``grads``; returns per-step (updates, state, params)."""
  update = jax.jit(tx.update) if jit else tx.update
  state, out = tx.init(params), []
  for i, g in enumerate(grads):
    extra = {k: v[i] for k, v in extra_seq.items()}
    updates, new_state = update(g, state, params, **extra)
    new_params = optax.apply_updates(params, updates)
    out.append((updates, state, new_state, params, new_params))
    state, params = new_state, new_params
  return out


def vec(values):
  return [jnp.array([v, 0.0], jnp.float32) for v in values]


# ---------------------------------------------------------------- skip_nonfinite


def test_skip_nonfinite_skips_bad_steps_bit_identically():
  tx = jaxclip.skip_nonfinite(optax.adam(0.1))
  grads = [
    {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5)},
    {"w": jnp.array([NAN, 2.0]), "b": jnp.array(0.5)},
    {"w": jnp.array([1.0, 2.0]), "b": jnp.array(INF)},
    {"w": jnp.array([-1.0, 1.0]), "b": jnp.array(0.1)},
    {"w": jnp.array([1.0, -INF]), "b": jnp.array(0.1)},
  ]
  params = {"w": jnp.zeros(2), "b": jnp.zeros(())}
  steps = run(tx, grads, params)
  bad = [False, True, True, False, True]
  for (updates, old, new, p_old, p_new), is_bad in zip(steps, bad, strict=True):
    assert bool(new.nonfinite_step_skipped) == is_bad
    if is_bad:
      assert_bit_identical(new.inner_state, old.inner_state)
      assert_bit_identical(p_new, p_old)
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    else:
      assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(p_new))
  assert [int(s[2].num_consecutive_nonfinite) for s in steps] == [0, 1, 2, 0, 1]
  assert int(steps[-1][2].num_nonfinite_skipped) == 3
  assert int(optax.tree.get(steps[-1][2], "num_nonfinite_skipped")) == 3
  # Adam's count moved only on the two finite steps.
  assert int(optax.tree.get(steps[-1][2], "count")) == 2


@pytest.mark.parametrize("limit", [1, 2])
def test_skip_nonfinite_matches_optax_apply_if_finite(limit):
  grads = vec([1.0, NAN, NAN, NAN, 2.0, INF, 3.0])
  params = jnp.zeros(2)
  ours = run(
    jaxclip.skip_nonfinite(optax.sgd(0.5, momentum=0.9), max_consecutive=limit), grads, params
  )
  ref = run(optax.apply_if_finite(optax.sgd(0.5, momentum=0.9), limit), grads, params)
  for a, b in zip(ours, ref, strict=True):
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert int(a[2].num_consecutive_nonfinite) == int(b[2].notfinite_count)
  # After `limit` skips in a row the NaNs go through, so the run fails loudly.
  assert np.isnan(np.asarray(ours[limit + 1][0])).any()
  assert not np.isnan(np.asarray(ours[limit][0])).any()


def test_skip_nonfinite_jit_scan_and_inject_hyperparams_agree():
  grads = jnp.stack(vec([1.0, NAN, 2.0, NAN, NAN, NAN, 4.0]))
  params = jnp.zeros(2)
  tx = jaxclip.skip_nonfinite(optax.adam(0.1), max_consecutive=2)
  jitted = run(tx, list(grads), params)
  # Op by op, XLA may round adam's step one ulp apart from a compiled program
  # (jax 0.10.0 does, without jaxclip): eager agrees to that, compiled ones exactly.
  eager = run(tx, list(grads), params, jit=False)
  for a, b in zip(eager, jitted, strict=True):
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), rtol=2e-7)
    assert int(a[2].num_consecutive_nonfinite) == int(b[2].num_consecutive_nonfinite)

  def body(carry, g):
    state, p = carry
    u, state = tx.update(g, state, p)
    return (state, optax.apply_updates(p, u)), u

  (state, _), us = jax.lax.scan(body, (tx.init(params), params), grads)
  np.testing.assert_array_equal(np.asarray(us), np.stack([np.asarray(s[0]) for s in jitted]))
  assert_bit_identical(state, jitted[-1][2])
  assert_same_avals(state, tx.init(params))

  injected = optax.inject_hyperparams(jaxclip.skip_nonfinite)(optax.adam(0.1), max_consecutive=2)
  inj = run(injected, list(grads), params)
  for a, b in zip(inj, jitted, strict=True):
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))


def test_skip_nonfinite_forwards_extra_args_and_validates():
  seen = {}

  def update(updates, state, params=None, **extra):
    seen.update(extra)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  tx = jaxclip.skip_nonfinite(inner)
  tx.update(jnp.ones(2), tx.init(jnp.ones(2)), None, loss=1.0)
  assert seen == {"loss": 1.0}
  with pytest.raises(ValueError, match="max_consecutive"):
    jaxclip.skip_nonfinite(optax.sgd(1.0), max_consecutive=-1)


def _nonfinite_probe_tree():
  # Leaves on each path of the grouped reduction: tiny (<= 64 elements, padded
  # and maxed together), small (concatenated), large (reduced alone) and 0-d;
  # three floating dtypes, a complex leaf and an integer leaf.
  tree = {
    "tiny": jnp.full((3,), 0.5),
    "tiny2": jnp.full((5,), -0.5),
    "small": jnp.full((200,), 0.25, jnp.bfloat16),
    "small2": jnp.full((300,), 2.0),
    "large": jnp.full((40, 50), -1.5, jnp.float16),
    "scalar": jnp.array(3.0),
    "complex": jnp.full((4,), 1 - 2j, jnp.complex64),
    "int": jnp.arange(4),
  }
  return tree


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_all_finite_finds_a_nonfinite_entry_in_any_leaf(bad):
  from jaxclip.skipping._scaffold import all_finite

  check = jax.jit(all_finite)
  tree = _nonfinite_probe_tree()
  assert bool(check(tree))
  # The largest finite value of each dtype is finite.
  biggest = {
    k: jnp.full_like(v, jnp.finfo(v.dtype).max if jnp.issubdtype(v.dtype, jnp.floating) else v)
    for k, v in tree.items()
  }
  assert bool(check(biggest))
  for name, leaf in tree.items():
    if name == "int":
      continue
    for index in (0, leaf.size - 1):
      poisoned = dict(tree)
      poisoned[name] = leaf.ravel().at[index].set(bad).reshape(leaf.shape)
      assert not bool(check(poisoned)), (name, index)
  assert bool(check({"int": jnp.arange(3)})) and bool(check({}))


def _compiled_instructions(tx, num_leaves):
  tree = [np.full((64,), 0.1, np.float32) for _ in range(num_leaves)]
  text = helpers.compiled(jax.jit(lambda t: tx.update(t, tx.init(t), t)[0]).lower(tree)).as_text()
  return len(re.findall(r"^\s+\S+ = ", text, re.M))


@pytest.mark.parametrize(
  "make",
  [
    lambda: jaxclip.skip_nonfinite(optax.sgd(0.1)),
    lambda: jaxclip.skip_on_spike(optax.sgd(0.1), ord=1),
  ],
  ids=["skip_nonfinite", "skip_on_spike"],
)
def test_skipping_compiles_to_a_program_linear_in_the_number_of_leaves(make):
  # The skip flag combines every leaf and every leaf's select reads it. When
  # XLA copied that chain of scalar ops into each select's kernel, the program
  # grew with the square of the leaves (14x for 4x the leaves) and 1,000
  # leaves took five minutes to compile.
  small, large = _compiled_instructions(make(), 64), _compiled_instructions(make(), 256)
  assert large <= 4.5 * small, (small, large)


# ---------------------------------------------------------------- zero_nonfinite


def test_zero_nonfinite_repairs_counts_and_keeps_dtypes():
  tx = jaxclip.zero_nonfinite()
  tree = {
    "f32": jnp.array([1.0, NAN, INF]),
    "bf16": jnp.array([-INF, 2.0], jnp.bfloat16),
    "f16": jnp.array([[3.0, NAN]], jnp.float16),
    "int": jnp.array([1, 2], jnp.int32),
  }
  out, state = jax.jit(tx.update)(tree, tx.init(None))
  expected = {
    "f32": jnp.array([1.0, 0.0, 0.0]),
    "bf16": jnp.array([0.0, 2.0], jnp.bfloat16),
    "f16": jnp.array([[3.0, 0.0]], jnp.float16),
    "int": jnp.array([1, 2], jnp.int32),
  }
  assert_tree_allclose(out, expected, rtol=0)
  assert int(state.num_nonfinite_zeroed) == 4
  assert int(state.num_steps_with_nonfinite) == 1
  out, state = tx.update(tree["f32"][:1], state)
  assert int(state.num_nonfinite_zeroed) == 0
  assert int(state.num_steps_with_nonfinite) == 1


def test_zero_nonfinite_repairs_each_leaf_of_a_shared_shape_and_complex_leaves():
  # Leaves of one shape and dtype share their zeros; each keeps its own values.
  tx = jaxclip.zero_nonfinite()
  rows = [
    jnp.array([float(i), NAN if i % 3 == 0 else 1.0, INF if i % 2 else -2.0]) for i in range(7)
  ]
  tree = {
    "rows": rows,
    "c": jnp.array([1 + 1j, NAN + 0j, complex(1, INF)], jnp.complex64),
    "scalar": jnp.float32(-INF),
  }
  out, state = jax.jit(tx.update)(tree, tx.init(None))
  expected = {
    "rows": [jnp.where(jnp.isfinite(r), r, 0.0) for r in rows],
    "c": jnp.array([1 + 1j, 0, 0], jnp.complex64),
    "scalar": jnp.float32(0.0),
  }
  assert_tree_allclose(out, expected, rtol=0)
  assert int(state.num_nonfinite_zeroed) == 3 + 3 + 2 + 1


# ---------------------------------------------------------------- skip_on_spike


def olmo_reference(norms, losses, window, sigma):
  """OLMo-core's skip rule on Python lists (float64), with jaxclip's documented
  differences: non-finite values are not recorded, and two previous values are
  needed for a standard deviation. Returns per-step (skipped, norm threshold)."""
  hist = {"norm": [], "loss": []}
  min_count = max(2, window // 2)
  out = []

  def check(name, x):
    prev = hist[name][-window:]
    if len(prev) + 1 < min_count or len(prev) < 2:
      return False, INF
    mean, std = np.mean(prev), np.std(prev, ddof=1)
    return not ((x - mean) <= sigma * std), mean + sigma * std

  for i, n in enumerate(norms):
    skip, threshold = check("norm", n)
    if np.isfinite(n):
      hist["norm"].append(n)
    if losses is not None:
      loss_skip, _ = check("loss", losses[i])
      skip = skip or loss_skip
      if np.isfinite(losses[i]):
        hist["loss"].append(losses[i])
    out.append((skip, threshold))
  return out


def spiky_sequence(n, seed, spikes, nans):
  rng = np.random.default_rng(seed)
  x = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
  for i, f in spikes.items():
    x[i] *= f
  for i, v in nans.items():
    x[i] = v
  return x


@pytest.mark.parametrize("with_loss", [False, True])
def test_skip_on_spike_matches_olmo_reference(with_loss):
  window, sigma = 16, 4.0
  norms = spiky_sequence(70, 0, {5: 30.0, 24: 8.0, 45: 6.0}, {3: NAN, 30: INF, 50: NAN})
  losses = spiky_sequence(70, 1, {33: 5.0, 60: 4.0}, {40: NAN}) if with_loss else None
  ref = olmo_reference(
    [float(v) for v in norms], None if losses is None else [float(v) for v in losses], window, sigma
  )
  tx = jaxclip.skip_on_spike(optax.adam(0.1), window=window, sigma=sigma)
  extra = {} if losses is None else {"loss": list(jnp.asarray(losses))}
  steps = run(tx, vec(norms), jnp.zeros(2), **extra)
  init = tx.init(jnp.zeros(2))
  skipped = []
  for (updates, old, new, p_old, p_new), (ref_skip, ref_thr) in zip(steps, ref, strict=True):
    assert bool(new.spike_step_skipped) == ref_skip
    np.testing.assert_allclose(float(new.spike_norm_threshold), ref_thr, rtol=1e-5)
    assert_same_avals(new, init)
    assert np.all(np.isfinite(np.asarray(new.spike_norm_history)))
    if ref_skip:
      assert_bit_identical(new.inner_state, old.inner_state)
      assert_bit_identical(p_new, p_old)
      assert not np.any(np.asarray(updates))
    skipped.append(ref_skip)
  # The sequence exercises the rule: early spike and NaN pass (inactive), later ones do not.
  assert not skipped[3] and not skipped[5]
  assert skipped[24] and skipped[30] and skipped[45] and skipped[50]
  if with_loss:
    assert skipped[33] and skipped[40] and skipped[60]
  assert int(steps[-1][2].num_spike_skipped) == sum(skipped)


def test_skip_on_spike_jit_eager_inject_and_scan_agree():
  norms = spiky_sequence(24, 2, {14: 20.0}, {18: NAN})
  params = jnp.zeros(2)
  tx = jaxclip.skip_on_spike(optax.sgd(1.0), window=8, sigma=3.0)
  eager = run(tx, vec(norms), params, jit=False)
  jitted = run(tx, vec(norms), params, jit=True)
  # The window may be static or (with an eager init) a hyperparameter array.
  injected = run(
    optax.inject_hyperparams(jaxclip.skip_on_spike, static_args="window")(
      optax.sgd(1.0), window=8, sigma=3.0
    ),
    vec(norms),
    params,
  )
  injected_window = run(
    optax.inject_hyperparams(jaxclip.skip_on_spike)(optax.sgd(1.0), window=8, sigma=3.0),
    vec(norms),
    params,
  )
  for a, b, c, d in zip(eager, jitted, injected, injected_window, strict=True):
    assert_tree_allclose(a[0], b[0])
    assert_tree_allclose(a[0], c[0])
    assert_tree_allclose(a[0], d[0])
  assert bool(eager[14][2].spike_step_skipped) and bool(eager[18][2].spike_step_skipped)

  def body(state, g):
    u, state = tx.update(g, state, params)
    return state, u

  state, us = jax.lax.scan(body, tx.init(params), jnp.stack(vec(norms)))
  np.testing.assert_allclose(np.asarray(us), np.stack([np.asarray(s[0]) for s in eager]), rtol=1e-6)
  assert int(state.num_spike_skipped) == int(eager[-1][2].num_spike_skipped)


def test_skip_on_spike_validates():
  for window in (0, 1):  # a standard deviation needs two values: window=1 never fires
    with pytest.raises(ValueError, match="window"):
      jaxclip.skip_on_spike(optax.sgd(1.0), window=window)
  injected = optax.inject_hyperparams(jaxclip.skip_on_spike)(optax.sgd(1.0), window=4)
  with pytest.raises(TypeError, match="static_args"):
    jax.jit(injected.init)(jnp.ones(2))
  with pytest.raises(ValueError, match="sigma"):
    jaxclip.skip_on_spike(optax.sgd(1.0), sigma=-1.0)
  tx = jaxclip.skip_on_spike(optax.sgd(1.0))
  with pytest.raises(ValueError, match="scalar loss"):
    tx.update(jnp.ones(2), tx.init(jnp.ones(2)), None, loss=jnp.ones(3))
