"""The benchmark package runs, the clip stays fused, and grouped norms stay exact."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from benchmarks import _cases, _main, _model, _peers, _trees, ghost, tricks
from jaxclip._kernel import _numerics

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


def test_benchmark_quick_run_writes_table_and_plot(tmp_path):
  # The full train step runs alone in the next test (--only), so skipped here (--skip).
  text = _main.main(["--quick", "--skip", "full-step", "--out", str(tmp_path)])
  written = (tmp_path / "results.md").read_text()
  assert written.strip() == text.strip()
  assert "## Full train step" not in text
  for section in (
    "## Train step",
    "## Standalone jitted clip",
    "## Compile time",
    "## Compile time (s) of every other transform",
    "## Standalone clip against the tree size",
    "load average",
    "x floor",
  ):
    assert section in text
  for transform in _cases.TRANSFORMS:
    assert f"| {transform} | 10 |" in text
  assert "jaxclip.clip_by_global_norm + adam" in text
  png = (tmp_path / "results.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_full_train_step_alone_in_quick_mode(tmp_path):
  text = _main.main(["--quick", "--only", "full-step", "--out", str(tmp_path)])
  assert "## Full train step: forward + backward + clip + adam" in text
  for section in ("## Train step", "## Standalone jitted clip", "## Compile time"):
    assert section not in text
  cfg = _model.QUICK
  leaves = len(_model.param_shapes(cfg))
  assert f"{_model.num_params(cfg):,} float32 params in {leaves} leaves" in text
  rows = {}
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells[0] in _cases.FULL_STEP_CASES:
      rows[cells[0]] = cells
  assert list(rows) == list(_cases.FULL_STEP_CASES)
  for case, (_, ms, x_adam, iqr, x_optax, temp_mb, _) in rows.items():
    low, high = map(float, iqr.split("-"))
    assert float(ms) > 0 and float(x_adam) > 0 and 0 < low <= high and float(temp_mb) >= 0, case
    assert (x_optax != "n/a") == case.startswith("jaxclip"), case
  # Both clips compute the same update, so the same loss after the same steps.
  jc, ox = rows["jaxclip.clip_by_global_norm + adam"], rows["optax.clip_by_global_norm + adam"]
  assert jc[-1] == ox[-1]
  assert (tmp_path / "results.md").read_text().strip() == text.strip()


def test_full_train_step_model_is_about_20m_params():
  assert 19e6 < _model.num_params(_model.FULL) < 22e6
  cfg = _model.QUICK
  params = _model.init_params(cfg)
  assert {k: v.shape for k, v in params.items()} == _model.param_shapes(cfg)
  loss = _model.loss_fn(params, _model.make_tokens(cfg), cfg)
  # At initialisation the predictions are nearly uniform over the vocabulary.
  assert abs(float(loss) - math.log(cfg.vocab)) < 0.5


def test_ghost_benchmark_quick_run_writes_table_and_plot(tmp_path):
  # In a fresh process, as `python -m benchmarks.ghost` runs: it is compile-bound, and
  # XLA compiles about twice as fast without its backend optimisations.
  root = Path(__file__).resolve().parents[1]
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
    "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
  }
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.ghost", "--quick", "--out", str(tmp_path)],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  text = (tmp_path / "ghost.md").read_text()
  assert "- machine: " in text and f"jax {jax.__version__}" in text
  lines = [line for line in text.splitlines() if line.startswith("| ")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  assert header == ghost.HEADER
  rows = [
    dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
    for line in lines[1:]
  ]
  assert [(int(r["B"]), int(r["T"])) for r in rows] == [
    (b, t) for t in ghost.QUICK_SEQ_LENS for b in ghost.QUICK_BATCHES
  ]
  has_ghost = ghost.ghost_available()
  for r in rows:
    numeric = [
      "B x P x 4 MiB",
      "grad MiB",
      "vmap MiB",
      "grad ms",
      "vmap ms",
      "vmap/grad mem",
      "vmap/grad time",
    ]
    ghost_cols = [c for c in header if "ghost" in c]
    if has_ghost:
      numeric += ghost_cols
    else:
      assert all(r[c] == "n/a" for c in ghost_cols), r
    for c in numeric:
      assert float(r[c]) >= 0 and (float(r[c]) > 0 or "MiB" in c), (c, r)
    assert float(r["vmap ms"]) > 0 and float(r["vmap MiB"]) > 0, r
  # The default clip, the median norm of a sample, clips some of the examples.
  clipped = re.findall(r"examples clipped.*?(\d+) of (\d+)", text)
  assert len(clipped) == len(rows) and any(0 < int(k) < int(n) for k, n in clipped), clipped
  if has_ghost:  # ghost and vmap clip the same examples to the same sum
    assert "ghost's clipped sum differs from vmap's" in text
  png = (tmp_path / "ghost.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_ghost_benchmark_memory_only_redraws_the_figure_and_times_nothing(tmp_path):
  # ghost.png plots compiled memory, which compiling alone gives: --memory-only redraws it
  # (and its record) without touching ghost.md's timed table.
  ghost.main(["--quick", "--memory-only", "--batch", "2", "--seq", "4", "--out", str(tmp_path)])
  assert not (tmp_path / "ghost.md").exists()
  text = (tmp_path / "ghost_memory.md").read_text()
  lines = [line for line in text.splitlines() if line.startswith("| ")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
  assert [row[:2] for row in rows] == [["2", "4"]]
  for row in rows:
    cells = dict(zip(header, row, strict=True))
    assert all(cells[f"{m} ms"] == "not run" for m in ghost.METHODS), cells
    assert all(float(cells[f"{m} MiB"]) >= 0 for m in ghost.METHODS), cells
    assert float(cells["vmap MiB"]) > 0, cells
  assert "memory only" in text
  png = (tmp_path / "ghost.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  record = json.loads((tmp_path / "ghost.png.json").read_text())
  assert record["command"] == (
    f"python -m benchmarks.ghost --quick --memory-only --batch 2 --seq 4 --out {tmp_path}"
  )


def test_ghost_benchmark_model_is_a_tied_gpt_of_about_085m_params():
  assert 0.8e6 < _model.num_params(_model.GPTConfig(seq_len=128, tied=True, **ghost.MODEL)) < 0.9e6
  cfg = _model.GPTConfig(seq_len=8, batch=3, tied=True, **ghost.QUICK_MODEL)
  params = _model.init_params(cfg)
  assert "head.kernel" not in params and set(params) == set(_model.param_shapes(cfg))
  tokens = _model.make_tokens(cfg)
  # The loss of one sequence is a per-example loss: their mean is the batch's loss.
  loss = jax.jit(_model.loss_fn, static_argnums=2)
  per_example = jax.jit(jax.vmap(loss, (None, 0, None)), static_argnums=2)(params, tokens, cfg)
  np.testing.assert_allclose(per_example.mean(), loss(params, tokens, cfg), rtol=1e-5)
  assert abs(float(per_example.mean()) - math.log(cfg.vocab)) < 0.5
  # The tied head: the token embedding gets gradient from the output layer too.
  grad = jax.jit(jax.grad(loss), static_argnums=2)(params, tokens[0], cfg)["wte"]
  unused = np.setdiff1d(np.arange(cfg.vocab), np.asarray(tokens[0, :-1]))
  assert np.all(np.abs(np.asarray(grad)[unused]).sum(axis=1) > 0)


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
  params = _trees.make_tree(_SHAPES)
  compiled, _ = _cases.compile_train_step(optax.chain(clip(), optax.adam(1e-3)), params, params)
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < _SMALLEST_WEIGHT // 8, (
    f"the compiled clip+adam step allocates {temp} temporary bytes: the clip is no longer "
    "fused into adam's update (a clipped copy of the gradients is materialised)"
  )


@pytest.mark.hlo
def test_memory_analysis_does_see_a_materialised_clip():
  # The check above can fail: optax 0.2's clip_by_global_norm materialises the
  # clipped gradients before adam, and the same measurement shows it.
  params = _trees.make_tree(_SHAPES)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  compiled, _ = _cases.compile_train_step(tx, params, params)
  assert compiled.memory_analysis().temp_size_in_bytes >= _SMALLEST_WEIGHT


@pytest.mark.hlo
def test_standalone_donated_clip_is_in_place():
  tree = _trees.make_tree(_SHAPES)
  tx = jaxclip.clip_by_global_norm(1.0)
  state = tx.init(tree)
  compiled = jax.jit(lambda t: tx.update(t, state)[0], donate_argnums=0).lower(tree).compile()
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
  # the two-output reduction (see _numerics._reduction_input and _reduce).
  tree = jax.tree.map(lambda x: x.astype(dtype), _trees.make_tree(_SHAPES))
  tx = clip()
  state = tx.init(tree)
  compiled = jax.jit(lambda t: tx.update(t, state)[0], donate_argnums=0).lower(tree).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < _SMALLEST_WEIGHT // 8


def _half_step_temp(tx, dtype):
  params = jax.tree.map(lambda x: x.astype(dtype), _trees.make_tree(_SHAPES))
  compiled, _ = _cases.compile_train_step(tx, params, params)
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
  assert temp <= control + 4096, (temp, control)
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
  tree = _trees.make_tree(_trees.many_leaf_shapes(256, mixed))
  scale_only = jax.jit(lambda t: jax.tree.map(lambda x: x * 0.5, t)).lower(tree).compile()
  tx = jaxclip.clip_by_global_norm(1.0)
  clip = jax.jit(lambda t: tx.update(t, tx.init(t))[0]).lower(tree).compile()
  count = lambda c: c.as_text().count(" fusion(")  # noqa: E731
  assert count(clip) <= count(scale_only) + 256 // 8, (count(clip), count(scale_only))


@pytest.mark.hlo
@pytest.mark.parametrize("mixed", [False, True], ids=["uniform", "mixed"])
def test_adaptive_grad_clip_of_many_leaves_compiles_to_a_few_kernels_per_leaf(mixed):
  # Leaf by leaf, adaptive_grad_clip made six to eight fusions per leaf (two
  # norms, the bound, the clip) and took 100 s to compile 5,000 leaves.
  shapes = _trees.many_leaf_shapes(256, mixed)
  g, p = _trees.make_tree(shapes), _trees.make_tree(shapes, seed=1)
  product = jax.jit(lambda g, p: jax.tree.map(jnp.multiply, g, p)).lower(g, p).compile()
  tx = jaxclip.adaptive_grad_clip(0.01)
  agc = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0]).lower(g, p).compile()
  count = lambda c: c.as_text().count(" fusion(")  # noqa: E731
  assert count(agc) <= 2.5 * count(product), (count(agc), count(product))
  # Its factor, computed once per stack, and not again in each row's kernel:
  # beside clip_by_norm on the same tree, only the params' inputs and stacks
  # are extra. A factor ending in a select made 2.1x clip_by_norm's program.
  clip = jaxclip.clip_by_norm(1.0)
  by_norm = jax.jit(lambda g: clip.update(g, clip.init(g))[0]).lower(g).compile()
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
  zeros = [jnp.zeros((5,)), jnp.zeros((64,)), jnp.zeros((3, 3))]
  grads = jax.grad(lambda t: jaxclip.ops.global_norm(t))(zeros)
  assert all(bool(jnp.all(g == 0)) for g in grads)
  tree = [jnp.arange(1.0, 6.0), jnp.full((64,), 0.5), jnp.ones((3, 3))]
  grads = jax.grad(lambda t: jaxclip.ops.global_norm(t))(tree)
  norm = jaxclip.ops.global_norm(tree)
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
  rng = np.random.default_rng(1)
  shapes = [(5,)] * 140 + [(3, 4)] * 7 + [(2, 3, 2)] * 3 + [(70,)] * 6 + [(8, 9)] * 5 + [(4,)] * 520
  shapes += [(n,) for n in range(90, 95)] * 2 + [(3,)] * 300 + [()] * 9
  return [rng.normal(size=s).astype(np.float32) * rng.choice([0.01, 1.0, 10.0]) for s in shapes]


def test_per_leaf_clip_of_rare_and_common_shapes_matches_leaf_by_leaf():
  leaves = _rare_and_common_shapes()
  counts = collections.Counter(x.shape for x in leaves)
  assert counts[(4,)] >= _numerics._STATIC_ROWS
  assert 2 * _numerics._STACK < counts[(5,)] < 3 * _numerics._STACK  # overlapping stacks
  assert 4 * _numerics._STACK <= counts[(3,)] < _numerics._STATIC_ROWS
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


def test_per_leaf_clip_of_stacked_leaves_under_grad_and_vmap():
  leaves = [x for x in _rare_and_common_shapes() if x.shape in {(5,), (3, 4), (4,)}][:200]
  loss = lambda t: sum(jnp.sum(jnp.sin(y)) for y in jaxclip.ops.clip_by_norm(t, 1.0))  # noqa: E731
  leaf_loss = lambda x: jnp.sum(jnp.sin(jaxclip.ops.clip_by_norm(x, 1.0)))  # noqa: E731
  grads = jax.jit(jax.grad(loss))(leaves)
  for g, x in zip(grads, leaves, strict=True):
    np.testing.assert_allclose(g, jax.grad(leaf_loss)(x), rtol=1e-5, atol=1e-7)
  batch = [np.stack([x, 3 * x]) for x in leaves]
  got = jax.jit(jax.vmap(lambda t: jaxclip.ops.clip_by_norm(t, 1.0)))(batch)
  for g, b in zip(got, batch, strict=True):
    for row in range(2):
      np.testing.assert_allclose(g[row], jaxclip.ops.clip_by_norm(b[row], 1.0), rtol=1e-6)


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
  scale_only = jax.jit(lambda t: jax.tree.map(lambda x: x * 0.5, t)).lower(tree).compile()
  clip = jax.jit(lambda t: jaxclip.ops.clip_by_norm(t, 1.0)).lower(tree).compile()
  assert _distinct_fusions(scale_only) <= 24 + 2
  assert _distinct_fusions(clip) <= 4 * 24, _distinct_fusions(clip)


def _probe_tree(n: int, shape: tuple[int, ...], dtype=jnp.float32) -> dict:
  return {
    f"p{i}": jnp.linspace(-2.0, 2.0, math.prod(shape)).reshape(shape).astype(dtype) * (i + 1)
    for i in range(n)
  }


# A small program for each trick of benchmarks/tricks.py that the trick changes.
_TRICK_PROBES = {
  "bf16_barrier": lambda: (jaxclip.clip_by_global_norm(1.0), _probe_tree(1, (8, 8), jnp.bfloat16)),
  "f16_two_output": lambda: (jaxclip.clip_by_global_norm(1.0), _probe_tree(1, (8, 8), jnp.float16)),
  "stacked_scales": lambda: (jaxclip.clip_by_norm(1.0), _probe_tree(3, (4,))),
  "opaque_indices": lambda: (jaxclip.clip_by_norm(1.0), _probe_tree(3, (4,))),
  "grouped_parts": lambda: (jaxclip.clip_by_global_norm(1.0), _probe_tree(3, (4,))),
  "stacked_rules": lambda: (jaxclip.adagc(), _probe_tree(3, (4,))),
  "segment_parts": lambda: (jaxclip.adaptive_value_clip(), _probe_tree(3, (4,))),
  "computed_once": lambda: (jaxclip.skip_nonfinite(optax.sgd(0.1)), _probe_tree(3, (4,))),
}


def test_every_trick_has_a_probe():
  assert set(tricks.SWITCHES) == set(tricks.ROWS) <= set(_TRICK_PROBES)


@pytest.mark.parametrize("trick", sorted(tricks.SWITCHES))
def test_each_trick_switch_changes_the_cpu_program_and_keeps_its_values(trick):
  # A switch that changed nothing would price its trick at 1.0x and delete it.
  tx, tree = _TRICK_PROBES[trick]()
  state = tx.init(tree)

  def program():
    tricks._clear()
    fn = jax.jit(lambda u, s: tx.update(u, s, tree))
    return fn.lower(tree, state).as_text(), fn(tree, state)

  with_text, with_out = program()
  with tricks.SWITCHES[trick]():
    without_text, without_out = program()
  assert with_text != without_text, trick
  for a, b in zip(jax.tree.leaves(with_out), jax.tree.leaves(without_out), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2)


def _import_without(*missing):
  def import_module(name):
    if name in missing:
      raise ModuleNotFoundError(f"No module named {name!r}")
    return types.SimpleNamespace(__version__="9.9")

  return import_module


def test_peers_availability_names_the_extra_of_a_missing_peer():
  have = _peers.availability(_import_without("opacus"))
  assert have["jax_privacy"] == ("jax_privacy 9.9", None)
  version, why = have["Opacus"]
  assert version is None and "`opacus`" in why and "`peers` extra" in why and _peers.INSTALL in why
  assert _peers.availability(_import_without("torch"))["Opacus"][1].count("`torch`") == 1
  # The install line is the extra's, and the extra is not the test extra.
  assert 'pip install -e ".[peers]" torch==2.13.0' in _peers.INSTALL
  extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
    "project"
  ]["optional-dependencies"]
  assert {"torch", "opacus", "jax-privacy"} <= {re.split("[<>=]", r)[0] for r in extras["peers"]}
  assert not any(r.startswith(("torch", "opacus", "jaxclip[peers")) for r in extras["test"])


def test_peers_run_without_torch_writes_the_table_and_names_the_extra(
  tmp_path, monkeypatch, capsys
):
  # `--peers` with Opacus missing: its rows read "not installed" and the note names the extra.
  # The measurement is replaced (a real run compiles for minutes); the rows, the ratios, the
  # notes and the file are the benchmark's own code.
  have = _peers.availability(_import_without("torch", "opacus"))
  monkeypatch.setattr(_peers, "availability", lambda: have)
  monkeypatch.setattr(_peers, "pin_one_thread", lambda with_torch: f"pinned (torch {with_torch})")
  secs = {"jax grad": [0.10, 0.20, 0.30], "jaxclip ghost": [0.12, 0.26, 0.33]}
  cpus = {"jax grad": [0.10, 0.10, 0.10], "jaxclip ghost": [0.11, 0.11, 0.12]}

  def run(batches, seq_lens, model, clip, reps, probes):
    assert (batches, seq_lens, reps) == ([3], [5], 3)
    rows = _peers.new_rows(3, 5, _peers.availability())
    for key, r in rows.items():
      if r["status"] == "ok":
        r.update(secs=secs.get(key, [0.2, 0.4, 0.6]), cpus=cpus.get(key, [0.2, 0.2, 0.2]))
        r.update(thread=0.99, peak_mb=8.0)
        r.update(
          temp_mb=4.0 if key == "jax grad" else 5.0, check=None if key == "jax grad" else 1e-7
        )
        r["check_ref"] = "jaxclip vmap"
    _peers.add_ratios(rows)
    return list(rows.values())

  monkeypatch.setattr(_peers, "run", run)
  argv = ["--peers", "--batch", "3", "--seq", "5", "--reps", "3", "--out", str(tmp_path)]
  text = ghost.main(argv)
  assert "`peers` extra" in capsys.readouterr().err
  assert (tmp_path / "ghost_peers.md").read_text().strip() == text.strip()
  assert "- threads: pinned (torch False)" in text and "shared with other jobs" in text
  tables = [[]]
  for line in text.splitlines():
    if line.startswith("| "):
      tables[-1].append([c.strip() for c in line.strip("|").split("|")])
    elif tables[-1] and not line.startswith("|---"):
      tables.append([])
  cpu_x, wall_x, peak_x, every = tables[:4]
  assert cpu_x[0][:2] == ["B", "T"] and len(cpu_x[0]) == 2 + len(_peers.SUMMARY)
  cpu, wall = (dict(zip(t[0], t[1], strict=True)) for t in (cpu_x, wall_x))
  # Paired wall ratios 1.2, 1.3, 1.1: the median, not the ratio of the medians (1.3 / 0.2).
  assert wall['jaxclip method="ghost"'] == "1.20" and wall['jaxclip method="vmap"'] == "2.00"
  assert cpu['jaxclip method="ghost"'] == "1.10" and cpu['jaxclip method="vmap"'] == "2.00"
  assert cpu["Opacus ghost"] == wall["Opacus hooks"] == "not installed"
  assert dict(zip(peak_x[0], peak_x[1], strict=True))["jax_privacy clipped_grad"] == "1.00"
  assert every[0] == _peers.HEADER and len(every) == 1 + len(_peers.CASES)
  rows = {(r[2], r[3]): dict(zip(every[0], r, strict=True)) for r in every[1:]}
  ghost_row = rows[("jaxclip", 'method="ghost"')]
  assert ghost_row["x own wall (IQR)"] == "1.20 (1.15-1.25)" and ghost_row["x own temp"] == "1.25"
  assert ghost_row["wall ms"] == "260.0" and ghost_row["CPU ms"] == "110.0"
  assert ghost_row["busiest thread"] == "99%"
  opacus = [r for (fw, _), r in rows.items() if fw in ("torch", "Opacus")]
  assert len(opacus) == 4 and all(r["CPU ms"] == "not installed" for r in opacus)
  notes = text.split("## Cases not run")[1]
  assert notes.count("`peers` extra") == 4 and _peers.INSTALL in notes
