"""The overflow- and underflow-safe norm of the kernel (issue #51, item 1).

Each check fails at ee5c6d7, where the float32 sum of squares overflowed to
``inf`` for entries of about 2e19 and lost entries below about 1e-19.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxclip._kernel import _numerics, _reduction


def _f64_norm(leaves, ord=2):
  flat = np.concatenate([np.abs(np.asarray(x, np.complex128)).ravel() for x in leaves])
  if ord == 2:
    m = flat.max() if flat.size else 0.0
    return 0.0 if m == 0 else m * math.sqrt(np.sum((flat / m) ** 2))
  return flat.sum() if ord == 1 else flat.max()


CASES = {
  "huge": {"a": jnp.array([3e20, 4e20]), "b": jnp.ones(3)},
  "near_max": {"a": jnp.full((4,), 1e38)},
  "tiny": {"a": jnp.array([3e-25, 4e-25]), "b": jnp.array([1e-30])},
  "squares_subnormal": {"a": jnp.full((5,), 1e-20)},
  "mixed_bf16_f16": {
    "a": jnp.array([3e20, 4e20], jnp.bfloat16),
    "b": jnp.array([3e3, 4e3], jnp.float16),
  },
  "complex": {"a": jnp.array([3e20 + 4e20j, 1.0 + 0j], jnp.complex64)},
  "ordinary": {"a": jnp.arange(6.0), "b": jnp.ones((2, 3))},
}


@pytest.mark.parametrize("ord", [2, 1])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("jit", [False, True])
def test_tree_norm_of_finite_leaves_is_the_true_norm(case, ord, jit):
  tree = CASES[case]
  fn = jax.jit(_reduction.tree_norm, static_argnums=1) if jit else _reduction.tree_norm
  got = float(fn(tree, ord))
  want = min(_f64_norm(jax.tree.leaves(tree), ord), float(jnp.finfo(jnp.float32).max))
  assert math.isfinite(got)
  np.testing.assert_allclose(got, want, rtol=2e-6 if case != "mixed_bf16_f16" else 1e-2)


def test_norm_beyond_float32_saturates_at_finfo_max():
  big = float(jnp.finfo(jnp.float32).max)
  assert float(_reduction.tree_norm({"a": jnp.full((4,), 3e38)})) == big
  norms, total = _reduction.tree_leaf_norms({"a": jnp.full((4,), 3e38), "b": jnp.ones(2)})
  assert (
    float(norms[0]) == big and float(total) == big and float(norms[1]) == pytest.approx(1.414, 1e-3)
  )


def test_non_finite_entries_keep_their_norm():
  # TF's semantics: an inf entry gives an inf norm, a NaN entry a NaN norm.
  assert float(_reduction.tree_norm({"a": jnp.array([jnp.inf, 1e20])})) == math.inf
  assert math.isnan(float(_reduction.tree_norm({"a": jnp.array([jnp.nan, 1e20])})))
  assert math.isnan(float(_reduction.tree_norm({"a": jnp.array([jnp.nan, 1.0])})))


@pytest.mark.parametrize("as_vector", [False, True])
def test_leaf_norms_each_rescaled(as_vector):
  tree = {"a": jnp.array([3e20, 4e20]), "b": jnp.array([1e-30, 0.0]), "c": jnp.array([3.0, 4.0])}
  norms, total = _reduction.tree_leaf_norms(tree, as_vector=as_vector)
  np.testing.assert_allclose(np.asarray(norms), [5e20, 1e-30, 5.0], rtol=1e-6)
  np.testing.assert_allclose(float(total), 5e20, rtol=1e-6)


def test_leaf_norm_over_axes_rescaled_per_row():
  x = jnp.array([[3e20, 4e20], [3.0, 4.0], [3e-25, 4e-25], [0.0, 0.0]])
  np.testing.assert_allclose(_numerics.leaf_norm(x, 2, 1), [5e20, 5.0, 5e-25, 0.0], rtol=1e-6)
  assert _numerics.leaf_norm(x, 2, 1, keepdims=True).shape == (4, 1)


def test_gradients_are_finite_and_zero_at_zero():
  for fn in (_reduction.tree_norm, lambda x: _numerics.leaf_norm(x)):
    np.testing.assert_array_equal(jax.grad(fn)(jnp.zeros(3)), 0.0)
    np.testing.assert_allclose(jax.grad(fn)(jnp.array([3e20, 4e20])), [0.6, 0.8], rtol=1e-6)
    assert np.all(np.isfinite(jax.hessian(fn)(jnp.zeros(2))))


def test_per_example_norms():
  g = [
    jnp.array([[3e20, 4e20], [3.0, 4.0], [3e-25, 4e-25], [0.0, 0.0], [3e38, 3e38]]),
    jnp.zeros((5, 2, 1)),
  ]
  norms = _numerics.per_example_norms(g)
  big = float(jnp.finfo(jnp.float32).max)
  np.testing.assert_allclose(norms, [5e20, 5.0, 5e-25, 0.0, big], rtol=1e-6)
  scaled = _numerics.per_example_scaled_norms(g)
  factors = scaled.clip_factor(1.0)
  np.testing.assert_allclose(factors[:4], [1 / 5e20, 0.2, 1.0, 1.0], rtol=1e-6)
  # Beyond float32's range the factor comes from the scaled form: the clipped
  # example has norm c (in float64), not c * true / finfo.max...
  c = 1e10
  clipped = np.asarray(g[0][4], np.float64) * float(scaled.clip_factor(c)[4])
  np.testing.assert_allclose(np.linalg.norm(clipped), c, rtol=1e-6)
  # ...and where the factor is below float32's normal range (c = 1), it is 0
  # on XLA:CPU (flushed), never above the bound.
  clipped = np.asarray(g[0][4], np.float64) * float(factors[4])
  assert np.linalg.norm(clipped) <= 1.0
  # The fast path: nothing rescaled, exponents 0.
  ordinary = _numerics.per_example_scaled_norms([jnp.array([[3.0, 4.0], [6.0, 8.0]])])
  np.testing.assert_array_equal(ordinary.exponent, 0)
  np.testing.assert_allclose(ordinary.norms, [5.0, 10.0])


def test_per_example_non_finite():
  norms = _numerics.per_example_norms([jnp.array([[jnp.inf, 1.0], [jnp.nan, 1.0], [3e20, 4e20]])])
  assert float(norms[0]) == math.inf and math.isnan(float(norms[1]))
  np.testing.assert_allclose(float(norms[2]), 5e20, rtol=1e-6)
  assert math.isnan(
    float(_numerics.per_example_scaled_norms([jnp.array([[jnp.inf]])]).clip_factor(1.0)[0])
  )


def test_the_fast_path_runs_no_rescale():
  # The rescale is a conditional on one scalar: its branch holds the max pass.
  text = jax.jit(_reduction.tree_norm).lower({"a": jnp.ones(8)}).as_text()
  assert "case" in text or "cond" in text or "if" in text


def test_times_pow2_is_exact_across_the_range():
  x = jnp.array([3e38, 1.5e-38, 1.0, 7.0], jnp.float32)
  for k in (-252, -149, -128, -1, 0, 1, 127):
    k = jnp.int32(k)
    back = _numerics.times_pow2(_numerics.times_pow2(x, -k), k)
    ok = np.isfinite(np.asarray(_numerics.times_pow2(x, -k))) & (
      np.asarray(_numerics.times_pow2(x, -k)) != 0
    )
    np.testing.assert_array_equal(np.asarray(back)[ok], np.asarray(x)[ok])


def _conds(jaxpr) -> int:
  """``cond`` equations of ``jaxpr``, nested ones included."""
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name == "cond"
    for p in eqn.params.values():
      for q in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(q, "jaxpr", q)
        if hasattr(inner, "eqns"):
          total += _conds(inner)
  return total


@pytest.mark.parametrize("axis", [None, 0])
def test_leaf_norms_of_many_shapes_rescued_each(axis):
  """scale_by_leaf_norms on leaves of distinct shapes: one rescue, each leaf its own scale."""
  mags = [3e20, 1e-25, 1.0, 0.0, 1e30]
  leaves = [jnp.full((2, 3 + i), m, jnp.float32).at[0, 0].set(2 * m) for i, m in enumerate(mags)]
  out = _numerics.scale_by_leaf_norms(
    lambda n, size, c: c / jnp.maximum(n, c), leaves, 2, axis, operands=(1.0,)
  )
  for x, y in zip(leaves, out, strict=True):
    x64 = np.asarray(x, np.float64)
    norm = np.sqrt(np.sum(x64**2, axis=axis, keepdims=True))
    want = x64 / np.maximum(norm, 1.0)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-30)


def test_leaf_norms_rescue_is_one_cond_for_the_tree():
  """The rescue does not grow the program by a ``cond`` per leaf (issue #51's safe norm, #50)."""

  def conds(k):
    leaves = [jax.ShapeDtypeStruct((2, 3 + i), jnp.float32) for i in range(k)]
    fn = lambda n, size, c: c / jnp.maximum(n, c)  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda xs: _numerics.scale_by_leaf_norms(fn, xs, 2, operands=(1.0,)))(
      leaves
    )
    return _conds(jaxpr.jaxpr)

  # One rescue per platform branch (the CPU one and the others'), under the
  # platform switch, which is a cond too: three, whatever the number of leaves.
  assert conds(4) == conds(16) == 3
  tree = {f"w{i}": jax.ShapeDtypeStruct((4, 5 + i % 3), jnp.float32) for i in range(24)}
  leaf_norms = lambda t, v: _reduction.tree_leaf_norms(t, as_vector=v)  # noqa: E731
  for as_vector in (False, True):
    jaxpr = jax.make_jaxpr(lambda t, v=as_vector: leaf_norms(t, v))(tree)
    assert _conds(jaxpr.jaxpr) == 1
