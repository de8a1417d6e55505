"""Multi-device clipping: sharded trees under jit, shard_map, pmap, per-example clipping.

The checks that need several devices are the ``md_*`` functions below. They
run in a subprocess (this file run as a script) on 8 virtual CPU devices,
because ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set
before JAX is imported; each becomes one parametrized pytest case that reports
on its own (``tests.helpers.multi_device_checks``).
Everything else runs in-process on one device (``vmap`` with ``axis_name``
stands in for a device axis).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip._kernel import _sharding
from tests.helpers import (
  device_env,
  hlo_collectives,
  mlp_loss,
  mlp_problem,
  multi_device_checks,
  run_subprocess,
)

ROOT = Path(__file__).resolve().parents[1]
N_DEVICES = 8
CLIP = 30.0  # clips some examples of the test problems, not all

# ----------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------


def _assert_trees_close(actual, expected, rtol=2e-6, atol=1e-6):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    tol = 1e-2 if a.dtype == jnp.bfloat16 else rtol
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=tol, atol=atol
    )


@jax.jit
def _reference_per_example(params, x, y, clip):
  grads = jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0))(params, x, y)
  return jaxclip.per_example_global_norm_clip(grads, clip)


# FSDP-style layout on a ('data', 'model') mesh: kernels sharded on both axes,
# a bias sharded over 'model' only (replicated over 'data'), a norm scale
# replicated everywhere, an embedding sharded over 'data' only.
FSDP_SPECS = {
  "dense": {"kernel": P("data", "model"), "bias": P("model")},
  "out": {"kernel": P("model", "data")},
  "norm_scale": P(),
  "embed": P("data", None),
}


def _fsdp_host_tree(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "dense": {
      "kernel": rng.normal(size=(16, 8)).astype(np.float32),
      "bias": rng.normal(size=(8,)).astype(np.float32),
    },
    "out": {"kernel": rng.normal(size=(8, 16)).astype(jnp.bfloat16)},
    "norm_scale": rng.normal(size=(5,)).astype(np.float32),
    "embed": rng.normal(size=(32, 4)).astype(np.float32),
  }


def _compiled(fn, *args):
  """fn jitted and compiled for args: call it, and read its HLO."""
  return jax.jit(fn).lower(*args).compile()


def _collectives(compiled):
  """(kind, result type) of every collective in the compiled HLO."""
  return hlo_collectives(compiled.as_text())


# What the md_* checks compiled, by label: the collectives found in its HLO
# and whether they must all be scalar all-reduces (else all-reduces of any
# shape). The checks only record them; test_collectives (marker ``hlo``)
# asserts on them, so that the behavioural checks are not tied to the HLO
# text of one XLA version.
COLLECTIVES: dict[str, dict] = {}


def _record_collectives(label, compiled, scalar=True):
  assert label not in COLLECTIVES, label
  COLLECTIVES[label] = {"found": _collectives(compiled), "scalar": scalar}


def _collective_problems(found, scalar):
  """What is wrong with ``found``: collectives other than (scalar) all-reduces."""
  problems = [f"{kind} {result}" for kind, result in found if kind != "all-reduce"]
  if scalar:
    for _, result in found:
      shapes = re.findall(r"\[([^\]]*)\]", result)
      if not shapes or any(shape != "" for shape in shapes):
        problems.append(f"non-scalar all-reduce: {result}")
  return problems


# ----------------------------------------------------------------------------
# Multi-device checks (run in the subprocess)
# ----------------------------------------------------------------------------


def _meshes():
  types = jax.sharding.AxisType
  return [
    jax.make_mesh((4, 2), ("data", "model"), axis_types=(t, t))
    for t in (types.Explicit, types.Auto)
  ]


def mesh_kind(mesh):
  return "explicit" if mesh.axis_types[0] == jax.sharding.AxisType.Explicit else "auto"


# The tree of issue 14, smaller: 12 kernels (16, 8) over four PartitionSpecs
# and 6 biases (8,) over 'data' or 'model', all small enough to be grouped,
# three leaves to a group (issue 14 had 40 and 20: more leaves in a group
# take the same code path, and only make the compiles longer).
_MIXED_SPECS = [P("data", "model"), P("model", "data"), P("data", None), P(None, "model")]
_MIXED_TREE_SPECS = {
  **{f"k{i}": _MIXED_SPECS[i % 4] for i in range(12)},
  **{f"b{i}": P("data" if i % 2 else "model") for i in range(6)},
}


def _mixed_host_tree(seed):
  rng = np.random.default_rng(seed)
  return {
    name: rng.normal(size=(16, 8) if name[0] == "k" else (8,)).astype(np.float32)
    for name in _MIXED_TREE_SPECS
  }


def _every_transform():
  """name -> (transform, extra update kwargs) for every stateful transform."""
  adam = optax.adam(1e-2)
  return {
    "clip_by_global_norm + adam": (optax.chain(jaxclip.clip_by_global_norm(1.0), adam), {}),
    "clip_by_norm": (jaxclip.clip_by_norm(0.5), {}),
    "clip_by_average_norm": (jaxclip.clip_by_average_norm(0.01), {}),
    "clip_by_block_rms": (jaxclip.clip_by_block_rms(0.3), {}),
    "adaptive_grad_clip": (jaxclip.adaptive_grad_clip(0.05), {}),
    "clip": (jaxclip.clip(0.5), {}),
    "clip_by_value": (jaxclip.clip_by_value(-0.5, 0.3), {}),
    "skip_nonfinite(adam)": (jaxclip.skip_nonfinite(adam), {}),
    "skip_above(clip_by_global_norm + adam)": (
      jaxclip.skip_above(optax.chain(jaxclip.clip_by_global_norm(1.0), adam), 1e3),
      {},
    ),
    "record_norms + adam": (optax.chain(jaxclip.record_norms(), adam), {}),
    "zero_nonfinite": (jaxclip.zero_nonfinite(), {}),
    "skip_on_spike(adam)": (jaxclip.skip_on_spike(adam, window=4), {"loss": 1.5}),
    "autoclip": (jaxclip.autoclip(50.0, history=8), {}),
    "zclip": (jaxclip.zclip(warmup_steps=1), {}),
    "adagc": (jaxclip.adagc(warmup_steps=1), {}),
    "adaptive_value_clip": (jaxclip.adaptive_value_clip(0.9), {}),
    "adaptive_norm_scale": (jaxclip.adaptive_norm_scale(), {}),
    "optax.clip_by_global_norm + adam": (optax.chain(optax.clip_by_global_norm(1.0), adam), {}),
  }


def _every_kind_of_mesh():
  types = jax.sharding.AxisType
  devices = np.asarray(jax.devices()).reshape(4, 2)
  return {
    "legacy": jax.sharding.Mesh(devices, ("data", "model")),
    "auto": jax.make_mesh((4, 2), ("data", "model"), axis_types=(types.Auto,) * 2),
    "explicit": jax.make_mesh((4, 2), ("data", "model"), axis_types=(types.Explicit,) * 2),
  }


def _transform_on_every_kind_of_mesh(name):
  # Legacy Mesh (no mesh context), Auto and Explicit meshes: the transform
  # matches one device over two steps, keeps each leaf's sharding, and
  # (test_collectives) compiles to scalar all-reduces only.
  tx, extra = _every_transform()[name]
  host = _mixed_host_tree(3)
  params_host = _mixed_host_tree(4)
  single, single_params = (jax.tree.map(jnp.asarray, t) for t in (host, params_host))

  def two_steps(u, p):
    state = tx.init(p)
    for scale in (1.0, 3.0):
      out, state = tx.update(jax.tree.map(lambda x, s=scale: x * s, u), state, p, **extra)
    return out, state

  ref_out, ref_state = jax.jit(two_steps)(single, single_params)
  for kind, mesh in _every_kind_of_mesh().items():
    put = lambda t, mesh=mesh: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, _MIXED_TREE_SPECS
    )
    context = contextlib.nullcontext() if kind == "legacy" else jax.set_mesh(mesh)
    with context:
      tree, params = put(host), put(params_host)
      fn = _compiled(two_steps, tree, params)
      out, state = fn(tree, params)
    _assert_trees_close(out, ref_out, rtol=1e-5, atol=1e-6)
    _assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6)
    for o, t in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
      assert o.sharding.is_equivalent_to(t.sharding, o.ndim), (name, kind, o.sharding)
    # Unit-wise norms of a sharded kernel are vectors, all-reduced as such.
    _record_collectives(
      f"{kind}/{name} ({len(host)} mixed leaves, 2 steps)",
      fn,
      scalar="adaptive_grad_clip" not in name,
    )


def _transform_check(name):
  def check():
    with jax.numpy_dtype_promotion("standard"):  # optax's adam needs it
      _transform_on_every_kind_of_mesh(name)

  return check


# One check per transform, so that each reports on its own.
for _name in _every_transform():
  _slug = re.sub(r"\W+", "_", _name).strip("_")
  globals()[f"md_every_transform_on_every_kind_of_mesh__{_slug}"] = _transform_check(_name)


_jit_global_norm = jax.jit(jaxclip.ops.global_norm, static_argnames="ord")
_jit_clip_by_global_norm = jax.jit(jaxclip.ops.clip_by_global_norm)


def md_jit_sharded_ops_match_single_device():
  host = _fsdp_host_tree()
  single = jax.tree.map(jnp.asarray, host)
  for mesh in _meshes():
    with jax.set_mesh(mesh):
      tree = jax.tree.map(
        lambda x, s, mesh=mesh: jax.device_put(x, NamedSharding(mesh, s)), host, FSDP_SPECS
      )
      for ord in (2, 1, math.inf):
        norm_fn = _compiled(lambda t, ord=ord: jaxclip.ops.global_norm(t, ord=ord), tree)
        np.testing.assert_allclose(norm_fn(tree), _jit_global_norm(single, ord=ord), rtol=2e-6)
        _record_collectives(f"{mesh_kind(mesh)}/ops.global_norm ord={ord}", norm_fn)
      clip_fn = _compiled(lambda t: jaxclip.ops.clip_by_global_norm(t, 3.0), tree)
      (out, norm), (ref, ref_norm) = clip_fn(tree), _jit_clip_by_global_norm(single, 3.0)
      assert float(ref_norm) > 3.0  # the clip is active
      np.testing.assert_allclose(norm, ref_norm, rtol=2e-6)
      _assert_trees_close(out, ref)
      for o, t in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        assert o.sharding.is_equivalent_to(t.sharding, o.ndim), (o.sharding, t.sharding)
      _record_collectives(f"{mesh_kind(mesh)}/ops.clip_by_global_norm (FSDP tree)", clip_fn)


def md_jit_sharded_transform_keeps_shardings():
  host = _fsdp_host_tree(1)
  single = jax.tree.map(jnp.asarray, host)
  tx = optax.chain(jaxclip.clip_by_global_norm(2.0), optax.sgd(0.1, momentum=0.9))
  ref_updates, ref_state = jax.jit(lambda u: tx.update(u, tx.init(u), u))(single)
  for mesh in _meshes():
    with jax.set_mesh(mesh):
      tree = jax.tree.map(
        lambda x, s, mesh=mesh: jax.device_put(x, NamedSharding(mesh, s)), host, FSDP_SPECS
      )
      state = jax.jit(tx.init)(tree)
      update_fn = _compiled(lambda u, s: tx.update(u, s, u), tree, state)
      updates, new_state = update_fn(tree, state)
      _assert_trees_close(updates, ref_updates)
      np.testing.assert_allclose(
        optax.tree.get(new_state, "pre_clip_norm"),
        optax.tree.get(ref_state, "pre_clip_norm"),
        rtol=2e-6,
      )
      momentum = new_state[1][0].trace
      for u, m, t in zip(*map(jax.tree.leaves, (updates, momentum, tree)), strict=True):
        assert u.sharding.is_equivalent_to(t.sharding, u.ndim)
        assert m.sharding.is_equivalent_to(t.sharding, m.ndim)
      _record_collectives(f"{mesh_kind(mesh)}/clip_by_global_norm + sgd (FSDP tree)", update_fn)


def _local_norm_fn(mesh, ord, check_vma=True, **where):
  def local(t):
    return jaxclip.ops.global_norm(t, ord=ord, axis_name=("data", "model"), **where)

  return jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(FSDP_SPECS,), out_specs=P(), check_vma=check_vma)
  )


def md_shard_map_replicated_leaves_counted_once():
  host = _fsdp_host_tree(2)
  single = jax.tree.map(jnp.asarray, host)
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  with jax.set_mesh(mesh):
    tree = jax.tree.map(
      lambda x, s, mesh=mesh: jax.device_put(x, NamedSharding(mesh, s)), host, FSDP_SPECS
    )
    by_path = lambda path, leaf: {"bias": "data", "norm_scale": True, "embed": ("model",)}.get(
      path[-1].key, False
    )
    for check_vma in (True, False):
      for where in ({"partition_specs": FSDP_SPECS}, {"replicated": by_path}):
        for ord in (2, 1, math.inf):
          got = _local_norm_fn(mesh, ord, check_vma, **where)(tree)
          np.testing.assert_allclose(got, _jit_global_norm(single, ord=ord), rtol=2e-6)
    # Under check_vma=True the leaves' types say which are replicated.
    for ord in (2, 1, math.inf):
      got = _local_norm_fn(mesh, ord)(tree)
      np.testing.assert_allclose(got, _jit_global_norm(single, ord=ord), rtol=2e-6)
    # Under check_vma=False, without replicated=, every leaf counts as a
    # shard: the replicated ones are counted once per device, too large.
    naive = _local_norm_fn(mesh, 2, check_vma=False)(tree)
    assert float(naive) > 1.05 * float(_jit_global_norm(single))


def md_shard_map_transform_and_clip_op():
  host = _fsdp_host_tree(3)
  single = jax.tree.map(jnp.asarray, host)
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  tx = jaxclip.clip_by_global_norm(2.0, axis_name=("data", "model"), partition_specs=FSDP_SPECS)
  ref_out, ref_norm = _jit_clip_by_global_norm(single, 2.0)

  def local(t):
    updates, state = tx.update(t, tx.init(t))
    clipped, norm = jaxclip.ops.clip_by_global_norm(
      t, 2.0, axis_name=("data", "model"), partition_specs=FSDP_SPECS
    )
    return updates, state.pre_clip_norm, clipped, norm

  with jax.set_mesh(mesh):
    tree = jax.tree.map(
      lambda x, s, mesh=mesh: jax.device_put(x, NamedSharding(mesh, s)), host, FSDP_SPECS
    )
    fn = jax.jit(
      jax.shard_map(
        local, mesh=mesh, in_specs=(FSDP_SPECS,), out_specs=(FSDP_SPECS, P(), FSDP_SPECS, P())
      )
    )
    updates, pre_clip_norm, clipped, norm = fn(tree)
  for out, n in ((updates, pre_clip_norm), (clipped, norm)):
    np.testing.assert_allclose(n, ref_norm, rtol=2e-6)
    _assert_trees_close(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, ref_out))


def md_pmap_with_replicated_leaf():
  rng = np.random.default_rng(4)
  w = rng.normal(size=(N_DEVICES, 3, 2)).astype(np.float32)  # one shard per device
  b = rng.normal(size=(7,)).astype(np.float32)  # the same on every device
  full = {"w": jnp.asarray(w.reshape(-1, 2)), "b": jnp.asarray(b)}

  def local(w_shard, bias):
    tree = {"w": w_shard, "b": bias}
    replicated = {"w": False, "b": True}
    norm = jaxclip.ops.global_norm(tree, axis_name="i", replicated=replicated)
    inf_norm = jaxclip.ops.global_norm(tree, ord="inf", axis_name="i", replicated=replicated)
    clipped, _ = jaxclip.ops.clip_by_global_norm(tree, 1.5, axis_name="i", replicated=replicated)
    return norm, inf_norm, clipped

  norm, inf_norm, clipped = jax.pmap(local, axis_name="i", in_axes=(0, None))(w, b)
  ref_clipped, ref_norm = _jit_clip_by_global_norm(full, 1.5)
  np.testing.assert_allclose(norm, np.full(N_DEVICES, ref_norm), rtol=2e-6)
  np.testing.assert_allclose(inf_norm, _jit_global_norm(full, ord=math.inf))
  np.testing.assert_allclose(clipped["w"].reshape(-1, 2), ref_clipped["w"], rtol=2e-6)
  for i in range(N_DEVICES):
    np.testing.assert_allclose(clipped["b"][i], ref_clipped["b"], rtol=2e-6)


def md_per_example_clipping_in_shard_map():
  params, x, y = mlp_problem(batch=64)
  ref_sum, ref_count = _reference_per_example(params, x, y, CLIP)
  assert 0 < int(ref_count) < 64
  mesh = jax.make_mesh((N_DEVICES,), ("data",))

  def with_op(p, xb, yb):
    p = _sharding.as_varying(p, "data")
    grads = jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0))(p, xb, yb)
    return jaxclip.per_example_global_norm_clip(grads, CLIP, axis_name="data")

  helper = jaxclip.per_example_clipped_grad(
    mlp_loss, CLIP, microbatch_size=3, batch_argnums=(1, 2), axis_name="data"
  )
  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    for fn, check_vma in ((with_op, True), (helper, True), (helper, False)):
      if True:
        out = jax.jit(
          jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P()),
            check_vma=check_vma,
          )
        )(params, xs, ys)
        _assert_trees_close(out[0], ref_sum, rtol=1e-5, atol=1e-5)
        assert int(out[1]) == int(ref_count)


def md_per_example_helper_under_jit_with_spmd_axis_name():
  params, x, y = mlp_problem(batch=64, seed=1)
  ref_sum, ref_count = _reference_per_example(params, x, y, CLIP)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    for microbatch_size in (None, 16):
      fn = jaxclip.per_example_clipped_grad(
        mlp_loss, CLIP, microbatch_size=microbatch_size, batch_argnums=(1, 2), spmd_axis_name="data"
      )
      compiled = _compiled(fn, ps, xs, ys)
      total, count = compiled(ps, xs, ys)
      _assert_trees_close(total, ref_sum, rtol=1e-5, atol=1e-5)
      assert int(count) == int(ref_count)
      # Per-example gradients stay where their examples are: the only
      # collectives are the all-reduces of the summed gradient and count.
      _record_collectives(
        f"per_example_clipped_grad microbatch={microbatch_size}", compiled, scalar=False
      )
    bad = jaxclip.per_example_clipped_grad(
      mlp_loss, CLIP, microbatch_size=12, batch_argnums=(1, 2), spmd_axis_name="data"
    )
    with pytest.raises(ValueError, match="multiple of the 8 devices"):
      jax.jit(bad)(ps, xs, ys)


def _per_device(tree):
  """Each leaf with a new leading axis, to come out of shard_map once per device."""
  return jax.tree.map(lambda x: x[None], _sharding.as_varying(tree, "data"))


def _assert_same_on_every_device(tree, skip=lambda path: False):
  """Every leaf's rows (one per device) are bit-identical, but those ``skip`` names."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not skip(jax.tree_util.keystr(path)):
      x = np.asarray(x)
      assert x.shape[0] == N_DEVICES, (path, x.shape)
      for row in x[1:]:
        np.testing.assert_array_equal(row, x[0], err_msg=jax.tree_util.keystr(path))


