"""Multi-host clipping: two JAX processes on localhost share one 4-device mesh.

The test starts this file as a script twice, as processes 0 and 1 of a
``jax.distributed`` job (coordinator and gloo CPU collectives on 127.0.0.1),
each with 2 virtual CPU devices. Each process builds the same tree from the
same NumPy data, sharded over a ``('data',)`` mesh of all 4 devices, so every
sharded leaf is split across the two processes (one leaf is replicated), and
computes under ``jax.jit``, on an Explicit and on an Auto mesh:

* ``jaxclip.ops.global_norm`` and ``jaxclip.ops.clip_by_global_norm``;
* one step of ``optax.chain(jaxclip.clip_by_global_norm(MAX_NORM),
  optax.adam(LR))`` with a threshold that clips;
* one step of DP-SGD with the defaults (``per_example_clipped_grad(...,
  method="auto")``, ``dp_noise(..., seed=None)``), the parameters replicated
  and the batch split across the processes; and one with a noise seed per
  process (a broken pipeline, which the agreement check must flag).

It gathers the results to host with ``process_allgather`` and writes them, and
the collectives in the compiled HLO of each function, to files the test reads.
The test checks that both processes agree, that the results equal the same
computation on one device in this process (and a NumPy norm), and, in a
separate test, that the compiled programs communicate by all-reduces only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from tests.helpers import hlo_collectives

ROOT = Path(__file__).resolve().parents[1]
N_PROCESSES = 2
LOCAL_DEVICES = 2
TIMEOUT_S = 180
MAX_NORM = 5.0  # the tree's norm is about 70: the clip is active
LR = 0.1

# Leaves large and small, sharded over 'data' along different dimensions (so
# small leaves of one shape carry different shardings), and one replicated.
SHAPES = {
  "embed": (64, 32),
  "dense": {"kernel": (32, 48), "bias": (48,)},
  "small_rows": (16, 8),
  "small_cols": (16, 8),
  "tiny": (4, 8),
  "norm_scale": (24,),
}
SPECS = {
  "embed": P("data", None),
  "dense": {"kernel": P(None, "data"), "bias": P("data")},
  "small_rows": P("data", None),
  "small_cols": P(None, "data"),
  "tiny": P(None, "data"),
  "norm_scale": P(),
}
AXIS_TYPES = ("Explicit", "Auto")


def _host_tree(seed: int) -> dict:
  """The tree of float32 NumPy arrays every process (and the test) builds."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda shape: rng.normal(size=shape).astype(np.float32),
    SHAPES,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def _tx() -> optax.GradientTransformation:
  return optax.chain(jaxclip.clip_by_global_norm(MAX_NORM), optax.adam(LR))


def _clip(tree):
  return jaxclip.ops.clip_by_global_norm(tree, MAX_NORM)


def _step(params, state, grads):
  """One optimizer step: new params, the updates and the new state."""
  updates, state = _tx().update(grads, state, params)
  return optax.apply_updates(params, updates), updates, state


