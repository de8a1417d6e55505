"""Per-example clipping: ``has_aux`` and ``per_example_layer_norm_clip``'s ``axis_name``.

The checks that need several devices (``md_*``) run in a subprocess (this
file run as a script) on 8 virtual CPU devices, as in ``test_distributed.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip._kernel import _sharding
from tests.helpers import mlp_loss, mlp_problem, multi_device_checks

N_DEVICES = 8
CLIP = 30.0  # clips some examples of the test problem, not all


def _loss_aux(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  pred = h @ params["w2"]
  loss = jnp.sum((pred - y) ** 2)
  return loss, {"pred": pred, "loss": loss, "argmax": jnp.argmax(pred)}


@jax.jit
def _vmap_aux(params, x, y):
  return jax.vmap(_loss_aux, in_axes=(None, 0, 0))(params, x, y)[1]


@jax.jit
def _per_example_grads(params, x, y):
  return jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0))(params, x, y)


def _assert_trees_close(actual, expected, rtol=1e-5, atol=1e-5):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# has_aux, on one device
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("microbatch_size", [None, 1, 5, 12, 50])
def test_has_aux_returns_each_examples_aux_in_batch_order(microbatch_size):
  params, x, y = mlp_problem()
  kwargs = {"microbatch_size": microbatch_size, "batch_argnums": (1, 2)}
  total, count, aux = jax.jit(
    jaxclip.per_example_clipped_grad(_loss_aux, CLIP, has_aux=True, **kwargs)
  )(params, x, y)
  ref_total, ref_count = jax.jit(jaxclip.per_example_clipped_grad(mlp_loss, CLIP, **kwargs))(
    params, x, y
  )
  assert 0 < int(ref_count) < 12 and int(count) == int(ref_count)
  _assert_trees_close(total, ref_total, rtol=0, atol=0)
  _assert_trees_close(aux, _vmap_aux(params, x, y), rtol=1e-6, atol=1e-6)


def test_has_aux_with_shared_argument_and_keep_batch_dim():
  params, x, y = mlp_problem(batch=7)

  # The batch after a shared argument; each example seen as a batch of one,
  # so the aux keeps that axis of one.
  def loss(p, scale, xb, yb):
    value, aux = _loss_aux(p, xb, yb)
    return scale * value, aux

  fn = jaxclip.per_example_clipped_grad(
    loss, CLIP, microbatch_size=3, batch_argnums=(2, 3), keep_batch_dim=True, has_aux=True
  )
  total, _, aux = jax.jit(fn)(params, jnp.float32(1.0), x, y)
  ref_total, _ = jaxclip.per_example_global_norm_clip(_per_example_grads(params, x, y), CLIP)
  _assert_trees_close(total, ref_total)
  expected = _vmap_aux(params, x[:, None], y[:, None])
  assert aux["pred"].shape == (7, 1, 3) and aux["loss"].shape == (7,)
  _assert_trees_close(aux, expected, rtol=1e-6, atol=1e-6)


def test_has_aux_under_vmap_with_axis_name_keeps_each_devices_examples():
  # vmap with axis_name stands in for a device axis: 3 "devices" of 4 examples.
  params, x, y = mlp_problem()
  split = lambda a: a.reshape((3, 4) + a.shape[1:])
  fn = jaxclip.per_example_clipped_grad(
    _loss_aux, CLIP, microbatch_size=3, batch_argnums=(1, 2), axis_name="i", has_aux=True
  )
  total, count, aux = jax.jit(jax.vmap(fn, in_axes=(None, 0, 0), axis_name="i"))(
    params, split(x), split(y)
  )
  ref_total, ref_count = jaxclip.per_example_global_norm_clip(
    _per_example_grads(params, x, y), CLIP
  )
  _assert_trees_close(jax.tree.map(lambda t: t[2], total), ref_total)
  assert list(np.asarray(count)) == [int(ref_count)] * 3
  _assert_trees_close(
    jax.tree.map(lambda a: a.reshape((12,) + a.shape[2:]), aux),
    _vmap_aux(params, x, y),
    rtol=1e-6,
    atol=1e-6,
  )


def test_has_aux_needs_a_pair():
  fn = jaxclip.per_example_clipped_grad(lambda w, x: jnp.dot(w, x), 1.0, has_aux=True)
  with pytest.raises((TypeError, ValueError)):
    fn(jnp.ones(2), jnp.ones((3, 2)))


# ----------------------------------------------------------------------------
# per_example_layer_norm_clip(axis_name=), on one device
# ----------------------------------------------------------------------------


def _row(tree, i):
  """Row ``i`` (one device's result) of every leaf."""
  return jax.tree.map(lambda a: a[i], tree)


@pytest.mark.parametrize("uniform", [True, False])
def test_layer_norm_clip_axis_name_under_vmap(uniform):
  params, x, y = mlp_problem()
  grads = _per_example_grads(params, x, y)
  ref_sum, ref_count = jaxclip.per_example_layer_norm_clip(grads, CLIP / 3, uniform)
  assert 0 < sum(int(c) for c in jax.tree.leaves(ref_count))
  split = jax.tree.map(lambda g: g.reshape((3, 4) + g.shape[1:]), grads)
  out, count = jax.jit(
    jax.vmap(
      lambda g: jaxclip.per_example_layer_norm_clip(g, CLIP / 3, uniform, axis_name="i"),
      axis_name="i",
    )
  )(split)
  for device in range(3):
    _assert_trees_close(_row(out, device), ref_sum)
    assert jax.tree.map(int, _row(count, device)) == jax.tree.map(int, ref_count)


# ----------------------------------------------------------------------------
# 8 devices (run in the subprocess)
# ----------------------------------------------------------------------------


def md_layer_norm_clip_in_shard_map():
  params, x, y = mlp_problem(batch=64, seed=1)
  grads = _per_example_grads(params, x, y)
  for mesh_shape, names in (((N_DEVICES,), ("data",)), ((4, 2), ("data", "model"))):
    mesh = jax.make_mesh(mesh_shape, names)
    axis = names if len(names) > 1 else names[0]
    for uniform in (True, False) if len(names) == 1 else (True,):
      ref_sum, ref_count = jaxclip.per_example_layer_norm_clip(grads, CLIP / 3, uniform)
      assert 0 < sum(int(c) for c in jax.tree.leaves(ref_count)) < 64 * 3

      def local(p, xb, yb, uniform=uniform, axis=axis):
        p = _sharding.as_varying(p, axis)
        return jaxclip.per_example_layer_norm_clip(
          _per_example_grads(p, xb, yb), CLIP / 3, uniform, axis_name=axis
        )

      for check_vma in (True, False) if len(names) == 1 else (True,):
        with jax.set_mesh(mesh):
          xs, ys = (jax.device_put(a, NamedSharding(mesh, P(names))) for a in (x, y))
          out, count = jax.jit(
            jax.shard_map(
              local,
              mesh=mesh,
              in_specs=(P(), P(names), P(names)),
              out_specs=(P(), P()),
              check_vma=check_vma,
            )
          )(params, xs, ys)
        _assert_trees_close(out, ref_sum)
        assert jax.tree.map(int, count) == jax.tree.map(int, ref_count)


def md_has_aux_in_shard_map_and_under_spmd_axis_name():
  params, x, y = mlp_problem(batch=64, seed=2)
  ref_sum, ref_count = jaxclip.per_example_global_norm_clip(_per_example_grads(params, x, y), CLIP)
  ref_aux = _vmap_aux(params, x, y)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    results = []
    for microbatch_size in (None, 3):
      local = jaxclip.per_example_clipped_grad(
        _loss_aux,
        CLIP,
        microbatch_size=microbatch_size,
        batch_argnums=(1, 2),
        axis_name="data",
        has_aux=True,
      )
      results.append(
        jax.jit(
          jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P(), P("data"))
          )
        )(params, xs, ys)
      )
    for microbatch_size in (None, 16, 24):  # 24: a padded last chunk
      fn = jaxclip.per_example_clipped_grad(
        _loss_aux,
        CLIP,
        microbatch_size=microbatch_size,
        batch_argnums=(1, 2),
        spmd_axis_name="data",
        has_aux=True,
      )
      out = jax.jit(fn)(ps, xs, ys)
      # The aux stays with the examples: sharded over 'data' like the batch.
      assert out[2]["pred"].sharding.spec[0] == "data", out[2]["pred"].sharding
      results.append(out)
  for total, count, aux in results:
    _assert_trees_close(total, ref_sum)
    assert int(count) == int(ref_count)
    _assert_trees_close(aux, ref_aux, rtol=1e-6, atol=1e-6)


