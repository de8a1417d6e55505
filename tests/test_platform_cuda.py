"""The CUDA global norm (jaxclip/_kernel/_platform/_cuda.py): values, derivatives, staging.

The kernel's program runs here in Pallas' interpreter (any backend); the
tests marked ``gpu`` run it compiled where a CUDA device is present. The
staging tests export for ``cuda`` from this process, as a process with a
CUDA backend would stage it (``cuda_in_process`` patched).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxclip
from jaxclip._kernel import _platform
from jaxclip._kernel._platform import _cuda

TRITON = "__gpu$xla.gpu.triton"
SHAPES = [(7,), (1000, 3), (2049,), (5, 5), (40_000,), (0,), (3, 0)]
HAS_CUDA = _platform.cuda_in_process()


def _leaves(seed, dtype=jnp.float32, scale=1.0, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(scale * rng.standard_normal(s)).astype(dtype) for s in shapes]


def _reference(leaves):
  total = sum(float(np.sum(np.asarray(x.astype(jnp.float32), np.float64) ** 2)) for x in leaves)
  return math.sqrt(total)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1e30, 1e-30])
def test_interpreted_kernel_matches_float64(dtype, scale):
  leaves = _leaves(int(scale < 1) + 2, dtype, scale)
  got, want = float(_cuda.cuda_norm(leaves, True)), _reference(leaves)
  assert want > 0
  # float32 squares overflow at 1e30 and underflow at 1e-30: the scaled sums do neither.
  assert abs(got - want) <= 1e-6 * want, (got, want)


def test_interpreted_kernel_zero_inf_nan():
  zeros = [jnp.zeros(s, jnp.float32) for s in SHAPES]
  assert float(_cuda.cuda_norm(zeros, True)) == 0.0
  leaves = _leaves(3)
  leaves[1] = leaves[1].at[3, 1].set(jnp.inf)
  assert float(_cuda.cuda_norm(leaves, True)) == math.inf
  leaves[4] = leaves[4].at[17].set(jnp.nan)
  assert math.isnan(float(_cuda.cuda_norm(leaves, True)))
  assert float(_cuda.cuda_norm([jnp.zeros((0,))], True)) == 0.0
  big = [jnp.full((16,), 3e38, jnp.float32)]  # the norm, 1.2e39, is beyond float32
  assert float(_cuda.cuda_norm(big, True)) == float(jaxclip.ops.global_norm(big))
  assert float(_cuda.cuda_norm(big, True)) == float(jnp.finfo(jnp.float32).max)


def test_interpreted_kernel_gradients_are_the_plain_norms():
  leaves = _leaves(4)
  got = jax.grad(lambda ls: _cuda.cuda_norm(ls, True))(leaves)
  want = jax.grad(jaxclip.ops.global_norm)(leaves)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-9)
  at_zero = jax.grad(lambda ls: _cuda.cuda_norm(ls, True))([jnp.zeros(s) for s in SHAPES])
  assert all(bool(jnp.all(g == 0)) for g in at_zero)


def test_interpreted_kernel_under_vmap():
  rng = np.random.default_rng(5)
  batch = [jnp.asarray(rng.standard_normal((3, *s)), jnp.float32) for s in SHAPES]
  got = jax.vmap(lambda ls: _cuda.cuda_norm(ls, True))(batch)
  want = [_reference([b[i] for b in batch]) for i in range(3)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_small_leaves_share_one_branch():
  leaves = _leaves(6, jnp.bfloat16)
  inputs = _cuda.kernel_inputs(leaves)
  big = [x for x in leaves if x.size >= _cuda.PACK_BELOW]
  assert len(big) == 1 and len(inputs) == 2  # (40_000,), then (7,), (1000, 3), (2049,), (5, 5)
  assert inputs[0].dtype == jnp.bfloat16 and inputs[1].dtype == jnp.float32
  assert inputs[1].size == sum(x.size for x in leaves if 0 < x.size < _cuda.PACK_BELOW)
  assert float(_cuda.cuda_norm(leaves, True)) == pytest.approx(_reference(leaves), rel=1e-6)


def test_applies_only_where_measured():
  f32 = [jnp.zeros((4, 4)), jnp.zeros((3,))]
  assert _cuda.cuda_norm_applies(f32)
  assert _cuda.cuda_norm_applies([jnp.zeros((4,), jnp.bfloat16), jnp.zeros((0,))])
  assert not _cuda.cuda_norm_applies([jnp.zeros((4,), jnp.float16)])  # not measured
  assert not _cuda.cuda_norm_applies([jnp.zeros((0,))])  # nothing to read
  too_many = [jnp.zeros((2,))] * (_cuda.MAX_LEAVES + 1)  # one branch per leaf
  assert not _cuda.cuda_norm_applies(too_many)
  assert _cuda.tile_table([5, 1024 * 32 + 1, 1024]) == [(0, 1, 1), (1, 2, 32), (3, 1, 1)]


def _exported(fn, tree, platforms):
  checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
  run = lambda: export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(tree)  # noqa: E731
  try:
    return run()
  except RuntimeError as e:  # jax >= 0.12 lowers Triton for a GPU it is told of when none is here
    if "abstract GPU device" not in str(e):
      raise
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    return run()


def _region_of(text: str, needle: str) -> str:
  """The innermost ``{...}`` region of the MLIR ``text`` around ``needle`` (strings blanked)."""
  text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text.replace(f"@{needle}", "@KERNEL"))
  p = text.index("@KERNEL")
  depth, start = 0, p
  while depth >= 0:
    start -= 1
    depth += {"}": 1, "{": -1}.get(text[start], 0)
  depth, end = 0, p
  while depth >= 0:
    end += 1
    depth += {"{": 1, "}": -1}.get(text[end], 0)
  return text[start : end + 1]


@pytest.fixture
def staged_for_cuda(monkeypatch):
  """This process stages the CUDA choices, as one with a CUDA backend does."""
  monkeypatch.setattr(_platform, "cuda_in_process", lambda: True)


@pytest.mark.hlo
@pytest.mark.usefixtures("staged_for_cuda")
def test_cuda_lowering_has_the_kernel_and_no_conditional():
  tree = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,), jnp.bfloat16)}
  cuda = _exported(jaxclip.ops.global_norm, tree, ("cuda",)).mlir_module()
  assert TRITON in cuda
  branch = _region_of(cuda, TRITON)  # the cuda branch of platform_dependent's choice
  assert "@KERNEL" in branch and "stablehlo.reduce" in branch
  assert not re.search(r"stablehlo\.(case|if|while)", branch)  # no rescue conditional
  clip = jaxclip.clip_by_global_norm(1.0)
  step = lambda t: clip.update(t, clip.init(t))[0]  # noqa: E731
  assert TRITON in _exported(step, tree, ("cuda",)).mlir_module()
  # Not measured: float16 leaves, a 1-norm, ROCm.
  f16 = {"w": jnp.zeros((64, 32), jnp.float16)}
  assert TRITON not in _exported(jaxclip.ops.global_norm, f16, ("cuda",)).mlir_module()
  one = lambda t: jaxclip.ops.global_norm(t, ord=1)  # noqa: E731
  assert TRITON not in _exported(one, tree, ("cuda",)).mlir_module()
  assert TRITON not in _exported(jaxclip.ops.global_norm, tree, ("rocm",)).mlir_module()


def _kernel_operands(text: str) -> int:
  return re.search(rf"custom_call @{re.escape(TRITON)}\(([^)]*)\)", text).group(1).count("%")


@pytest.mark.hlo
@pytest.mark.usefixtures("staged_for_cuda")
@pytest.mark.skipif(not _cuda._has_triton_pallas(), reason="Pallas' Triton backend")
@pytest.mark.parametrize("trick", ["cuda_norm", "cuda_packing"])
def test_a_cuda_trick_switched_off_changes_the_cuda_program(trick):
  # jaxclip.platform.without, as benchmarks/gpu_norm.py measures each trick; a fresh function
  # each time (jax.jit caches a function's trace), no cache cleared.
  tree = {"w": jnp.zeros((40_000,)), "b": jnp.zeros((32,)), "g": jnp.zeros((7,), jnp.bfloat16)}

  def cuda():  # the program's text, without its source locations
    text = _exported(lambda t: jaxclip.ops.global_norm(t), tree, ("cuda",)).mlir_module()
    return re.sub(r"^#loc.*$| loc\(#loc\d*\)", "", text, flags=re.M)

  before = cuda()
  with jaxclip.platform.without(trick):
    off = cuda()
  assert cuda() == before
  assert _kernel_operands(before) == 2  # the large leaf, the two small ones packed
  if trick == "cuda_norm":  # XLA's reductions, rescued by a conditional
    assert TRITON not in off and re.search(r"stablehlo\.(case|if)", off)
  else:  # a branch per leaf
    assert _kernel_operands(off) == 3
    leaves = _leaves(4, shapes=[(40_000,), (32,), (7,)])
    with jaxclip.platform.without(trick):
      unpacked = _cuda.cuda_norm(leaves, True)
    np.testing.assert_allclose(unpacked, _cuda.cuda_norm(leaves, True), rtol=1e-6)


@pytest.mark.hlo
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compares XLA:CPU programs")
def test_cpu_program_unchanged_by_the_cuda_choice(monkeypatch):
  tree = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,), jnp.bfloat16)}
  plain = jax.jit(jaxclip.ops.global_norm).lower(tree).compile().as_text()
  monkeypatch.setattr(_platform, "cuda_in_process", lambda: True)
  staged = jax.jit(jaxclip.ops.global_norm).lower(tree)
  assert TRITON not in staged.as_text()
  strip = lambda t: re.sub(r"\.\d+|metadata=\{[^}]*\}", "", t)  # noqa: E731
  assert strip(staged.compile().as_text()) == strip(plain)
  assert TRITON not in _exported(jaxclip.ops.global_norm, tree, ("cpu",)).mlir_module()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1e30, 1e-30])
def test_gpu_global_norm_matches_float64(dtype, scale):
  leaves = _leaves(6, dtype, scale)
  compiled = jax.jit(jaxclip.ops.global_norm).lower(leaves).compile()
  assert "triton" in compiled.as_text() and "conditional" not in compiled.as_text()
  got, want = float(compiled(leaves)), _reference(leaves)
  assert abs(got - want) <= 1e-6 * want, (got, want)
  leaves[1] = leaves[1].at[0, 0].set(jnp.inf)
  assert float(compiled(leaves)) == math.inf
  leaves[1] = leaves[1].at[0, 0].set(jnp.nan)
  assert math.isnan(float(compiled(leaves)))
