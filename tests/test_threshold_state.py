"""suggest_threshold reads recorded optimizer states as well as plain norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip

PARAMS = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3), "s": jnp.zeros(())}
SCALES = jnp.asarray([1.0, 3.0, 0.5, 8.0, 2.0, jnp.inf, 4.0])


def grads_at(scale):
  return {"w": jnp.full((2, 3), 0.5) * scale, "b": jnp.arange(3.0) * scale, "s": scale}


@pytest.fixture(scope="module")
def scanned():
  """A record_norms + clip + adam chain run over SCALES by lax.scan: its states, stacked."""
  tx = optax.chain(
    jaxclip.record_norms(), jaxclip.clip_by_global_norm(float("inf")), optax.adam(1e-3)
  )

  def step(state, scale):
    _, state = tx.update(grads_at(scale), state, PARAMS)
    return state, state

  _, states = jax.jit(lambda s: jax.lax.scan(step, tx.init(PARAMS), s))(SCALES)
  expected = np.asarray([float(jaxclip.ops.global_norm(grads_at(s))) for s in SCALES])
  return tx, states, expected


def test_stacked_states_of_a_scan_give_the_recorded_norms(scanned):
  _, states, expected = scanned
  assert np.isfinite(expected).sum() == 6  # the inf step has a NaN norm (0 * inf)
  for p in (50, 90):
    s = jaxclip.suggest_threshold(states, p)
    plain = jaxclip.suggest_threshold(expected, p, num_tensors=3)
    assert s.max_norm == pytest.approx(plain.max_norm, rel=1e-6)
    assert (s.num_norms, s.num_nonfinite) == (6, 1)
    # The number of tensors comes from the record_norms state's leaf_norms.
    assert s.per_tensor_max_norm == pytest.approx(plain.max_norm / np.sqrt(3), rel=1e-6)
  # An explicit num_tensors wins.
  assert jaxclip.suggest_threshold(states, num_tensors=12).per_tensor_max_norm == pytest.approx(
    jaxclip.suggest_threshold(expected).max_norm / np.sqrt(12), rel=1e-6
  )


def test_a_list_of_per_step_states_and_the_state_alone(scanned):
  tx, stacked, expected = scanned
  steps = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(len(SCALES))]
  s = jaxclip.suggest_threshold(steps, 50)
  assert s.max_norm == pytest.approx(jaxclip.suggest_threshold(expected, 50).max_norm, rel=1e-6)
  assert s.num_norms == 6
  # One state (the last step) is one norm; so is the bare RecordNormsState.
  last = steps[-1]
  record = optax.tree.get(last, "global_norm")
  assert jaxclip.suggest_threshold(last).max_norm == pytest.approx(float(record))
  (node,) = [s for s in last if isinstance(s, jaxclip.RecordNormsState)]
  assert jaxclip.suggest_threshold(node).max_norm == pytest.approx(expected[-1], rel=1e-6)


def test_a_clip_by_global_norm_state_is_read_without_record_norms():
  tx = optax.chain(jaxclip.clip_by_global_norm(float("inf")), optax.sgd(0.1))

  def step(state, scale):
    _, state = tx.update(grads_at(scale), state, PARAMS)
    return state, state

  _, states = jax.lax.scan(step, tx.init(PARAMS), SCALES[:3])
  s = jaxclip.suggest_threshold(states, 100)
  assert s.max_norm == pytest.approx(float(jaxclip.ops.global_norm(grads_at(3.0))), rel=1e-6)
  assert s.per_tensor_max_norm is None  # a pre_clip_norm does not say how many tensors


def test_recorded_norms_at_two_places_are_ambiguous():
  # Two record_norms (before and after a clip) see different norms: the caller must choose.
  tx = optax.chain(jaxclip.record_norms(), jaxclip.clip_by_global_norm(1.0), jaxclip.record_norms())
  _, state = tx.update(grads_at(4.0), tx.init(PARAMS), PARAMS)
  with pytest.raises(ValueError, match="more than one place"):
    jaxclip.suggest_threshold(state)
  assert jaxclip.suggest_threshold(state[2]).max_norm == pytest.approx(1.0, rel=1e-6)
  # Plain norms still work, and a state whose norms are all NaN is refused as norms are.
  assert jaxclip.suggest_threshold([3.0, 1.0, 2.0]).max_norm == 2.0
  empty = jaxclip.RecordNormsState(leaf_norms={"w": jnp.nan}, global_norm=jnp.asarray([jnp.nan]))
  with pytest.raises(ValueError, match="at least one finite norm"):
    jaxclip.suggest_threshold(empty)
