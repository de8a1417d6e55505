"""The norm kernel's memory, fusion and exactness on XLA:CPU: half precision, many leaves, stacks.

The clip must stay fused into the optimiser's update (no gradient-sized
temporary), accumulate half precision in float32 without a float32 copy,
compile to about one kernel per leaf (or per shape) however many leaves there
are, and match a float64 reference on leaves grouped and stacked together.
"""

from __future__ import annotations

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip._kernel._platform import _stacks
from tests import helpers
from workloads import trees

# Gradient-sized leaves (one above the kernel's small-leaf size, the others
# grouped) and a bias: a clipped copy of any weight would need at least
# _SMALLEST_WEIGHT bytes of temporary memory.
_SHAPES = {
  "w_in": (256, 256),
  "w_out": (512, 128),
  "w_emb": (1000, 64),
  "w_big": (320, 256),
  "bias": (256,),
}
_SMALLEST_WEIGHT = 1000 * 64 * 4


@pytest.mark.hlo
@pytest.mark.parametrize(
  "clip",
  [
    lambda: jaxclip.clip_by_global_norm(1.0),
    lambda: jaxclip.clip_by_norm(1.0),
    lambda: jaxclip.clip_by_value(-1e-3, 1e-3),
  ],
  ids=["clip_by_global_norm", "clip_by_norm", "clip_by_value"],
)
def test_clip_adam_step_holds_no_gradient_sized_buffer(clip):
  params = trees.make_tree(_SHAPES)
  compiled, _ = trees.compile_train_step(optax.chain(clip(), optax.adam(1e-3)), params, params)
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < _SMALLEST_WEIGHT // 8, (
    f"the compiled clip+adam step allocates {temp} temporary bytes: the clip is no longer "
    "fused into adam's update (a clipped copy of the gradients is materialised)"
  )


@pytest.mark.hlo
def test_memory_analysis_does_see_a_materialised_clip():
  # The check above can fail: optax 0.2's clip_by_global_norm materialises the
  # clipped gradients before adam, and the same measurement shows it.
  params = trees.make_tree(_SHAPES)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  compiled, _ = trees.compile_train_step(tx, params, params)
  assert compiled.memory_analysis().temp_size_in_bytes >= _SMALLEST_WEIGHT


@pytest.mark.hlo
def test_standalone_donated_clip_is_in_place():
  tree = trees.make_tree(_SHAPES)
  tx = jaxclip.clip_by_global_norm(1.0)
  state = tx.init(tree)
  compiled = helpers.compiled(
    jax.jit(lambda t: tx.update(t, state)[0], donate_argnums=0).lower(tree)
  )
  assert compiled.memory_analysis().temp_size_in_bytes < _SMALLEST_WEIGHT // 8


_HALF = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
_NORM_CLIPS = pytest.mark.parametrize(
  "clip",
  [
    lambda: jaxclip.clip_by_global_norm(1.0),
    lambda: jaxclip.clip_by_norm(1.0),
    lambda: jaxclip.clip_by_global_norm(1.0, ord=1),
    lambda: jaxclip.clip_by_global_norm(1.0, ord="inf"),
  ],
  ids=["clip_by_global_norm", "clip_by_norm", "ord=1", "ord=inf"],
)


@pytest.mark.hlo
@_HALF
@_NORM_CLIPS
def test_half_precision_clip_holds_no_float32_copy(clip, dtype):
  # The norm accumulates in float32, but no full-size float32 copy of a
  # half-precision leaf may be materialised for it. XLA:CPU did so for
  # bfloat16 before the reduction got its own operand, and for float16 before
  # the two-output reduction (jaxclip/_kernel).
  tree = jax.tree.map(lambda x: x.astype(dtype), trees.make_tree(_SHAPES))
  tx = clip()
  state = tx.init(tree)
  compiled = helpers.compiled(
    jax.jit(lambda t: tx.update(t, state)[0], donate_argnums=0).lower(tree)
  )
  assert compiled.memory_analysis().temp_size_in_bytes < _SMALLEST_WEIGHT // 8


def _half_step_temp(tx, dtype):
  params = jax.tree.map(lambda x: x.astype(dtype), trees.make_tree(_SHAPES))
  compiled, _ = trees.compile_train_step(tx, params, params)
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.hlo
@_HALF
@_NORM_CLIPS
def test_half_precision_clip_adam_step_costs_no_more_than_any_elementwise_transform(clip, dtype):
  # XLA:CPU materialises the input of a bfloat16 adam update once whenever an
  # elementwise transform precedes it (optax.scale(0.5) included). The clip
  # must cost no more than that control: no float32 copy, no second buffer.
  # For float16 the control holds nothing, and neither may the clip.
  control = _half_step_temp(optax.chain(optax.scale(0.5), optax.adam(1e-3)), dtype)
  temp = _half_step_temp(optax.chain(clip(), optax.adam(1e-3)), dtype)
  # 8 KiB: the float32 partial sums of the float16 reductions (one per 1,024
  # entries, for the fast norm and for its rescue); a copy of a leaf is >= 128 KB.
  assert temp <= control + 8192, (temp, control)
  if dtype == jnp.float16:
    assert temp < _SMALLEST_WEIGHT // 8


