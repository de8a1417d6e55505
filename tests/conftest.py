"""Test configuration: XLA flags, the order tests reach pytest-xdist's workers, strict promotion.

The suite is compile-bound: XLA:CPU compiles about twice as fast without its
backend (LLVM) optimisations, and the tests check results, not speed. So the
tests and every subprocess they start (which inherit the environment) run
with ``--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes``
unless ``XLA_FLAGS`` already sets a backend optimisation level (set
``XLA_FLAGS=--xla_backend_optimization_level=3`` to test as users compile).
XLA's HLO passes still run: the ``hlo`` tests read fused, partitioned HLO.

The README's command runs the suite on two pytest-xdist workers, which
``pytest_xdist_make_scheduler`` below feeds: the multi-device checks of a file
(which share one subprocess) and the tests of a file that share a
module-scoped fixture go to one worker as one unit, so that nothing runs
twice; every other test is a unit of its own; and the slowest units start
first, so that no long test starts last on one worker while the other sits
idle. (pytest-xdist's own ``--dist loadgroup`` does not group under pytest 9:
it renames node ids through an attribute pytest 9 no longer reads.)

No persistent compilation cache: shared by the two workers and their
subprocesses (one program written per compile, jax's file lock, and an
eviction scan of the folder per write) it made the README's command take
1,080 s where it takes 447 s without (1,216 tests, same clone, idle).
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
  "tests/test_every_transform.py::test_every_transform_chained_with_adam": 25,
  "tests/test_examples.py::test_clipping_study_tiny_run": 90,
  "tests/test_ghost.py::test_multi_device": 70,
  "tests/test_benchmarks.py::test_benchmark_quick_run": 28,
  "tests/test_privacy.py::test_multi_device": 40,
  "tests/test_per_example.py::test_multi_device": 30,
  "tests/test_multihost.py": 30,
  "tests/test_wheel.py": 30,
  "tests/test_docs.py": 25,
  "tests/test_distributed.py::test_fsdp_example_runs": 20,
}


def _seconds(item: pytest.Item) -> float:
  return max((s for p, s in _SLOW_FIRST.items() if item.nodeid.startswith(p)), default=0.0)


# Test files whose tests share a module-scoped fixture (a build, a job of
# several processes): one unit. test_one_unit_per_shared_fixture checks the list.
SHARED_FIXTURE_FILES = (
  "tests/test_docs.py",
  "tests/test_multihost.py",
  "tests/test_muon_clip.py",
  "tests/test_threshold_state.py",
  "tests/test_wheel.py",
)

# Whole-program checks, marked ``slow``: they run the examples, notebooks and
# benchmarks, build the docs and the wheel, run the linters, or start
# subprocesses of 8 virtual devices or of several hosts. The README's test
# command leaves them out (``-m "not slow"``, the library's own tests);
# ``.ci/run`` then runs them (``-m slow``), so every test runs in CI.
# test_slow_marker_covers_the_whole_program_checks checks the lists.
SLOW_FILES = (
  "tests/test_benchmarks.py",
  "tests/test_docs.py",
  "tests/test_examples.py",
  "tests/test_figures.py",
  "tests/test_lint.py",
  "tests/test_multihost.py",
  "tests/test_notebooks.py",
  "tests/test_wheel.py",
)
SLOW_TESTS = (
  "test_multi_device[",  # the 8-device subprocess of a file's md_* checks
  "test_collectives",
  "test_fsdp_example_runs",
  "test_each_check_reports_on_its_own",  # the md_* runner's own subprocesses
)


def is_slow(nodeid: str) -> bool:
  """Whether a test is a whole-program check (``-m slow``)."""
  path, _, name = nodeid.partition("::")
  return path in SLOW_FILES or name.startswith(SLOW_TESTS)


# Tests that share a compiled program through a module-level cache, per
# parametrization: the tests with the same id go to one worker as one unit.
SHARED_COMPILE_TESTS = {
  "tests/test_lowering.py": (  # _compiled_grad: values and cost analysis
    "test_grad_matches_naive_math[",
    "test_grad_costs_at_most_twice_the_naive_math[",
  ),
}


def work_unit(nodeid: str) -> str:
  """The unit of work a test belongs to (tests of one unit run on one worker, in order)."""
  path, _, name = nodeid.partition("::")
  if path in SHARED_FIXTURE_FILES:
    return path
  if name.startswith(SHARED_COMPILE_TESTS.get(path, ())):
    return path + "::shared compile " + name[name.index("[") :]
  if name.startswith(("test_multi_device[", "test_collectives")):
    return path + "::multi-device checks"  # they read one subprocess's reports
  return nodeid


def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "load":  # -n alone; another --dist is pytest-xdist's
    return None
  from xdist.scheduler import LoadScopeScheduling

  class Scheduling(LoadScopeScheduling):
    """Units from :func:`work_unit`, in the collection order (slowest first)."""

    def _split_scope(self, nodeid):
      return work_unit(nodeid)

  config.option.loadscopereorder = False
  return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
  for item in items:
    if is_slow(item.nodeid):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: -_seconds(item))  # stable: the rest keep their order


@pytest.fixture
def strict_promotion():
  """Runs a test with ``jax_numpy_dtype_promotion='strict'``."""
  with jax.numpy_dtype_promotion("strict"):
    yield
