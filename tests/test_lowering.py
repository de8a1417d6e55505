"""How the kernel lowers: per platform, under ``jax.grad`` and under ``jax.vmap``.

The XLA:CPU policy (``jaxclip._kernel._platform``) is chosen by the platform a
program is lowered for. The tests marked ``hlo`` read exported or compiled
program text and cost analyses; the others check values.
"""

from __future__ import annotations

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip._kernel import _numerics
from jaxclip._kernel._platform import _reduce, _segments, _stacks, _vectors
from tests import helpers

# Many small leaves of a few shapes (stacked on CPU) and one larger leaf.
_SHAPES = [(64,)] * 12 + [(8, 4), (4,), (3, 5)] * 6 + [(32, 32)]


def _tree(seed, dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(scale * rng.normal(size=s), dtype) for s in _SHAPES]


_PARAMS = _tree(100)


def _default_branch(*args, cpu, default):
  # What GPU and TPU run: the default branch of every platform choice.
  del cpu
  return default(*args)


def _naive_norm(x):
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(x * x))


def _naive_global_clip(tree, c):
  scale = jnp.minimum(1.0, c / jnp.sqrt(sum(_naive_norm(x) ** 2 for x in tree)))
  return [x * scale for x in tree]


# name -> (jaxclip's clip, the naive per-leaf math); both (tree, threshold).
CLIPS = {
  "ops.clip_by_norm": (
    lambda t, c: jaxclip.ops.clip_by_norm(t, c),
    lambda t, c: [x * jnp.minimum(1.0, c / _naive_norm(x)) for x in t],
  ),
  "ops.clip_by_average_norm": (
    lambda t, c: jaxclip.ops.clip_by_average_norm(t, c),
    lambda t, c: [x * jnp.minimum(1.0, c * x.size / _naive_norm(x)) for x in t],
  ),
  "ops.clip_by_global_norm": (
    lambda t, c: jaxclip.ops.clip_by_global_norm(t, c)[0],
    lambda t, c: _naive_global_clip(t, c),
  ),
  "ops.clip_by_value": (
    lambda t, c: jaxclip.ops.clip_by_value(t, -c, c),
    lambda t, c: [jnp.clip(x, -c, c) for x in t],
  ),
  "clip_by_norm": (
    lambda t, c: jaxclip.clip_by_norm(c).update(t, optax.EmptyState())[0],
    lambda t, c: [x * jnp.minimum(1.0, c / _naive_norm(x)) for x in t],
  ),
  "clip_by_block_rms": (
    lambda t, c: jaxclip.clip_by_block_rms(c).update(t, optax.EmptyState())[0],
    lambda t, c: [x / jnp.maximum(1.0, _naive_norm(x) / jnp.sqrt(x.size) / c) for x in t],
  ),
  "adaptive_grad_clip": (
    lambda t, c: jaxclip.adaptive_grad_clip(c).update(t, optax.EmptyState(), _PARAMS)[0],
    lambda t, c: optax.adaptive_grad_clip(c).update(t, optax.EmptyState(), _PARAMS)[0],
  ),
}
# Thresholds at which some leaves are clipped and others not.
THRESHOLD = {
  "ops.clip_by_norm": 4.0,
  "ops.clip_by_average_norm": 0.1,
  "ops.clip_by_global_norm": 20.0,
  "ops.clip_by_value": 1.5,
  "clip_by_norm": 4.0,
  "clip_by_block_rms": 0.9,
  "adaptive_grad_clip": 0.8,
}
_WEIGHTS = _tree(7)


def _loss(clip):
  """A scalar of the clipped tree, whose gradient reaches every entry."""

  def loss(tree, c):
    return sum(jnp.sum(y * w) for y, w in zip(clip(tree, c), _WEIGHTS, strict=True))

  return loss


def _cost(fn, *args):
  return _analysis(helpers.compiled(jax.jit(fn).lower(*args)))


def _analysis(compiled):
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  return analysis["flops"], analysis["bytes accessed"], compiled.as_text()


def _assert_close(actual, expected, rtol=2e-6, atol=2e-6):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol
    )


def test_clips_are_active_and_inactive_on_the_test_tree():
  tree = _tree(0)
  for name, (clip, _) in CLIPS.items():
    clipped = jax.jit(clip)(tree, jnp.float32(THRESHOLD[name]))
    changed = [bool(jnp.any(y != x)) for x, y in zip(tree, clipped, strict=True)]
    if name == "ops.clip_by_global_norm":
      assert all(changed), name
    else:
      assert any(changed) and not all(changed), (name, changed)