@pytest.mark.parametrize("ord", [1, 2, math.inf])
def test_float16_norm_value_and_gradient(ord):
  # Large float16 leaves take the two-output reduction on CPU; its value and
  # its derivative are those of the plain reduction.
  rng = np.random.default_rng(1)
  leaves = [
    rng.normal(size=(300, 257)).astype(np.float16),
    np.full((70_000,), 300.0, np.float16),
    np.zeros((80_000,), np.float16),
  ]
  got = jax.jit(lambda t: jaxclip.ops.global_norm(t, ord=ord))(leaves)
  np.testing.assert_allclose(float(got), _reference_norm(leaves, ord), rtol=2e-6)
  per_leaf = jaxclip.ops.clip_by_norm(leaves[0], 1.0, axes=[1])
  expected = np.asarray(leaves[0], np.float64)
  expected = expected / np.maximum(np.linalg.norm(expected, axis=1, keepdims=True), 1.0)
  np.testing.assert_allclose(np.asarray(per_leaf, np.float64), expected, rtol=2e-3, atol=1e-6)
  grads = jax.grad(lambda t: jaxclip.ops.global_norm(t, ord=ord).astype(jnp.float32))(
    [jnp.asarray(x, jnp.float32).astype(jnp.float16) for x in leaves[:1]] + [leaves[2]]
  )
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  if ord == 2:
    big = np.asarray(leaves[0], np.float64)
    np.testing.assert_allclose(
      np.asarray(grads[0], np.float64), big / np.linalg.norm(big), rtol=1e-2, atol=1e-4
    )


@pytest.mark.hlo
@pytest.mark.parametrize("mixed", [False, True], ids=["uniform", "mixed"])
def test_many_leaves_compile_to_about_one_kernel_per_leaf(mixed):
  # Compile time follows the number of HLO fusions; one reduction per small
  # leaf plus a chain of thousands of scalar adds is what made it quadratic.
  tree = trees.make_tree(trees.many_leaf_shapes(256, mixed))
  scale_only = helpers.compiled(jax.jit(lambda t: jax.tree.map(lambda x: x * 0.5, t)).lower(tree))
  tx = jaxclip.clip_by_global_norm(1.0)
  clip = helpers.compiled(jax.jit(lambda t: tx.update(t, tx.init(t))[0]).lower(tree))
  count = lambda c: c.as_text().count(" fusion(")  # noqa: E731
  entry = helpers.entry_fusions(clip.as_text())
  assert entry <= count(scale_only) + 256 // 8, (entry, count(scale_only))
  # The overflow rescue (a lax.cond branch, compiled with every step): a few
  # kernels per dtype and width of small leaves, not a rescue per leaf.
  assert count(clip) - entry <= 24, (count(clip), entry)