def md_vma_inference_counts_replicated_gradients_once():
  params, x, y = mlp_problem(batch=8 * 4, seed=6)
  full_grad = jax.jit(jax.grad(mlp_loss))(params, x, y)
  expected = _jit_global_norm({"g": full_grad, "x": x})
  mesh = jax.make_mesh((N_DEVICES,), ("data",))

  def local(p, xb, yb, check_vma, **where):
    g = jax.grad(mlp_loss)(p, xb, yb)
    if not check_vma:
      # No types to read: the gradient is local, and its sum is replicated.
      g = jax.lax.psum(g, "data")
    tree = {"g": g, "x": xb}  # a replicated leaf and a shard
    clipped, norm = jaxclip.ops.clip_by_global_norm(tree, 1.0, axis_name="data", **where)
    return jaxclip.ops.global_norm(tree, axis_name="data", **where), norm, clipped["g"]

  routes = [
    (True, {}),  # inferred from jax.typeof(leaf)'s varying axes
    (True, {"replicated": {"g": True, "x": False}}),
    (False, {"replicated": {"g": True, "x": False}}),
    (False, {"partition_specs": {"g": P(), "x": P("data")}}),
  ]
  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    for check_vma, where in routes:
      fn = jax.shard_map(
        lambda p, xb, yb, c=check_vma, w=where: local(p, xb, yb, c, **w),
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P(), P()),
        check_vma=check_vma,
      )
      norm, clip_norm, clipped = jax.jit(fn)(params, xs, ys)
      np.testing.assert_allclose(norm, expected, rtol=1e-5, err_msg=str((check_vma, where)))
      np.testing.assert_allclose(clip_norm, expected, rtol=1e-5)
      _assert_trees_close(
        clipped, jax.tree.map(lambda t: t / expected, full_grad), rtol=1e-4, atol=1e-6
      )
    # Under check_vma=False, replicated=None takes every leaf for a shard: the
    # summed gradient counts once per device (why the docs ask for replicated=).
    naive = jax.jit(
      jax.shard_map(
        lambda p, xb, yb: local(p, xb, yb, False)[0],
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
        check_vma=False,
      )
    )(params, xs, ys)
    assert float(naive) > 2 * float(expected)


