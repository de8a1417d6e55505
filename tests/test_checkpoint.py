"""Optimizer states survive an orbax checkpoint: a resumed run is the uninterrupted one.

Every transform with a non-empty state is in one chain around adam; a few
steps with a non-finite gradient and a spike make its counters and histories
non-trivial before the state is saved, restored into a fresh ``init`` state
and trained on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip

ocp = pytest.importorskip("orbax.checkpoint")

NUM_STEPS, SAVE_AFTER = 14, 8
NAN_STEPS = (3, 4)  # skipped by skip_nonfinite, then let through to zero_nonfinite
SPIKE_STEPS = (6, 11)  # a gradient and loss far above their history
SKIP_ABOVE = 1.7  # some ordinary steps' clipped norms are above it, others not


def _optimizer() -> optax.GradientTransformationExtraArgs:
  """Every stateful jaxclip transform, nested so that each one acts."""
  inner = optax.chain(
    jaxclip.record_norms(),
    jaxclip.clip_by_global_norm(5.0),
    jaxclip.dp_noise(5.0, 1e-3, seed=1),  # its key resumes: the same noise after a restore
    jaxclip.autoclip(50.0, history=4),
    jaxclip.zclip(z_thresh=1.0, warmup_steps=2),
    jaxclip.skip_above(jaxclip.clipped(optax.adam(1e-2), global_clipnorm=4.0), SKIP_ABOVE),
    # Per-tensor statistics of the optimizer's updates (after skip_above, whose
    # decisions they would otherwise change by rescaling every tensor).
    jaxclip.adaptive_value_clip(beta=0.9),
    jaxclip.adagc(beta=0.9, lambda_abs=0.05, warmup_steps=3),
    jaxclip.adaptive_norm_scale(),
  )
  spiky = jaxclip.skip_on_spike(inner, window=4, sigma=3.0)
  # One non-finite step in a row is skipped; the second is let through, and
  # zero_nonfinite repairs it before skip_on_spike sees it.
  return jaxclip.skip_nonfinite(optax.chain(jaxclip.zero_nonfinite(), spiky), max_consecutive=1)


def _problem():
  rng = np.random.default_rng(0)
  params = {
    "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
    "b": jnp.zeros((3,), jnp.float32),
  }
  xs = jnp.asarray(rng.normal(size=(NUM_STEPS, 8, 4)), jnp.float32)
  ys = jnp.asarray(rng.normal(size=(NUM_STEPS, 8, 3)), jnp.float32)
  return params, xs, ys


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _make_step(tx):
  @jax.jit
  def step(params, state, x, y, i):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    spike = jnp.isin(i, jnp.asarray(SPIKE_STEPS))
    grads = jax.tree.map(lambda g: jnp.where(spike, 1e3 * g, g), grads)
    loss = jnp.where(spike, 1e3 * loss, loss)
    bad = jnp.isin(i, jnp.asarray(NAN_STEPS))
    grads["w"] = grads["w"].at[0, 0].set(jnp.where(bad, jnp.nan, grads["w"][0, 0]))
    updates, state = tx.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state

  return step


def _run(step, params, state, xs, ys, steps):
  for i in steps:
    params, state = step(params, state, xs[i], ys[i], jnp.int32(i))
  return params, state


def _assert_bitwise_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
  ):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (jax.tree_util.keystr(path), a.dtype, b.dtype)
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _node_types(tree) -> set[type]:
  types = set()
  jax.tree.map(lambda x: types.add(type(x)), tree, is_leaf=lambda x: types.add(type(x)) and False)
  return types


def test_the_chain_holds_every_state_jaxclip_exports():
  params, _, _ = _problem()
  exported = {getattr(jaxclip, name) for name in jaxclip.__all__ if name.endswith("State")}
  assert exported <= _node_types(_optimizer().init(params))


def test_every_stateful_transform_resumes_bit_for_bit(tmp_path):
  tx = _optimizer()
  step = _make_step(tx)
  params0, xs, ys = _problem()
  expected = _run(step, params0, tx.init(params0), xs, ys, range(NUM_STEPS))

  params, state = _run(step, params0, tx.init(params0), xs, ys, range(SAVE_AFTER))
  # The counters the schedule is meant to move did move.
  get = lambda name, state=state: int(optax.tree.get(state, name))
  assert get("num_nonfinite_skipped") == 1
  assert get("num_steps_with_nonfinite") == 1
  assert get("num_spike_skipped") == 1
  assert 1 <= get("num_above_skipped") < SAVE_AFTER - 2
  assert float(optax.tree.get(state, "global_norm")) > 0
  assert get("autoclip_norm_count") > 0 and get("zclip_warmup_count") > 0

  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  del params, state
  fresh = {"params": params0, "opt_state": tx.init(params0)}
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt", fresh)
  _assert_bitwise_equal(
    restored["opt_state"], _run(step, params0, tx.init(params0), xs, ys, range(SAVE_AFTER))[1]
  )

  resumed = _run(
    step, restored["params"], restored["opt_state"], xs, ys, range(SAVE_AFTER, NUM_STEPS)
  )
  _assert_bitwise_equal(resumed, expected)


def test_an_optax_checkpoint_is_not_restored_into_jaxclip_unawares(tmp_path):
  # optax.clip_by_global_norm's state is empty; jaxclip's holds pre_clip_norm.
  # Restoring with jaxclip's init state as the target raises; restoring with
  # optax's and re-initialising the clip state carries the adam moments over.
  params, xs, ys = _problem()
  grads = jax.grad(_loss)(params, xs[0], ys[0])
  theirs = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
  ours = jaxclip.clipped(optax.adam(1e-2), global_clipnorm=0.1)
  _, state = theirs.update(grads, theirs.init(params), params)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "optax", state)
    with pytest.raises(ValueError, match="structures do not match"):
      ckpt.restore(tmp_path / "optax", ours.init(params))
    restored = ckpt.restore(tmp_path / "optax", theirs.init(params))
  migrated = (ours.init(params)[0], restored[1])
  assert jax.tree.structure(migrated) == jax.tree.structure(ours.init(params))
  expected, _ = theirs.update(grads, state, params)
  actual, _ = ours.update(grads, migrated, params)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, e, rtol=1e-6)


def test_an_optax_apply_if_finite_state_maps_onto_skip_nonfinite(tmp_path):
  # The recipe docs/migration.md gives for optax.apply_if_finite checkpoints.
  params, _, _ = _problem()
  theirs = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5)
  ours = jaxclip.skip_nonfinite(optax.adam(1e-2), max_consecutive=5)
  nan = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  state = theirs.init(params)
  for g in (jax.tree.map(jnp.ones_like, params), nan, nan):
    _, state = theirs.update(g, state, params)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "optax", state)
    with pytest.raises(ValueError, match="structures do not match"):
      ckpt.restore(tmp_path / "optax", ours.init(params))
    old = ckpt.restore(tmp_path / "optax", theirs.init(params))
  migrated = jaxclip.SkipNonfiniteState(
    inner_state=old.inner_state,
    num_nonfinite_skipped=old.total_notfinite,
    num_consecutive_nonfinite=old.notfinite_count,
    nonfinite_step_skipped=jnp.logical_not(old.last_finite) & (old.notfinite_count <= 5),
  )
  expected = ours.init(params)
  for g in (jax.tree.map(jnp.ones_like, params), nan, nan):
    _, expected = ours.update(g, expected, params)
  _assert_bitwise_equal(migrated, expected)