@pytest.mark.hlo
def test_per_leaf_rescue_of_many_distinct_shapes_is_a_few_kernels():
  """Leaves of distinct shapes (no stacks) above the small-leaf size: the CPU rescue branch
  holds each leaf's padded copy and a few kernels per padded width, not a rescue per leaf, and
  the fast branch one square root per dtype, not an output per leaf (issue #50: a cond output
  and a rescue per leaf, 8 kernels per leaf in the branches, took 480 such leaves from 33 s to
  104 s of compile; now 60 s)."""
  rng = np.random.default_rng(0)
  sizes = rng.choice(np.arange(1100, 2000), 48, replace=False)
  tree = {
    f"w{i}": jnp.asarray(rng.standard_normal((n,) if i % 2 else (4, n // 4)), jnp.float32)
    for i, n in enumerate(sizes)
  }
  tx = jaxclip.clip_by_norm(1.0)
  clip = helpers.compiled(jax.jit(lambda t: tx.update(t, tx.init(t))[0]).lower(tree))
  text = clip.as_text()
  entry = helpers.entry_fusions(text)
  assert text.count(" fusion(") - entry <= len(tree) + 8, (text.count(" fusion("), entry)
  # Every leaf rescued where it overflows (one entry of 3e30 per leaf, a sum of squares past
  # float32), against float64.
  big = {k: v.at[(0,) * v.ndim].set(3e30) for k, v in tree.items()}
  for k, x in clip(big).items():
    ref = np.asarray(big[k], np.float64)
    np.testing.assert_allclose(np.asarray(x, np.float64), ref / np.linalg.norm(ref), rtol=1e-5)


@pytest.mark.hlo
@pytest.mark.parametrize("mixed", [False, True], ids=["uniform", "mixed"])
def test_adaptive_grad_clip_of_many_leaves_compiles_to_a_few_kernels_per_leaf(mixed):
  # Leaf by leaf, adaptive_grad_clip made six to eight fusions per leaf (two
  # norms, the bound, the clip) and took 100 s to compile 5,000 leaves.
  shapes = trees.many_leaf_shapes(256, mixed)
  g, p = trees.make_tree(shapes), trees.make_tree(shapes, seed=1)
  product = helpers.compiled(jax.jit(lambda g, p: jax.tree.map(jnp.multiply, g, p)).lower(g, p))
  tx = jaxclip.adaptive_grad_clip(0.01)
  agc = helpers.compiled(jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0]).lower(g, p))
  count = lambda c: c.as_text().count(" fusion(")  # noqa: E731
  # 3x: each stack's norms (of the updates and of the params) are measured
  # scaled, a maximum and then a sum, so that none overflows (jaxclip/_kernel).
  assert count(agc) <= 3 * count(product), (count(agc), count(product))
  # Its factor, computed once per stack, and not again in each row's kernel:
  # beside clip_by_norm on the same tree, only the params' inputs and stacks
  # are extra. A factor ending in a select made 2.1x clip_by_norm's program.
  clip = jaxclip.clip_by_norm(1.0)
  by_norm = helpers.compiled(jax.jit(lambda g: clip.update(g, clip.init(g))[0]).lower(g))
  size = lambda c: c.as_text().count(" = ")  # noqa: E731
  assert size(agc) <= 1.5 * size(by_norm), (size(agc), size(by_norm))


def _reference_norm(leaves, ord):
  flat = np.concatenate([np.abs(np.asarray(x, np.complex128)).ravel() for x in leaves])
  if ord == math.inf:
    return flat.max(initial=0.0)
  return np.sum(flat**ord) ** (1 / ord)


@pytest.mark.parametrize("ord", [1, 2, math.inf])
def test_grouped_norm_matches_float64_reference(ord):
  rng = np.random.default_rng(0)
  sizes = [1, 3, 5, 64, 64, 65, 100, 7, (1 << 16) + 3]
  leaves = [rng.normal(size=n).astype(np.float32) for n in sizes]
  leaves += [
    rng.normal(size=(9, 7)).astype(jnp.bfloat16),
    np.full((300,), 200.0, np.float16),
    (rng.normal(size=6) + 1j * rng.normal(size=6)).astype(np.complex64),
    np.zeros((0,), np.float32),
  ]
  got = jax.jit(lambda t: jaxclip.ops.global_norm(t, ord=ord))(leaves)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), _reference_norm(leaves, ord), rtol=2e-6)
  assert math.isnan(float(jaxclip.ops.global_norm([*leaves, np.float32([np.nan])], ord=ord)))


def test_grouped_norm_gradient_is_finite_at_zero_and_right_elsewhere():
  grad = jax.jit(jax.value_and_grad(jaxclip.ops.global_norm))  # one compile for both trees
  zeros = [jnp.zeros((5,)), jnp.zeros((64,)), jnp.zeros((3, 3))]
  _, grads = grad(zeros)
  assert all(bool(jnp.all(g == 0)) for g in grads)
  tree = [jnp.arange(1.0, 6.0), jnp.full((64,), 0.5), jnp.ones((3, 3))]
  norm, grads = grad(tree)
  for g, x in zip(grads, tree, strict=True):
    np.testing.assert_allclose(g, x / norm, rtol=1e-6)


def _per_leaf_reference(leaves, clip_norm, axes=None):
  out = []
  for x in leaves:
    x64 = np.asarray(x, np.float64)
    norm = np.sqrt(np.sum(x64**2, axis=axes, keepdims=True))
    out.append(x64 * np.where(norm > clip_norm, clip_norm / np.where(norm > 0, norm, 1), 1.0))
  return out