@functools.cache
def _lowered_grad(name, which):
  """The gradient (tree and threshold) of ``CLIPS[name][which]``'s loss, traced once: the
  values test and the cost test below share it."""
  fn = jax.jit(jax.grad(_loss(CLIPS[name][which]), argnums=(0, 1)))
  return fn.lower(_tree(0), jnp.float32(THRESHOLD[name]))


def _compiled_grad(name, which, as_users=False):
  """``_lowered_grad`` compiled with the suite's flags (values), or as users compile (costs)."""
  lowered = _lowered_grad(name, which)
  return helpers.compiled(lowered) if as_users else lowered.compile()


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_grad_matches_naive_math(name):
  tree, c = _tree(0), jnp.float32(THRESHOLD[name])
  ours = _compiled_grad(name, 0)(tree, c)
  ref = _compiled_grad(name, 1)(tree, c)
  _assert_close(ours, ref, rtol=1e-5, atol=1e-6)
  # The threshold's derivative is taken through the operands, not lost in a
  # closure: it is non-zero where the clip is active.
  assert float(ours[1]) != 0.0


@pytest.mark.hlo
@pytest.mark.parametrize("name", sorted(CLIPS))
def test_grad_costs_at_most_twice_the_naive_math(name, monkeypatch):
  # XLA's cost analysis counts every branch of a conditional. The overflow
  # rescue (a lax.cond branch taken only where a sum overflowed or lost
  # squares to subnormals) is counted apart: with it, at most 3.5x.
  flops, nbytes, _ = _analysis(_compiled_grad(name, 0, as_users=True))
  naive_flops, naive_bytes, _ = _analysis(_compiled_grad(name, 1, as_users=True))
  assert flops <= 3.5 * naive_flops, (flops, naive_flops)
  assert nbytes <= 3.5 * naive_bytes, (nbytes, naive_bytes)
  # Without it (a predicate that is constantly false: XLA drops the branch),
  # the step's own math costs at most twice the naive math.
  jax.clear_caches()
  # Patched in every module that reads it by name: the package (``_numerics.needs_rescaling``,
  # read by _reduction) and the rooms of ``_numerics/`` that call it (_rescue and its importers).
  never = lambda total, size: jnp.zeros_like(total, bool)
  readers = [
    module
    for name, module in sorted(sys.modules.items())
    if name.startswith("jaxclip.")
    and getattr(module, "needs_rescaling", None) is _numerics.needs_rescaling
  ]
  assert _numerics in readers and len(readers) > 1, readers
  for module in readers:
    monkeypatch.setattr(module, "needs_rescaling", never)
  try:
    fast = jax.jit(jax.grad(_loss(CLIPS[name][0]), argnums=(0, 1)))
    fast_flops, fast_bytes, _ = _analysis(
      helpers.compiled(fast.lower(_tree(0), jnp.float32(THRESHOLD[name])))
    )
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  if name != "ops.clip_by_value":  # a norm's rescue was counted above, and is not here
    assert fast_flops < flops, (fast_flops, flops)
  assert fast_flops <= 2 * naive_flops, (fast_flops, naive_flops)
  assert fast_bytes <= 2 * naive_bytes, (fast_bytes, naive_bytes)


def _batched(seed, batch=3):
  return [jnp.stack([x * (i + 1) for i in range(batch)]) for x in _tree(seed)]