def md_loss_spike_on_one_device_skipped_on_all():
  params, x, y = mlp_problem(batch=8 * 4, seed=5)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  spike_step, num_steps = 6, 8

  def train(p, xb, yb, check_vma):
    where = {} if check_vma else {"replicated": True}
    tx = jaxclip.skip_on_spike(
      optax.sgd(1e-2, momentum=0.9), window=4, sigma=3.0, axis_name="data", **where
    )
    state, skipped = tx.init(p), []
    for step in range(num_steps):
      loss, g = jax.value_and_grad(mlp_loss)(p, xb, yb)  # loss: this device's
      if not check_vma:  # check_vma=True sums the gradient of a P() input already
        g = jax.lax.psum(g, "data")
      if step == spike_step:  # device 3 alone sees a spike
        loss = jnp.where(jax.lax.axis_index("data") == 3, 1e4, 1.0) * loss
      updates, state = tx.update(g, state, p, loss=loss)
      p = optax.apply_updates(p, updates)
      skipped.append(state.spike_step_skipped)
    return _per_device((p, state, jnp.stack(skipped)))

  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    for check_vma in (True, False):
      out = jax.jit(
        jax.shard_map(
          lambda p, xb, yb, c=check_vma: train(p, xb, yb, c),
          mesh=mesh,
          in_specs=(P(), P("data"), P("data")),
          out_specs=P("data"),
          check_vma=check_vma,
        )
      )(params, xs, ys)
      _assert_same_on_every_device(out)
      final_params, state, skipped = out
      assert np.all(np.asarray(skipped)[:, spike_step]), np.asarray(skipped)
      assert np.all(np.asarray(state.num_spike_skipped) >= 1)
      assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(final_params))


