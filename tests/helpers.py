"""Shared test helpers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


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


def run_checks(checks: dict[str, Callable[[], None]], n_devices: int) -> None:
  """Runs each check here, printing ``{name: "ok" or its traceback}`` as a JSON line per check.

  The body of a test file run as a script in :func:`checks_in_subprocess`.
  Each result is printed (and flushed) as soon as its check ends, so that
  the checks done before a crash or a kill still report on their own.
  """
  assert jax.device_count() == n_devices, jax.devices()
  for name, check in checks.items():
    try:
      check()
      result = "ok"
    except Exception:  # reported to the parent test, one case per check
      result = traceback.format_exc()
    print(json.dumps({name: result}), flush=True)


class _Results(dict):
  """The checks' results; a check that never reported reads as why (never as ``"ok"``)."""

  def __init__(self, results: dict[str, str], missing: str):
    super().__init__(results)
    self.missing = missing

  def __missing__(self, name: str) -> str:
    return f"{name} did not report: {self.missing}"


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


def checks_in_subprocess(script: str, n_devices: int, timeout: float = 900) -> dict[str, str]:
  """Runs ``script`` (which calls :func:`run_checks`) on ``n_devices`` virtual CPU devices.

  Each check's result is read from its own line, so a check that ended
  before a crash or a kill reports as it ended; one that never reported
  fails with what happened to the subprocess and after how long.
  """
  _, stdout, stderr, problem = run_subprocess(
    [sys.executable, script], device_env(n_devices), timeout
  )
  results = {}
  for line in stdout.splitlines():
    try:
      parsed = json.loads(line)
    except ValueError:
      continue
    if isinstance(parsed, dict):
      results.update(parsed)
  why = problem or "the subprocess ended without reporting it"
  if not results:
    raise AssertionError(f"{why}\n{stdout[-3000:]}{stderr[-3000:]}")
  return _Results(results, f"{why}\n{stderr[-2000:]}")


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
