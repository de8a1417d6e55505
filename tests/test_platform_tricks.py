"""jaxclip.platform: each compile-time trick switched off changes the program, not the values.

The CPU tricks here; the CUDA ones (``cuda_norm``, ``cuda_packing``) in
tests/test_platform_cuda.py, which exports for ``cuda``. No cache is cleared
between programs: a trick's choice that outlived its switch (a kernel cache
of jitted functions not keyed by the switches) fails the checks that the
program changes under the switch and comes back after it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip._kernel import _platform


def _probe_tree(n: int, shape: tuple[int, ...], dtype=jnp.float32) -> dict:
  return {
    f"p{i}": jnp.linspace(-2.0, 2.0, math.prod(shape)).reshape(shape).astype(dtype) * (i + 1)
    for i in range(n)
  }


# A small program for each CPU trick that the trick changes.
PROBES = {
  "bf16_barrier": lambda: (jaxclip.clip_by_global_norm(1.0), _probe_tree(1, (8, 8), jnp.bfloat16)),
  "f16_two_output": lambda: (jaxclip.clip_by_global_norm(1.0), _probe_tree(1, (8, 8), jnp.float16)),
  "stacked_scales": lambda: (jaxclip.clip_by_norm(1.0), _probe_tree(3, (4,))),
  "opaque_indices": lambda: (jaxclip.clip_by_norm(1.0), _probe_tree(3, (4,))),
  "grouped_parts": lambda: (jaxclip.clip_by_global_norm(1.0), _probe_tree(3, (4,))),
  "stacked_rules": lambda: (jaxclip.adagc(), _probe_tree(3, (4,))),
  "segment_parts": lambda: (jaxclip.adaptive_value_clip(), _probe_tree(3, (4,))),
  "computed_once": lambda: (jaxclip.skip_nonfinite(optax.sgd(0.1)), _probe_tree(3, (4,))),
}
CUDA_TRICKS = ("cuda_norm", "cuda_packing")


def test_every_trick_is_named_described_and_switched_in_the_code():
  assert set(jaxclip.platform.TRICKS) == set(PROBES) | set(CUDA_TRICKS)
  for name, line in jaxclip.platform.TRICKS.items():
    assert line.strip() and "\n" not in line, name
  with pytest.raises(TypeError):
    jaxclip.platform.TRICKS["new"] = "read-only"  # type: ignore[index]
  # Each name is asked for by the code that does the trick, and only those names.
  root = Path(jaxclip.__file__).parent
  asked = {
    name
    for path in root.rglob("*.py")
    for name in re.findall(r"""is_on\(["'](\w+)["']\)""", path.read_text())
  }
  assert asked == set(jaxclip.platform.TRICKS)


def _program(trick: str) -> tuple[str, list]:
  """The probe of ``trick``, traced afresh: its lowered text and its values."""
  tx, tree = PROBES[trick]()
  state = tx.init(tree)
  fn = jax.jit(lambda u, s: tx.update(u, s, tree))
  return fn.lower(tree, state).as_text(), jax.tree.leaves(fn(tree, state))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU programs")
@pytest.mark.parametrize("trick", sorted(PROBES))
def test_a_trick_switched_off_changes_the_program_and_keeps_the_values(trick):
  # A switch that changed nothing would price its trick at 1.0x (benchmarks/tricks.py).
  with_text, with_out = _program(trick)
  with jaxclip.platform.without(trick):
    assert not _platform.is_on(trick)
    without_text, without_out = _program(trick)
  assert _platform.is_on(trick)
  assert with_text != without_text, trick
  for a, b in zip(with_out, without_out, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2)
  # After the block (no cache cleared) the program is the trick's again.
  assert _program(trick)[0] == with_text


def test_blocks_nest_and_restore_what_was_off():
  with jaxclip.platform.without("grouped_parts"):
    with jaxclip.platform.without("computed_once", "grouped_parts"):
      assert not _platform.is_on("grouped_parts") and not _platform.is_on("computed_once")
    assert not _platform.is_on("grouped_parts") and _platform.is_on("computed_once")
    with pytest.raises(RuntimeError), jaxclip.platform.without("computed_once"):
      raise RuntimeError  # an exception in the block restores the switches too
    assert _platform.is_on("computed_once")
  assert all(_platform.is_on(name) for name in jaxclip.platform.TRICKS)
  with jaxclip.platform.without():
    assert all(_platform.is_on(name) for name in jaxclip.platform.TRICKS)


def test_an_unknown_name_raises_naming_it_and_the_tricks():
  with pytest.raises(ValueError, match="'grouped_part'") as e:
    jaxclip.platform.without("computed_once", "grouped_part")  # before any block opens
  assert all(name in str(e.value) for name in jaxclip.platform.TRICKS)
  assert _platform.is_on("computed_once")


def test_a_function_traced_before_keeps_its_program():
  # What without()'s docstring warns of: jax.jit caches the trace of a function.
  tree = _probe_tree(3, (4,))
  norm = jax.jit(jaxclip.ops.global_norm)
  before = norm.lower(tree).as_text()
  with jaxclip.platform.without("grouped_parts"):
    assert norm.lower(tree).as_text() == before
    assert jax.jit(lambda t: jaxclip.ops.global_norm(t)).lower(tree).as_text() != before
