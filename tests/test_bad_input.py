"""Bad input to every public constructor and ``update``: a clear error, never a wrong result.

Each case must raise ``ValueError`` or ``TypeError`` whose message names the
argument (or the leaf's path), before anything silently goes wrong and
without an internal error (``AttributeError``, ``IndexError``, XLA's).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxclip
from jaxclip import ops

FAST = settings(max_examples=25, deadline=None)
NAN = float("nan")

# Values that are not a real number: every threshold refuses them.
NOT_A_NUMBER = st.sampled_from(["1.0", "abc", 1 + 2j, True, object(), {"a": 1.0}, b"1"])
NOT_A_NUMBER_OR_NONE = st.one_of(NOT_A_NUMBER, st.none())
NEGATIVE = st.floats(-1e6, -1e-6)
VECTOR = st.lists(st.floats(0.1, 10.0), min_size=2, max_size=3)
BAD_ORD = st.sampled_from([0, 3, -1, "fro", "nuc", True, 2.5, [1], "two"])


def _opt():
  return optax.sgd(0.1)


def _threshold_bad(scalar: bool, none_ok: bool = False):
  """Bad values for a ``>= 0`` threshold (and for a scalar one, vectors too)."""
  kinds = [NOT_A_NUMBER if none_ok else NOT_A_NUMBER_OR_NONE, st.just(NAN), NEGATIVE]
  if scalar:
    kinds.append(VECTOR)
  return st.one_of(*kinds)


# Bad values for an EMA decay, which lies in [0, 1).
_DECAY_BAD = st.one_of(
  NOT_A_NUMBER_OR_NONE, st.just(NAN), st.just(1.0), NEGATIVE, st.floats(1.0, 1e9), VECTOR
)

_GRADS = [jnp.array([[0.0, 3.0], [4.0, 0.0]])]
_LOSS, _KEY = (lambda w, x: jnp.dot(w, x)), jax.random.key(0)
# Bad values for a size (a batch size, a number of rows): not an int, or below 1.
_SIZE_BAD = st.one_of(NOT_A_NUMBER, st.just(2.5), st.just(2.0), st.integers(-100, 0))
_COUNT_BAD = st.one_of(NOT_A_NUMBER_OR_NONE, st.just(2.5), st.integers(-100, -1))  # 0 is fine

# (constructor call with the bad value, argument name, strategy of bad values)
CASES = [
  (lambda v: jaxclip.clip(v), "max_delta", _threshold_bad(False)),
  (
    lambda v: jaxclip.clip_by_value(v, 1.0),
    "min_value",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.just(NAN)),
  ),
  (
    lambda v: jaxclip.clip_by_value(-1.0, v),
    "max_value",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.just(NAN)),
  ),
  (lambda v: jaxclip.clip_by_norm(v), "max_norm", _threshold_bad(False)),
  (lambda v: jaxclip.clip_by_average_norm(v), "max_norm", _threshold_bad(False)),
  (lambda v: jaxclip.clip_by_global_norm(v), "max_norm", _threshold_bad(True)),
  (lambda v: jaxclip.clip_by_global_norm(1.0, ord=v), "ord", BAD_ORD),
  (lambda v: jaxclip.clip_by_block_rms(v), "threshold", _threshold_bad(False)),
  (lambda v: jaxclip.adaptive_grad_clip(v), "clipping", _threshold_bad(False)),
  (lambda v: jaxclip.adaptive_grad_clip(0.1, eps=v), "eps", _threshold_bad(False)),
  (
    lambda v: jaxclip.skip_nonfinite(_opt(), max_consecutive=v),
    "max_consecutive",
    st.one_of(NOT_A_NUMBER, st.just(2.5), st.just(NAN), st.integers(-100, 0)),
  ),
  (lambda v: jaxclip.skip_nonfinite(v), "inner", NOT_A_NUMBER_OR_NONE),
  (
    lambda v: jaxclip.skip_on_spike(_opt(), window=v),
    "window",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.just(2.5), st.integers(-100, 1)),
  ),
  (lambda v: jaxclip.skip_on_spike(_opt(), sigma=v), "sigma", _threshold_bad(True)),
  (lambda v: jaxclip.skip_on_spike(_opt(), ord=v), "ord", BAD_ORD),
  (lambda v: jaxclip.skip_on_spike(v), "inner", NOT_A_NUMBER_OR_NONE),
  (
    lambda v: jaxclip.autoclip(v),
    "percentile",
    st.one_of(
      NOT_A_NUMBER_OR_NONE,
      st.just(NAN),
      st.just(math.inf),
      NEGATIVE,
      st.floats(100.001, 1e9),
      VECTOR,
    ),
  ),
  (
    lambda v: jaxclip.autoclip(history=v),
    "history",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.just(2.5), st.integers(-100, 0)),
  ),
  (lambda v: jaxclip.autoclip(ord=v), "ord", BAD_ORD),
  (
    lambda v: jaxclip.zclip(alpha=v),
    "alpha",
    st.one_of(
      NOT_A_NUMBER_OR_NONE, st.just(NAN), st.just(math.inf), NEGATIVE, st.floats(1.001, 1e9), VECTOR
    ),
  ),
  (lambda v: jaxclip.zclip(z_thresh=v), "z_thresh", _threshold_bad(True)),
  (lambda v: jaxclip.zclip(max_norm=v), "max_norm", _threshold_bad(True, none_ok=True)),
  (lambda v: jaxclip.zclip(clip_factor=v), "clip_factor", _threshold_bad(True)),
  (lambda v: jaxclip.zclip(eps=v), "eps", _threshold_bad(True)),
  (
    lambda v: jaxclip.zclip(warmup_steps=v),
    "warmup_steps",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.just(2.5), st.integers(-100, 0)),
  ),
  (lambda v: jaxclip.zclip(mode=v), "mode", st.one_of(NOT_A_NUMBER_OR_NONE, st.text(max_size=5))),
  (
    lambda v: jaxclip.zclip(clip_option=v),
    "clip_option",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.text(max_size=5)),
  ),
  (lambda v: jaxclip.zclip(ord=v), "ord", BAD_ORD),
  (lambda v: jaxclip.adagc(beta=v), "beta", _DECAY_BAD),
  (lambda v: jaxclip.adagc(lambda_abs=v), "lambda_abs", _threshold_bad(True)),
  (lambda v: jaxclip.adagc(lambda_rel=v), "lambda_rel", _threshold_bad(True)),
  (lambda v: jaxclip.adagc(eps=v), "eps", _threshold_bad(True)),
  (
    lambda v: jaxclip.adagc(warmup_steps=v),
    "warmup_steps",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.just(2.5), st.integers(-100, -1)),
  ),
  (lambda v: jaxclip.adaptive_value_clip(beta=v), "beta", _DECAY_BAD),
  (lambda v: jaxclip.adaptive_norm_scale(beta1=v), "beta1", _DECAY_BAD),
  (lambda v: jaxclip.adaptive_norm_scale(beta2=v), "beta2", _DECAY_BAD),
  (lambda v: jaxclip.adaptive_norm_scale(eps=v), "eps", _threshold_bad(True)),
  (lambda v: jaxclip.clipped(_opt(), clipnorm=v), "clipnorm", _threshold_bad(False, True)),
  (lambda v: jaxclip.clipped(_opt(), clipvalue=v), "clipvalue", _threshold_bad(False, True)),
  (
    lambda v: jaxclip.clipped(_opt(), global_clipnorm=v),
    "global_clipnorm",
    _threshold_bad(True, True),
  ),
  (lambda v: jaxclip.clipped(v, clipnorm=1.0), "optimizer", NOT_A_NUMBER_OR_NONE),
  (lambda v: jaxclip.skip_above(_opt(), v), "max_norm", _threshold_bad(True)),
  (lambda v: jaxclip.skip_above(_opt(), 1.0, ord=v), "ord", BAD_ORD),
  (lambda v: jaxclip.skip_above(v, 1.0), "inner", NOT_A_NUMBER_OR_NONE),
  (lambda v: jaxclip.skip_bad_microbatches(v), "max_norm", _threshold_bad(True, none_ok=True)),
  (lambda v: jaxclip.record_norms(ord=v), "ord", BAD_ORD),
  (
    lambda v: jaxclip.per_example_global_norm_clip(_GRADS, v),
    "l2_norm_clip",
    _threshold_bad(False),
  ),
  (
    lambda v: jaxclip.per_example_layer_norm_clip(_GRADS, v),
    "global_l2_norm_clip",
    _threshold_bad(False),
  ),
  (lambda v: ops.clip_by_global_norm(_GRADS, v), "clip_norm", _threshold_bad(True)),
  (lambda v: ops.global_norm(_GRADS, ord=v), "ord", BAD_ORD),
  (
    lambda v: jaxclip.per_example_clipped_grad(_LOSS, 1.0, microbatch_size=v),
    "microbatch_size",
    _SIZE_BAD,
  ),
  (
    lambda v: jaxclip.per_example_clipped_grad(_LOSS, 1.0, group_size=v),
    "group_size",
    st.one_of(st.none(), _SIZE_BAD),
  ),
  (lambda v: jaxclip.poisson_batch(_KEY, v, 0.5, 4), "num_examples", _COUNT_BAD),
  (lambda v: jaxclip.poisson_batch(_KEY, 10, 0.5, v), "max_batch_size", _SIZE_BAD),
  (lambda v: jaxclip.poisson_batch(v, 10, 0.5, 4), "key", NOT_A_NUMBER_OR_NONE),
  (
    lambda v: jaxclip.suggest_threshold([1.0, 2.0], v),
    "percentile",
    st.one_of(NOT_A_NUMBER_OR_NONE, st.just(NAN), NEGATIVE, st.floats(100.001, 1e9)),
  ),
]


@pytest.mark.parametrize("make, name, bad", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_bad_argument_is_refused_naming_it(make, name, bad):
  @FAST
  @given(bad)
  def check(value):
    with pytest.raises((ValueError, TypeError)) as info:
      make(value)
    assert name in str(info.value), (value, info.value)

  check()


@FAST
@given(st.floats(-1e3, 1e3), st.floats(1e-3, 1e3))
def test_min_above_max_is_refused(lo, gap):
  with pytest.raises(ValueError, match="min_value"):
    jaxclip.clip_by_value(lo + gap, lo)


def test_traced_scalar_thresholds_still_work():
  # inject_hyperparams passes jnp scalars; under jit they are traced.
  tx = optax.inject_hyperparams(jaxclip.clip_by_global_norm)(max_norm=1.0)
  params = {"w": jnp.ones(2)}
  out, _ = jax.jit(tx.update)({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
  np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=1e-6)
  clip = jax.jit(lambda t, c: ops.clip_by_global_norm(t, c)[0])
  np.testing.assert_allclose(clip([jnp.array([3.0, 4.0])], 1.0)[0], [0.6, 0.8], rtol=1e-6)


# ------------------------------------------------------------------ update

_STATEFUL = {
  "clip_by_global_norm": lambda: jaxclip.clip_by_global_norm(1.0),
  "skip_nonfinite": lambda: jaxclip.skip_nonfinite(_opt()),
  "zero_nonfinite": lambda: jaxclip.zero_nonfinite(),
  "skip_on_spike": lambda: jaxclip.skip_on_spike(_opt(), window=4),
  "autoclip": lambda: jaxclip.autoclip(history=4),
  "zclip": lambda: jaxclip.zclip(warmup_steps=2),
  "skip_above": lambda: jaxclip.skip_above(_opt(), 10.0),
  "record_norms": lambda: jaxclip.record_norms(),
  "adagc": lambda: jaxclip.adagc(warmup_steps=2),
  "adaptive_value_clip": lambda: jaxclip.adaptive_value_clip(),
  "adaptive_norm_scale": lambda: jaxclip.adaptive_norm_scale(),
}
_ALL = {
  **_STATEFUL,
  "clip_by_value": lambda: jaxclip.clip_by_value(-1.0, 1.0),
  "clip": lambda: jaxclip.clip(1.0),
  "clip_by_norm": lambda: jaxclip.clip_by_norm(1.0),
  "clip_by_average_norm": lambda: jaxclip.clip_by_average_norm(1.0),
  "clip_by_block_rms": lambda: jaxclip.clip_by_block_rms(1.0),
  "adaptive_grad_clip": lambda: jaxclip.adaptive_grad_clip(0.1),
  "clipped": lambda: jaxclip.clipped(_opt(), global_clipnorm=1.0),
}


@pytest.mark.parametrize("name", sorted(set(_STATEFUL) - {"clip_by_global_norm"}))
def test_update_with_a_foreign_state_is_refused(name):
  tx = _ALL[name]()
  for state in (None, optax.EmptyState(), (jnp.zeros(()),)):
    with pytest.raises(TypeError, match=f"{name}.*state"):
      tx.update({"w": jnp.ones(2)}, state)


def test_adaptive_grad_clip_params_of_another_structure_are_refused():
  tx = jaxclip.adaptive_grad_clip(0.1)
  updates = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
  with pytest.raises(ValueError, match="params"):
    tx.update(updates, tx.init(updates), {"w": jnp.ones((2, 2))})
  with pytest.raises(ValueError, match="params"):
    tx.update(updates, tx.init(updates), {"w": jnp.ones((2, 2)), "b": jnp.ones(3)})


@pytest.mark.parametrize("name", sorted(_ALL))
def test_any_params_tree_optax_accepts_inits_and_updates(name):
  """Integer, boolean, PRNG-key (typed and raw) and None leaves in params."""
  tx = _ALL[name]()
  params = {
    "w": jnp.ones(3),
    "step": jnp.int32(0),
    "flag": jnp.array(True),
    "key": jax.random.key(0),
    "raw_key": jax.random.PRNGKey(0),
    "none": None,
  }
  state = tx.init(params)
  floats = {"w": params["w"], "none": None}
  updates, _ = tx.update({"w": jnp.array([3.0, 0.0, 4.0]), "none": None}, state, floats)
  assert updates["none"] is None and updates["w"].dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(_ALL))
def test_key_leaf_in_updates_is_refused_naming_its_path(name):
  tx = _ALL[name]()
  tree = {"w": jnp.ones(2), "key": jax.random.key(0)}
  with pytest.raises(TypeError, match=r"\['key'\]"):
    tx.update(tree, tx.init(tree), tree)


@pytest.mark.parametrize("name", sorted(set(_ALL) - {"skip_nonfinite", "clipped"}))
@settings(max_examples=5, deadline=None)
@given(ints=st.lists(st.integers(-20, 20), min_size=1, max_size=4))
def test_integer_leaves_are_promoted_as_optax_does(name, ints):
  """The policy: an integer or boolean leaf is a number, promoted to float and clipped.

  Never a silent wrong result: the same as for the float leaf.
  """
  tx = _ALL[name]()
  int_tree = {
    "w": jnp.array([3.0, 4.0]),
    "n": jnp.array(ints, jnp.int32),
    "b": jnp.array([True, False]),
  }
  float_tree = jax.tree.map(lambda x: x.astype(jnp.float32), int_tree)
  params = jax.tree.map(jnp.ones_like, float_tree)
  got, _ = tx.update(int_tree, tx.init(params), params)
  want, _ = tx.update(float_tree, tx.init(params), params)
  for key in int_tree:
    # The identity transforms pass every leaf through in its own dtype.
    identity = name in ("zero_nonfinite", "record_norms")
    assert got[key].dtype == want[key].dtype or identity, (key, got[key])
    np.testing.assert_allclose(
      np.asarray(got[key], np.float32), np.asarray(want[key], np.float32), rtol=1e-6
    )


def test_drop_in_functions_promote_integers_as_optax():
  grads = [jnp.array([[0, 3], [3, 4]])]
  for fn in (jaxclip.per_example_global_norm_clip, jaxclip.per_example_layer_norm_clip):
    ours, theirs = fn(grads, 1.0), getattr(optax, fn.__name__)(grads, 1.0)
    assert jax.tree.map(lambda x: x.dtype, ours) == jax.tree.map(lambda x: x.dtype, theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  x = jnp.array([[3, 0], [4, 1]])
  np.testing.assert_allclose(jaxclip.unitwise_norm(x), optax.transforms.unitwise_norm(x))
  assert jaxclip.unitwise_norm(x).dtype == jnp.float32
  args = (jnp.array([5, 5]), jnp.array([1, 1]), jnp.array([3, 4]))
  np.testing.assert_allclose(jaxclip.unitwise_clip(*args), optax.transforms.unitwise_clip(*args))
  out = jaxclip.clip(0.5).update(jnp.array([-3, 0, 3]), None)[0]
  ref = optax.clip(0.5).update(jnp.array([-3, 0, 3]), None)[0]
  assert out.dtype == ref.dtype and np.array_equal(out, ref)


@FAST
@given(shape=st.sampled_from([(), (2, 2, 2, 2, 2, 2)]))
def test_wrong_ranks_are_refused(shape):
  x = jnp.ones(shape)
  if shape == ():
    with pytest.raises(ValueError, match="grads"):
      jaxclip.per_example_global_norm_clip([x], 1.0)
    with pytest.raises(ValueError, match="grads"):
      jaxclip.per_example_layer_norm_clip([x], 1.0)
  else:
    with pytest.raises(ValueError, match="axis"):
      jaxclip.unitwise_norm(x)
  with pytest.raises(ValueError, match="axis"):
    jaxclip.clip_by_norm(1.0, axes=7).update(jnp.ones((2, 2)), None)
  with pytest.raises(ValueError, match="grad"):
    jaxclip.unitwise_clip(jnp.ones(2), jnp.ones(2), jnp.ones(3))


def test_skip_on_spike_reads_value_or_loss():
  params = jnp.zeros(2)
  tx = jaxclip.skip_on_spike(_opt(), window=4)
  runs = []
  for kw in ("value", "loss"):
    state = tx.init(params)
    for v in [1.0, 2.0, 1.0, 2.0, 100.0]:
      _, state = tx.update(jnp.ones(2), state, params, **{kw: v})
    runs.append(state)
  assert bool(runs[0].spike_step_skipped) and bool(runs[1].spike_step_skipped)
  np.testing.assert_array_equal(runs[0].spike_loss_history, runs[1].spike_loss_history)
  state = tx.init(params)
  tx.update(jnp.ones(2), state, params, loss=1.0, value=1.0)  # the same: fine
  with pytest.raises(ValueError, match="loss=.*value="):
    tx.update(jnp.ones(2), state, params, loss=1.0, value=2.0)
  with pytest.raises(ValueError, match="loss"):
    tx.update(jnp.ones(2), state, params, value=jnp.ones(2))
  jitted = jax.jit(lambda s, v: tx.update(jnp.ones(2), s, params, loss=v, value=v))
  jitted(state, 1.0)