def md_nonfinite_gradient_on_one_device_skipped_on_all():
  num_steps, nan_step, bias_nan_step = 6, 3, 4
  rng = np.random.default_rng(7)
  w = rng.normal(size=(num_steps, 2 * N_DEVICES, 3)).astype(np.float32)
  w[nan_step, 2 * 5 + 1, 2] = np.nan  # in device 5's shard only
  b = rng.normal(size=(num_steps, 5)).astype(np.float32) * 3
  b[bias_nan_step, 0] = np.inf  # in the replicated leaf (every device sees it)
  grads = {"w": w, "b": b}
  specs = {"w": P("data"), "b": P()}
  params = {"w": np.zeros((2 * N_DEVICES, 3), np.float32), "b": np.zeros(5, np.float32)}

  def transforms(**kw):
    return {
      "skip": jaxclip.skip_nonfinite(
        optax.chain(
          jaxclip.autoclip(50.0, 8, **kw),
          jaxclip.zclip(warmup_steps=2, **kw),
          optax.sgd(0.1, momentum=0.9),
        ),
        axis_name=kw.get("axis_name"),
      ),
      "spike": jaxclip.skip_on_spike(optax.sgd(0.1), window=4, **kw),
      "zero": optax.chain(
        jaxclip.zero_nonfinite(**kw), jaxclip.clip_by_global_norm(1.0, **kw), optax.sgd(0.1)
      ),
    }

  def run(txs, p, gs):
    out = {}
    for name, tx in txs.items():
      q, state, trace = p, tx.init(p), []
      for step in range(num_steps):
        g = jax.tree.map(lambda a, step=step: a[step], gs)
        updates, state = tx.update(g, state, q)
        q = optax.apply_updates(q, updates)
        trace.append(
          jnp.stack(
            [
              optax.tree.get(state, "nonfinite_step_skipped", False),
              optax.tree.get(state, "spike_step_skipped", False),
            ]
          ).astype(jnp.int32)
          if name != "zero"
          else optax.tree.get(state, "num_nonfinite_zeroed")
        )
      out[name] = (q, state, jnp.stack(trace))
    return out

  expected = jax.jit(lambda p, gs: run(transforms(), p, gs))(params, grads)
  assert int(expected["zero"][2][bias_nan_step]) == 1  # one entry, counted once
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  grad_specs = {"w": P(None, "data"), "b": P()}
  with jax.set_mesh(mesh):
    put = lambda tree, specs: jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs
    )
    ps, gs = put(params, specs), put(grads, grad_specs)
    for check_vma in (True, False):
      kw = {"axis_name": "data"} if check_vma else {"axis_name": "data", "partition_specs": specs}
      fn = jax.shard_map(
        lambda p, g, kw=kw: _per_device(run(transforms(**kw), p, g)),
        mesh=mesh,
        in_specs=(specs, grad_specs),
        out_specs=P("data"),
        check_vma=check_vma,
      )
      got = jax.tree.map(np.asarray, jax.jit(fn)(ps, gs))
      # Everything but w's shards (and their moments) is the same everywhere,
      _assert_same_on_every_device(got, skip=lambda path: "['w']" in path)
      for name, (q, state, trace) in got.items():
        ref_q, ref_state, ref_trace = expected[name]
        # and it is what one device computes on the whole tree.
        np.testing.assert_array_equal(np.asarray(trace[0]), np.asarray(ref_trace), err_msg=name)
        np.testing.assert_allclose(
          np.asarray(q["w"]).reshape(-1, 3), ref_q["w"], rtol=1e-5, atol=1e-6, err_msg=name
        )
        np.testing.assert_allclose(q["b"][0], ref_q["b"], rtol=1e-5, atol=1e-6, err_msg=name)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
          if "['w']" not in jax.tree_util.keystr(path):
            np.testing.assert_allclose(
              np.asarray(leaf[0], np.float64),
              np.asarray(_get_path(ref_state, path), np.float64),
              rtol=1e-5,
              atol=1e-6,
              err_msg=f"{name} {jax.tree_util.keystr(path)}",
            )
      skipped = np.asarray(got["skip"][2])
      assert np.all(skipped[:, nan_step, 0] == 1) and np.all(skipped[:, bias_nan_step, 0] == 1)


