"""Every transform through jit, inject_hyperparams, chain, MultiSteps, masked,
lax.scan, flax nnx and equinox, keeping dtypes and accepting state=None."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from tests.helpers import assert_dtypes_kept, assert_tree_allclose, random_tree


@dataclasses.dataclass(frozen=True)
class Case:
  """A transform factory, hyperparameters that clip the test gradients, and
  whether its ``update`` reads its state (then ``state=None`` is not allowed)."""

  factory: Callable[..., Any]
  hparams: dict[str, Any]
  static: dict[str, Any] = dataclasses.field(default_factory=dict)
  reads_state: bool = False
  needs_params: bool = False


# Wrappers and composites take a numeric hyperparameter of their own so that
# inject_hyperparams and traced-hyperparameter tests exercise them too.
def skip_nonfinite_gn(max_norm, max_consecutive=3):
  return jaxclip.skip_nonfinite(
    jaxclip.clip_by_global_norm(max_norm), max_consecutive=max_consecutive
  )


def skip_on_spike_gn(max_norm, sigma=6.0):
  return jaxclip.skip_on_spike(jaxclip.clip_by_global_norm(max_norm), window=4, sigma=sigma)


def skip_above_gn(max_norm, skip_norm=1e3):
  return jaxclip.skip_above(jaxclip.clip_by_global_norm(max_norm), skip_norm)


def zero_nonfinite_gn(max_norm):
  return optax.chain(jaxclip.zero_nonfinite(), jaxclip.clip_by_global_norm(max_norm))


def clipped_identity(clipnorm):
  return jaxclip.clipped(optax.identity(), clipnorm=clipnorm)


CASES: dict[str, Case] = {
  "clip_by_value": Case(jaxclip.clip_by_value, {"min_value": -0.3, "max_value": 0.4}),
  "clip": Case(jaxclip.clip, {"max_delta": 0.3}),
  "clip_by_norm": Case(jaxclip.clip_by_norm, {"max_norm": 0.5}),
  "clip_by_norm_axes": Case(jaxclip.clip_by_norm, {"max_norm": 0.5}, {"axes": [0]}),
  "clip_by_average_norm": Case(jaxclip.clip_by_average_norm, {"max_norm": 0.05}),
  "clip_by_global_norm": Case(jaxclip.clip_by_global_norm, {"max_norm": 0.5}),
  "clip_by_global_norm_ord1": Case(jaxclip.clip_by_global_norm, {"max_norm": 0.5}, {"ord": 1}),
  "clip_by_block_rms": Case(jaxclip.clip_by_block_rms, {"threshold": 0.2}),
  "adaptive_grad_clip": Case(jaxclip.adaptive_grad_clip, {"clipping": 0.05}, needs_params=True),
  "autoclip": Case(jaxclip.autoclip, {"percentile": 50.0}, {"history": 8}, reads_state=True),
  "zclip": Case(
    jaxclip.zclip, {"z_thresh": 1.0, "max_norm": 0.5}, {"warmup_steps": 2}, reads_state=True
  ),
  "adagc": Case(
    jaxclip.adagc, {"lambda_rel": 1.05, "beta": 0.9}, {"warmup_steps": 0}, reads_state=True
  ),
  "adaptive_value_clip": Case(jaxclip.adaptive_value_clip, {"beta": 0.4}, reads_state=True),
  "adaptive_norm_scale": Case(
    jaxclip.adaptive_norm_scale, {"eps": 1e-8, "beta1": 0.3}, reads_state=True
  ),
  "skip_nonfinite": Case(skip_nonfinite_gn, {"max_norm": 0.5}, reads_state=True),
  "skip_on_spike": Case(skip_on_spike_gn, {"max_norm": 0.5}, reads_state=True),
  "skip_above": Case(skip_above_gn, {"max_norm": 0.5}, reads_state=True),
  "zero_nonfinite": Case(zero_nonfinite_gn, {"max_norm": 0.5}, reads_state=True),
  # An optax.chain: its update indexes its state.
  "clipped": Case(clipped_identity, {"clipnorm": 0.5}, reads_state=True),
}


def make(case: Case):
  return case.factory(**case.hparams, **case.static)


def grads_and_params(dtype=jnp.float32):
  # No scalar leaf: the ``axes=[0]`` case needs every leaf to have axis 0.
  tree = random_tree(11, dtype=dtype, scale=2.0, scalar=False)
  params = random_tree(12, dtype=dtype, scalar=False)
  return tree, params


def run(tx, grads, params, state=None):
  state = tx.init(params) if state is None else state
  return tx.update(grads, state, params)


@pytest.fixture(params=sorted(CASES))
def case(request):
  return CASES[request.param]


def test_clips_something(case):
  grads, params = grads_and_params()
  tx = make(case)
  state = tx.init(params)
  # Small steps first, so adaptive thresholds (AutoClip, ZClip) have a history
  # that the full-size step stands out from.
  for _ in range(3):
    _, state = tx.update(jax.tree.map(lambda g: g / 10, grads), state, params)
  out, _ = tx.update(grads, state, params)
  assert not all(
    np.allclose(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(grads), strict=True)
  )


def test_is_extra_args_transformation(case):
  tx = make(case)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  grads, params = grads_and_params()
  out, _ = tx.update(grads, tx.init(params), params, loss=jnp.float32(1.0), step=3)
  ref, _ = run(tx, grads, params)
  assert_tree_allclose(out, ref, rtol=0)


def test_jit_matches_eager(case):
  tx = make(case)
  grads, params = grads_and_params()
  eager = run(tx, grads, params)
  jitted = jax.jit(lambda g, s, p: tx.update(g, s, p))(grads, tx.init(params), params)
  assert_tree_allclose(jitted, eager, rtol=1e-6)


def test_traced_hyperparameters_under_jit(case):
  grads, params = grads_and_params()

  @jax.jit
  def f(hp, g, p):
    tx = case.factory(**hp, **case.static)
    return tx.update(g, tx.init(p), p)[0]

  hp = {k: jnp.asarray(v, jnp.float32) for k, v in case.hparams.items()}
  assert_tree_allclose(f(hp, grads, params), run(make(case), grads, params)[0], rtol=1e-6)


def test_inject_hyperparams_with_schedule(case):
  grads, params = grads_and_params()
  name = next(iter(case.hparams))
  value = case.hparams[name]
  sched = optax.linear_schedule(value, 2 * value, 10) if value > 0 else value
  other = {k: v for k, v in case.hparams.items() if k != name}
  tx = optax.inject_hyperparams(case.factory, static_args=tuple(case.static))(
    **{name: sched}, **other, **case.static
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  for _ in range(3):
    out, state = step(grads, state, params)
  # The third update (count 2) used the schedule's value at step 2.
  expected_hp = optax.linear_schedule(value, 2 * value, 10)(2) if value > 0 else value
  ref = case.factory(**{name: expected_hp}, **other, **case.static)
  assert_tree_allclose(out, run(ref, grads, params)[0], rtol=1e-5)
  np.testing.assert_allclose(state.hyperparams[name], expected_hp, rtol=1e-6)


def test_chain_with_adamw_and_apply(case):
  grads, params = grads_and_params()
  tx = optax.chain(make(case), optax.adamw(1e-2))
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert_dtypes_kept(params, new)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new))


def test_multisteps(case):
  grads, params = grads_and_params()
  tx = optax.MultiSteps(optax.chain(make(case), optax.sgd(1.0)), every_k_schedule=2)
  state = tx.init(params)
  update = jax.jit(tx.update)  # one compile for both steps
  u1, state = update(grads, state, params)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u1))
  u2, state = update(grads, state, params)
  ref, _ = run(optax.chain(make(case), optax.sgd(1.0)), grads, params)
  assert_tree_allclose(u2, ref, rtol=1e-5)


def test_masked(case):
  grads, params = grads_and_params()
  mask = jax.tree.map(lambda x: x.ndim >= 2, params)
  tx = optax.masked(make(case), mask)
  out, _ = tx.update(grads, tx.init(params), params)
  for g, o, m in zip(
    jax.tree.leaves(grads), jax.tree.leaves(out), jax.tree.leaves(mask), strict=True
  ):
    if not m:
      np.testing.assert_array_equal(o, g)


def test_lax_scan_training_loop(case):
  grads, params = grads_and_params()
  tx = optax.chain(make(case), optax.adam(1e-2))

  def body(carry, _):
    p, s = carry
    u, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, u), s), None

  (p_scan, s_scan), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=3)
  p, s = params, tx.init(params)
  for _ in range(3):
    (p, s), _ = body((p, s), None)
  assert_tree_allclose(p_scan, p, rtol=1e-5)
  assert jax.tree.structure(s_scan) == jax.tree.structure(s)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtypes_kept(case, dtype):
  grads, params = grads_and_params(dtype)
  out, state = run(make(case), grads, params)
  assert_dtypes_kept(grads, out)
  _, state2 = run(make(case), grads, params, state)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == jax.tree.map(
    lambda a: (a.shape, a.dtype), state2
  )


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if not c.reads_state))
def test_state_none_when_state_unused(name):
  case = CASES[name]
  grads, params = grads_and_params()
  out, _ = make(case).update(grads, None, params)
  assert_tree_allclose(out, run(make(case), grads, params)[0], rtol=0)


def test_flax_nnx_optimizer(case):
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.chain(make(case), optax.sgd(0.01)), wrt=nnx.Param)
  x = jnp.ones((4, 3))

  @nnx.jit(donate_argnums=(0, 1))  # as users write it: model and optimizer donated
  def step(model, opt):
    loss, g = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    opt.update(model, g)
    return loss

  l0 = step(model, opt)
  l1 = step(model, opt)
  assert bool(jnp.isfinite(l1)) and float(l1) < float(l0)


def test_equinox_training_step(case):
  import equinox as eqx

  model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
  tx = optax.chain(make(case), optax.sgd(0.01))
  state = tx.init(eqx.filter(model, eqx.is_array))
  x = jnp.ones((4, 3))

  @eqx.filter_jit(donate="all")  # as users write it: model and state donated
  def step(model, state):
    loss, g = eqx.filter_value_and_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
    u, state = tx.update(g, state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, u), state, loss

  model, state, l0 = step(model, state)
  model, state, l1 = step(model, state)
  assert bool(jnp.isfinite(l1)) and float(l1) < float(l0)


def test_pre_clip_norm_readable_from_any_chain():
  grads, params = grads_and_params()
  tx = optax.chain(
    jaxclip.clip_by_value(-10.0, 10.0),
    optax.inject_hyperparams(jaxclip.clip_by_global_norm)(max_norm=0.5),
    optax.adam(1e-3),
  )
  state = tx.init(params)
  assert float(optax.tree.get(state, "pre_clip_norm")) == 0.0
  _, state = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_allclose(
    optax.tree.get(state, "pre_clip_norm"), jaxclip.ops.global_norm(grads), rtol=1e-6
  )
  ms = optax.MultiSteps(tx, every_k_schedule=1)
  ms_state = ms.init(params)
  _, ms_state = ms.update(grads, ms_state, params)
  np.testing.assert_allclose(
    optax.tree.get(ms_state, "pre_clip_norm"), jaxclip.ops.global_norm(grads), rtol=1e-6
  )