@pytest.mark.hlo
@pytest.mark.parametrize("ord", [2, 1, np.inf])
def test_per_leaf_norms_differentiate_as_the_plain_per_leaf_math(ord):
  """The per-leaf norms behind record_norms and the adaptive clips (stacked rows)."""
  rng = np.random.default_rng(0)
  shapes = [(64,)] * 40 + [(8, 8)] * 10 + [(3,)] * 5 + [(2000,)]
  leaves = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
  w = jnp.asarray(rng.normal(size=len(leaves)), jnp.float32)
  ours = lambda xs: jnp.dot(w, jnp.stack(_numerics.leaf_norm_shares(xs, ord, jnp.float32)))
  share = {
    2: lambda x: jnp.sum(x * x),
    1: lambda x: jnp.sum(jnp.abs(x)),
    np.inf: lambda x: jnp.max(jnp.abs(x)),
  }[ord]
  plain = lambda xs: jnp.dot(w, jnp.stack([share(x) for x in xs]))
  np.testing.assert_allclose(ours(leaves), plain(leaves), rtol=1e-5)
  for a, b in zip(jax.grad(ours)(leaves), jax.grad(plain)(leaves), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  flops, nbytes, _ = _cost(jax.grad(ours), leaves)
  plain_flops, plain_bytes, _ = _cost(jax.grad(plain), leaves)
  assert flops <= 2 * plain_flops and nbytes <= 2 * plain_bytes, (flops, plain_flops)


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_vmap_matches_a_loop(name):
  clip, _ = CLIPS[name]
  batch, c = _batched(1), THRESHOLD[name]
  out = jax.jit(jax.vmap(lambda t: clip(t, c)))(batch)
  for i in range(3):
    _assert_close([y[i] for y in out], clip([x[i] for x in batch], c))


@pytest.mark.hlo
@pytest.mark.parametrize("name", sorted(CLIPS))
def test_vmap_compiles_to_no_gathers(name):
  clip, _ = CLIPS[name]
  _, _, text = _cost(jax.vmap(lambda t: clip(t, THRESHOLD[name])), _batched(1))
  assert not re.search(r"\bgather\(", text)


# ----------------------------------------------------------------------------
# Platforms
# ----------------------------------------------------------------------------


def _mixed_precision_tree():
  tree = _tree(2)
  return (
    [x.astype(jnp.bfloat16) for x in tree[:18]]
    + [x.astype(jnp.float16) for x in tree[18:30]]
    + tree[30:]
  )


_STEPS = {
  "clip_by_global_norm": jaxclip.clip_by_global_norm(1.0),
  "clip_by_norm": jaxclip.clip_by_norm(1.0),
  "clip_by_block_rms": jaxclip.clip_by_block_rms(0.5),
  "adaptive_grad_clip": jaxclip.adaptive_grad_clip(0.1),
  "skip_nonfinite(clip_by_norm)": jaxclip.skip_nonfinite(jaxclip.clip_by_norm(1.0)),
  # Per-leaf norms: stacked rows on CPU, one reduction per leaf elsewhere
  # (only vectors of norms are joined, so no concatenate check).
  "record_norms": jaxclip.record_norms(),
  "adagc": jaxclip.adagc(warmup_steps=1),
  "adaptive_value_clip": jaxclip.adaptive_value_clip(0.9),
  "adaptive_norm_scale": jaxclip.adaptive_norm_scale(),
}


def _exported_text(name, platform):
  tx = optax.chain(_STEPS[name], optax.adam(1e-3))
  params = _mixed_precision_tree()

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with jax.numpy_dtype_promotion("standard"):
    exported = jax.export.export(jax.jit(step), platforms=(platform,))(
      params, tx.init(params), params
    )
  return exported.mlir_module()


_PER_LEAF = ("clip_by_norm", "clip_by_block_rms", "adaptive_grad_clip")
# The per-tensor rules' small leaves are reduced by one segment reduction on CPU.
_SEGMENTED = ("adagc", "adaptive_value_clip", "adaptive_norm_scale")
_CPU_ONLY = (
  "stablehlo.optimization_barrier",
  "stablehlo.dynamic_slice",
  "stablehlo.slice",
  "stablehlo.scatter",
)


@pytest.mark.hlo
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", sorted(_STEPS))
def test_programs_for_gpu_and_tpu_carry_no_cpu_workaround(name, platform):
  text = _exported_text(name, platform)
  if name in _SEGMENTED:  # each leaf reads its entry of the state's vectors (LeafStats)
    n = len(jax.tree.leaves(_mixed_precision_tree()))
    entry = rf"stablehlo\.slice %\S+ \[\d+:\d+\] : \(tensor<{n}xf32>\) -> tensor<1xf32>"
    assert len(re.findall(entry, text)) >= n
    text = re.sub(entry, "", text)
  for op in _CPU_ONLY:
    assert op not in text, op
  if name in _PER_LEAF:  # no stacking either (only the grouped norms concatenate)
    assert "stablehlo.concatenate" not in text
  # The same step lowered for CPU does carry them: the check can fail.
  cpu_text = _exported_text(name, "cpu")
  assert "stablehlo.optimization_barrier" in cpu_text
  if name in _PER_LEAF:
    assert "stablehlo.concatenate" in cpu_text
  if name in _SEGMENTED:
    assert "stablehlo.scatter" in cpu_text


@pytest.mark.hlo
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_zero_nonfinite_counts_by_segment_on_cpu_only(platform):
  tree = _mixed_precision_tree()
  tx = jaxclip.zero_nonfinite()

  def text(p):
    exported = jax.export.export(jax.jit(tx.update), platforms=(p,))(tree, tx.init(tree))
    return exported.mlir_module()

  assert "stablehlo.scatter" not in text(platform)
  assert "stablehlo.scatter" in text("cpu")
  # Both count alike: NaN and inf entries in leaves of every dtype.
  bad = [x.at[..., 0].set(jnp.nan if i % 2 else jnp.inf) for i, x in enumerate(tree)]
  cpu = jax.jit(tx.update)(bad, tx.init(bad))[1].num_nonfinite_zeroed
  with pytest.MonkeyPatch.context() as m:
    m.setattr(jax.lax, "platform_dependent", _default_branch)
    default = jax.jit(tx.update)(bad, tx.init(bad))[1].num_nonfinite_zeroed
  expected = sum(int(np.prod(x.shape[:-1])) for x in tree)
  assert int(cpu) == int(default) == expected


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_the_path_of_other_platforms_computes_the_same(name, monkeypatch):
  # What GPU and TPU run (the default branch of every workaround), run here.
  clip, _ = CLIPS[name]
  tree, c = _mixed_precision_tree(), THRESHOLD[name]
  cpu = jax.jit(lambda t: clip(t, c))(tree)
  monkeypatch.setattr(jax.lax, "platform_dependent", _default_branch)
  default = jax.jit(lambda t: clip(t, c))(tree)
  for a, b in zip(default, cpu, strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(
      np.asarray(a, np.float32),
      np.asarray(b, np.float32),
      rtol=1e-2 if a.dtype != jnp.float32 else 1e-6,
      atol=1e-6,
    )


@pytest.mark.parametrize("op", ["sum", "max"])
def test_small_parts_reduces_each_array_in_one_segment_reduction(op):
  rng = np.random.default_rng(0)
  terms = tuple(
    jnp.asarray(np.abs(rng.normal(size=shape)), jnp.float32)
    for shape in [(3,), (1,), (4, 5), (65,), (2, 1, 3)]
  )
  plain = lambda ts: jnp.stack([_reduce.plain_reduce(t, op, None, False) for t in ts])
  parts = jax.jit(lambda ts: _segments.small_parts(ts, op))
  np.testing.assert_allclose(parts(terms), plain(terms), rtol=1e-6)
  assert "scatter" in parts.lower(terms).as_text()
  assert "stablehlo.reduce" not in parts.lower(terms).as_text()
  # Derivatives are the plain reductions': a gradient at 0 is finite.
  weights = jnp.arange(1.0, 6.0)
  grad = jax.grad(lambda ts: jnp.sum(_segments.small_parts(ts, op) * weights))
  reference = jax.grad(lambda ts: jnp.sum(plain(ts) * weights))(terms)
  for a, b in zip(grad(terms), reference, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  zeros = tuple(jnp.zeros_like(t) for t in terms)
  assert all(np.isfinite(g).all() for g in grad(zeros))


@pytest.mark.parametrize("k, b", [(5, 8), (8, 8), (9, 4), (200, 15)])
def test_entries_reads_every_entry_of_a_vector_at_opaque_indices(k, b):
  v = jnp.arange(k, dtype=jnp.float32) * 1.5 - 7.0

  @jax.jit
  def read(v):
    return jnp.stack(_vectors.entries(v, _stacks.opaque_indices(b, v)))

  np.testing.assert_array_equal(read(v), v)
  # Differentiable at the cost of the plain math: the tangent is the identity.
  np.testing.assert_array_equal(jax.grad(lambda v: jnp.sum(read(v) * v))(v), 2 * v)
  # Every value read as it is, in a vector of rows (k > b) too: NaN, infinities, -0.0.
  odd = v.at[0].set(jnp.nan).at[k - 1].set(-jnp.inf).at[k // 2].set(-0.0)
  np.testing.assert_array_equal(read(odd), odd)
  assert np.signbit(read(odd)[k // 2])


def test_map_leaves_on_vectors_gives_each_leaf_its_own_scalars():
  """The vector path (one multi-output kernel per leaf) returns the per-leaf values as they are."""
  k = 520  # past one block of opaque indices
  a = (jnp.arange(k, dtype=jnp.float32) - 300.0).at[3].set(jnp.nan).at[4].set(-0.0)
  a = a.at[5].set(jnp.inf).at[6].set(-jnp.inf)
  b = jnp.arange(k, dtype=jnp.int32) - 7

  def fn(x, y, s):
    return (x * s, (y + 1, -x)), (x + s, y * 2)

  @functools.partial(jax.jit, static_argnums=2)
  def run(a, b, vectors):
    columns = [a, b] if vectors else [list(a), list(b)]
    return _vectors.map_leaves(fn, columns, (jnp.float32(2.0),), vectors=vectors)

  for vectors in (True, False):
    out, (plus, twice) = run(a, b, vectors)
    assert len(out) == k
    for j, (c, (i, n)) in enumerate(out):
      (want_c, (want_i, want_n)), _ = fn(a[j], b[j], jnp.float32(2.0))
      assert c.dtype == jnp.float32 and i.dtype == jnp.int32 and n.dtype == jnp.float32
      np.testing.assert_array_equal(c, want_c)
      np.testing.assert_array_equal(i, want_i)
      np.testing.assert_array_equal(n, want_n)
      assert np.signbit(n) == np.signbit(want_n)
    # the second output comes as vectors of every leaf's entries
    assert plus.shape == (k,) and plus.dtype == jnp.float32 and twice.dtype == jnp.int32
    np.testing.assert_array_equal(plus, a + 2.0)
    np.testing.assert_array_equal(twice, b * 2)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_share_vector_takes_the_small_leaves_terms_in_one_kernel(op):
  """Every leaf's share, the small leaves' terms joined: the old per-leaf terms' sums, bit for bit.

  Terms taken leaf by leaf before they are joined make XLA:CPU compute each
  leaf's terms in a kernel of its own: thousands of kernels to compile for a
  tree of thousands of small leaves.
  """
  rng = np.random.default_rng(1)
  shapes = [(64 + i % 7,) if i % 2 else (8, 3 + i % 4) for i in range(60)]
  leaves = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
  leaves += [
    jnp.asarray(rng.normal(size=(5, 7)), jnp.bfloat16),
    jnp.asarray(rng.normal(size=(9,)), jnp.float16),
    jnp.asarray(rng.normal(size=(3,)) + 1j * rng.normal(size=(3,)), jnp.complex64),
    jnp.asarray(rng.normal(size=(2000,)), jnp.float32),  # large: reduced alone
    jnp.zeros((0, 3), jnp.float32),  # empty: its share is 0
    jnp.asarray(2.5, jnp.float32),
  ]
  term = _numerics.abs_sq if op == "sum" else _numerics.safe_abs
  vector = jax.jit(lambda xs: _segments.share_vector(xs, term, op, jnp.float32))
  plain = jnp.stack([_reduce.share(x, term, op).astype(jnp.float32) for x in leaves])
  np.testing.assert_allclose(vector(leaves), plain, rtol=1e-6)
  # The same segment reduction of the same terms as when each leaf's were taken alone.
  segmentable = _segments.segmentable
  per_leaf = tuple(
    term(x).astype(jnp.float32)
    if segmentable(x)
    else jnp.reshape(_reduce.share(x, term, op).astype(jnp.float32), (1,))
    for x in leaves
  )
  np.testing.assert_array_equal(
    vector(leaves), jax.jit(_segments.small_parts, static_argnums=1)(per_leaf, op)
  )
  hlo = vector.lower(leaves).compile().as_text()
  assert hlo.count(" fusion(") < 20, hlo.count(" fusion(")
  # Derivatives are the plain shares': finite at zero.
  weights = jnp.arange(1.0, len(leaves) + 1.0)
  grad = jax.grad(lambda xs: jnp.sum(vector(xs) * weights))
  reference = jax.grad(
    lambda xs: jnp.sum(jnp.stack([_reduce.share(x, term, op) for x in xs]) * weights)
  )(leaves)
  for a, b in zip(grad(leaves), reference, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6)
  zeros = [jnp.zeros_like(x) for x in leaves]
  assert all(np.isfinite(np.asarray(g, np.complex64)).all() for g in grad(zeros))