def md_norm_spike_on_one_device_skipped_on_all():
  # skip_above, skip_bad_microbatches and record_norms inside shard_map: w is
  # sharded over 'data' and spikes (or holds a NaN) in device 2's shard only;
  # every device takes the decision one device takes on the whole tree.
  rng = np.random.default_rng(11)
  num_steps, spike_step, nan_step = 5, 2, 3
  w = rng.normal(size=(num_steps, 2 * N_DEVICES, 3)).astype(np.float32)
  w[spike_step, 2 * 2, 1] = 1e3
  w[nan_step, 2 * 2 + 1, 0] = np.nan
  b = rng.normal(size=(num_steps, 4)).astype(np.float32)
  grads, specs = {"w": w, "b": b}, {"w": P("data"), "b": P()}
  params = {"w": np.zeros((2 * N_DEVICES, 3), np.float32), "b": np.zeros(4, np.float32)}

  def run(p, gs, **kw):
    tx = jaxclip.skip_above(optax.chain(jaxclip.record_norms(**kw), optax.adam(0.1)), 100.0, **kw)
    fn = jaxclip.skip_bad_microbatches(100.0, **kw)
    state, trace = tx.init(p), []
    for step in range(num_steps):
      g = jax.tree.map(lambda a, step=step: a[step], gs)
      updates, state = tx.update(g, state, p)
      p = optax.apply_updates(p, updates)
      trace.append(
        jnp.stack(
          [
            state.above_step_skipped.astype(jnp.float32),
            fn(g, 0, p)[0].astype(jnp.float32),
            optax.tree.get(state, "global_norm"),
            optax.tree.get(state, "leaf_norms")["b"],
          ]
        )
      )
    return p, state, jnp.stack(trace)

  # optax's adam needs standard dtype promotion (its bias correction raises a
  # Python float to an int32 count).
  with jax.numpy_dtype_promotion("standard"):
    _norm_spike_checks(run, params, grads, specs, num_steps, spike_step, nan_step)


