"""Shared test helpers."""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workloads import xla_options


def compiled(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
  """``lowered`` compiled with XLA:CPU's fusion emitters, as users compile it.

  For a test that reads a compiled program (its fusions, instructions,
  buffers): the suite's ``XLA_FLAGS`` turn the emitters off.
  """
  return lowered.compile(compiler_options=xla_options.AS_USERS_COMPILE)


def entry_fusions(compiled_text: str) -> int:
  """The fusions (kernels) of a program's ENTRY computation: those of no ``cond`` branch."""
  entry = compiled_text[compiled_text.index("\nENTRY") :]
  return entry.split("\n}", 1)[0].count(" fusion(")


def tree_allclose(a, b, *, rtol=1e-6, atol=0.0) -> bool:
  """True if two pytrees have one structure, equal dtypes and close leaves."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      return False
    xf = np.asarray(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
    yf = np.asarray(y.astype(jnp.promote_types(y.dtype, jnp.float32)))
    if not np.allclose(xf, yf, rtol=rtol, atol=atol, equal_nan=True):
      return False
  return True


def assert_tree_allclose(a, b, *, rtol=1e-6, atol=0.0) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b), (
    jax.tree.structure(a),
    jax.tree.structure(b),
  )
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = jnp.asarray(x), jnp.asarray(y)
    assert x.shape == y.shape, (x.shape, y.shape)
    assert x.dtype == y.dtype, (x.dtype, y.dtype)
    np.testing.assert_allclose(
      np.asarray(x.astype(jnp.promote_types(x.dtype, jnp.float32))),
      np.asarray(y.astype(jnp.promote_types(y.dtype, jnp.float32))),
      rtol=rtol,
      atol=atol,
    )


def assert_dtypes_kept(inp, out) -> None:
  """Every output leaf has its input leaf's dtype and shape."""
  assert jax.tree.structure(inp) == jax.tree.structure(out)
  for x, y in zip(jax.tree.leaves(inp), jax.tree.leaves(out), strict=True):
    assert jnp.asarray(y).dtype == jnp.asarray(x).dtype, (x.dtype, y.dtype)
    assert jnp.shape(y) == jnp.shape(x)


def all_finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def random_tree(seed: int = 0, dtype=jnp.float32, scale: float = 1.0, scalar: bool = True):
  """A small nested pytree (dict, list, tuple, None) of random arrays."""
  k = jax.random.split(jax.random.key(seed), 4)
  tree = {
    "dense": {
      "w": scale * jax.random.normal(k[0], (4, 3), dtype),
      "b": scale * jax.random.normal(k[1], (3,), dtype),
    },
    "layers": [scale * jax.random.normal(k[2], (2, 2, 3), dtype), None],
    "scalar": (scale * jax.random.normal(k[3], (), dtype),),
  }
  if not scalar:
    del tree["scalar"]
  return tree


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One cycle of an import graph ``{module: the modules it imports}`` (``[a, b, a]``), or ``[]``.

  Used by the layering checks of jaxclip (``tests/test_api.py``) and of the benchmarks
  (``tests/test_layout.py``).
  """
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(node: str, path: list[str]) -> list[str]:
    state[node] = 1
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return [*path[path.index(nxt) :], node, nxt] if nxt in path else [node, nxt]
      if nxt not in state:
        found = visit(nxt, [*path, node])
        if found:
          return found
    state[node] = 2
    return []

  for node in sorted(graph):
    if node not in state:
      found = visit(node, [])
      if found:
        return found
  return []


def longest_import_chain(graph: dict[str, set[str]]) -> list[str]:
  """The longest chain ``[a, b, c]`` (``a`` imports ``b``, ``b`` imports ``c``) of an acyclic
  import graph ``{module: the modules it imports}``: its modules, the first of the longest."""
  memo: dict[str, list[str]] = {}

  def longest(node: str) -> list[str]:
    if node not in memo:
      below = [longest(nxt) for nxt in sorted(graph.get(node, ()))]
      memo[node] = [node, *max(below, key=len, default=[])]
    return memo[node]

  return max((longest(node) for node in sorted(graph)), key=len, default=[])


_COLLECTIVE_OPS = (
  "all-reduce",
  "all-gather",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
  "collective-broadcast",
)
# One HLO instruction per line: ``%name = <result type> <opcode>(operands...``.
# The result type may hold spaces and ``=`` (a tuple's ``/*index=5*/``), so
# it is everything up to the first collective opcode on the line.
_COLLECTIVE_LINE = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(_COLLECTIVE_OPS) + r")(?:-start)?\(",
  re.MULTILINE,
)


def hlo_collectives(hlo_text: str) -> list[tuple[str, str]]:
  """``(kind, result type)`` of every collective in compiled HLO text.

  An asynchronous collective counts once (its ``-start``; ``-done`` is not
  matched).
  """
  return [(m.group(2), m.group(1)) for m in _COLLECTIVE_LINE.finditer(hlo_text)]


ROOT = Path(__file__).resolve().parents[1]


def device_env(n_devices: int) -> dict[str, str]:
  """A subprocess environment: ``n_devices`` virtual CPU devices, the repo importable."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


# The marker that starts each line a check subprocess reports on, followed by JSON.
_REPORT = "@@jaxclip-check "


def _report(**event) -> None:
  print(_REPORT + json.dumps(event), flush=True)


def run_checks(
  checks: dict[str, Callable[[], None]],
  n_devices: int,
  names: list[str] | None = None,
  report: Callable[[], object] | None = None,
) -> None:
  """Runs ``checks`` here, one after the other, reporting each as it starts and ends.

  The body of a test file run as a script by :class:`SubprocessChecks`. Each
  check prints (and flushes) a line when it starts and one with its result
  (``"ok"`` or its traceback), its time and ``report()`` (data a test reads,
  such as the collectives it compiled) when it ends, so that a crash or a
  kill fails only the check that was running.

  Args:
    checks: name -> check, in the order they run.
    n_devices: the device count the checks need (asserted).
    names: the checks to run (all if ``None``), in this order.
    report: called after each check; its JSON-able result goes with the check's.
  """
  assert jax.device_count() == n_devices, jax.devices()
  for name in checks if names is None else names:
    _report(start=name)
    start = time.monotonic()
    try:
      checks[name]()
      result = "ok"
    except Exception:  # reported to the parent test, one case per check
      result = traceback.format_exc()
    data = report() if report is not None else None
    _report(name=name, result=result, seconds=time.monotonic() - start, data=data)


def _describe_exit(returncode: int) -> str:
  if returncode < 0:
    return f"died of signal {signal.Signals(-returncode).name} (out of memory?)"
  return f"exited with status {returncode}"


class SubprocessChecks:
  """The checks of a script run in subprocesses, read one by one as each ends.

  The script (a test file run as ``python tests/test_x.py NAME...``) runs the
  named checks with :func:`run_checks`. :meth:`result` reads the subprocess's
  reports until the asked check has ended, so every check reports on its own
  and in its own time. When the subprocess crashes or is killed, the check
  that was running fails with what happened and after how long, and the
  checks after it run in a fresh subprocess. A check that runs longer than
  ``check_timeout`` seconds is killed and fails saying so; nothing is killed
  without a message.

  Args:
    script: the path of the script.
    names: every check, in the order they run.
    env: the subprocesses' environment.
    check_timeout: the wall-clock seconds one check may run.
    start_timeout: the wall-clock seconds a subprocess may take to start its first check.
  """

  def __init__(self, script, names, env, check_timeout=600.0, start_timeout=600.0):
    self.script = str(script)
    self.env = env
    self.check_timeout = check_timeout
    self.start_timeout = start_timeout
    self._pending = list(names)
    self._results: dict[str, str] = {}
    self._data: dict[str, object] = {}
    self._proc = None

  def result(self, name: str) -> str:
    """``"ok"``, or why the check ``name`` failed (its traceback, or its subprocess's fate)."""
    if name not in self._pending and name not in self._results:
      raise KeyError(f"{name!r} is no check of {self.script}")
    while name not in self._results:
      self._next_event()
    return self._results[name]

  def data(self, name: str):
    """What the check ``name``'s ``report`` returned (``None`` if it did not report)."""
    self.result(name)
    return self._data.get(name)

  def run_all(self) -> dict[str, str]:
    """Every check's result, running those not run yet."""
    while self._pending:
      self._next_event()
    return dict(self._results)

  def close(self) -> None:
    """Kills a subprocess still running (its checks then fail saying so)."""
    if self._proc is not None:
      self._end("was killed as the tests ended", kill=True)

  def _start(self) -> None:
    self._stderr = tempfile.TemporaryFile("w+")
    self._proc = subprocess.Popen(
      [sys.executable, self.script, *self._pending],
      env=self.env,
      cwd=ROOT,
      text=True,
      stdout=subprocess.PIPE,
      stderr=self._stderr,
    )
    self._lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._read, args=(self._proc.stdout, self._lines), daemon=True).start()
    self._started = time.monotonic()
    self._running, self._running_since, self._output = None, self._started, []

  @staticmethod
  def _read(stream, lines) -> None:
    for line in stream:
      lines.put(line)
    lines.put(None)

  def _next_event(self) -> None:
    if self._proc is None:
      self._start()
    limit = self.start_timeout if self._running is None else self.check_timeout
    waited = time.monotonic() - self._running_since
    try:
      line = self._lines.get(timeout=max(0.1, limit - waited))
    except queue.Empty:
      self._end(
        f"was killed by the test after {time.monotonic() - self._running_since:.0f} s "
        f"{'on this check' if self._running else 'starting'} (the wall-clock limit is "
        f"{limit:.0f} s; the machine may be overloaded)",
        kill=True,
      )
      return
    if line is None:
      self._proc.wait()
      self._end(_describe_exit(self._proc.returncode), kill=False)
      return
    if not line.startswith(_REPORT):
      self._output.append(line)
      return
    event = json.loads(line[len(_REPORT) :])
    if "start" in event:
      self._running, self._running_since, self._output = event["start"], time.monotonic(), []
      return
    self._results[event["name"]] = event["result"]
    self._data[event["name"]] = event["data"]
    self._pending.remove(event["name"])
    self._running, self._running_since = None, time.monotonic()
    if not self._pending:
      self._proc.wait()
      self._close_process()

  def _end(self, what: str, kill: bool) -> None:
    """The subprocess is gone (or is killed now): fail the check it was running."""
    if kill:
      self._proc.kill()
      self._proc.wait()
    took = time.monotonic() - self._started
    self._stderr.seek(0)
    tail = self._stderr.read()[-3000:]
    output = "".join(self._output)[-2000:]
    command = f"the subprocess `{Path(self.script).name} ...` {what}, {took:.0f} s after it started"
    if self._running is not None:
      message = (
        f"{command}, while running this check (for "
        f"{time.monotonic() - self._running_since:.0f} s); the checks after it run in a "
        f"fresh subprocess.\n--- its output ---\n{output}\n--- its stderr ---\n{tail}"
      )
      self._results[self._running] = message
      self._pending.remove(self._running)
    else:
      # It died between checks or before the first: a fault of no one check
      # (an import error, say), which a fresh subprocess would only repeat.
      message = f"{command}, before this check started.\n--- its stderr ---\n{tail}"
      for name in self._pending:
        self._results[name] = message
      self._pending.clear()
    self._close_process()

  def _close_process(self) -> None:
    self._proc.stdout.close()
    self._stderr.close()
    self._proc = None


