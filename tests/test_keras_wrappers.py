"""clipped: Keras's clipnorm / clipvalue / global_clipnorm on any optax optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from tests.helpers import assert_tree_allclose

GRADS = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[0.5, -12.0]])}  # norms 5 and ~12.01
PARAMS = jax.tree.map(jnp.zeros_like, GRADS)


def first_update(tx):
  return jax.jit(tx.update)(GRADS, tx.init(PARAMS), PARAMS)[0]


@pytest.mark.parametrize(
  "kw,head",
  [
    (dict(clipnorm=2.0), jaxclip.clip_by_norm(2.0)),
    (dict(global_clipnorm=2.0), jaxclip.clip_by_global_norm(2.0)),
    (dict(clipvalue=1.0), jaxclip.clip_by_value(-1.0, 1.0)),
  ],
)
def test_clipped_is_the_keras_chain(kw, head):
  opt = optax.sgd(0.5, momentum=0.9)
  tx = jaxclip.clipped(opt, **kw)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert_tree_allclose(first_update(tx), first_update(optax.chain(head, opt)))


def test_clipped_semantics_per_tensor_global_and_value():
  sgd = optax.sgd(1.0)
  per_tensor = first_update(jaxclip.clipped(sgd, clipnorm=2.0))
  for leaf in jax.tree.leaves(per_tensor):  # each leaf on its own reaches norm 2
    np.testing.assert_allclose(np.linalg.norm(np.asarray(leaf)), 2.0, rtol=1e-6)
  global_ = first_update(jaxclip.clipped(sgd, global_clipnorm=2.0))
  np.testing.assert_allclose(float(optax.tree.norm(global_)), 2.0, rtol=1e-6)
  ratio = np.asarray(global_["a"]) / np.asarray(GRADS["a"])  # one factor for all leaves
  np.testing.assert_allclose(np.asarray(global_["b"]) / np.asarray(GRADS["b"]), ratio[0])
  value = first_update(jaxclip.clipped(sgd, clipvalue=1.0))
  np.testing.assert_array_equal(np.asarray(value["b"]), [[-0.5, 1.0]])  # direction changed


def test_clipped_without_clipping_is_the_optimizer():
  opt = optax.adam(0.1)
  tx = jaxclip.clipped(opt)
  assert_tree_allclose(first_update(tx), first_update(opt))
  assert isinstance(tx, optax.GradientTransformationExtraArgs)


def test_clipped_rejects_more_than_one_or_bad_values():
  with pytest.raises(ValueError, match="Only one of"):
    jaxclip.clipped(optax.sgd(1.0), clipnorm=1.0, clipvalue=1.0)
  with pytest.raises(ValueError, match="Only one of"):
    jaxclip.clipped(optax.sgd(1.0), clipnorm=1.0, global_clipnorm=1.0)
  with pytest.raises(ValueError, match="clipvalue"):
    jaxclip.clipped(optax.sgd(1.0), clipvalue=-1.0)
  with pytest.raises(ValueError, match="global_clipnorm"):
    jaxclip.clipped(optax.sgd(1.0), global_clipnorm=float("nan"))


def test_clipped_composes_with_the_robust_wrappers():
  tx = jaxclip.skip_nonfinite(jaxclip.clipped(optax.adam(0.1), global_clipnorm=1.0))
  state = tx.init(PARAMS)
  bad = jax.tree.map(lambda g: g * jnp.nan, GRADS)
  updates, new_state = tx.update(bad, state, PARAMS)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert int(new_state.num_nonfinite_skipped) == 1
  updates, new_state = tx.update(GRADS, new_state, PARAMS)
  np.testing.assert_allclose(
    float(optax.tree.get(new_state, "pre_clip_norm")), float(optax.tree.norm(GRADS)), rtol=1e-6
  )