def md_per_layer_clip_and_normalize_under_spmd_axis_name_and_in_shard_map():
  """A clip norm per layer and automatic clipping, both methods: the batch sharded under jit
  (``spmd_axis_name``) and split inside ``shard_map`` (``axis_name``), against the clip of
  materialised per-example gradients (itself checked in NumPy in test_per_layer_clip.py)."""
  params, x, y = mlp_problem(batch=64, seed=4)
  clip = {"w1": 8.0, "b1": 3.0, "w2": 20.0}
  grads = _per_example_grads(params, x, y)
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    # one compile per method and mode: normalize changes only the weights
    for method, normalize in (("vmap", None), ("ghost", 0.01)):
      ref_sum, ref_count = jaxclip.per_example_global_norm_clip(grads, clip, normalize=normalize)
      assert normalize is not None or 0 < int(ref_count["w1"]) < 64
      kwargs = dict(method=method, normalize=normalize, batch_argnums=(1, 2), return_norms=True)
      spmd = jaxclip.per_example_clipped_grad(
        mlp_loss, clip, microbatch_size=16, spmd_axis_name="data", **kwargs
      )
      local = jaxclip.per_example_clipped_grad(mlp_loss, clip, axis_name="data", **kwargs)
      mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P(), P("data")),
      )
      for total, count, norms in (jax.jit(spmd)(ps, xs, ys), jax.jit(mapped)(params, xs, ys)):
        _assert_trees_close(total, ref_sum, atol=1e-4)  # sums of 64 terms up to 40
        assert jax.tree.map(int, count) == jax.tree.map(int, ref_count)
        for k in clip:
          expect = np.linalg.norm(np.asarray(grads[k]).reshape(64, -1), axis=1)
          np.testing.assert_allclose(np.asarray(norms[k]), expect, rtol=1e-5)


test_multi_device = multi_device_checks(
  globals(), N_DEVICES, setup=lambda: jax.config.update("jax_numpy_dtype_promotion", "strict")
)