def _norm_spike_checks(run, params, grads, specs, num_steps, spike_step, nan_step):
  expected = jax.jit(run)(params, grads)
  skipped = np.asarray(expected[2])[:, :2]
  assert skipped[spike_step].all() and skipped[nan_step].all() and skipped.sum() == 4
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  grad_specs = {"w": P(None, "data"), "b": P()}
  with jax.set_mesh(mesh):
    put = lambda tree, sp: jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, sp
    )
    ps, gs = put(params, specs), put(grads, grad_specs)
    for check_vma in (True, False):
      kw = {"axis_name": "data"} if check_vma else {"axis_name": "data", "partition_specs": specs}
      fn = jax.shard_map(
        lambda p, g, kw=kw: _per_device(run(p, g, **kw)),
        mesh=mesh,
        in_specs=(specs, grad_specs),
        out_specs=P("data"),
        check_vma=check_vma,
      )
      q, state, trace = jax.tree.map(np.asarray, jax.jit(fn)(ps, gs))
      _assert_same_on_every_device((q["b"], trace, state.num_above_skipped))
      np.testing.assert_array_equal(trace[0][:, :2], np.asarray(expected[2])[:, :2])
      np.testing.assert_allclose(trace[0][:, 2:], np.asarray(expected[2])[:, 2:], rtol=1e-5)
      np.testing.assert_allclose(q["w"].reshape(-1, 3), expected[0]["w"], rtol=1e-5, atol=1e-6)