def run_subprocess(
  cmd: list[str], env: dict[str, str], timeout: float = 900
) -> tuple[int | None, str, str, str | None]:
  """``(returncode, stdout, stderr, problem)`` of ``cmd`` run in the repo's root.

  ``problem`` says, in words, what went wrong and after how long: a kill on
  the wall-clock ``timeout`` (then ``returncode`` is ``None`` and the output
  is what the process had written), a signal, or a non-zero exit.
  """
  start = time.monotonic()
  proc = subprocess.Popen(
    cmd, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
  )
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    stdout, stderr = proc.communicate()
    took = time.monotonic() - start
    return (
      None,
      stdout,
      stderr,
      (
        f"the subprocess {' '.join(cmd[1:])!r} was killed by the test after {took:.0f} s "
        f"(its wall-clock limit is {timeout:.0f} s; the machine may be overloaded)"
      ),
    )
  took = time.monotonic() - start
  problem = None
  if proc.returncode < 0:
    problem = (
      f"the subprocess {' '.join(cmd[1:])!r} died of signal "
      f"{signal.Signals(-proc.returncode).name} after {took:.0f} s (out of memory?)"
    )
  elif proc.returncode:
    problem = (
      f"the subprocess {' '.join(cmd[1:])!r} exited with status {proc.returncode} "
      f"after {took:.0f} s"
    )
  return proc.returncode, stdout, stderr, problem


