"""adagc, adaptive_value_clip and adaptive_norm_scale against NumPy ports of their rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from tests.helpers import assert_dtypes_kept

NUM_STEPS = 30
SPIKES = {6: 40.0, 13: 25.0, 21: 80.0}
ZERO_STEP = 9  # every leaf is zero
ZERO_LEAF_STEP = 16  # only "b" is zero


def gradient_run(seed=0):
  """Per-step dicts of float32/bfloat16 gradients with spikes and zero steps."""
  rng = np.random.default_rng(seed)
  shapes = {"w": (8, 3), "b": (4,), "h": (4, 2)}
  steps = []
  for t in range(NUM_STEPS):
    g = {
      k: rng.normal(size=s).astype(np.float32) * (1 + 0.3 * i)
      for i, (k, s) in enumerate(shapes.items())
    }
    if t in SPIKES:
      g["w"] *= SPIKES[t]
    if t == ZERO_STEP:
      g = {k: np.zeros_like(v) for k, v in g.items()}
    if t == ZERO_LEAF_STEP:
      g["b"] = np.zeros_like(g["b"])
    steps.append(
      {"w": jnp.asarray(g["w"]), "b": jnp.asarray(g["b"]), "h": jnp.asarray(g["h"], jnp.bfloat16)}
    )
  return steps


def as64(tree):
  return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def norm(x):
  return float(np.sqrt(np.sum(x * x)))


# ------------------------------------------------------------------ NumPy ports


def adagc_port(steps, beta, lambda_abs, lambda_rel, warmup_steps, eps):
  gamma, outs, states = None, [], []
  for t, g in enumerate(map(as64, steps), start=1):
    if t < warmup_steps:
      total = np.sqrt(sum(np.sum(v * v) for v in g.values()))
      out = {k: v * min(1.0, lambda_abs / (total + eps)) for k, v in g.items()}
      gamma = {k: norm(v) if t == 1 else min(gamma[k], norm(v)) for k, v in out.items()}
    else:
      if gamma is None:
        gamma = {k: norm(v) for k, v in g.items()}
      out = {}
      for k, v in g.items():
        n, limit = norm(v), lambda_rel * gamma[k]
        out[k] = v * (limit / n if n > limit else 1.0)
        gamma[k] = beta * gamma[k] + (1 - beta) * norm(out[k])
    outs.append(out)
    states.append(dict(gamma))
  return outs, states


def value_clip_port(steps, beta):
  m, outs, states = None, [], []
  for t, g in enumerate(map(as64, steps), start=1):
    m = {k: beta * (m[k] if m else 0.0) + (1 - beta) * np.max(np.abs(v)) for k, v in g.items()}
    out = {}
    for k, v in g.items():
      bound, top = m[k] / (1 - beta**t), np.max(np.abs(v))
      out[k] = v.copy()
      big = np.abs(v) > bound
      out[k][big] = v[big] / top * bound
    outs.append(out)
    states.append(dict(m))
  return outs, states


def norm_scale_port(steps, beta1, beta2, eps):
  m = v = None
  outs, states = [], []
  for t, g in enumerate(map(as64, steps), start=1):
    n = {k: norm(x) for k, x in g.items()}
    m = {k: beta1 * (m[k] if m else 0.0) + (1 - beta1) * n[k] for k in g}
    v = {k: beta2 * (v[k] if v else 0.0) + (1 - beta2) * n[k] ** 2 for k in g}
    out = {}
    for k, x in g.items():
      target = (m[k] / (1 - beta1**t)) / (np.sqrt(v[k] / (1 - beta2**t)) + eps)
      out[k] = x / n[k] * target if n[k] > 0 else x
    outs.append(out)
    states.append((dict(m), dict(v)))
  return outs, states


CONFIGS = {
  "adagc": (
    jaxclip.adagc,
    dict(beta=0.9, lambda_abs=6.0, lambda_rel=1.05, warmup_steps=5, eps=1e-8),
    adagc_port,
  ),
  "adagc_no_warmup": (
    jaxclip.adagc,
    dict(beta=0.98, lambda_abs=1.0, lambda_rel=1.5, warmup_steps=0, eps=1e-8),
    adagc_port,
  ),
  "adaptive_value_clip": (jaxclip.adaptive_value_clip, dict(beta=0.9), value_clip_port),
  "adaptive_norm_scale": (
    jaxclip.adaptive_norm_scale,
    dict(beta1=0.7, beta2=0.9, eps=1e-8),
    norm_scale_port,
  ),
}


def state_values(state):
  if isinstance(state, jaxclip.AdaGCState):
    return state.adagc_gamma.as_tree()
  if isinstance(state, jaxclip.AdaptiveValueClipState):
    return state.value_clip_max_ema.as_tree()
  return state.norm_scale_mu.as_tree(), state.norm_scale_nu.as_tree()


def run_steps(tx, steps):
  state = tx.init(steps[0])
  update = jax.jit(tx.update)
  outs, states = [], []
  for g in steps:
    out, state = update(g, state)
    outs.append(out)
    states.append(state)
  return outs, states


def assert_close(got, want, rtol):
  for k in want:
    tol = 2e-2 if k == "h" else rtol  # bfloat16 output rounding
    np.testing.assert_allclose(
      np.asarray(got[k], np.float64), want[k], rtol=tol, atol=tol * 1e-6, err_msg=k
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_numpy_port(name):
  factory, kw, port = CONFIGS[name]
  steps = gradient_run()
  outs, states = run_steps(factory(**kw), steps)
  want_outs, want_states = port(steps, **kw)
  changed = 0
  for t, (g, out, want, state, want_state) in enumerate(
    zip(steps, outs, want_outs, states, want_states, strict=True)
  ):
    assert_dtypes_kept(g, out)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((out, state))), t
    assert_close(out, want, rtol=2e-5)
    got_state = state_values(state)
    for got_part, want_part in zip(
      jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True
    ):
      np.testing.assert_allclose(float(got_part), want_part, rtol=2e-5, atol=1e-30)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got_state))
    changed += not all(
      np.allclose(np.asarray(out[k], np.float64), np.asarray(g[k], np.float64), rtol=1e-3)
      for k in g
    )
    if t == ZERO_STEP:
      assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(out))
  assert changed >= 3  # the run exercises the rule


def test_inject_hyperparams_gives_the_same_run():
  steps = gradient_run(1)[:12]
  for factory, kw, static in (
    (jaxclip.adagc, dict(beta=0.9, lambda_abs=6.0, lambda_rel=1.05, warmup_steps=4), ()),
    (jaxclip.adagc, dict(beta=0.9, lambda_rel=1.05, warmup_steps=4), ("warmup_steps",)),
    (jaxclip.adaptive_value_clip, dict(beta=0.9), ()),
    (jaxclip.adaptive_norm_scale, dict(beta1=0.6, beta2=0.95, eps=1e-6), ()),
  ):
    plain, _ = run_steps(factory(**kw), steps)
    injected, _ = run_steps(optax.inject_hyperparams(factory, static_args=static)(**kw), steps)
    for a, b in zip(plain, injected, strict=True):
      for k in a:
        np.testing.assert_allclose(
          np.asarray(a[k], np.float32), np.asarray(b[k], np.float32), rtol=1e-6
        )


def _makers(**kw):
  return (
    jaxclip.adagc(beta=0.9, lambda_abs=6.0, warmup_steps=3, **kw),
    jaxclip.adaptive_value_clip(beta=0.9, **kw),
    jaxclip.adaptive_norm_scale(**kw),
  )


def test_axis_name_under_vmap_matches_the_unsharded_run():
  steps = gradient_run(2)[:8]
  replicas = 4

  def shard(tree):  # (replicas, rows / replicas, ...) per leaf
    return {k: v.reshape(replicas, v.shape[0] // replicas, *v.shape[1:]) for k, v in tree.items()}

  for ref, sharded in zip(_makers(), _makers(axis_name="d"), strict=True):
    want_outs, want_states = run_steps(ref, steps)

    def run(shards, sharded=sharded):
      state, outs = sharded.init(shards[0]), []
      for g in shards:
        out, state = sharded.update(g, state)
        outs.append(out)
      return outs, state

    outs, state = jax.jit(jax.vmap(run, axis_name="d"))([shard(g) for g in steps])
    for out, want in zip(outs, want_outs, strict=True):
      for k in want:
        np.testing.assert_allclose(
          np.asarray(out[k], np.float32).reshape(want[k].shape),
          np.asarray(want[k], np.float32),
          rtol=1e-5,
          err_msg=k,
        )
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want_states[-1]), strict=True):
      got = np.asarray(got)
      assert np.all(got == got[0])  # every replica keeps the same state
      np.testing.assert_allclose(got[0], np.asarray(expected), rtol=1e-5)


def test_grad_is_finite_at_zero():
  params = {"w": jnp.zeros((2, 3)), "h": jnp.zeros(3, jnp.bfloat16)}
  warm = {"w": jnp.ones((2, 3)), "h": jnp.ones(3, jnp.bfloat16)}
  for tx in (
    *_makers(),
    jaxclip.adagc(warmup_steps=0, eps=0.0),
    jaxclip.adaptive_norm_scale(eps=0.0),
  ):
    fresh = tx.init(params)
    update = jax.jit(tx.update)
    _, used = update(warm, fresh)

    def loss(g, state, tx=tx):
      out = tx.update(g, state)[0]
      return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))

    grad = jax.jit(jax.grad(loss))
    for state in (fresh, used):
      grads = grad(params, state)
      assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(grads))
      out, new_state = update(params, state)
      assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(out))
      assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new_state))


def test_strict_promotion_and_scan(strict_promotion):
  tree = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2)}
  for tx in (
    *_makers(),
    optax.inject_hyperparams(jaxclip.adagc, hyperparam_dtype=jnp.bfloat16)(),
    optax.inject_hyperparams(jaxclip.adaptive_norm_scale, hyperparam_dtype=jnp.bfloat16)(),
  ):
    init = tx.init(tree)

    def body(state, scale, tx=tx):
      g = jax.tree.map(lambda x: x * scale.astype(x.dtype), tree)
      out, state = tx.update(g, state)
      return state, out

    state, outs = jax.lax.scan(body, init, jnp.array([1.0, 3.0, 0.0, 50.0]))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(
      lambda x: (x.shape, x.dtype), init
    )
    assert_dtypes_kept(tree, jax.tree.map(lambda x: x[0], outs))


def test_the_statistics_are_one_vector_per_field_matched_to_the_leaves_by_path():
  """LeafStats: one array leaf per statistic; each update leaf reads its own entry by path."""
  params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3), "step": jnp.zeros((), jnp.int32)}
  for tx in _makers():
    state = tx.init(params)
    stats = [x for x in state[:-1]]
    assert all(isinstance(x, jaxclip.LeafStats) for x in stats)
    # one array leaf per field (and the count): what jit, donation and checkpoints see
    assert [x.shape for x in jax.tree.leaves(state)] == [(3,)] * len(stats) + [()]
    assert {p for p, _ in jax.tree_util.tree_flatten_with_path(stats[0])[0]} == {
      (jax.tree_util.GetAttrKey("values"),)
    }
    # the updates leave out the integer leaf: its entry is kept, the others move
    g = {"w": jnp.full((2, 3), 2.0), "b": jnp.full(3, 0.5)}
    _, after = jax.jit(tx.update)(g, state)
    # equality is by layout and values, a bool for vectors of any length
    assert stats[0] == tx.init(params)[0] and after[0] != stats[0]
    assert stats[0] != tx.init({"w": params["w"], "b": params["b"]})[0]
    for field in range(len(stats)):
      tree = after[field].as_tree()
      assert set(tree) == {"w", "b", "step"} and float(tree["step"]) == 0.0
      assert float(tree["w"]) != float(tree["b"])  # each its own tensor's statistic
    # the same updates in another order of keys read the same entries
    _, again = tx.update({"b": g["b"], "w": g["w"]}, state)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(again), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # updates of as many leaves under other names are refused, naming the path
    with pytest.raises(ValueError, match=r"\['v'\]"):
      tx.update({"w": g["w"], "v": g["b"], "step": jnp.zeros(())}, state)
    # statistics of another length than their leaves are refused
    short = jaxclip.LeafStats(jnp.zeros(5), stats[0].layout)
    with pytest.raises(ValueError, match="another structure"):
      tx.update(g, type(state)(*stats[:-1], short, state[-1]))
    # a tree of scalars (a state of an older release) is refused, naming the field
    old = type(state)(*[jax.tree.map(lambda _: jnp.zeros(()), params) for _ in stats], state[-1])
    field = type(state)._fields[0]
    with pytest.raises(TypeError, match=f"keeps its {field} as a jaxclip.LeafStats"):
      tx.update(g, old)


def test_updates_may_unwrap_the_containers_the_params_had():
  """flax.nnx.Optimizer inits with the params' Variables and updates with their arrays."""
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  wrapped = nnx.state(model, nnx.Param)
  pure = getattr(nnx, "as_pure", getattr(nnx, "pure", None))(wrapped)
  assert [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(wrapped)[0]] != [
    tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]
  ]
  g = jax.tree.map(lambda x: x * 3.0 + 1.0, pure)
  for tx in _makers():
    out, state = tx.update(g, tx.init(wrapped))
    want_out, want_state = tx.update(g, tx.init(pure))
    want = jax.tree.leaves((want_out, want_state))
    for a, b in zip(jax.tree.leaves((out, state)), want, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_validation_names_the_argument():
  for make, name in (
    (lambda: jaxclip.adagc(beta=1.0), "beta"),
    (lambda: jaxclip.adagc(lambda_rel=-1.0), "lambda_rel"),
    (lambda: jaxclip.adagc(warmup_steps=-1), "warmup_steps"),
    (lambda: jaxclip.adagc(warmup_steps=2.5), "warmup_steps"),
    (lambda: jaxclip.adaptive_value_clip(beta=-0.1), "beta"),
    (lambda: jaxclip.adaptive_norm_scale(beta2=1.0), "beta2"),
    (lambda: jaxclip.adaptive_norm_scale(eps=-1.0), "eps"),
  ):
    with pytest.raises((ValueError, TypeError), match=name):
      make()
  tx = jaxclip.adagc()
  with pytest.raises(ValueError, match=r"adagc_gamma.*\[.b.\]"):
    tx.update({"a": jnp.ones(2), "b": jnp.ones(2)}, tx.init({"a": jnp.ones(2)}))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_gradient_never_reaches_the_state(bad):
  """The step's updates pass through; the state is the last finite step's, bit for bit."""
  warm = {"w": jnp.ones((2, 3)), "h": jnp.full(3, 2.0, jnp.bfloat16)}
  for tx in _makers():
    update = jax.jit(tx.update)  # one compile for every step below
    state = tx.init(warm)
    for _ in range(3):
      _, state = update(warm, state)
    poisoned = {"w": warm["w"].at[1, 2].set(bad), "h": warm["h"]}
    out, after = update(poisoned, state)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.all(np.isfinite(np.asarray(out["w"])))
    # and the run goes on from the last finite step as if the bad one never came
    np.testing.assert_array_equal(
      np.asarray(update(warm, after)[0]["w"]), np.asarray(update(warm, state)[0]["w"])
    )
