"""``per_example_clipped_grad``'s arguments and dtypes with ``method="ghost"``, as with ``"vmap"``.

Shared and static arguments, ``keep_batch_dim``, a traced clip, a loss that
ignores the batch or depends on the parameters for some examples only;
bfloat16 parameters (their sum in float32) and float64 ones; the pre-clip
norms in batch order; a non-finite example's zero contribution; and what is
refused, with the reason named (a bad method, complex parameters, a loss
that is not a real scalar, a loop JAX cannot differentiate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from tests.ghost_helpers import compare as _compare
from tests.helpers import mlp_loss, mlp_problem


def test_loss_that_depends_on_the_parameters_only_for_some_examples():
  loss = lambda w, x: jnp.where(x[0] > 0, jnp.sum(w**2), jnp.sum(w * x))
  w = jnp.arange(3.0)
  xs = jax.random.normal(jax.random.key(3), (12, 3))
  _compare(loss, w, xs)


def test_shared_argument_keep_batch_dim_and_traced_clip():
  params, x, y = mlp_problem(batch=12, seed=4)
  loss = lambda p, scale, xb, yb: mlp_loss(p, xb[0] * scale, yb[0])
  args = (jnp.float32(0.7), x, y)
  ref = jaxclip.per_example_clipped_grad(loss, 20.0, batch_argnums=(2, 3), keep_batch_dim=True)
  fn = lambda c: jaxclip.per_example_clipped_grad(
    loss, c, batch_argnums=(2, 3), keep_batch_dim=True, method="ghost", return_norms=True
  )
  got = jax.jit(lambda c, *a: fn(c)(*a))(20.0, params, *args)
  want = ref(params, *args)
  assert 0 < int(want[1]) < 12 and int(got[1]) == int(want[1])
  for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
    np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-5)


def test_bfloat16_parameters_keep_their_dtype():
  params, x, y = mlp_problem(batch=12, seed=5)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  x, y = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
  _compare(mlp_loss, params, x, y, batch_argnums=(1, 2), rtol=3e-2, atol=1e-2)
  # Nothing clipped: ghost's sum is the sum of the per-example gradients in float32 (jax.grad
  # rounds it to bfloat16; the noise is added before any rounding): within the per-example
  # gradients' bfloat16 rounding of it, and not itself rounded to bfloat16.
  per_example = jax.vmap(jax.grad(mlp_loss), (None, 0, 0))(params, x, y)
  got = jax.jit(
    jaxclip.per_example_clipped_grad(mlp_loss, 1e6, method="ghost", batch_argnums=(1, 2))
  )(params, x, y)[0]
  unrounded = []
  for a, g in zip(jax.tree.leaves(got), jax.tree.leaves(per_example), strict=True):
    assert a.dtype == jnp.float32
    a, g = np.asarray(a, np.float64), np.asarray(g, np.float64)
    assert np.all(np.abs(a - g.sum(0)) <= 2**-7 * np.abs(g).sum(0) + 1e-6)
    unrounded.append(np.any(a != np.asarray(a.astype(jnp.bfloat16), np.float64)))
  assert any(unrounded)


def test_float64_parameters_accumulate_in_float64_as_vmap_does():
  with jax.enable_x64(True):
    params, x, y = mlp_problem(batch=12, seed=9)
    params, x, y = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x, y))
    got, _ = _compare(mlp_loss, params, x, y, batch_argnums=(1, 2), rtol=1e-12, atol=1e-12)
    assert got[2].dtype == jnp.float64


def test_return_norms_are_the_pre_clip_norms_in_batch_order():
  params, x, y = mlp_problem(batch=11, seed=6)
  grads = jax.vmap(jax.grad(mlp_loss), (None, 0, 0))(params, x, y)
  want = jax.vmap(jaxclip.ops.global_norm)(grads)
  options = [(method, mb) for method in ("vmap", "ghost") for mb in (None, 4)]

  @jax.jit  # the four in one program
  def norms(params, x, y):
    return [
      jaxclip.per_example_clipped_grad(
        mlp_loss, 1.0, batch_argnums=(1, 2), method=method, microbatch_size=mb, return_norms=True
      )(params, x, y)[2]
      for method, mb in options
    ]

  for option, got in zip(options, norms(params, x, y), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=str(option))


def test_non_finite_example_contributes_zero_as_with_vmap():
  params, x, y = mlp_problem(batch=6, seed=7)
  bad = x.at[2, 0].set(jnp.nan)
  keep = np.arange(6) != 2
  for method in ("vmap", "ghost"):
    fn = jaxclip.per_example_clipped_grad(
      mlp_loss, 1.0, batch_argnums=(1, 2), method=method, return_num_nonfinite=True
    )
    total, _, num_nonfinite = jax.jit(fn)(params, bad, y)
    want = jax.jit(fn)(params, x[keep], y[keep])[0]
    assert int(num_nonfinite) == 1, method
    for a, e in zip(jax.tree.leaves(total), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=method)


def test_a_parameter_in_a_loop_jax_cannot_differentiate_names_the_primitive():
  def loss(w, x):
    n = x[0].astype(jnp.int32) % 3 + 1  # a data-dependent trip count
    body = lambda c: (jnp.tanh(c[0] @ w), c[1] + 1)
    return jnp.sum(jax.lax.while_loop(lambda c: c[1] < n, body, (x, 0))[0])

  fn = jaxclip.per_example_clipped_grad(loss, 1.0, method="ghost")
  with pytest.raises(ValueError, match="through `while`"):
    fn(jnp.eye(3), jnp.ones((4, 3)))


def test_bad_method_and_complex_parameters_are_refused():
  with pytest.raises(ValueError, match="method must be one of 'vmap', 'ghost', 'auto'"):
    jaxclip.per_example_clipped_grad(mlp_loss, 1.0, method="ghosts")
  with pytest.raises(ValueError, match="ghost_plan takes method 'ghost' or 'auto'"):
    jaxclip.ghost_plan(mlp_loss, *mlp_problem(batch=2, seed=0), method="vmap")
  fn = jaxclip.per_example_clipped_grad(lambda w, x: jnp.abs(jnp.sum(w * x)), 1.0, method="ghost")
  with pytest.raises(ValueError, match="real parameters"):
    fn(jnp.ones(2, jnp.complex64), jnp.ones((3, 2), jnp.complex64))
  fn = jaxclip.per_example_clipped_grad(lambda w, x: w * x, 1.0, method="ghost")
  with pytest.raises(ValueError, match="real scalar"):
    fn(jnp.ones(2), jnp.ones((3, 2)))


def test_static_shared_arguments_and_a_loss_that_ignores_the_batch_as_with_vmap():
  def loss(w, flag, name, x):
    assert isinstance(flag, bool) and name == "tanh"
    return jnp.sum(jnp.tanh(x @ w)) if flag else jnp.sum(x @ w)

  w = jax.random.normal(jax.random.key(0), (3, 2))
  xs = jax.random.normal(jax.random.key(1), (6, 3))
  fns = {
    m: jaxclip.per_example_clipped_grad(loss, 1.0, method=m, return_norms=True, batch_argnums=3)
    for m in ("vmap", "ghost")
  }
  # The bool and the str: static arguments, handed to the loss as they are.
  ref, got = (
    jax.jit(fns[m], static_argnums=(1, 2))(w, True, "tanh", xs) for m in ("vmap", "ghost")
  )
  np.testing.assert_allclose(got[2], ref[2], rtol=1e-5, atol=1e-6)  # as _compare
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
  assert int(got[1]) == int(ref[1]) > 0
  # A loss without the example: every example has the same gradient.
  ignore = lambda w, x: jnp.sum(w**2)
  for method in ("vmap", "ghost"):
    total, count, norms = jax.jit(
      jaxclip.per_example_clipped_grad(
        ignore, 1.0, method=method, return_norms=True, batch_argnums=1
      )
    )(w, xs)
    np.testing.assert_allclose(norms, np.full(6, 2 * np.linalg.norm(w)), rtol=1e-6)
    np.testing.assert_allclose(total, 6 * 2 * w / norms[0], rtol=1e-5)
    assert int(count) == 6
