"""The subprocess runner of the multi-device checks reports each check on its own.

A script of five checks (one passes, one fails, one kills its process, one
hangs past the limit, one passes after those) runs on one CPU device: every
check gets its own result, the crash and the kill name what happened and
after how long, and the checks after them run in a fresh subprocess.
"""

from __future__ import annotations

import re
import textwrap

from tests import conftest
from tests.helpers import ROOT, SubprocessChecks, device_env

_SCRIPT = """
import os, signal, time
from tests.helpers import multi_device_checks

def md_1_passes():
  print("some output of the first check")

def md_2_fails():
  assert 1 + 1 == 3, "arithmetic"

def md_3_crashes():
  print("about to crash")
  os.kill(os.getpid(), signal.SIGKILL)

def md_4_hangs():
  time.sleep(600)

def md_5_passes_in_a_fresh_process():
  pass

def md_6_reports(): pass

with open(__file__ + ".pids", "a") as f:
  f.write(f"{os.getpid()}\\n")
multi_device_checks(globals(), 1, report=lambda: {"pid": os.getpid()})
"""


def test_each_check_reports_on_its_own(tmp_path):
  script = tmp_path / "checks.py"
  script.write_text(textwrap.dedent(_SCRIPT))
  names = [
    "md_1_passes",
    "md_2_fails",
    "md_3_crashes",
    "md_4_hangs",
    "md_5_passes_in_a_fresh_process",
    "md_6_reports",
  ]
  runner = SubprocessChecks(script, names, device_env(1), check_timeout=5.0, start_timeout=300.0)
  assert runner.result("md_1_passes") == "ok"
  assert "AssertionError: arithmetic" in runner.result("md_2_fails")
  crashed = runner.result("md_3_crashes")
  assert "died of signal SIGKILL" in crashed and "while running this check" in crashed, crashed
  assert "about to crash" in crashed and "fresh subprocess" in crashed, crashed
  hung = runner.result("md_4_hangs")
  assert "killed by the test after" in hung and "limit is 5 s" in hung, hung
  results = runner.run_all()
  assert results["md_5_passes_in_a_fresh_process"] == "ok"
  assert results.keys() == set(names)
  # Three processes: the first, one after the crash, one after the kill.
  started = script.with_suffix(".py.pids").read_text().split()
  assert len(started) == 3, started
  assert runner.data("md_6_reports") == {"pid": int(started[2])}
  assert runner.data("md_1_passes") == {"pid": int(started[0])}
  assert runner.data("md_4_hangs") is None


def test_a_subprocess_that_cannot_start_fails_every_check(tmp_path):
  script = tmp_path / "broken.py"
  script.write_text("raise ImportError('no such module')\n")
  runner = SubprocessChecks(script, ["md_a", "md_b"], device_env(1))
  results = runner.run_all()
  for name in ("md_a", "md_b"):
    assert "exited with status 1" in results[name], results[name]
    assert "before this check started" in results[name] and "no such module" in results[name]


def test_one_unit_per_shared_fixture():
  # The files whose tests share a module-scoped fixture are the ones conftest
  # sends to one worker as one unit.
  shared = {
    path.relative_to(ROOT).as_posix()
    for path in sorted((ROOT / "tests").glob("test_*.py"))
    if re.search(r"@pytest\.fixture\([^)]*scope=.(module|package|session)", path.read_text())
  }
  assert shared == set(conftest.SHARED_FIXTURE_FILES)
  assert conftest.work_unit("tests/test_wheel.py::test_a") == "tests/test_wheel.py"
  units = {conftest.work_unit(f"tests/test_x.py::test_multi_device[md_{i}]") for i in range(3)}
  units.add(conftest.work_unit("tests/test_x.py::test_collectives"))
  assert len(units) == 1
  assert conftest.work_unit("tests/test_x.py::test_y[1]") == "tests/test_x.py::test_y[1]"
  # Tests sharing a cached compile, per parametrization: one unit per id.
  matches, costs = conftest.SHARED_COMPILE_TESTS["tests/test_lowering.py"]
  unit = lambda test, id: conftest.work_unit(f"tests/test_lowering.py::{test}{id}]")
  assert unit(matches, "clip_by_norm") == unit(costs, "clip_by_norm")
  assert unit(matches, "clip_by_norm") != unit(matches, "ops.clip_by_norm")


def test_slow_marker_covers_the_whole_program_checks():
  # Every listed file exists, and every file's subprocess of devices (its md_* checks) is
  # the test the name rule marks: `test_multi_device = multi_device_checks(...)`.
  for path in conftest.SLOW_FILES:
    assert (ROOT / path).is_file(), path
  for path in sorted((ROOT / "tests").glob("test_*.py")):
    text, rel = path.read_text(), path.relative_to(ROOT).as_posix()
    if rel != "tests/test_helpers.py" and "multi_device_checks(" in text:
      assert re.search(r"^test_multi_device = multi_device_checks\(", text, re.M), rel
  # Every name in SLOW_TESTS is a test's (a renamed test would silently join the inner loop).
  names = {
    name
    for path in (ROOT / "tests").glob("test_*.py")
    for name in re.findall(r"^(?:def )?(test_\w+)", path.read_text(), re.M)
  }
  for prefix in conftest.SLOW_TESTS:
    assert any(name.startswith(prefix.rstrip("[")) for name in names), prefix
  assert conftest.is_slow(
    "tests/test_ghost_multi_device.py::test_multi_device[md_ghost_in_shard_map]"
  )
  assert conftest.is_slow("tests/test_examples.py::test_dp_sgd_tiny_run")
  assert conftest.is_slow("tests/test_distributed.py::test_collectives[psum]")
  assert conftest.is_slow("tests/test_ghost_zoo.py::test_ghost_equals_vmap_on_the_zoo_model[x]")
  assert conftest.is_slow("tests/test_training_loops.py::test_nnx_optimizer_under_donation")
  assert conftest.is_slow("tests/test_ops.py::test_x", hlo=True)
  assert conftest.is_slow("tests/test_ops.py::test_x", search=True)
  assert not conftest.is_slow("tests/test_ops.py::test_clip_by_value")
  assert not conftest.is_slow("tests/test_kernel.py::test_grouped_norm_matches_float64_reference")
  assert conftest.is_slow("tests/test_ghost_models.py::test_gpt_with_tied_head_matches_vmap")
  assert not conftest.is_slow(
    "tests/test_ghost_models.py::test_mlp_matches_vmap_and_uses_the_dot_rule"
  )
