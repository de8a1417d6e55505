"""The ghost engine's ``scale`` rule: a layer norm's or RMS norm's scale vector.

The rule's squared norm against ``jax.vmap(jax.grad(...))`` on synthetic
records (the ``mul`` forms flax, equinox and hand-written norms trace to,
float32 and bfloat16, a scale shared by a scan's iterations, and an
adversarial example whose squares overflow float32); the analyser's view of
each library's scale; ghost against vmap for flax linen and nnx, equinox and
hand-written norms, in float32 and bfloat16, with and without a scan, each
scale reported ``"scale"`` by :func:`jaxclip.ghost_plan`.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxclip
from jaxclip.privacy._ghost._rules._scale import SCALE, scale_sumsq
from tests.ghost_helpers import compare as _compare
from tests.ghost_helpers import plan as _plan

N, T, D = 12, 5, 8


def _boundaries(plan, leaf):
  """The ``(site, k)`` boundaries of a leaf in an analysed plan."""
  return [
    (site, k)
    for site in plan.sites
    for k, info in enumerate(site.infos)
    if leaf in info.deps and site.outs
  ]


def _scale_site(loss, params, leaf, *example):
  """The one site of ``leaf``, checked to be a ``scale`` boundary of a view of it."""
  ((site, k),) = _boundaries(_plan(loss, params, *example), leaf)
  pos = site.param_positions()[k]
  assert SCALE.matches(site.eqn, site.roles, pos), site.name
  assert site.infos[k].view == leaf
  return site, k


# ----------------------------------------------------------------------------
# The squared norm, on synthetic records
# ----------------------------------------------------------------------------

# (scale's view, data operand's shape): how each library multiplies its scale.
_FORMS = {
  "row": (lambda s: s.reshape(1, D), (T, D)),  # linen/nnx, hand: x * scale
  "column": (lambda s: s.reshape(1, D), (T, 1)),  # linen/nnx: rsqrt(var + eps) * scale
  "vector": (lambda s: s, (D,)),  # x of shape (d,)
  "3d": (lambda s: s.reshape(1, 1, D), (2, T, D)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("form", sorted(_FORMS))
def test_sumsq_equals_the_per_example_gradients_norm(form, dtype):
  view, shape = _FORMS[form]
  ks = jax.random.split(jax.random.key(0), 3)
  s = (1 + jax.random.normal(ks[0], (D,))).astype(dtype)
  a = jax.random.normal(ks[1], (N, *shape)).astype(dtype)
  out = jnp.broadcast_shapes(shape, view(s).shape)
  g = jax.random.normal(ks[2], (N, *out)).astype(dtype)
  loss = lambda s, a, g: jnp.sum((g * (a * view(s))).astype(jnp.float32))
  site, k = _scale_site(loss, s, 0, a[0], g[0])
  got = SCALE.sumsq(site, k, None, a, g)
  grads = jax.vmap(jax.grad(loss), (None, 0, 0))(s, a, g)
  want = np.sum(np.asarray(grads, np.float64) ** 2, axis=1)
  if dtype == jnp.bfloat16:  # the rule sums in float32; the gradient is rounded to bfloat16
    a64, g64 = np.asarray(a, np.float64), np.asarray(g, np.float64)
    exact = g64 * (a64 * np.ones(out))
    exact = exact.reshape(N, -1, D).sum(1) if form != "vector" else exact
    want = np.sum(exact**2, axis=1)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_sumsq_of_a_scale_shared_by_a_scans_iterations_sums_them_first():
  ks = jax.random.split(jax.random.key(1), 2)
  a, g = jax.random.normal(ks[0], (N, 3, T, D)), jax.random.normal(ks[1], (N, 3, T, D))
  # one shared scan level: its axis follows the batch axis, summed with the rows
  got = scale_sumsq(a, g, (1, 2))
  want = np.sum(np.sum(np.asarray(a, np.float64) * np.asarray(g, np.float64), (1, 2)) ** 2, 1)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_sumsq_survives_huge_and_tiny_finite_records():
  """Squares of the records overflow or flush in float32 where the norm does not; a huge row
  whose output gradient is 0 does not set the scale (and flush every other row's terms)."""
  rng = np.random.default_rng(0)
  a = rng.normal(size=(4, T, D)).astype(np.float32)
  g = rng.normal(size=(4, T, D)).astype(np.float32)
  a[0] *= 1e25  # a^2 overflows; g a ~ 1e13
  g[0] *= 1e-12
  a[1] *= 1e-25  # tiny a, huge g: g a ~ 1
  g[1] *= 1e25
  a[2, 0], g[2, 0] = 3e38, 0.0  # a huge row that contributes nothing
  a[2, 1:] *= 1e-20
  g[2, 1:] *= 1e20
  a[3, :, 0] = 1e19  # one column's gradient near sqrt(float32 max)
  got = np.asarray(scale_sumsq(jnp.asarray(a), jnp.asarray(g), (1,)), np.float64)
  want = np.sum(np.sum(a.astype(np.float64) * g.astype(np.float64), axis=1) ** 2, axis=1)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  over = scale_sumsq(jnp.asarray(a[3:] * 1e10), jnp.asarray(g[3:]), (1,))
  assert np.isinf(np.asarray(over)).all()  # past float32's range: inf, never under-read


# ----------------------------------------------------------------------------
# The libraries' norms
# ----------------------------------------------------------------------------


class _Linen(linen.Module):
  rms: bool
  dtype: jnp.dtype = jnp.float32

  @linen.compact
  def __call__(self, x):
    h = linen.Dense(D, dtype=self.dtype)(x)
    if self.rms:
      h = linen.RMSNorm(dtype=self.dtype)(h)
    else:
      h = linen.LayerNorm(dtype=self.dtype, use_bias=False)(h)
    return linen.Dense(1, dtype=self.dtype)(h).astype(jnp.float32)


class _Nnx(nnx.Module):
  def __init__(self, rms, dtype, rngs):
    self.inp = nnx.Linear(D, D, dtype=dtype, rngs=rngs)
    norm = (
      nnx.RMSNorm(D, dtype=dtype, rngs=rngs)
      if rms
      else nnx.LayerNorm(D, dtype=dtype, use_bias=False, rngs=rngs)
    )
    self.norm = norm
    self.out = nnx.Linear(D, 1, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(self.inp(x))).astype(jnp.float32)


def _problem(library, rms, dtype, shape):
  """``(loss, params, x, y, scale path)`` of a dense, norm, dense model (nnx's path may end in
  ``.value``)."""
  ks = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(ks[0], (N, *shape)).astype(dtype)
  y = jax.random.normal(ks[1], (N,))
  fit = lambda out, y: jnp.mean((out - y) ** 2)
  if library == "linen":
    model = _Linen(rms, dtype)
    params = model.init(ks[2], x[0])["params"]
    params = jax.tree.map(lambda p: p * 1.5, params)  # a scale that is not 1
    name = "RMSNorm_0" if rms else "LayerNorm_0"
    return (
      lambda p, x, y: fit(model.apply({"params": p}, x), y),
      params,
      x,
      y,
      f"['{name}']['scale']",
    )
  if library == "nnx":
    graphdef, state = nnx.split(_Nnx(rms, dtype, nnx.Rngs(0)))
    state = jax.tree.map(lambda p: p * 1.5, state)
    return lambda s, x, y: fit(nnx.merge(graphdef, s)(x), y), state, x, y, "['norm']['scale']"
  if library == "equinox":
    k1, k2 = jax.random.split(ks[2])
    norm = eqx.nn.RMSNorm(D, use_bias=False) if rms else eqx.nn.LayerNorm(D, use_bias=False)
    model = (eqx.nn.Linear(D, D, key=k1), norm, eqx.nn.Linear(D, 1, key=k2))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = jax.tree.map(lambda p: p * 1.5, params)

    def loss(p, x, y):
      inp, nrm, out = eqx.combine(p, static)
      one = lambda v: out(nrm(inp(v.astype(jnp.float32))))
      h = jax.vmap(one)(x) if x.ndim > 1 else one(x)
      return fit(h, y)

    return loss, params, x, y, "[1].weight"
  # by hand: an RMS norm, x_hat * scale
  ks2 = jax.random.split(ks[2], 3)
  params = {
    "w": jax.random.normal(ks2[0], (D, D)) / 3,
    "scale": 1 + jax.random.normal(ks2[1], (D,)),
    "head": jax.random.normal(ks2[2], (D,)) / 3,
  }

  def loss(p, x, y):
    h = x @ p["w"].astype(x.dtype)
    h = h * jax.lax.rsqrt(jnp.mean(h.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6).astype(
      h.dtype
    )
    h = h * p["scale"].astype(h.dtype)
    return fit(jnp.sum(h.astype(jnp.float32) @ p["head"]), y)

  return loss, params, x, y, "['scale']"


_LIBRARIES = ["linen", "nnx", "equinox", "hand"]


@pytest.mark.parametrize("shape", [(T, D), (D,)], ids=["tokens", "vector"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("library", _LIBRARIES)
def test_analyser_sees_each_librarys_scale(library, rms, shape):
  loss, params, x, y, path = _problem(library, rms, jnp.float32, shape)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  (leaf,) = [j for j, (p, _) in enumerate(leaves) if jax.tree_util.keystr(p).startswith(path)]
  _scale_site(loss, params, leaf, x[0], y[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("library", _LIBRARIES)
def test_ghost_equals_vmap_and_plans_the_scale_rule(library, rms, dtype):
  loss, params, x, y, path = _problem(library, rms, dtype, (T, D))
  tol = {} if dtype == jnp.float32 else {"rtol": 3e-2, "atol": 1e-2}
  _compare(loss, params, x, y, batch_argnums=(1, 2), **tol)
  rules = jaxclip.ghost_plan(loss, params, x, y, batch_argnums=(1, 2)).rules
  assert [r for p, r in rules.items() if p.startswith(path)] == ["scale"], rules


def test_a_scale_repeated_by_broadcast_to_is_instantiated_exactly():
  """``jnp.broadcast_to`` repeats the scale's values: not a view of the leaf, so the rule does
  not take it (its gradient is a sum over the repeats) and the leaf is instantiated."""
  ks = jax.random.split(jax.random.key(5), 3)
  params = {"scale": 1 + jax.random.normal(ks[0], (D,)), "head": jax.random.normal(ks[1], (D,))}
  x = jax.random.normal(ks[2], (N, T, D))

  def loss(p, x):
    h = jnp.tanh(x) * jnp.broadcast_to(p["scale"], x.shape)
    return jnp.sum(jnp.tanh(h) @ p["head"]) ** 2

  _compare(loss, params, x, batch_argnums=1)
  assert jaxclip.ghost_plan(loss, params, x, batch_argnums=1).rules["['scale']"] == "instantiate"


# ----------------------------------------------------------------------------
# Scans
# ----------------------------------------------------------------------------


def test_linen_scan_over_layers_each_with_its_scale():
  class Block(linen.Module):
    @linen.compact
    def __call__(self, h, _):
      return h + linen.Dense(D)(jnp.tanh(linen.RMSNorm()(h))), None

  class Model(linen.Module):
    @linen.compact
    def __call__(self, x):
      stack = linen.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
      h, _ = stack()(x, None)
      return jnp.sum(linen.Dense(2)(h) ** 2)

  model = Model()
  xs = jax.random.normal(jax.random.key(6), (N, T, D))
  params = model.init(jax.random.key(7), xs[0])["params"]
  params = jax.tree.map(lambda p: p * 1.5, params)
  loss = lambda p, x: model.apply({"params": p}, x)
  _compare(loss, params, xs, batch_argnums=1, rtol=1e-4)
  rules = jaxclip.ghost_plan(loss, params, xs, batch_argnums=1).rules
  assert rules["['ScanBlock_0']['RMSNorm_0']['scale']"] == "scale"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_hand_scan_with_a_stacked_and_a_shared_scale(dtype):
  """One scale per layer (sliced from the scan's xs) and one every layer reads (closed over:
  its gradient sums the layers' before the square)."""
  ks = jax.random.split(jax.random.key(8), 4)
  params = {
    "w": jax.random.normal(ks[0], (3, D, D)) / 3,
    "scales": 1 + jax.random.normal(ks[1], (3, D)) / 2,
    "shared": 1 + jax.random.normal(ks[2], (D,)) / 2,
  }
  x = jax.random.normal(ks[3], (N, T, D)).astype(dtype)

  def loss(p, x):
    def layer(h, wl):
      w, s = wl
      h = h + jnp.tanh(h @ w.astype(dtype)) * s.astype(dtype) * p["shared"].astype(dtype)
      return h, None

    h, _ = jax.lax.scan(layer, x, (p["w"], p["scales"]))
    return jnp.sum(h.astype(jnp.float32) ** 2) / T

  tol = {} if dtype == jnp.float32 else {"rtol": 3e-2, "atol": 1e-2}
  _compare(loss, params, x, batch_argnums=1, **tol)
  rules = jaxclip.ghost_plan(loss, params, x, batch_argnums=1).rules
  assert rules["['scales']"] == "scale" and rules["['shared']"] == "scale", rules


def test_a_repeat_closed_over_by_a_scan_is_not_read_per_iteration():
  """A scale broadcast outside a scan whose iterations all read it: its gradient is their sum,
  so the rule does not take the iterations apart (the leaf is instantiated, exactly)."""
  ks = jax.random.split(jax.random.key(9), 2)
  params = {"scale": 1 + jax.random.normal(ks[0], (D,))}
  x = jax.random.normal(ks[1], (N, T, D))

  def loss(p, x):
    big = jnp.broadcast_to(p["scale"], (T, D))
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h * big), None), x, None, length=3)
    return jnp.sum(h**2)

  ((site, k),) = _boundaries(_plan(loss, params, x[0]), 0)
  assert site.stack and site.infos[k].view is None
  _compare(loss, params, x, batch_argnums=1)
  assert jaxclip.ghost_plan(loss, params, x, batch_argnums=1).rules["['scale']"] == "instantiate"


# ----------------------------------------------------------------------------
# An adversarial example
# ----------------------------------------------------------------------------


def test_huge_finite_activation_gives_vmaps_finite_norm():
  """An example whose activations' squares overflow float32 (and whose norm's square does not):
  the scale's norm is finite, and equal to the float64 one, as vmap's."""
  ks = jax.random.split(jax.random.key(10), 3)
  params = {"scale": 1 + jax.random.normal(ks[0], (D,))}
  head = np.asarray(jax.random.normal(ks[1], (T, D)), np.float32) * 1e-3
  x = np.array(jax.random.normal(ks[2], (N, T, D)), np.float32)
  x[3] *= 1e20  # x^2 ~ 1e40: past float32's range; the gradient ~ 1e17

  loss = lambda p, x: jnp.sum(head * (x * p["scale"]))
  want = np.sqrt(np.sum(np.sum(head.astype(np.float64) * x, axis=1) ** 2, axis=1))
  for method in ("vmap", "ghost"):
    fn = jaxclip.per_example_clipped_grad(loss, 1.0, method=method, return_norms=True)
    norms = np.asarray(jax.jit(fn)(params, jnp.asarray(x))[2], np.float64)
    assert np.all(np.isfinite(norms)), method
    np.testing.assert_allclose(norms, want, rtol=1e-5, err_msg=method)
  assert jaxclip.ghost_plan(loss, params, jnp.asarray(x)).rules["['scale']"] == "scale"
