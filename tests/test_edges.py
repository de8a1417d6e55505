"""The edges where a clip silently stopped clipping (issue #51, items 3-8).

Each test fails at ee5c6d7.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip import ops

X = {"w": jnp.array([3.0, 4.0, 1e-40])}


def _with_traced(make, name, value, updates=X):
  """``make``'s update under ``jit`` with hyperparameter ``name`` traced as ``value``."""
  tx = optax.inject_hyperparams(make)(**{name: 1.0})
  state = tx.init(updates)
  state.hyperparams[name] = jnp.asarray(value, jnp.float32)
  return jax.jit(tx.update)(updates, state, updates)[0]["w"]


NORM_CLIPS = [
  (jaxclip.clip_by_global_norm, "max_norm"),
  (jaxclip.clip_by_norm, "max_norm"),
  (jaxclip.clip_by_block_rms, "threshold"),
  (jaxclip.clip_by_average_norm, "max_norm"),
]
ALL_THRESHOLDS = [
  *NORM_CLIPS,
  (jaxclip.clip, "max_delta"),
  (jaxclip.adaptive_grad_clip, "clipping"),
]


@pytest.mark.parametrize(("make", "name"), ALL_THRESHOLDS, ids=lambda v: getattr(v, "__name__", v))
def test_a_traced_nan_threshold_gives_nan_visibly(make, name):
  # At ee5c6d7 the norm clips compared against NaN, found no clipping and
  # passed the update through unclipped.
  assert bool(jnp.all(jnp.isnan(_with_traced(make, name, jnp.nan))))


@pytest.mark.parametrize(("make", "name"), ALL_THRESHOLDS, ids=lambda v: getattr(v, "__name__", v))
def test_a_traced_negative_threshold_acts_as_zero_everywhere(make, name):
  # At ee5c6d7 clip(-1) gave -1 everywhere and adaptive_grad_clip(-1)
  # flipped the update's sign; the norm clips gave zeros.
  out = _with_traced(make, name, -1.0)
  np.testing.assert_array_equal(out, 0.0)


def test_ops_clip_by_global_norm_traced_nan():
  out, norm = jax.jit(ops.clip_by_global_norm)(X, jnp.nan)
  assert bool(jnp.all(jnp.isnan(out["w"]))) and float(norm) == pytest.approx(5.0)


Z = {"w": jnp.array([-0.5 + 9j, 0.3 + 0.4j, 3e30 + 4e30j], jnp.complex64)}


@pytest.mark.parametrize(
  "tx",
  [jaxclip.clip(1.0), jaxclip.clipped(optax.identity(), clipvalue=1.0)],
  ids=["clip", "clipped"],
)
def test_complex_value_clips_bound_the_modulus_keeping_the_phase(tx):
  out = tx.update(Z, tx.init(Z))[0]["w"]
  np.testing.assert_allclose(np.abs(out), [1.0, 0.5, 1.0], rtol=1e-6)
  np.testing.assert_allclose(np.angle(out), np.angle(np.asarray(Z["w"])), rtol=1e-6)
  assert out[1] == Z["w"][1]  # below the bound, unchanged


def test_complex_leaves_refused_by_two_sided_value_clips():
  with pytest.raises(TypeError, match=r"\['w'\].*complex"):
    jaxclip.clip_by_value(-1.0, 1.0).update(Z, None)
  with pytest.raises(TypeError, match=r"\['w'\].*complex"):
    ops.clip_by_value(Z, -1.0, 1.0)


def test_zclip_statistics_survive_one_huge_finite_norm():
  tx = jaxclip.zclip(warmup_steps=2)
  g = {"w": jnp.ones(4)}
  state = tx.init(g)
  update = jax.jit(tx.update)
  for grads in [{"w": jnp.full(4, 5e19)}, g, g, g]:
    _, state = update(grads, state)
  assert np.isfinite(float(state.zclip_norm_ema)) and np.isfinite(float(state.zclip_norm_var_ema))
  # A later spike is still clipped.
  spiked, state = update({"w": jnp.full(4, 1e35)}, state)
  assert float(ops.global_norm(spiked)) < 1e34


def test_skip_on_spike_threshold_stays_finite_after_huge_norms():
  tx = jaxclip.skip_on_spike(optax.identity(), window=4)
  state = tx.init(X)
  update = jax.jit(tx.update)
  for scale in (1e20, 2e20, 3e20, 1e20):
    _, state = update({"w": jnp.full(3, scale)}, state)
  assert np.isfinite(float(state.spike_norm_threshold))


def test_numpy_float64_leaves_request_no_float64_with_x64_off():
  tree = {"a": np.ones(3), "b": np.arange(2.0)}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ops.global_norm(tree)
    for tx in (
      jaxclip.clip_by_global_norm(1.0),
      jaxclip.record_norms(),
      jaxclip.skip_above(optax.identity(), 10.0),
    ):
      tx.update(tree, tx.init(tree), tree)


def test_clip_by_global_norm_names_itself_for_a_foreign_state():
  tx = jaxclip.clip_by_global_norm(1.0)
  with pytest.raises(TypeError, match="clip_by_global_norm"):
    tx.update(X, optax.EmptyState())
  tx.update(X, None)  # no state kept: still accepted


def test_errors_name_the_argument_at_fault():
  g = {"w": jnp.ones((3, 4))}
  with pytest.raises(ValueError, match=r"clip_norm of shape \(7,\).*\['w'\]"):
    ops.clip_by_norm(g, jnp.ones(7))
  with pytest.raises(ValueError, match=r"max_norm of shape \(7,\)"):
    jaxclip.clip_by_norm(jnp.ones(7)).update(g, None)
  with pytest.raises(TypeError, match="axes must be"):
    ops.clip_by_norm(g, 1.0, axes="x")
  with pytest.raises(TypeError, match="axes must be"):
    jaxclip.clip_by_norm(1.0, axes="x")
  with pytest.raises(TypeError, match="needs norms.*None"):
    jaxclip.suggest_threshold(None)
  ops.clip_by_norm(g, jnp.ones(4), axes=0)  # a per-column bound broadcasts


def _bits(x):
  return np.asarray(x).view(np.uint32 if x.dtype == jnp.float32 else np.uint16)


@pytest.mark.parametrize(
  "fn",
  [
    lambda t: ops.clip_by_global_norm(t, 1e3)[0],
    lambda t: ops.clip_by_norm(t, 1e3),
    lambda t: ops.clip_by_average_norm(t, 1e3),
    lambda t: jaxclip.clip_by_global_norm(1e3).update(t, None)[0],
    lambda t: jaxclip.clip_by_block_rms(1e3).update(t, None)[0],
    lambda t: jaxclip.adaptive_grad_clip(1e3).update(t, None, t)[0],
  ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_below_the_threshold_the_input_passes_bit_for_bit(fn, dtype):
  # Subnormals included: XLA:CPU flushes a subnormal times 1.0 to zero.
  tree = {"w": jnp.array([1e-40, -1e-45, 0.5, -0.0], jnp.float32).astype(dtype)}
  if dtype == "bfloat16":
    tree = {"w": jnp.array([1e-39, -1e-40, 0.5, -0.0], jnp.float32).astype(dtype)}
  out = jax.jit(fn)(tree)
  np.testing.assert_array_equal(_bits(out["w"]), _bits(tree["w"]))
