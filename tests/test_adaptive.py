"""autoclip, zclip, their ring buffer, and suggest_threshold."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip._kernel import _history
from tests import helpers
from tests.helpers import assert_dtypes_kept

NAN, INF = float("nan"), float("inf")


def spiky_norms(n=60, seed=0):
  rng = np.random.default_rng(seed)
  x = (1.0 + 0.1 * rng.standard_normal(max(n, 48))).astype(np.float32)
  x[[12, 20, 21, 33, 47]] *= np.float32([8.0, 5.0, 12.0, 3.0, 20.0])
  x[[2, 25]] = NAN
  x[40] = INF
  return x[:n]


def feed(tx, norms, jit=True):
  """Feeds [n, 0] per step; returns per-step (first entry of the update, state)."""
  update = jax.jit(tx.update) if jit else tx.update
  state, out = tx.init(jnp.zeros(2)), []
  for n in norms:
    u, state = update(jnp.array([n, 0.0], jnp.float32), state)
    out.append((float(u[0]), state))
  return out


def scanned(tx, norms):
  """What feed gives (first update entries), from one lax.scan over the norms."""

  def body(state, n):
    u, state = tx.update(jnp.stack([n, jnp.zeros_like(n)]), state)
    return state, u[0]

  _, us = jax.lax.scan(body, tx.init(None), jnp.asarray(norms))
  return np.asarray(us)


def assert_same_avals(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)


def clipped_value(n, threshold):
  if not np.isfinite(n):
    return NAN
  return n * min(1.0, threshold / n) if n > 0 else 0.0


# ---------------------------------------------------------------- ring buffer


@jax.jit
def _push_twice(buf, v):
  return _history.push(_history.push(buf, v), jnp.float32(NAN))  # the NaN is never recorded


_percentiles = jax.jit(jax.vmap(_history.percentile, in_axes=(None, 0)))


def test_history_percentile_and_moments_match_numpy():
  rng = np.random.default_rng(0)
  qs = [0.0, 10.0, 37.5, 50.0, 99.0, 100.0]
  for capacity, pushes in [(1, 3), (5, 3), (5, 12), (16, 40)]:
    buf, seen = _history.empty(capacity), []
    for v in rng.gamma(2.0, size=pushes).astype(np.float32):
      buf = _push_twice(buf, v)
      seen = (seen + [float(v)])[-capacity:]
    assert int(buf.size) == len(seen)
    np.testing.assert_allclose(
      np.asarray(_percentiles(buf, jnp.array(qs))), np.percentile(seen, qs), rtol=1e-6
    )
    mean, std = jax.jit(_history.mean_std)(buf)
    np.testing.assert_allclose(float(mean), np.mean(seen), rtol=1e-6)
    if len(seen) > 1:
      np.testing.assert_allclose(float(std), np.std(seen, ddof=1), rtol=1e-5)
  assert float(_history.percentile(_history.empty(3), 50.0)) == INF


# ---------------------------------------------------------------- autoclip


def autoclip_reference(norms, percentile, history):
  """AutoClip as in the paper's code: append the norm, clip to the percentile of
  the history (here: the last `history` finite norms). Per-step thresholds."""
  hist, out = [], []
  for n in norms:
    if np.isfinite(n):
      hist = (hist + [float(n)])[-history:]
    out.append(np.percentile(hist, percentile) if hist else INF)
  return out


@pytest.mark.parametrize("percentile,history", [(10.0, 1000), (50.0, 8), (90.0, 5)])
def test_autoclip_matches_reference(percentile, history):
  norms = spiky_norms()
  tx = jaxclip.autoclip(percentile, history)
  steps = feed(tx, norms)
  init = tx.init(jnp.zeros(2))
  ref = autoclip_reference(norms, percentile, history)
  for n, thr, (u, state) in zip(norms, ref, steps, strict=True):
    np.testing.assert_allclose(float(state.autoclip_threshold), thr, rtol=1e-6)
    np.testing.assert_allclose(u, clipped_value(float(n), thr), rtol=1e-5)
    assert_same_avals(state, init)
    assert np.all(np.isfinite(np.asarray(state.autoclip_norm_history)))
  assert float(steps[0][0]) == pytest.approx(float(norms[0]))  # first step never clipped
  assert math.isnan(steps[40][0])  # the inf step stays visible


def test_autoclip_jit_eager_scan_inject_agree_and_dtypes():
  norms = spiky_norms(20)
  tx = jaxclip.autoclip(25.0, 6)
  eager = [u for u, _ in feed(tx, norms, jit=False)]
  np.testing.assert_allclose(eager, [u for u, _ in feed(tx, norms)], rtol=1e-6)
  injected = optax.inject_hyperparams(jaxclip.autoclip)(percentile=25.0, history=6)
  np.testing.assert_allclose(eager, [u for u, _ in feed(injected, norms)], rtol=1e-6)

  np.testing.assert_allclose(scanned(tx, norms), eager, rtol=1e-6)

  tree = {"a": jnp.full((3,), 100.0, jnp.bfloat16), "b": jnp.ones((2, 2), jnp.float16)}
  state = tx.init(tree)
  out, state = tx.update(tree, state)
  assert_dtypes_kept(tree, out)
  assert state.autoclip_pre_clip_norm.dtype == jnp.float32


def test_autoclip_validates():
  with pytest.raises(ValueError, match="percentile"):
    jaxclip.autoclip(percentile=101.0)
  with pytest.raises(ValueError, match="history"):
    jaxclip.autoclip(history=0)
  with pytest.raises(TypeError, match="history"):
    jaxclip.autoclip(history=2.5)
  with pytest.raises(TypeError, match="static_args"):
    jax.jit(optax.inject_hyperparams(jaxclip.autoclip)(history=4).init)(jnp.ones(2))
  with pytest.raises(ValueError, match="ord"):
    jaxclip.autoclip(ord=3)


# ---------------------------------------------------------------- zclip


class ZClipReference:
  """The reference ZClip's step() on floats (float64), minus its norm
  computation, with jaxclip's documented difference: NaN/inf norms are never
  collected or averaged in. ``step`` returns the threshold applied."""

  def __init__(
    self,
    alpha,
    z_thresh,
    max_norm,
    warmup,
    mode,
    clip_option,
    clip_factor,
    skip_update_on_spike,
    eps=1e-6,
  ):
    self.__dict__.update(locals())
    self.buffer, self.mean, self.var = [], None, None

  def step(self, n):
    cap = INF if self.max_norm is None else self.max_norm
    if not np.isfinite(n):
      return cap
    if self.mean is None:
      self.buffer.append(n)
      if len(self.buffer) >= self.warmup:
        self.mean = np.mean(self.buffer)
        self.var = np.mean((np.array(self.buffer) - self.mean) ** 2)
      return cap
    std = self.var**0.5
    clip_val = None
    if self.mode == "percentile":
      if n > self.mean + self.z_thresh * std:
        clip_val = self.mean + self.z_thresh * std
    else:
      z = (n - self.mean) / (std + self.eps)
      if z > self.z_thresh:
        if self.clip_option == "adaptive_scaling":
          clip_val = (self.mean + self.z_thresh * std / (z / self.z_thresh)) * self.clip_factor
        else:
          clip_val = self.mean
    if not (clip_val is not None and self.skip_update_on_spike):
      x = n if clip_val is None else clip_val
      self.mean = self.alpha * self.mean + (1 - self.alpha) * x
      self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
    return min(INF if clip_val is None else clip_val, cap)


ZCLIP_CONFIGS = [
  dict(),
  dict(clip_option="mean", z_thresh=2.0),
  dict(mode="percentile", alpha=0.9),
  dict(skip_update_on_spike=True, clip_factor=0.7, warmup_steps=10),
  dict(max_norm=1.05, alpha=0.8),
]


@pytest.mark.parametrize("config", ZCLIP_CONFIGS)
def test_zclip_matches_reference(config):
  kw = dict(
    alpha=0.97,
    z_thresh=2.5,
    max_norm=None,
    warmup_steps=5,
    mode="zscore",
    clip_option="adaptive_scaling",
    clip_factor=1.0,
    skip_update_on_spike=False,
  )
  kw.update(config)
  ref = ZClipReference(
    kw["alpha"],
    kw["z_thresh"],
    kw["max_norm"],
    kw["warmup_steps"],
    kw["mode"],
    kw["clip_option"],
    kw["clip_factor"],
    kw["skip_update_on_spike"],
  )
  tx = jaxclip.zclip(**kw)
  norms = spiky_norms()
  init = tx.init(jnp.zeros(2))
  clipped_steps = 0
  for n, (u, state) in zip(norms, feed(tx, norms), strict=True):
    thr = ref.step(float(n))
    np.testing.assert_allclose(float(state.zclip_threshold), thr, rtol=2e-5)
    np.testing.assert_allclose(u, clipped_value(float(n), thr), rtol=2e-5)
    if ref.mean is not None:
      np.testing.assert_allclose(float(state.zclip_norm_ema), ref.mean, rtol=2e-5)
      np.testing.assert_allclose(float(state.zclip_norm_var_ema), ref.var, rtol=1e-4)
    assert np.isfinite(float(state.zclip_norm_ema)) and np.isfinite(float(state.zclip_norm_var_ema))
    assert_same_avals(state, init)
    clipped_steps += bool(np.isfinite(n) and u < n * (1 - 1e-6))
  assert clipped_steps >= 3  # the sequence exercises the clipping


def test_zclip_inject_hyperparams_scan_and_grad_at_zero():
  norms = spiky_norms(30)
  tx = jaxclip.zclip(alpha=0.9, z_thresh=2.0, warmup_steps=4)
  eager = [u for u, _ in feed(tx, norms, jit=False)]
  injected = optax.inject_hyperparams(jaxclip.zclip)(alpha=0.9, z_thresh=2.0, warmup_steps=4)
  np.testing.assert_allclose(eager, [u for u, _ in feed(injected, norms)], rtol=1e-6)

  np.testing.assert_allclose(scanned(tx, norms), eager, rtol=1e-6)

  for t in (tx, jaxclip.autoclip(10.0, 4)):
    state = t.init(jnp.zeros(3))
    grad = jax.grad(lambda x, t=t, state=state: jnp.sum(t.update(x, state)[0]))(jnp.zeros(3))
    assert np.all(np.isfinite(np.asarray(grad)))


def test_zclip_validates():
  with pytest.raises(ValueError, match="mode"):
    jaxclip.zclip(mode="bogus")
  with pytest.raises(ValueError, match="clip_option"):
    jaxclip.zclip(clip_option="bogus")
  with pytest.raises(ValueError, match="alpha"):
    jaxclip.zclip(alpha=1.5)
  with pytest.raises(ValueError, match="z_thresh"):
    jaxclip.zclip(z_thresh=-1.0)
  with pytest.raises(ValueError, match="warmup_steps"):
    jaxclip.zclip(warmup_steps=0)


# ---------------------------------------------------------------- sharded norms


def test_axis_name_gives_the_unsharded_result():
  # A subprocess of 4 virtual devices (slow: tests/conftest.py's SLOW_TESTS).
  script = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax, jaxclip
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((4,), ("d",))
    grads = jnp.arange(1.0, 9.0) * jnp.array([1.0, -1.0] * 4)
    sharded_grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("d")))
    for make in (lambda **k: jaxclip.autoclip(50.0, 4, **k),
                 lambda **k: jaxclip.zclip(warmup_steps=2, **k),
                 lambda **k: jaxclip.skip_on_spike(optax.sgd(1.0), window=4, **k),
                 lambda **k: jaxclip.skip_nonfinite(optax.sgd(1.0), **k)):
      ref, sharded = make(), make(axis_name="d")
      def steps(tx, g):
        state, outs = tx.init(g), []
        for scale in (1.0, 2.0, 1.0, 30.0):
          u, state = tx.update(g * scale, state, g)
          outs.append(u)
        return jnp.stack(outs)
      expected = jax.jit(lambda g: steps(ref, g))(grads)
      got = jax.jit(jax.shard_map(lambda g: steps(sharded, g), mesh=mesh,
                                  in_specs=P("d"), out_specs=P(None, "d")))(sharded_grads)
      np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6)
    print("ok")
  """)
  result = subprocess.run(
    [sys.executable, "-c", script],
    env=helpers.device_env(4),
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("ok")


# ---------------------------------------------------------------- suggest_threshold


def test_suggest_threshold_reports_how_it_was_chosen():
  rng = np.random.default_rng(0)
  norms = np.concatenate([rng.gamma(4.0, 0.25, 200), [NAN, INF, 50.0]])
  s = jaxclip.suggest_threshold(jnp.asarray(norms), percentile=95, num_tensors=16)
  finite = norms[np.isfinite(norms)]
  assert s.max_norm == pytest.approx(np.percentile(finite, 95))
  assert (s.num_norms, s.num_nonfinite, s.percentile) == (201, 2, 95.0)
  assert s.median == pytest.approx(np.median(finite))
  assert s.maximum == 50.0
  assert s.fraction_clipped == pytest.approx(np.mean(finite > s.max_norm))
  assert s.per_tensor_max_norm == pytest.approx(s.max_norm / 4)
  assert "percentile 95" in s.explanation and "sqrt(16)" in s.explanation
  assert jaxclip.suggest_threshold([2.0]).max_norm == 2.0


def test_suggest_threshold_validates():
  with pytest.raises(ValueError, match="finite"):
    jaxclip.suggest_threshold([NAN, INF])
  with pytest.raises(ValueError, match="non-negative"):
    jaxclip.suggest_threshold([1.0, -1.0])
  with pytest.raises(ValueError, match="percentile"):
    jaxclip.suggest_threshold([1.0], percentile=-5)
  with pytest.raises(ValueError, match="num_tensors"):
    jaxclip.suggest_threshold([1.0], num_tensors=0)


def test_all_new_transforms_survive_strict_promotion(strict_promotion):
  tree = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2)}
  for tx in (
    jaxclip.autoclip(),
    jaxclip.zclip(),
    jaxclip.zero_nonfinite(),
    jaxclip.skip_nonfinite(optax.sgd(0.1, momentum=0.9)),  # adam is not strict-safe
    jaxclip.skip_on_spike(optax.sgd(0.1, momentum=0.9), window=4),
    optax.inject_hyperparams(jaxclip.zclip, hyperparam_dtype=jnp.bfloat16)(alpha=0.9),
    optax.inject_hyperparams(jaxclip.autoclip, hyperparam_dtype=jnp.bfloat16)(),
  ):
    state = init = tx.init(tree)
    update = jax.jit(tx.update)
    for _ in range(3):
      out, state = update(tree, state, tree, loss=jnp.float32(1.0))
    assert_dtypes_kept(tree, out)
    assert_same_avals(state, init)