def _get_path(tree, path):
  leaves = dict(
    (jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  )
  return leaves[jax.tree_util.keystr(path)]


def _take_collectives():
  """What the check that just ended compiled (reported with its result, then forgotten)."""
  taken = dict(COLLECTIVES)
  COLLECTIVES.clear()
  return taken


# In the subprocess (this file run as a script) this runs the checks and exits.
test_multi_device = multi_device_checks(
  globals(),
  N_DEVICES,
  setup=lambda: jax.config.update("jax_numpy_dtype_promotion", "strict"),
  report=_take_collectives,
)


@pytest.mark.hlo
def test_collectives():
  """Every program the md_* checks compiled all-reduces scalars, nothing else.

  No all-to-all, collective-permute or all-gather (a resharding) on any kind
  of mesh. Per-example gradients all-reduce their sum, which is not a scalar.
  """
  runner = test_multi_device.runner()
  recorded = {}
  for name in runner.run_all():
    recorded.update(runner.data(name) or {})
  assert any(label.startswith("legacy/") for label in recorded)  # the checks ran
  problems = {
    label: p
    for label, r in recorded.items()
    if (p := _collective_problems(r["found"], r["scalar"]))
  }
  assert not problems, json.dumps(problems, indent=1)


def test_fsdp_example_runs():
  example = ROOT / "examples" / "fsdp_training.py"
  returncode, stdout, stderr, problem = run_subprocess(
    [sys.executable, str(example), "--steps", "40"], device_env(N_DEVICES)
  )
  assert returncode == 0, f"{problem}\n{stdout[-3000:]}{stderr[-3000:]}"
  assert "loss decreased" in stdout and "all-reduces of scalars only: True" in stdout, stdout


# ----------------------------------------------------------------------------
# One-device tests: replicated= resolution, vmap axes, the per-example helper
# ----------------------------------------------------------------------------


def test_leaf_reduction_axes_forms():
  tree = {"a": jnp.ones(2), "b": {"c": jnp.ones(3), "d": None}, "e": jnp.ones(1)}
  names = ("data", "model")
  axes = lambda r: _sharding.leaf_reduction_axes(tree, names, r)
  assert axes(None) == [names] * 3
  assert axes({"a": True, "b": False, "e": "model"}) == [(), names, ("data",)]
  assert axes({"a": ("data", "model"), "b": "data", "e": ("model",)}) == [(), ("model",), ("data",)]
  assert axes(lambda path, leaf: leaf.size == 3) == [names, (), names]
  specs = lambda s, axis_name=names: _sharding.leaf_reduction_axes(
    tree, axis_name, partition_specs=s
  )
  assert specs({"a": P(), "b": P(None, "model"), "e": P(("data", "model"))}) == [
    (),
    ("model",),
    names,
  ]
  assert specs(P("data")) == [("data",)] * 3
  assert specs({"a": P("model"), "b": P(), "e": P("data", "model")}, "data") == [(), (), ("data",)]


@pytest.mark.parametrize(
  "where, error, match",
  [
    ({"replicated": {"a": "expert"}}, ValueError, "not among axis_name"),
    ({"replicated": {"a": 3}}, TypeError, "axis name"),
    ({"replicated": {"a": True, "zzz": False}}, ValueError, "pytree prefix"),
    ({"replicated": lambda path, leaf: None}, TypeError, "leaf at \\['a'\\]"),
    # PartitionSpecs say where a leaf is sharded: they have their own argument.
    ({"replicated": {"a": P("i")}}, TypeError, "partition_specs="),
    ({"replicated": P()}, TypeError, "partition_specs="),
    ({"replicated": lambda path, leaf: P()}, TypeError, "partition_specs="),
    ({"partition_specs": {"a": True}}, TypeError, "PartitionSpecs only"),
    ({"partition_specs": {"zzz": P()}}, ValueError, "pytree prefix"),
    ({"replicated": True, "partition_specs": P()}, ValueError, "not both"),
  ],
)
def test_replicated_errors(where, error, match):
  with pytest.raises(error, match=match):
    jax.vmap(lambda a: jaxclip.ops.global_norm({"a": a}, axis_name="i", **where), axis_name="i")(
      jnp.ones((2, 3))
    )


def test_replicated_needs_axis_name_and_axis_names_distinct():
  with pytest.raises(ValueError, match="axis_name"):
    jaxclip.ops.global_norm({"a": jnp.ones(2)}, replicated=True)
  with pytest.raises(ValueError, match="axis_name"):
    jaxclip.ops.global_norm({"a": jnp.ones(2)}, partition_specs=P())
  with pytest.raises(ValueError, match="distinct"):
    jax.vmap(lambda a: jaxclip.ops.global_norm(a, axis_name=("i", "i")), axis_name="i")(
      jnp.ones((2, 3))
    )


@settings(max_examples=12, deadline=None)
@given(
  st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=4),
  st.sampled_from([1, 2, math.inf]),
  st.integers(0, 2**16),
)
def test_vmap_shards_match_whole_tree(leaf_specs, ord, seed):
  """Splitting the sharded leaves over a vmapped axis gives the whole tree's norm."""
  n, rng = 3, np.random.default_rng(seed)
  leaf_specs = [(1, False)] + leaf_specs  # vmap needs one mapped input
  leaves = [jnp.asarray(rng.normal(size=(n * rows, 2)), jnp.float32) for rows, _ in leaf_specs]
  replicated = [rep for _, rep in leaf_specs]
  shards = [x if rep else x.reshape(n, -1, 2) for x, rep in zip(leaves, replicated, strict=True)]
  in_axes = ([None if rep else 0 for rep in replicated],)
  local = lambda t: jaxclip.ops.global_norm(t, ord=ord, axis_name="i", replicated=replicated)
  got = jax.jit(jax.vmap(local, in_axes=in_axes, axis_name="i"))(shards)
  np.testing.assert_allclose(got, np.full(n, _jit_global_norm(leaves, ord=ord)), rtol=2e-6)


def test_transform_with_axis_name_under_vmap_and_grad_at_zero():
  tx = jaxclip.clip_by_global_norm(1.0, axis_name="i", replicated={"w": False, "b": True})
  w, b = jnp.array([[3.0], [4.0]]), jnp.array([0.0])  # global norm 5

  def step(w_shard, bias):
    updates, state = tx.update({"w": w_shard, "b": bias}, tx.init({"w": w_shard, "b": bias}))
    return updates["w"], state.pre_clip_norm

  upd, norm = jax.vmap(step, in_axes=(0, None), axis_name="i")(w, b)
  np.testing.assert_allclose(norm, [5.0, 5.0])
  np.testing.assert_allclose(upd, [[0.6], [0.8]], rtol=1e-6)
  grad = jax.vmap(jax.grad(lambda x: jaxclip.ops.global_norm(x, axis_name="i")), axis_name="i")(
    jnp.zeros((2, 3))
  )
  assert np.all(np.asarray(grad) == 0)


