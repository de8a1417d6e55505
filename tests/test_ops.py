"""jaxclip.ops: TensorFlow's formulas, worked examples, structures and errors."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip import ops
from tests.helpers import assert_dtypes_kept, assert_tree_allclose, random_tree

pytestmark = pytest.mark.usefixtures("strict_promotion")

# ---------------------------------------------------------------- worked examples


def test_worked_example_clip_by_value_vector():
  out = ops.clip_by_value(jnp.array([-1, 2, 10]), 0, 3)
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(out, [0, 2, 3])


def test_worked_example_clip_by_value_int_matrix():
  a = jnp.array([[1, 1, 2, 4], [3, 4, 8, 5]])
  out = ops.clip_by_value(a, 2, 5)
  assert out.dtype == a.dtype
  np.testing.assert_array_equal(out, [[2, 2, 2, 4], [3, 4, 5, 5]])


def test_worked_example_clip_by_norm():
  t = jnp.array([-2.0, 3.0, 6.0])
  # [-2, 3, 6] * 5/7 evaluated exactly, then rounded once to float32.
  exact = (np.array([-2.0, 3.0, 6.0]) * 5.0 / 7.0).astype(np.float32)
  np.testing.assert_array_equal(ops.clip_by_norm(t, 5.0), exact)
  np.testing.assert_array_equal(ops.clip_by_norm(t, 9.0), t)


def test_worked_example_clip_by_norm_tf_digits():
  out = ops.clip_by_norm(jnp.array([2.0, 5.0]), 5.0)
  np.testing.assert_array_equal(out, np.array([1.8569534, 4.6423836], np.float32))


def test_worked_example_clip_by_average_norm():
  out = ops.clip_by_average_norm(jnp.array([3.0, 4.0]), 1.0)
  np.testing.assert_array_equal(out, np.array([1.2, 1.6], np.float32))


def test_worked_example_clip_by_global_norm():
  tree = [jnp.array([-2.0, 3.0, 6.0]), jnp.array([-4.0, 6.0, 12.0])]
  clipped, norm = ops.clip_by_global_norm(tree, 14.5)
  np.testing.assert_allclose(norm, math.sqrt(245.0), rtol=1e-7)
  scale = 14.5 / math.sqrt(245.0)
  assert isinstance(clipped, list)
  for c, t in zip(clipped, tree, strict=True):
    np.testing.assert_allclose(c, np.asarray(t) * scale, rtol=2e-7)


# ---------------------------------------------------------------- formulas


def _np_norm(x, axis=None):
  x = np.asarray(x, np.float64)
  return np.sqrt(np.sum(np.abs(x) ** 2, axis=axis, keepdims=axis is not None))


@pytest.mark.parametrize("clip_norm", [0.5, 2.0, 100.0])
def test_clip_by_norm_formula(clip_norm):
  tree = random_tree(1, scale=2.0)
  out = ops.clip_by_norm(tree, clip_norm)
  expected = jax.tree.map(lambda t: np.asarray(t) * clip_norm / max(_np_norm(t), clip_norm), tree)
  assert_tree_allclose(
    out, jax.tree.map(lambda e, t: jnp.asarray(e, t.dtype), expected, tree), rtol=1e-6
  )


@pytest.mark.parametrize("axes", [[0], [1], (0, 1), 1, -1])
def test_clip_by_norm_axes(axes):
  m = jax.random.normal(jax.random.key(3), (5, 4)) * 3
  out = ops.clip_by_norm(m, 1.5, axes=axes)
  ax = tuple(axes) if isinstance(axes, (list, tuple)) else (axes,)
  n = _np_norm(m, axis=ax)
  np.testing.assert_allclose(out, np.asarray(m) * 1.5 / np.maximum(n, 1.5), rtol=1e-6)
  # every slice is now within the bound
  assert np.all(_np_norm(out, axis=ax) <= 1.5 * (1 + 1e-6))


def test_clip_by_norm_rows_and_columns():
  m = jnp.array([[3.0, 4.0], [0.3, 0.4]])
  rows = ops.clip_by_norm(m, 1.0, axes=[1])
  np.testing.assert_allclose(rows, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)
  cols = ops.clip_by_norm(m, 1.0, axes=[0])
  n0 = np.sqrt(np.array([3.0**2 + 0.3**2, 4.0**2 + 0.4**2]))
  np.testing.assert_allclose(cols, np.asarray(m) / n0, rtol=1e-6)


def test_clip_by_average_norm_formula():
  t = jax.random.normal(jax.random.key(4), (3, 5))
  for c in (0.01, 0.1, 10.0):
    out = ops.clip_by_average_norm(t, c)
    n = _np_norm(t)
    expected = np.asarray(t) * min(1.0, c * t.size / n)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_clip_by_global_norm_formula_and_use_norm():
  tree = random_tree(5, scale=3.0)
  norm = math.sqrt(sum(float(_np_norm(t)) ** 2 for t in jax.tree.leaves(tree)))
  clipped, got = ops.clip_by_global_norm(tree, 2.0)
  np.testing.assert_allclose(got, norm, rtol=1e-6)
  assert_tree_allclose(
    clipped, jax.tree.map(lambda t: t * jnp.float32(2.0 / norm), tree), rtol=1e-6
  )
  # use_norm is used for the scale and returned as the norm
  clipped2, got2 = ops.clip_by_global_norm(tree, 2.0, use_norm=jnp.float32(4.0))
  assert float(got2) == 4.0
  assert_tree_allclose(clipped2, jax.tree.map(lambda t: t * jnp.float32(0.5), tree), rtol=1e-6)
  # under the threshold nothing changes
  same, _ = ops.clip_by_global_norm(tree, norm * 1.01)
  assert_tree_allclose(same, tree, rtol=0)


def test_global_norm_matches_numpy_and_empty():
  tree = random_tree(6)
  expected = math.sqrt(sum(float(_np_norm(t)) ** 2 for t in jax.tree.leaves(tree)))
  np.testing.assert_allclose(ops.global_norm(tree), expected, rtol=1e-6)
  assert float(ops.global_norm({})) == 0.0
  assert float(ops.global_norm([None, None])) == 0.0
  assert float(ops.global_norm([], ord=math.inf)) == 0.0
  assert float(ops.global_norm([], ord=1)) == 0.0


# ---------------------------------------------------------------- ord vs torch formulas


def _torch_total_norm(leaves, p):
  """torch.nn.utils.get_total_norm: the p-norm of the per-tensor p-norms."""
  per = [np.linalg.norm(np.asarray(x, np.float64).ravel(), p) for x in leaves]
  return np.linalg.norm(np.array(per), p) if per else 0.0


@pytest.mark.parametrize("ord_", [1, 2, None, math.inf, "inf", 2.0, jnp.inf, jnp.array(1)])
def test_global_norm_ord_matches_torch_formula(ord_):
  tree = random_tree(7)
  p = {1: 1, 2: 2, None: 2, "inf": np.inf}.get(
    ord_ if not hasattr(ord_, "item") else ord_.item(), ord_
  )
  expected = _torch_total_norm(jax.tree.leaves(tree), p)
  np.testing.assert_allclose(ops.global_norm(tree, ord=ord_), expected, rtol=1e-6)


@pytest.mark.parametrize("ord_", [1, math.inf])
def test_clip_by_global_norm_other_ords(ord_):
  tree = random_tree(8, scale=4.0)
  clipped, norm = ops.clip_by_global_norm(tree, 1.0, ord=ord_)
  assert float(norm) > 1.0
  np.testing.assert_allclose(ops.global_norm(clipped, ord=ord_), 1.0, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, 3, -1, "fro", "nuc", 0.5, jnp.array([1, 2])])
def test_unsupported_ord(bad):
  with pytest.raises(ValueError, match="ord"):
    ops.global_norm([jnp.ones(2)], ord=bad)
  with pytest.raises(ValueError, match="ord"):
    ops.clip_by_global_norm([jnp.ones(2)], 1.0, ord=bad)
  with pytest.raises(ValueError, match="ord"):
    jaxclip.clip_by_global_norm(1.0, ord=bad)


# ---------------------------------------------------------------- structures


class Pair(NamedTuple):
  a: jax.Array
  b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
  w: jax.Array
  b: jax.Array


ALL_OPS = [
  lambda t: ops.clip_by_value(t, -0.5, 0.5),
  lambda t: ops.clip_by_norm(t, 0.5),
  lambda t: ops.clip_by_average_norm(t, 0.05),
  lambda t: ops.clip_by_global_norm(t, 0.5)[0],
]


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize(
  "tree",
  [
    {"a": jnp.ones((2, 3)), "b": None, "c": [jnp.arange(3.0), (jnp.ones(()),)]},
    [jnp.ones(3), None, jnp.full((2,), 2.0)],
    (jnp.ones(3), jnp.ones(2)),
    Pair(jnp.ones(3), jnp.full((2, 2), -3.0)),
    Layer(jnp.ones((2, 2)), jnp.zeros(2)),
    jnp.ones((3, 3)),
  ],
  ids=["dict", "list", "tuple", "namedtuple", "dataclass", "array"],
)
def test_structure_kept_and_none_in_place(op, tree):
  out = op(tree)
  assert jax.tree.structure(out, is_leaf=lambda x: x is None) == jax.tree.structure(
    tree, is_leaf=lambda x: x is None
  )
  assert type(out) is type(tree)
  assert_dtypes_kept(tree, out)


def test_python_scalar_leaves():
  out, norm = ops.clip_by_global_norm([3.0, 4.0], 1.0)
  assert isinstance(out, list)
  np.testing.assert_allclose([float(o) for o in out], [0.6, 0.8], rtol=1e-6)
  assert float(norm) == 5.0


def test_clip_by_value_array_bounds_broadcast():
  x = jnp.arange(6.0).reshape(2, 3)
  lo = jnp.array([0.0, 2.0, 1.0])
  hi = jnp.array([[2.5], [4.0]])
  np.testing.assert_array_equal(
    ops.clip_by_value(x, lo, hi), np.clip(np.asarray(x), np.asarray(lo), np.asarray(hi))
  )
  with pytest.raises(ValueError, match="broadcast"):
    ops.clip_by_value(jnp.ones(3), jnp.zeros((2, 3)), 1.0)
  # Shapes that do not broadcast at all get the same error, naming the leaf.
  with pytest.raises(ValueError, match=r"shape \(2,\) does not broadcast to the leaf at \['w'\]"):
    ops.clip_by_value({"v": jnp.ones(2), "w": jnp.ones(3)}, 0.0, jnp.ones(2))
  # Leaves of one shape share their broadcast bounds; each is clipped on its own.
  rows = [jnp.array([-3.0, 0.5, 3.0]) * k for k in range(1, 5)]
  for got, row in zip(ops.clip_by_value(rows, lo, 2.0), rows, strict=True):
    np.testing.assert_array_equal(got, np.clip(np.asarray(row), np.asarray(lo), 2.0))


def test_clip_by_value_integer_leaves_round_inwards_and_saturate():
  x = jnp.array([0, 1, 2, 3, 4], jnp.int32)
  out = ops.clip_by_value(x, 1.5, 3.5)
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(out, [2, 2, 2, 3, 3])
  u = jnp.array([0, 5, 255], jnp.uint8)
  out = ops.clip_by_value(u, -10, 300)
  assert out.dtype == jnp.uint8
  np.testing.assert_array_equal(out, [0, 5, 255])
  np.testing.assert_array_equal(ops.clip_by_value(u, 3.0, 1000.0), [3, 5, 255])


def test_clip_by_value_mixed_tree_keeps_dtypes():
  tree = {
    "i": jnp.array([-5, 5], jnp.int8),
    "h": jnp.array([-5, 5], jnp.bfloat16),
    "f": jnp.array([-5.0, 5.0]),
  }
  out = ops.clip_by_value(tree, -2, 2)
  assert_dtypes_kept(tree, out)
  for v in out.values():
    np.testing.assert_array_equal(np.asarray(v, np.float32), [-2, 2])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [-1.0, -1e-9, float("nan"), np.array([1.0, -1.0])])
@pytest.mark.parametrize(
  "call",
  [
    lambda c: ops.clip_by_norm(jnp.ones(2), c),
    lambda c: ops.clip_by_average_norm(jnp.ones(2), c),
    lambda c: ops.clip_by_global_norm([jnp.ones(2)], c),
    lambda c: jaxclip.clip_by_norm(c),
    lambda c: jaxclip.clip_by_average_norm(c),
    lambda c: jaxclip.clip_by_global_norm(c),
    lambda c: jaxclip.clip(c),
    lambda c: jaxclip.clip_by_block_rms(c),
    lambda c: jaxclip.adaptive_grad_clip(c),
    lambda c: jaxclip.per_example_global_norm_clip([jnp.ones((2, 2))], c),
    lambda c: jaxclip.per_example_layer_norm_clip([jnp.ones((2, 2))], c),
  ],
)
def test_bad_threshold_raises(call, bad):
  with pytest.raises(ValueError, match="non-negative|NaN"):
    call(bad)


def test_min_greater_than_max_raises():
  with pytest.raises(ValueError, match="clip_value_min must not exceed clip_value_max"):
    ops.clip_by_value(jnp.ones(2), 3.0, 1.0)
  with pytest.raises(ValueError, match="must not exceed"):
    ops.clip_by_value(jnp.ones(2), jnp.array([0.0, 2.0]), jnp.array([1.0, 1.0]))
  with pytest.raises(ValueError, match="min_value must not exceed max_value"):
    jaxclip.clip_by_value(1.0, -1.0)
  with pytest.raises(ValueError, match="NaN"):
    ops.clip_by_value(jnp.ones(2), float("nan"), 1.0)


@pytest.mark.parametrize(
  "call",
  [
    lambda t: ops.global_norm(t),
    lambda t: ops.clip_by_norm(t, 1.0),
    lambda t: ops.clip_by_average_norm(t, 1.0),
    lambda t: ops.clip_by_global_norm(t, 1.0),
  ],
)
def test_integer_leaf_in_norm_raises_with_path(call):
  tree = {"encoder": {"kernel": jnp.ones(2), "step": jnp.array([1, 2])}}
  with pytest.raises(TypeError, match=r"\['encoder'\]\['step'\].*int32"):
    call(tree)
  with pytest.raises(TypeError, match="bool"):
    call([jnp.ones(2), jnp.array([True])])


def test_complex_leaf_in_value_clip_raises():
  with pytest.raises(TypeError, match="complex"):
    ops.clip_by_value({"z": jnp.array([1 + 1j])}, 0.0, 1.0)


def test_traced_negative_threshold_acts_as_zero():
  t = jnp.array([3.0, 4.0])
  out = jax.jit(ops.clip_by_norm)(t, -1.0)
  np.testing.assert_array_equal(out, [0.0, 0.0])
  out, norm = jax.jit(ops.clip_by_global_norm)([t], -2.0)
  np.testing.assert_array_equal(out[0], [0.0, 0.0])
  assert float(norm) == 5.0


def test_traced_ord_asks_for_static_args():
  with pytest.raises(ValueError, match="static_args"):
    jax.jit(lambda o: ops.global_norm([jnp.ones(2)], ord=o))(1)
  tx = optax.inject_hyperparams(jaxclip.clip_by_global_norm, static_args=("ord",))(
    max_norm=1.0, ord=1
  )
  out, _ = jax.jit(tx.update)([jnp.array([3.0, -4.0])], tx.init([jnp.zeros(2)]))
  np.testing.assert_allclose(out[0], [3 / 7, -4 / 7], rtol=1e-6)


def test_traced_min_greater_than_max_gives_max():
  out = jax.jit(ops.clip_by_value)(jnp.array([-5.0, 0.0, 5.0]), 2.0, 1.0)
  np.testing.assert_array_equal(out, [1.0, 1.0, 1.0])


# ------------------------------------------------- TensorFlow users' first calls


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_of_numbers_is_one_tensor_as_in_tensorflow(container):
  """``tf.clip_by_norm([3., 4.], 1.)`` is ``[0.6, 0.8]``: the list is one vector."""
  out = ops.clip_by_norm(container([3.0, 4.0]), 1.0)
  assert isinstance(out, jax.Array) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, [0.6, 0.8], rtol=1e-6)
  rows = ops.clip_by_norm(container([container([3.0, 4.0]), container([0.0, 1.0])]), 1.0, axes=[1])
  np.testing.assert_allclose(rows, [[0.6, 0.8], [0.0, 1.0]], rtol=1e-6)
  # TF v1's clip_by_average_norm: norm 5 / 2 entries = 2.5, held to 1.
  np.testing.assert_allclose(ops.clip_by_average_norm(container([3.0, 4.0]), 1.0), [1.2, 1.6])
  np.testing.assert_array_equal(ops.clip_by_value(container([-1, 2, 10]), 0, 3), [0, 2, 3])
  np.testing.assert_allclose(ops.clip_by_norm([np.float32(3), np.float32(4)], 1.0), [0.6, 0.8])


def test_a_list_of_arrays_stays_a_pytree_and_a_ragged_list_is_refused():
  leaves = ops.clip_by_norm([jnp.array(3.0), jnp.array(4.0)], 1.0)
  assert isinstance(leaves, list)
  np.testing.assert_allclose(leaves, [1.0, 1.0])
  with pytest.raises(ValueError, match="ragged"):
    ops.clip_by_norm([[3.0, 4.0], [1.0]], 1.0)
  with pytest.raises(TypeError, match="floating-point"):
    ops.clip_by_norm([3, 4], 1.0)  # integers have no norm to clip, as before
  # The global ops take a list of tensors in TF: a list of numbers is scalar leaves there.
  clipped, norm = ops.clip_by_global_norm([3.0, 4.0], 1.0)
  np.testing.assert_allclose(norm, 5.0)
  np.testing.assert_allclose(clipped, [0.6, 0.8], rtol=1e-6)


@pytest.mark.parametrize("given", [jnp.bfloat16(5), jnp.float16(5), np.int32(5)])
def test_use_norm_of_a_lower_precision_is_read_in_float32(given):
  clipped, norm = ops.clip_by_global_norm({"w": jnp.array(3.0)}, 3.0, use_norm=given)
  assert norm.dtype == jnp.float32
  assert clipped["w"].dtype == jnp.float32
  np.testing.assert_allclose(clipped["w"], 1.8, rtol=1e-6)  # bfloat16 arithmetic: 1.8046875
