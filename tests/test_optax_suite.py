"""optax's own clipping tests, run against jaxclip's drop-ins.

optax ships ``optax/transforms/_clipping_test.py`` in its wheel. It calls every
transform through the module attribute ``_clipping`` (``_clipping.clip(...)``,
``_clipping.unitwise_norm(...)``), so loading the file and pointing that
attribute at jaxclip runs optax's assertions on jaxclip's code.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import types
import unittest

import pytest

import jaxclip

DROP_INS = (
  "adaptive_grad_clip",
  "clip",
  "clip_by_block_rms",
  "clip_by_global_norm",
  "per_example_global_norm_clip",
  "per_example_layer_norm_clip",
  "unitwise_clip",
  "unitwise_norm",
)

# Tests of the file that fail with optax's own code too, with the reason. The
# test below checks that each still fails with optax, so a fixed one shows up.
FAIL_WITH_OPTAX = {
  "test_clip_by_block_rms": (
    "asserts that the RMS of a clipped float32 leaf equals the threshold to 7 "
    "decimal places; optax's own clip gives 0.9999999 (1 ulp off) for the "
    "first leaf at threshold 1 on XLA:CPU, jaxclip's for the second."
  ),
}


def _load_optax_test_module() -> types.ModuleType:
  origin = importlib.util.find_spec("optax").origin
  path = pathlib.Path(origin).parent / "transforms" / "_clipping_test.py"
  if not path.exists():
    pytest.skip(f"this optax wheel ships no {path}")
  pytest.importorskip("absl.testing.absltest")
  spec = importlib.util.spec_from_file_location("optax_clipping_test_on_jaxclip", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _counting(name: str, calls: dict[str, int]):
  fn = getattr(jaxclip, name)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    calls[name] = calls.get(name, 0) + 1
    return fn(*args, **kwargs)

  return wrapper


def _run(module: types.ModuleType, names: set[str] | None = None):
  """Runs the module's test cases (only ``names`` if given): ``(run, {name: trace})``."""
  suite = unittest.TestSuite(
    test
    for case in unittest.defaultTestLoader.loadTestsFromModule(module)
    for test in case
    if names is None or test.id().rsplit(".", 1)[-1] in names
  )
  result = unittest.TestResult()
  suite.run(result)
  return result.testsRun, {
    test.id().rsplit(".", 1)[-1]: text for test, text in result.failures + result.errors
  }


def test_optax_clipping_suite_passes_on_jaxclip():
  module = _load_optax_test_module()
  calls: dict[str, int] = {}
  original = module._clipping
  module._clipping = types.SimpleNamespace(**{n: _counting(n, calls) for n in DROP_INS})
  run, problems = _run(module)

  unexpected = {k: v for k, v in problems.items() if k not in FAIL_WITH_OPTAX}
  assert not unexpected, "\n\n".join(f"{k}:\n{v}" for k, v in unexpected.items())
  assert run >= 9, run
  # The substitution happened: every drop-in the file calls was ours.
  source = pathlib.Path(module.__file__).read_text()
  used = {n for n in DROP_INS if f"_clipping.{n}(" in source}
  assert len(used) >= 7 and set(calls) == used, (calls, used)

  # The excluded tests fail with optax's own code as well.
  module._clipping = original
  run, with_optax = _run(module, set(FAIL_WITH_OPTAX))
  assert run == len(FAIL_WITH_OPTAX)
  assert set(with_optax) == set(FAIL_WITH_OPTAX), with_optax
