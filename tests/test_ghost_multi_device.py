"""Ghost norms on 8 devices, against ``method="vmap"`` on one.

The GPT of ``tests.ghost_helpers`` under ``shard_map`` (with and without
microbatches and ``check_vma``), a scan over layers under ``shard_map`` (one
backward pass and two), and the GPT and an MLP under ``spmd_axis_name`` on
Explicit and Auto meshes, gathering no examples, and under ``jit`` of arrays sharded
on those meshes with no mesh set. The checks (``md_*``) run
in a subprocess on 8 virtual CPU devices, as in ``test_per_example.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from tests.ghost_helpers import gpt_loss
from tests.ghost_helpers import gpt_params as _gpt_params
from tests.ghost_helpers import gpt_tokens as _tokens
from tests.helpers import mlp_loss, mlp_problem, multi_device_checks

N_DEVICES = 8


@jax.jit
def _gpt_reference(clip, params, tokens):
  return jaxclip.per_example_clipped_grad(gpt_loss, clip, return_norms=True)(params, tokens)


def _reference(batch, seed):
  params, tokens = _gpt_params(seed), _tokens(batch, seed)
  clip = float(np.median(np.asarray(_gpt_reference(1.0, params, tokens)[2])))
  return params, tokens, clip, _gpt_reference(clip, params, tokens)


def _check(out, ref):
  assert int(out[1]) == int(ref[1]) and 0 < int(ref[1])
  for a, e in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0]), strict=True):
    # An entry is a sum over examples whose terms may cancel: its float32
    # rounding scales with the leaf's largest entry, not with its own size
    # (the sharded sums add in another order than the reference's).
    scale = max(1.0, float(np.max(np.abs(np.asarray(e)))))
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-6 * scale)


def md_ghost_in_shard_map():
  params, tokens, clip, ref = _reference(32, 1)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  for microbatch_size in (None, 3):
    for check_vma in (True, False):
      local = jaxclip.per_example_clipped_grad(
        gpt_loss, clip, microbatch_size=microbatch_size, axis_name="data", method="ghost"
      )
      with jax.set_mesh(mesh):
        xs = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        out = jax.jit(
          jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=check_vma
          )
        )(params, xs)
      _check(out, ref)


def _scan_loss(p, x):
  h, _ = jax.lax.scan(lambda h, lw: (jnp.tanh(h @ lw["w"] + lw["b"]), None), x, p)
  return jnp.sum(h**2)


def _remat_scan_loss(p, x):
  layer = jax.checkpoint(lambda h, lw: (jnp.tanh(h @ lw["w"] + lw["b"]), None))
  h, _ = jax.lax.scan(layer, x, p)
  return jnp.sum(h**2)


def md_ghost_scan_over_layers_in_shard_map():
  ks = jax.random.split(jax.random.key(3), 3)
  params = {"w": 0.5 * jax.random.normal(ks[0], (3, 6, 6)), "b": jax.random.normal(ks[1], (3, 6))}
  xs = jax.random.normal(ks[2], (16, 4, 6))
  norms = jaxclip.per_example_clipped_grad(_scan_loss, 1.0, return_norms=True)(params, xs)[2]
  clip = float(np.median(np.asarray(norms)))
  ref = jaxclip.per_example_clipped_grad(_scan_loss, clip)(params, xs)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  for loss in (_scan_loss, _remat_scan_loss):  # one pass, two passes
    for microbatch_size in (None, 1):
      local = jaxclip.per_example_clipped_grad(
        loss, clip, microbatch_size=microbatch_size, axis_name="data", method="ghost"
      )
      with jax.set_mesh(mesh):
        sharded = jax.device_put(xs, NamedSharding(mesh, P("data")))
        out = jax.jit(
          jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
        )(params, sharded)
      _check(out, ref)


def _spmd(axis_type, loss, params, batch, ref, clip):
  mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(axis_type,))
  with jax.set_mesh(mesh):
    xs = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in batch]
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    for microbatch_size in (None, 16, 24):  # 24: a padded last chunk
      fn = jaxclip.per_example_clipped_grad(
        loss,
        clip,
        microbatch_size=microbatch_size,
        batch_argnums=tuple(range(1, len(xs) + 1)),
        spmd_axis_name="data",
        method="ghost",
      )
      compiled = jax.jit(fn).lower(ps, *xs).compile()
      _check(compiled(ps, *xs), ref)
      assert "all-gather" not in compiled.as_text(), (axis_type, microbatch_size)


def md_ghost_under_spmd_axis_name_gathers_no_examples():
  # On an Explicit mesh JAX cannot shard a batched embedding lookup without an
  # out_sharding (method="vmap" fails there too): the GPT runs on an Auto mesh,
  # the MLP on both.
  params, tokens, clip, ref = _reference(32, 2)
  _spmd(jax.sharding.AxisType.Auto, gpt_loss, params, [tokens], ref, clip)
  params, x, y = mlp_problem(batch=32, seed=8)
  ref = jaxclip.per_example_clipped_grad(mlp_loss, 30.0, batch_argnums=(1, 2))(params, x, y)
  for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    for loss in (mlp_loss, jax.checkpoint(mlp_loss)):  # one pass, two passes
      _spmd(axis_type, loss, params, [x, y], ref, 30.0)


def md_ghost_on_sharded_arrays_without_a_mesh_set():
  # jit reads the mesh from the arrays' shardings (no jax.set_mesh): the engine's sharded
  # zeros took a bare PartitionSpec, which an Explicit mesh refused outside a mesh context.
  params, x, y = mlp_problem(batch=32, seed=9)
  ref = jaxclip.per_example_clipped_grad(mlp_loss, 30.0, batch_argnums=(1, 2))(params, x, y)
  for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(axis_type,))
    xs = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    # "auto" times nothing: its candidates timed on one device are not the program that runs
    # on eight. Under jit the tracers' types name the arrays' mesh (it timed them on one
    # device before); called outside jit, the arrays' own shardings do (JAX runs no program
    # outside jit on an Explicit mesh's arrays with no mesh set, vmap's neither).
    eager = axis_type == jax.sharding.AxisType.Auto
    for method, jitted in [("ghost", True), ("auto", True)] + [("auto", False)] * eager:
      fn = jaxclip.per_example_clipped_grad(mlp_loss, 30.0, batch_argnums=(1, 2), method=method)
      _check((jax.jit(fn) if jitted else fn)(ps, *xs), ref)
      if method == "auto":
        (m,) = fn.measured.values()
        assert m.pick is None and m.why == "an input spread over several devices", m.why


test_multi_device = multi_device_checks(globals(), N_DEVICES)
