"""Test configuration: XLA flags, the order tests reach pytest-xdist's workers, strict promotion.

The suite is compile-bound, and the tests check results, not speed. XLA:CPU
compiles about twice as fast without its backend (LLVM) optimisations, about
1.6 times as fast again without its fusion emitters (an elementwise op is
then a kernel of its own), and faster still generating each program's code
in one piece rather than in parallel parts (small programs, one per core).
So the tests and every subprocess they start (which inherit the environment)
run with ``--xla_backend_optimization_level=0
--xla_llvm_disable_expensive_passes --xla_cpu_use_fusion_emitters=false
--xla_cpu_parallel_codegen_split_count=1`` (``workloads/xla_options.py``: the
emitters' option only where the XLA has it) unless ``XLA_FLAGS`` already sets
a backend optimisation level (set
``XLA_FLAGS=--xla_backend_optimization_level=3`` to test as users compile).
XLA's HLO passes still run; a test that reads a compiled program's fusions,
instructions or buffers compiles it with the fusion emitters
(``tests.helpers.compiled``).

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

from workloads import xla_options

# Before JAX starts its backend (it reads XLA_FLAGS then).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  flags = [os.environ.get("XLA_FLAGS", ""), xla_options.as_flags(xla_options.FAST_COMPILE)]
  os.environ["XLA_FLAGS"] = " ".join(flags).strip()

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Tracing makes many short-lived objects, and Python's collector, run every
# 700 allocations by default, walks every object still alive (jax, flax, the
# compiled programs' caches): fewer collections, the long-lived objects
# frozen out of them, made the library's tests about a tenth faster on 2
# cores, with the same peak memory.
gc.freeze()
gc.set_threshold(50_000, 20, 100)

# The longest work, started first, longest first: node id prefixes with the
# seconds each unit took in the README's command on 2 idle cores. A stale
# entry only changes the order.
_SLOW_FIRST = {
  "tests/test_examples.py::test_clipping_study_tiny_run": 80,
  "tests/test_ghost_multi_device.py::test_multi_device": 75,
  "tests/test_kernel.py::test_per_leaf_clip_of_stacked_leaves_under_grad_and_vmap[real]": 36,
  "tests/test_distributed.py::test_multi_device": 32,
  "tests/test_distributed.py::test_collectives": 32,
  "tests/test_benchmarks.py::test_benchmark_quick_run": 32,
  "tests/test_examples.py::test_dp_sgd_tiny_run": 31,
  "tests/test_docs.py": 11,
  "tests/test_notebooks.py::test_notebook_executes[03": 9,
  "tests/test_optax_suite.py": 7,
  "tests/test_every_transform.py::test_every_transform_chained_with_adam": 7,
  "tests/test_helpers.py::test_each_check_reports_on_its_own": 7,
  "tests/test_benchmarks.py::test_ghost_benchmark_quick_run": 6,
  "tests/test_multihost.py": 6,
  "tests/test_per_example.py::test_multi_device": 5,
  "tests/test_privacy.py::test_multi_device": 5,
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
# benchmarks, build the docs and the wheel, run the linters, start
# subprocesses of 8 virtual devices or of several hosts, run a docs page's
# code, train the zoo's models, models built from flax and equinox layers and
# the loops users write (flax TrainState, nnx.Optimizer, equinox, donation,
# export, orbax checkpoints), run optax's own clipping suite or a property
# search (hypothesis's ``@given``, in any file), or read a compiled program
# (the tests marked ``hlo``). The README's test command runs everything;
# ``-m "not slow"`` is the inner loop (CONTRIBUTING.md): the library's own
# tests and doctests.
# test_slow_marker_covers_the_whole_program_checks checks the lists.
SLOW_FILES = (
  "tests/test_benchmarks.py",
  "tests/test_checkpoint.py",
  "tests/test_docs.py",
  "tests/test_dp_audit.py",
  "tests/test_examples.py",
  "tests/test_figures.py",
  "tests/test_ghost_zoo.py",
  "tests/test_lint.py",
  "tests/test_multihost.py",
  "tests/test_notebooks.py",
  "tests/test_optax_suite.py",
  "tests/test_platform_cuda.py",
  "tests/test_properties.py",
  "tests/test_training_loops.py",
  "tests/test_wheel.py",
)
SLOW_TESTS = (
  "test_multi_device[",  # the 8-device subprocess of a file's md_* checks
  "test_adversarial_full_product[",  # 384 compiled cases (the inner loop runs a slice)
  "test_cancelling_rows_full_product[",  # 62 compiled cases of 48 examples (a slice: 12 of 12)
  "test_collectives",
  "test_fsdp_example_runs",
  "test_each_check_reports_on_its_own",  # the md_* runner's own subprocesses
  "test_axis_name_gives_the_unsharded_result",  # a subprocess of 4 devices
  "test_the_code_of_the_accumulation_page_runs",  # a docs page's code
  # Models built from flax (linen, nnx) and equinox layers, as the zoo's:
  "test_gpt_with_tied_head_matches_vmap",
  "test_gpt_with_microbatches_padding_and_aux",
  "test_flax_nnx_model_matches_vmap",
  "test_equinox_conv_model_matches_vmap",
  "test_flax_linen_model_with_remat_mixed_precision_and_dropout_keys",
  "test_flax_linen_scan_over_remat_blocks_gets_the_dot_rule_per_layer",
  "test_conv_rule_with_stride_padding_dilation_and_feature_groups",
  "test_every_transform_chained_with_adam_stays_linear_in_the_leaves",  # compiles, 4 sizes
  # Each transform in the loops users write (test_training_loops.py chains them all):
  "test_flax_nnx_optimizer",
  "test_equinox_training_step",
  # Finite in, finite out (test_finite.py): the cross-product of magnitudes and dtypes.
  "test_every_transform_finite_at_every_magnitude_and_dtype",
  "test_every_transform_finite_in_float64",
  "test_every_op_finite_in_every_dtype",
  # The exact truncated-Poisson PLD (dp_accounting) takes seconds per evaluation:
  "test_calibrate_noise_accounts_for_truncation_exactly_by_pld",
  "test_dpsgd_accounts_for_truncation_exactly_by_pld",
  "test_the_accountants_state_round_trips_through_orbax",
)


def is_slow(nodeid: str, hlo: bool = False, search: bool = False) -> bool:
  """Whether a test (``hlo``: marked so; ``search``: a hypothesis property search) is a
  whole-program check (``-m slow``)."""
  path, _, name = nodeid.partition("::")
  return hlo or search or path in SLOW_FILES or name.startswith(SLOW_TESTS)


# Tests that share a traced program through a module-level cache, per
# parametrization: the tests with the same id go to one worker as one unit.
SHARED_COMPILE_TESTS = {
  "tests/test_lowering.py": (  # _lowered_grad: values and cost analysis
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


def pytest_ignore_collect(collection_path, config):
  # The inner loop does not import the files of whole-program checks (docs, notebooks,
  # the zoo's models...): about a second of each worker's start.
  if config.getoption("markexpr", "").replace(" ", "") != "notslow":
    return None
  if not collection_path.is_relative_to(config.rootpath):
    return None
  return collection_path.relative_to(config.rootpath).as_posix() in SLOW_FILES or None


def pytest_collection_modifyitems(config, items):
  for item in items:
    hlo = item.get_closest_marker("hlo") is not None
    search = getattr(getattr(item, "obj", None), "is_hypothesis_test", False)
    if is_slow(item.nodeid, hlo=hlo, search=search):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: -_seconds(item))  # stable: the rest keep their order


@pytest.fixture
def strict_promotion():
  """Runs a test with ``jax_numpy_dtype_promotion='strict'``."""
  with jax.numpy_dtype_promotion("strict"):
    yield


@pytest.fixture(params=["scaled down", pytest.param("real", marks=pytest.mark.slow)])
def stacks(request, monkeypatch):
  """XLA:CPU's stacking constants (``jaxclip._kernel._platform._stacks``) at an eighth of
  their values, so that a tree of ~100 leaves takes every path of the stacks that ~1,000
  take (the inner loop), and as they are (``slow``). A test sizes its tree from them."""
  if request.param == "scaled down":
    from jaxclip._kernel._platform import _stacks

    for name in ("_STACK", "_FLAT_STACK", "_STATIC_ROWS"):
      monkeypatch.setattr(_stacks, name, getattr(_stacks, name) // 8)
  return request.param