def _flat(prefix: str, tree) -> dict[str, np.ndarray]:
  """``tree``'s leaves as NumPy arrays, keyed ``prefix/their/path``."""

  def key(path):
    return "/".join([prefix, *(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)])

  return {key(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# DP-SGD's step across the processes: params replicated, the batch split over them.
DP_CLIP = 1.0
DP_BATCH = 16
DP_SHAPES = {"w1": (8, 16), "w2": (16, 4)}


def _dp_loss(p, x, y):
  return jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def _dp_data() -> tuple[dict, np.ndarray, np.ndarray]:
  """The params, inputs and targets every process (and the test) builds."""
  rng = np.random.default_rng(2)
  params = {k: (rng.normal(size=v) / 2).astype(np.float32) for k, v in DP_SHAPES.items()}
  x = rng.normal(size=(DP_BATCH, 8)).astype(np.float32)
  return params, x, rng.normal(size=(DP_BATCH, 4)).astype(np.float32)


def _dp_step_of(clipped_grad, tx):
  def step(params, state, x, y):
    grads, _ = clipped_grad(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), grads, state

  return step


def _collective_counts(compiled) -> dict[str, int]:
  """How many collectives of each kind the compiled HLO holds."""
  return dict(collections.Counter(kind for kind, _ in hlo_collectives(compiled.as_text())))


def _collective_types(compiled) -> list[str]:
  """The result type of every collective in the compiled HLO."""
  return [result for _, result in hlo_collectives(compiled.as_text())]


def _single_process_results() -> dict[str, np.ndarray]:
  """What the processes compute, computed on one device, keyed as theirs."""
  grads = jax.tree.map(jnp.asarray, _host_tree(0))
  params = jax.tree.map(jnp.asarray, _host_tree(1))
  state = jax.jit(_tx().init)(params)
  clipped, clip_norm = jax.jit(_clip)(grads)
  new_params, updates, new_state = jax.jit(_step)(params, state, grads)
  return {
    "norm": np.asarray(jax.jit(jaxclip.ops.global_norm)(grads)),
    "clip_norm": np.asarray(clip_norm),
    "pre_clip_norm": np.asarray(optax.tree.get(new_state, "pre_clip_norm")),
    **_flat("clipped", clipped),
    **_flat("params", new_params),
    **_flat("updates", updates),
  }


# ----------------------------------------------------------------------------
# The worker: one process of the multi-host job (this file run as a script)
# ----------------------------------------------------------------------------


def _global_tree(host, mesh: jax.sharding.Mesh, specs=SPECS):
  """``host`` as global arrays on ``mesh``; each process makes its own shards."""

  def make(x, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])

  return jax.tree.map(make, host, specs)


def _check_split_across_processes(tree: dict) -> None:
  """Every leaf but the replicated one has shards this process does not hold."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    assert len(leaf.addressable_shards) == LOCAL_DEVICES, (path, leaf.addressable_shards)
    if path[-1].key == "norm_scale":
      assert leaf.sharding.is_fully_replicated, (path, leaf.sharding)
    else:
      assert not leaf.is_fully_addressable, (path, leaf.sharding)
      held = sum(s.data.size for s in leaf.addressable_shards)
      assert held == leaf.size // N_PROCESSES, (path, held, leaf.size)


def _dp_results(mesh: jax.sharding.Mesh, report: dict, name: str) -> dict:
  """One DP-SGD step with the defaults (``method="auto"``, ``dp_noise(seed=None)``, made by
  every process), and one whose noise seed differs by process (a broken pipeline: the
  processes' replicas of the parameters drift apart, which test_processes_agree would flag)."""
  host_params, x, y = _dp_data()
  params = _global_tree(host_params, mesh, {k: P() for k in DP_SHAPES})
  x, y = _global_tree(x, mesh, P("data")), _global_tree(y, mesh, P("data"))
  clipped_grad = jaxclip.per_example_clipped_grad(_dp_loss, DP_CLIP, method="auto")
  results = {}
  for key, seed in (("dp", None), ("broken", jax.process_index())):
    tx = optax.chain(jaxclip.dp_noise(DP_CLIP, 1.0, seed=seed), optax.sgd(LR))
    state = jax.jit(tx.init)(params)
    new_params, grads, state = jax.jit(_dp_step_of(clipped_grad, tx))(params, state, x, y)
    results[key] = {"params": new_params, "grads": grads, "key": state[0].dp_noise_key}
  # dp_noise(seed=None) made inside a trace (its key broadcast at compile time): the same key
  # on every process (test_processes_agree).
  made_in_trace = jax.jit(lambda p: jaxclip.dp_noise(DP_CLIP, 1.0).init(p))(params)
  results["made_in_trace"] = {"key": made_in_trace.dp_noise_key}
  # ... and where the caller set a mesh (the sum's own mesh then differed from the context's:
  # "context mesh ... should match the aval mesh" on the Explicit mesh), outside jit and in it
  with jax.set_mesh(mesh):
    made_under_a_mesh = jaxclip.dp_noise(DP_CLIP, 1.0).init(params)
    made_in_trace = jax.jit(lambda p: jaxclip.dp_noise(DP_CLIP, 1.0).init(p))(params)
  results["made_under_a_mesh"] = {"key": made_under_a_mesh.dp_noise_key}
  results["made_in_trace_under_a_mesh"] = {"key": made_in_trace.dp_noise_key}
  report.setdefault("measured", {})[name] = [m.why for m in clipped_grad.measured.values()]
  return multihost_utils.process_allgather(results, tiled=True)


def _run_worker(process_id: int, port: int, out: Path) -> None:
  """Computes on the shared mesh and writes ``out``.npz and ``out``.json."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # The coordinator binds to all interfaces unless told otherwise: loopback only.
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    coordinator_bind_address=f"127.0.0.1:{port}",
    num_processes=N_PROCESSES,
    process_id=process_id,
    initialization_timeout=60,
  )
  assert jax.process_index() == process_id
  assert jax.process_count() == N_PROCESSES and jax.local_device_count() == LOCAL_DEVICES
  assert jax.device_count() == N_PROCESSES * LOCAL_DEVICES, jax.devices()
  arrays, report = {}, {"process_id": process_id, "collectives": {}, "collective_types": {}}
  for name in AXIS_TYPES:
    axis_type = getattr(jax.sharding.AxisType, name)
    mesh = jax.make_mesh((N_PROCESSES * LOCAL_DEVICES,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
      grads = _global_tree(_host_tree(0), mesh)
      params = _global_tree(_host_tree(1), mesh)
      _check_split_across_processes(grads)
      state = jax.jit(_tx().init)(params)
      compiled = {
        "global_norm": jax.jit(jaxclip.ops.global_norm).lower(grads).compile(),
        "clip_by_global_norm": jax.jit(_clip).lower(grads).compile(),
        "step": jax.jit(_step).lower(params, state, grads).compile(),
      }
      norm = compiled["global_norm"](grads)
      clipped, clip_norm = compiled["clip_by_global_norm"](grads)
      new_params, updates, new_state = compiled["step"](params, state, grads)
      for leaf, spec in zip(jax.tree.leaves(new_params), jax.tree.leaves(SPECS), strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
          leaf.sharding,
          spec,
        )
      results = {
        "norm": norm,
        "clip_norm": clip_norm,
        "pre_clip_norm": optax.tree.get(new_state, "pre_clip_norm"),
        "clipped": clipped,
        "params": new_params,
        "updates": updates,
      }
      gathered = multihost_utils.process_allgather(results, tiled=True)
    # No mesh set: jit reads the shardings from the arrays (a mesh set was not timed before).
    gathered.update(_dp_results(mesh, report, name))
    arrays.update(_flat(name, gathered))
    report["collectives"][name] = {k: _collective_counts(c) for k, c in compiled.items()}
    report["collective_types"][name] = {k: _collective_types(c) for k, c in compiled.items()}
  np.savez(f"{out}.npz", **arrays)
  Path(f"{out}.json").write_text(json.dumps(report))


# ----------------------------------------------------------------------------
# The test: starts the two workers, compares with one device
# ----------------------------------------------------------------------------


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
  env = dict(os.environ)
  flags = [
    f
    for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def _run_job(tmp: Path) -> list[tuple[int | None, str]]:
  """Runs the workers; their exit codes and outputs (None: killed)."""
  port = _free_port()
  logs = [open(tmp / f"log{i}.txt", "w+") for i in range(N_PROCESSES)]
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        __file__,
        "--process-id",
        str(i),
        "--port",
        str(port),
        "--out",
        str(tmp / f"process{i}"),
      ],
      env=_worker_env(),
      cwd=ROOT,
      text=True,
      stdout=log,
      stderr=subprocess.STDOUT,
    )
    for i, log in enumerate(logs)
  ]
  start = time.monotonic()
  deadline = start + TIMEOUT_S
  killed = [False] * len(procs)
  try:
    # A worker that fails leaves the other waiting on it: stop at the first failure.
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for i, p in enumerate(procs):
      if p.poll() is None:
        p.kill()
        killed[i] = True
      p.wait()
  took = time.monotonic() - start
  outputs = []
  for log, was_killed in zip(logs, killed, strict=True):
    log.seek(0)
    why = (
      f"\n[killed by the test after {took:.0f} s: "
      + (
        f"the wall-clock limit is {TIMEOUT_S} s; the machine may be overloaded]"
        if took >= TIMEOUT_S
        else "the other process had failed]"
      )
      if was_killed
      else ""
    )
    outputs.append(log.read() + why)
    log.close()
  return [(p.returncode, text) for p, text in zip(procs, outputs, strict=True)]


@pytest.fixture(scope="module")
def multihost_results():
  """The arrays and reports the two workers wrote, after checking they ran."""
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    runs = _run_job(tmp)
    message = "\n".join(
      f"--- process {i}: exit code {code} ---\n{text[-6000:]}"
      for i, (code, text) in enumerate(runs)
    )
    assert all(code == 0 for code, _ in runs), message
    results = []
    for i in range(N_PROCESSES):
      with np.load(tmp / f"process{i}.npz") as npz:
        arrays = dict(npz)
      results.append((arrays, json.loads((tmp / f"process{i}.json").read_text())))
  return results


def _agree(arrays: dict, first: dict, key: str) -> bool:
  return bool(np.array_equal(arrays[key], first[key]))


def test_processes_agree(multihost_results):
  (first, _), *others = multihost_results
  for arrays, _ in others:
    assert arrays.keys() == first.keys()
    for key in first:
      if "/broken/" not in key:  # the broken pipeline's replicas must differ (below)
        np.testing.assert_array_equal(arrays[key], first[key], err_msg=key)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_a_noise_seed_per_process_is_flagged(multihost_results, axis_type):
  # The check above flags a broken pipeline: with a seed that differs by process, each
  # process's replicas of the parameters get their own noise (the clipped sums still agree).
  (first, _), (second, _) = multihost_results
  broken = [k for k in first if k.startswith(f"{axis_type}/broken/")]
  assert not _agree(second, first, f"{axis_type}/broken/key")
  for key in broken:
    assert _agree(second, first, key) == ("/grads/" in key), key


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_dp_step_with_the_defaults_across_processes(multihost_results, axis_type):
  # method="auto" and dp_noise(seed=None), made by each process: the clipped sum equals one
  # device's, the noise is there (z C = 1), every replica gets the same (process 0's key,
  # test_processes_agree), and auto timed nothing (processes that picked different programs
  # failed at their first collective).
  arrays, report = multihost_results[0]
  got = {k.split("/dp/", 1)[1]: v for k, v in arrays.items() if k.startswith(f"{axis_type}/dp/")}
  params, x, y = _dp_data()
  fn = jaxclip.per_example_clipped_grad(_dp_loss, DP_CLIP, method="vmap")
  want, _ = jax.jit(fn)(params, x, y)
  noise = []
  for k in DP_SHAPES:
    np.testing.assert_allclose(got[f"grads/{k}"], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    noise.append(((params[k] - got[f"params/{k}"]) / LR - got[f"grads/{k}"]).ravel())
  noise = np.concatenate(noise)
  assert 0.7 < float(np.std(noise)) < 1.4, np.std(noise)
  (why,) = report["measured"][axis_type]
  assert why.startswith("a job of 2 processes"), why
  # the key of a dp_noise made inside a trace, or under a mesh set by the caller, is a fresh
  # secret one (and the same on every process: test_processes_agree)
  keys = [v for k, v in arrays.items() if k.startswith(f"{axis_type}/made_")]
  keys.append(arrays[f"{axis_type}/dp/key"])
  assert len(keys) == 4 and len({tuple(np.ravel(k)) for k in keys}) == 4, keys


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_multihost_matches_single_process(multihost_results, axis_type):
  arrays = {
    k.split("/", 1)[1]: v
    for k, v in multihost_results[0][0].items()
    if k.startswith(axis_type + "/")
    and k.split("/")[1] not in ("dp", "broken")
    and not k.split("/")[1].startswith("made_")
  }
  expected = _single_process_results()
  assert float(expected["norm"]) > MAX_NORM  # the clip is active
  host = _host_tree(0)
  numpy_norm = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(host)))
  np.testing.assert_allclose(arrays["norm"], numpy_norm, rtol=1e-6)
  np.testing.assert_allclose(arrays["pre_clip_norm"], numpy_norm, rtol=1e-6)
  assert arrays.keys() == expected.keys()
  for key, value in expected.items():
    assert arrays[key].shape == value.shape and arrays[key].dtype == value.dtype, key
    np.testing.assert_allclose(arrays[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


@pytest.mark.hlo
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_multihost_collectives_are_scalar_all_reduces(multihost_results, axis_type):
  report = multihost_results[0][1]
  counts = report["collectives"][axis_type]
  for fn, fn_counts in counts.items():
    assert set(fn_counts) == {"all-reduce"}, (fn, counts, report["collective_types"][axis_type])
    for result_type in report["collective_types"][axis_type][fn]:
      shapes = re.findall(r"\[([^\]]*)\]", result_type)
      assert shapes and all(s == "" for s in shapes), (fn, result_type)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--out", type=Path, required=True)
  args = parser.parse_args()
  try:
    _run_worker(args.process_id, args.port, args.out)
  except Exception:  # the test prints it with the other process's output
    traceback.print_exc()
    sys.exit(1)
