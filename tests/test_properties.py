"""Hypothesis properties of the clip ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxclip import ops

# Each example's new shapes compile new programs: 20 examples a property.
SETTINGS = settings(max_examples=20, deadline=None)

floats = st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False, width=32)
arrays = hnp.arrays(
  np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=4), elements=floats
)
trees = st.lists(arrays, min_size=1, max_size=4)
thresholds = st.floats(float(np.float32(1e-3)), 1e3, width=32)


def _norm(tree):
  return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree)))


@SETTINGS
@given(trees, thresholds)
def test_global_norm_bounded_after_clip(tree, c):
  clipped, _ = ops.clip_by_global_norm([jnp.asarray(x) for x in tree], c)
  assert _norm(clipped) <= c * (1 + 1e-6)


@SETTINGS
@given(trees, thresholds)
def test_direction_kept(tree, c):
  clipped, norm = ops.clip_by_global_norm([jnp.asarray(x) for x in tree], c)
  flat_in = np.concatenate([np.ravel(x) for x in tree]).astype(np.float64)
  flat_out = np.concatenate([np.ravel(x) for x in clipped]).astype(np.float64)
  if float(norm) > 0:
    scale = min(1.0, c / float(norm))
    np.testing.assert_allclose(flat_out, flat_in * scale, rtol=1e-5, atol=1e-6 * c)


@SETTINGS
@given(trees, thresholds)
def test_idempotent(tree, c):
  once, _ = ops.clip_by_global_norm([jnp.asarray(x) for x in tree], c)
  twice, _ = ops.clip_by_global_norm(once, c)
  for a, b in zip(once, twice, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * c)
  once = ops.clip_by_norm([jnp.asarray(x) for x in tree], c)
  twice = ops.clip_by_norm(once, c)
  for a, b in zip(once, twice, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * c)


@SETTINGS
@given(trees)
def test_under_threshold_unchanged(tree):
  tree = [jnp.asarray(x) for x in tree]
  c = _norm(tree) * 1.01 + 1e-3
  clipped, _ = ops.clip_by_global_norm(tree, c)
  per_leaf = ops.clip_by_norm(tree, c)
  for x, a, b in zip(tree, clipped, per_leaf, strict=True):
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, x)


@SETTINGS
@given(trees, floats, floats)
def test_clip_by_value_bounds_hold(tree, a, b):
  lo, hi = min(a, b), max(a, b)
  out = ops.clip_by_value([jnp.asarray(x) for x in tree], lo, hi)
  for x, y in zip(tree, out, strict=True):
    y = np.asarray(y)
    assert np.all(y >= np.float32(lo)) and np.all(y <= np.float32(hi))
    inside = (x >= lo) & (x <= hi)
    np.testing.assert_array_equal(y[inside], x[inside])


@SETTINGS
@given(trees, thresholds)
def test_per_leaf_norm_bounded(tree, c):
  for y in ops.clip_by_norm([jnp.asarray(x) for x in tree], c):
    assert _norm([y]) <= c * (1 + 1e-6)


@SETTINGS
@given(
  st.lists(
    hnp.arrays(
      np.int32, hnp.array_shapes(max_dims=2, max_side=4), elements=st.integers(-1000, 1000)
    ),
    min_size=1,
    max_size=3,
  ),
  st.floats(-500, 500),
  st.floats(-500, 500),
)
def test_clip_by_value_integers_stay_inside(tree, a, b):
  # Host-side float64 rounding of concrete bounds: -1e-80 still rounds to -1.
  lo, hi = min(a, b), max(a, b)
  if np.ceil(lo) > np.floor(hi):
    return
  out = ops.clip_by_value([jnp.asarray(x) for x in tree], lo, hi)
  for y in out:
    assert y.dtype == jnp.int32
    assert np.all(np.asarray(y) >= lo) and np.all(np.asarray(y) <= hi)


def test_jit_agrees_with_eager_on_random_trees():
  tree = [jax.random.normal(jax.random.key(i), (3, i + 1)) * 5 for i in range(4)]
  for fn in (
    lambda t: ops.clip_by_global_norm(t, 2.0),
    lambda t: ops.clip_by_norm(t, 2.0),
    lambda t: ops.clip_by_value(t, -1.0, 1.0),
    lambda t: ops.clip_by_average_norm(t, 0.1),
  ):
    eager, jitted = fn(tree), jax.jit(fn)(tree)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6)