def _rare_and_common_shapes():
  # Shapes with a few leaves each (one stack, rows at opaque indices); (5,)
  # leaves fill three stacks, the last overlapping the one before; (3,) leaves
  # fill five; (4,) leaves are enough for rows at constant offsets; 0-d leaves.
  # The counts follow the stacking constants (conftest's `stacks` fixture).
  rng = np.random.default_rng(1)
  stack, rows = _stacks._STACK, _stacks._STATIC_ROWS
  shapes = [(5,)] * (2 * stack + stack // 4) + [(3, 4)] * 7 + [(2, 3, 2)] * 3 + [(70,)] * 6
  shapes += [(8, 9)] * 5 + [(4,)] * (rows + 8) + [(n,) for n in range(90, 95)] * 2
  shapes += [(3,)] * (4 * stack + stack // 2) + [()] * 9
  return [rng.normal(size=s).astype(np.float32) * rng.choice([0.01, 1.0, 10.0]) for s in shapes]


def test_per_leaf_clip_of_rare_and_common_shapes_matches_leaf_by_leaf(stacks):
  leaves = _rare_and_common_shapes()
  counts = collections.Counter(x.shape for x in leaves)
  assert counts[(4,)] >= _stacks._STATIC_ROWS
  assert 2 * _stacks._STACK < counts[(5,)] < 3 * _stacks._STACK  # overlapping stacks
  assert 4 * _stacks._STACK <= counts[(3,)] < _stacks._STATIC_ROWS
  leaves[0][0] = np.nan  # the first leaf of a stack: only it turns NaN
  leaves[1][:] = 0.0
  got = jax.jit(lambda t: jaxclip.ops.clip_by_norm(t, 1.5))(leaves)
  want = _per_leaf_reference(leaves, 1.5)
  assert bool(jnp.all(jnp.isnan(got[0])))
  for g, w in zip(got[1:], want[1:], strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-6, atol=1e-7)
  ranked = [x for x in leaves[1:] if x.ndim]
  got = jax.jit(lambda t: jaxclip.ops.clip_by_norm(t, 1.5, axes=[0]))(ranked)
  for g, w in zip(got, _per_leaf_reference(ranked, 1.5, axes=0), strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-6, atol=1e-7)
  empty = [np.zeros((0,), np.float32)] * 3 + [np.zeros((2, 0), np.float32)] * 2
  got = jax.jit(lambda t: jaxclip.ops.clip_by_norm(t, 1.5, axes=[0]))(empty)
  assert [g.shape for g in got] == [x.shape for x in empty]


def test_per_leaf_clip_of_stacked_leaves_under_grad_and_vmap(stacks):
  common = {(5,), (3, 4), (4,)}
  leaves = [x for x in _rare_and_common_shapes() if x.shape in common][: 3 * _stacks._STACK + 8]
  loss = lambda t: sum(jnp.sum(jnp.sin(y)) for y in jaxclip.ops.clip_by_norm(t, 1.0))  # noqa: E731
  leaf_loss = lambda x: jnp.sum(jnp.sin(jaxclip.ops.clip_by_norm(x, 1.0)))  # noqa: E731
  grads = jax.jit(jax.grad(loss))(leaves)
  leaf_grad = jax.jit(jax.grad(leaf_loss))  # one leaf at a time: a compile per shape
  for g, x in zip(grads, leaves, strict=True):
    np.testing.assert_allclose(g, leaf_grad(x), rtol=1e-5, atol=1e-7)
  batch = [np.stack([x, 3 * x]) for x in leaves]
  got = jax.jit(jax.vmap(lambda t: jaxclip.ops.clip_by_norm(t, 1.0)))(batch)
  one = jax.jit(lambda x: jaxclip.ops.clip_by_norm(x, 1.0))
  for g, b in zip(got, batch, strict=True):
    for row in range(2):
      np.testing.assert_allclose(g[row], one(b[row]), rtol=1e-6)


def _distinct_fusions(compiled) -> int:
  """Fusion kernels that differ in more than names (what XLA:CPU compiles once each)."""
  text = compiled.as_text()
  bodies = {}
  for name, body in re.findall(r"^%?(\S+) \([^)]*\) -> [^{]*\{\n(.*?)\n\}", text, re.M | re.S):
    body = re.sub(r", metadata=\{[^}]*\}", "", body)
    bodies[name] = re.sub(r"%[\w.\-]+", "%", body)
  called = re.findall(r" fusion\(.*?calls=%?([\w.\-]+)", text)
  return len({bodies[c] for c in called if c in bodies})


@pytest.mark.hlo
def test_per_leaf_clip_of_many_shapes_compiles_one_kernel_per_shape_not_per_row():
  # 24 shapes of 20 leaves: rows at constant offsets would make about one
  # kernel per (shape, offset), 480 in all; opaque indices one per shape.
  tree = [np.full((4 + i % 24,), 0.1, np.float32) for i in range(480)]
  scale_only = helpers.compiled(jax.jit(lambda t: jax.tree.map(lambda x: x * 0.5, t)).lower(tree))
  clip = helpers.compiled(jax.jit(lambda t: jaxclip.ops.clip_by_norm(t, 1.0)).lower(tree))
  assert _distinct_fusions(scale_only) <= 24 + 2
  assert _distinct_fusions(clip) <= 4 * 24, _distinct_fusions(clip)