_RUNNERS: dict[str, SubprocessChecks] = {}


@atexit.register
def _close_runners() -> None:
  for runner in _RUNNERS.values():
    runner.close()


def multi_device_checks(
  namespace: dict,
  n_devices: int = 8,
  *,
  setup: Callable[[], None] | None = None,
  report: Callable[[], object] | None = None,
):
  """The one pytest case per ``md_*`` check of a test file, run on ``n_devices`` CPU devices.

  ``XLA_FLAGS=--xla_force_host_platform_device_count`` must be set before JAX
  is imported, so the ``md_*`` functions of the calling module run in a
  subprocess: the module itself run as a script, where this call runs the
  checks named on its command line and exits. In pytest it returns the test
  to bind to a ``test_*`` name: parametrized over the checks, each case
  failing on its own (see :class:`SubprocessChecks`). Under pytest-xdist one
  worker runs them all, in one subprocess (``tests/conftest.py``).

  Call it at the end of the module, after every check is defined::

      test_multi_device = multi_device_checks(globals(), N_DEVICES)

  Args:
    namespace: the calling module's ``globals()``.
    n_devices: the virtual CPU devices the checks run on.
    setup: called in the subprocess before the checks (a config update, say).
    report: called in the subprocess after each check; see :func:`run_checks`.

  Returns:
    The test function. Its ``runner()`` is the :class:`SubprocessChecks` the cases read.
  """
  names = sorted(name for name in namespace if name.startswith("md_"))
  script = namespace["__file__"]
  if namespace["__name__"] == "__main__":
    if setup is not None:
      setup()
    checks = {name: namespace[name] for name in names}
    run_checks(checks, n_devices, sys.argv[1:] or names, report)
    sys.exit(0)

  def md_runner() -> SubprocessChecks:
    if script not in _RUNNERS:
      _RUNNERS[script] = SubprocessChecks(script, names, device_env(n_devices))
    return _RUNNERS[script]

  @pytest.mark.parametrize("name", names)
  def test_multi_device(name):
    result = md_runner().result(name)
    assert result == "ok", result

  test_multi_device.runner = md_runner
  return test_multi_device


def mlp_loss(params, x, y):
  """The summed squared error of a one-hidden-layer tanh MLP (the per-example tests' model)."""
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.sum((h @ params["w2"] - y) ** 2)


def mlp_problem(batch: int = 12, seed: int = 0):
  """``(params, x, y)`` for :func:`mlp_loss`: 5 inputs, 8 hidden units, 3 outputs."""
  rng = np.random.default_rng(seed)
  params = {
    "w1": jnp.asarray(rng.normal(size=(5, 8)), jnp.float32),
    "b1": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(batch, 5)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(batch, 3)), jnp.float32)
  return params, x, y
