"""Replacing optax.X by jaxclip.X gives optax's numbers (float32 rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip._kernel._platform import _stacks
from tests.helpers import assert_tree_allclose


def _tree(seed, shapes, scale=1.0):
  rng = np.random.default_rng(seed)
  return {
    f"p{i}": jnp.asarray(scale * rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)
  }


SHAPES = [(5,), (4, 3), (2, 3, 4), (3, 3, 2, 4), (2, 2, 2, 3, 2), (1, 6)]


def _same_transform(ours, theirs, grads, params=None, rtol=1e-6):
  a, _ = ours.update(grads, ours.init(grads), params)
  b, _ = theirs.update(grads, theirs.init(grads), params)
  assert_tree_allclose(a, b, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_clip(seed, scale):
  g = _tree(seed, SHAPES, scale)
  _same_transform(jaxclip.clip(0.7), optax.clip(0.7), g)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", [0.05, 0.5, 5.0])
def test_clip_by_block_rms(seed, threshold):
  g = _tree(seed, SHAPES)
  _same_transform(jaxclip.clip_by_block_rms(threshold), optax.clip_by_block_rms(threshold), g)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("max_norm", [0.1, 3.0, 1e3])
def test_clip_by_global_norm(seed, max_norm):
  g = _tree(seed, SHAPES)
  _same_transform(jaxclip.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm), g)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("clipping", [0.01, 0.1, 10.0])
def test_adaptive_grad_clip(seed, clipping):
  g = _tree(seed, SHAPES, 2.0)
  p = _tree(seed + 100, SHAPES)
  _same_transform(
    jaxclip.adaptive_grad_clip(clipping), optax.adaptive_grad_clip(clipping), g, params=p, rtol=2e-6
  )


@pytest.mark.parametrize("axis", [0, 1, (0, 1), -1])
def test_adaptive_grad_clip_axis(axis):
  g = _tree(0, [(4, 3), (2, 3, 4)], 2.0)
  p = _tree(1, [(4, 3), (2, 3, 4)])
  _same_transform(
    jaxclip.adaptive_grad_clip(0.1, axis=axis),
    optax.adaptive_grad_clip(0.1, axis=axis),
    g,
    params=p,
    rtol=2e-6,
  )


def test_adaptive_grad_clip_needs_params():
  tx = jaxclip.adaptive_grad_clip(0.1)
  with pytest.raises(ValueError):
    tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


def test_adaptive_grad_clip_needs_params_of_the_updates_shapes():
  tx = jaxclip.adaptive_grad_clip(0.1)
  with pytest.raises(ValueError, match=r"params of the updates' shapes.*\(3,\).*\(2,\)"):
    tx.update({"w": jnp.ones(2)}, tx.init(None), {"w": jnp.ones(3)})


def test_adaptive_grad_clip_over_many_stacked_leaves_matches_optax(stacks):
  # Leaves of one shape are clipped as stacks (one kernel for many leaves):
  # (5,) leaves fill several overlapping stacks, (4, 3) leaves are clipped
  # column by column, and the rare and large shapes one by one.
  s = _stacks._STACK
  n = 4 * s + s // 2
  shapes = [(5,)] * n + [(4, 3)] * (2 * s + s // 4) + [(2, 3, 4)] * 3 + [(1, 6)] * 2 + [(40, 40)]
  g = _tree(0, shapes, 2.0)
  p = _tree(1, shapes)
  # Some units far below their bound, some zero (g and p), so every branch is taken.
  g["p1"], p["p2"] = 1e-4 * g["p1"], jnp.zeros(5)
  g[f"p{n + 1}"] = g[f"p{n + 1}"].at[:, 1].set(0.0)
  ours = jaxclip.adaptive_grad_clip(0.05)
  b, _ = jax.jit(optax.adaptive_grad_clip(0.05).update)(g, optax.EmptyState(), p)
  for update in (ours.update, jax.jit(ours.update)):  # eager, then jitted
    a, _ = update(g, ours.init(p), p)
    assert_tree_allclose(a, b, rtol=2e-6, atol=1e-7)
    assert bool(jnp.all(a["p1"] == g["p1"]))  # below the bound: unchanged, bit for bit


def test_adaptive_grad_clip_of_bfloat16_gradients_over_stacked_leaves(stacks):
  # bfloat16 gradients with float32 parameters: norms accumulate in float32,
  # and the product is rounded to bfloat16 once.
  s = _stacks._STACK
  shapes = [(6,)] * (3 * s + s // 8) + [(3, 4)] * (s + s // 8)
  g = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(2, shapes, 3.0))
  p = _tree(3, shapes)
  a, _ = jax.jit(jaxclip.adaptive_grad_clip(0.1).update)(g, optax.EmptyState(), p)
  for name in g:
    g64, p64 = np.asarray(g[name], np.float64), np.asarray(p[name], np.float64)
    axis = None if g64.ndim == 1 else 0
    g_norm = np.sqrt(np.sum(g64**2, axis=axis, keepdims=True))
    bound = 0.1 * np.maximum(np.sqrt(np.sum(p64**2, axis=axis, keepdims=True)), 1e-3)
    want = np.where(g_norm < bound, g64, g64 * bound / np.maximum(g_norm, 1e-6))
    assert a[name].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a[name], np.float64), want, rtol=2**-8)


@pytest.mark.parametrize("shape", SHAPES + [()])
@pytest.mark.parametrize("axis", [None, 0])
def test_unitwise_norm(shape, axis):
  if axis is not None and len(shape) == 0:
    return
  x = jax.random.normal(jax.random.key(3), shape)
  np.testing.assert_allclose(
    jaxclip.unitwise_norm(x, axis), optax.transforms.unitwise_norm(x, axis), rtol=1e-6
  )
  assert jaxclip.unitwise_norm(x, axis).shape == x.shape


def test_unitwise_norm_rank6_needs_axis():
  with pytest.raises(ValueError, match="axis"):
    jaxclip.unitwise_norm(jnp.ones((2,) * 6))


def test_unitwise_clip():
  g = jax.random.normal(jax.random.key(4), (4, 3)) * 3
  gn = jaxclip.unitwise_norm(g)
  mn = jnp.full_like(gn, 1.5)
  np.testing.assert_allclose(
    jaxclip.unitwise_clip(gn, mn, g), optax.transforms.unitwise_clip(gn, mn, g), rtol=1e-6
  )
  with pytest.raises(ValueError, match="shape"):
    jaxclip.unitwise_clip(gn[:1], mn, g)


@pytest.mark.parametrize("clip_value", [0.0, 0.5, 3.0, jnp.inf])
def test_per_example_global_norm_clip(clip_value):
  g = _tree(5, [(8, 3), (8, 2, 2), (8,)], 2.0)
  ours = jaxclip.per_example_global_norm_clip(g, clip_value)
  theirs = optax.per_example_global_norm_clip(g, clip_value)
  assert_tree_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
  assert int(ours[1]) == int(theirs[1])


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("clip_value", [0.0, 0.5, 3.0])
def test_per_example_layer_norm_clip(uniform, clip_value):
  g = _tree(6, [(8, 3), (8, 2, 2), (8,)], 2.0)
  ours = jaxclip.per_example_layer_norm_clip(g, clip_value, uniform)
  theirs = optax.per_example_layer_norm_clip(g, clip_value, uniform)
  assert_tree_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(theirs[1]), strict=True):
    assert int(a) == int(b)


def test_per_example_needs_batch_dim():
  with pytest.raises(ValueError, match="batch"):
    jaxclip.per_example_global_norm_clip([jnp.ones((3, 2)), jnp.ones((4, 2))], 1.0)
  with pytest.raises(ValueError, match="batch"):
    jaxclip.per_example_layer_norm_clip([jnp.ones(())], 1.0)


# ---------------------------------------------------------------- where jaxclip is more correct


def test_more_correct_bf16_global_norm():
  """1,000 bf16 leaves: jaxclip's norm is their exact norm (float32 sums)."""
  leaves = [jnp.full((100,), 0.03162, jnp.bfloat16)] * 1000
  true = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in leaves))
  _, state = (tx := jaxclip.clip_by_global_norm(1.0)).update(leaves, tx.init(leaves))
  np.testing.assert_allclose(float(state.pre_clip_norm), true, rtol=1e-4)


def test_more_correct_zero_threshold_zero_updates():
  g = {"w": jnp.zeros(3)}
  for tx in (jaxclip.clip_by_global_norm(0.0), jaxclip.clip_by_block_rms(0.0)):
    out, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(out["w"], 0.0)