def test_per_example_global_norm_clip_axis_name_under_vmap():
  params, x, y = mlp_problem(batch=12)
  grads = jax.jit(jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0)))(params, x, y)
  ref_sum, ref_count = _reference_per_example(params, x, y, CLIP)
  split = jax.tree.map(lambda g: g.reshape((3, 4) + g.shape[1:]), grads)
  out, count = jax.jit(
    jax.vmap(lambda g: jaxclip.per_example_global_norm_clip(g, CLIP, axis_name="i"), axis_name="i")
  )(split)
  _assert_trees_close(jax.tree.map(lambda a: a[1], out), ref_sum, rtol=1e-5, atol=1e-5)
  assert list(np.asarray(count)) == [int(ref_count)] * 3


@pytest.mark.parametrize("microbatch_size", [None, 1, 4, 5, 12, 50])
def test_per_example_clipped_grad_matches_per_example_clip(microbatch_size):
  params, x, y = mlp_problem(batch=12)
  ref_sum, ref_count = _reference_per_example(params, x, y, CLIP)
  assert 0 < int(ref_count) < 12
  fn = jaxclip.per_example_clipped_grad(
    mlp_loss, CLIP, microbatch_size=microbatch_size, batch_argnums=(1, 2)
  )
  total, count = jax.jit(fn)(params, x, y)
  _assert_trees_close(total, ref_sum, rtol=1e-5, atol=1e-5)
  assert int(count) == int(ref_count) and count.dtype == ref_count.dtype


def test_per_example_clipped_grad_options():
  params, x, y = mlp_problem(batch=6)
  ref_sum, _ = _reference_per_example(params, x, y, 0.5)
  # A shared (non-batch) argument before the batch, and each example seen
  # with a batch axis of one.
  loss = lambda p, scale, xb, yb: scale * mlp_loss(p, xb[0], yb[0])
  fn = jaxclip.per_example_clipped_grad(
    loss, 0.5, microbatch_size=4, batch_argnums=(2, 3), keep_batch_dim=True
  )
  total, _ = jax.jit(fn)(params, jnp.float32(1.0), x, y)
  _assert_trees_close(total, ref_sum, rtol=1e-5, atol=1e-5)
  # The threshold may be traced.
  traced = jax.jit(
    lambda c: jaxclip.per_example_clipped_grad(
      mlp_loss, c, microbatch_size=4, batch_argnums=(1, 2)
    )(params, x, y)
  )(0.5)
  _assert_trees_close(traced[0], ref_sum, rtol=1e-5, atol=1e-5)


def test_per_example_clipped_grad_padding_drops_nonfinite():
  # The padding examples are zeros; log(0) makes their gradients non-finite.
  loss = lambda w, x: jnp.sum(jnp.log(x) * w)
  x = jnp.array([[1.0, 2.0], [3.0, 0.5], [2.0, 2.0]])
  fn = jaxclip.per_example_clipped_grad(loss, 1.0, microbatch_size=2)
  total, count = jax.jit(fn)(jnp.ones(2), x)
  grads = jnp.log(x)
  ref, ref_count = jaxclip.per_example_global_norm_clip([grads], 1.0)
  np.testing.assert_allclose(total, ref[0], rtol=1e-6)
  assert int(count) == int(ref_count)


def test_per_example_clipped_grad_half_precision_params():
  params, x, y = mlp_problem(batch=8)
  ref_sum, _ = _reference_per_example(params, x, y, CLIP)
  half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  loss = lambda p, xb, yb: mlp_loss(jax.tree.map(lambda a: a.astype(jnp.float32), p), xb, yb)
  total, _ = jax.jit(
    jaxclip.per_example_clipped_grad(loss, CLIP, microbatch_size=2, batch_argnums=(1, 2))
  )(half, x, y)
  # float32 for bfloat16 params: the noise goes on before any rounding (issue #48)
  assert all(t.dtype == jnp.float32 for t in jax.tree.leaves(total))
  for t, r in zip(jax.tree.leaves(total), jax.tree.leaves(ref_sum), strict=True):
    np.testing.assert_allclose(np.asarray(t, np.float32), r, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
  "kwargs, args, match",
  [
    ({"microbatch_size": 0}, None, "positive integer"),
    ({"batch_argnums": 0}, None, "batch_argnums"),
    ({}, (jnp.ones(3), jnp.ones((4, 3)), jnp.ones((5, 3))), "batch dimension"),
    ({"batch_argnums": 3}, (jnp.ones(3), jnp.ones((4, 3))), "batch_argnums"),
  ],
)
def test_per_example_clipped_grad_errors(kwargs, args, match):
  loss = lambda w, x, *rest: jnp.dot(w, x)
  kwargs = {"batch_argnums": (1, 2), **kwargs} if args and len(args) == 3 else kwargs
  with pytest.raises(ValueError, match=match):
    fn = jaxclip.per_example_clipped_grad(loss, 1.0, **kwargs)
    fn(*(args or (jnp.ones(3), jnp.ones((4, 3)))))


def test_per_example_clipped_grad_rejects_bad_threshold_and_int_params():
  with pytest.raises(ValueError, match="l2_norm_clip"):
    jaxclip.per_example_clipped_grad(lambda w, x: w @ x, -1.0)
  with pytest.raises(TypeError, match="per_example_clipped_grad"):
    jaxclip.per_example_clipped_grad(lambda w, x: w @ x, 1.0)(
      jnp.ones(3, jnp.int32), jnp.ones((2, 3))
    )
