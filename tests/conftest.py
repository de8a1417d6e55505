"""Test configuration: XLA flags, the order tests reach pytest-xdist's workers, strict promotion.

The suite is compile-bound: XLA:CPU compiles about twice as fast without its
backend (LLVM) optimisations, and the tests check results, not speed. So the
tests and every subprocess they start (which inherit the environment) run
with ``--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes``
unless ``XLA_FLAGS`` already sets a backend optimisation level (set
``XLA_FLAGS=--xla_backend_optimization_level=3`` to test as users compile).
XLA's HLO passes still run: the ``hlo`` tests read fused, partitioned HLO.

The README's command runs the suite on two pytest-xdist workers with
``--dist loadgroup`` (``addopts`` in ``pyproject.toml``): tests that share a
module-scoped fixture, and the multi-device checks of a file (which share one
subprocess), run on one worker, so that nothing runs twice; and the slowest
work units start first, so that no long test starts last on one worker while
the other sits idle.
"""

import os

# Before JAX starts its backend (it reads XLA_FLAGS then).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
    [
      os.environ.get("XLA_FLAGS", ""),
      "--xla_backend_optimization_level=0",
      "--xla_llvm_disable_expensive_passes=true",
    ]
  ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Work that takes tens of seconds, started first, longest first: node id
# prefixes with the wall seconds measured on 2 cores (loaded). A stale entry
# only changes the order.
_SLOW_FIRST = {
  "tests/test_distributed.py::test_multi_device": 120,
  "tests/test_distributed.py::test_collectives": 120,
  "tests/test_every_transform.py::test_every_transform_compiles": 100,
  "tests/test_examples.py::test_clipping_study_tiny_run": 85,
  "tests/test_ghost.py::test_multi_device": 70,
  "tests/test_benchmarks.py::test_ghost_benchmark_quick_run": 50,
  "tests/test_privacy.py::test_multi_device": 40,
  "tests/test_per_example.py::test_multi_device": 30,
  "tests/test_multihost.py": 30,
  "tests/test_wheel.py": 30,
  "tests/test_docs.py": 25,
  "tests/test_distributed.py::test_fsdp_example_runs": 20,
}


def _seconds(item: pytest.Item) -> float:
  return max((s for p, s in _SLOW_FIRST.items() if item.nodeid.startswith(p)), default=0.0)


def _module_fixtures(item: pytest.Item) -> list[str]:
  """The module-scoped fixtures of the item's own test file that it uses."""
  info = getattr(item, "_fixtureinfo", None)
  if info is None:
    return []
  names = []
  for name in info.names_closure:
    for fixturedef in info.name2fixturedefs.get(name, ()):
      if fixturedef.scope == "module" and fixturedef.baseid == item.nodeid.split("::")[0]:
        names.append(name)
  return names


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
  for item in items:
    if not any(True for _ in item.iter_markers("xdist_group")):
      if fixtures := _module_fixtures(item):
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        item.add_marker(pytest.mark.xdist_group(f"{module}_{'_'.join(sorted(fixtures))}"))
  items.sort(key=lambda item: -_seconds(item))  # stable: the rest keep their order


@pytest.fixture
def strict_promotion():
  """Runs a test with ``jax_numpy_dtype_promotion='strict'``."""
  with jax.numpy_dtype_promotion("strict"):
    yield
