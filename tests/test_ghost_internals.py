"""The ghost engine's reading of JAX internals (issue #38).

* A higher-order primitive the engine does not know (a fake one registered
  here, or a known one "renamed" by editing the engine's name table) makes
  the whole loss take ``method="vmap"``, visibly: the plan names it, and the
  clipped sum equals ``method="vmap"``'s.
* A weight that a ``lax.scan`` closes over is reported as a scan constant,
  not as "transformed".
* ``per_example_clipped_grad`` exports with a symbolic batch dimension
  (``jax.export``), for both methods, and the exported program gives the
  jitted function's results at several batch sizes.
"""

from __future__ import annotations

import warnings

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import ad, batching, mlir

import jaxclip
from jaxclip.privacy import _ghost
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._rules import _instantiate
from tests.helpers import assert_tree_allclose

FAKE = "fake_call_for_ghost_tests"


# ----------------------------------------------------------------------------
# A higher-order primitive unknown to the engine: a call under another name
# ----------------------------------------------------------------------------


def _run(*args, jaxpr):
  return jex.jaxpr_as_fun(jaxpr)(*args)


def _fake_jvp(primals, tangents, *, jaxpr):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  out, dout = jax.jvp(lambda *a: _run(*a, jaxpr=jaxpr), tuple(primals), tuple(tangents))
  return list(out), list(dout)


def _fake_batch(args, dims, *, jaxpr):
  out = jax.vmap(lambda *a: _run(*a, jaxpr=jaxpr), in_axes=dims)(*args)
  return out, [0] * len(out)


fake_p = jex.Primitive(FAKE)
fake_p.multiple_results = True
fake_p.def_impl(_run)
fake_p.def_abstract_eval(lambda *args, jaxpr: jaxpr.out_avals)
ad.primitive_jvps[fake_p] = _fake_jvp
batching.primitive_batchers[fake_p] = _fake_batch
mlir.register_lowering(fake_p, mlir.lower_fun(_run, multiple_results=True))


def fake_call(f, *args):
  """``f(*args)`` (a list of arrays) through the fake primitive, its body a sub-jaxpr."""
  return fake_p.bind(*args, jaxpr=jax.make_jaxpr(f)(*args))


def _problem(batch=12):
  ks = jax.random.split(jax.random.key(7), 5)
  params = {
    "w": 0.5 * jax.random.normal(ks[0], (4, 6)),
    "b": 0.1 * jax.random.normal(ks[1], (6,)),
    "v": 0.5 * jax.random.normal(ks[2], (6, 3)),
  }
  x = jax.random.normal(ks[3], (batch, 4))
  y = jax.random.normal(ks[4], (batch, 3))
  return params, x, y


def _dense(w, b, x):
  return [jnp.tanh(x @ w + b)]


def _fake_loss(p, x, y):
  (h,) = fake_call(_dense, p["w"], p["b"], x)
  return jnp.sum((h @ p["v"] - y) ** 2)


def _compare_methods(loss, params, *args, falls_back=None):
  """Both methods at the median norm (some examples clipped, some not): the same outputs;
  ``method="ghost"`` warns that it runs vmap's program where (and only where) it
  ``falls_back`` (a text of the warning)."""
  vmap = jax.jit(
    lambda clip, *a: jaxclip.per_example_clipped_grad(loss, clip, return_norms=True)(*a)
  )
  clip = float(np.median(np.asarray(vmap(1.0, params, *args)[2])))
  ref = vmap(clip, params, *args)
  ghost = jax.jit(jaxclip.per_example_clipped_grad(loss, clip, method="ghost", return_norms=True))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = ghost(params, *args)
  said = [str(w.message) for w in caught if "runs the program of method='vmap'" in str(w.message)]
  if falls_back is None:
    assert not said, said
  else:
    assert len(said) == 1 and falls_back in said[0], said
    assert "per_example_clipped_grad(method='ghost')" in said[0]
  assert 0 < int(ref[1]) < args[0].shape[0]
  assert int(got[1]) == int(ref[1])
  assert_tree_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=1e-5, atol=1e-6)


def _assert_falls_back(plan, named):
  assert set(plan.rules.values()) == {"instantiate"}
  for leaf in plan.leaves:
    assert "method='vmap'" in leaf.reason and named in leaf.reason, leaf.reason
  assert named in str(plan) and plan.fallback_share == 1.0 and plan.passes == 1


def test_unknown_higher_order_primitive_falls_back_to_vmap_and_is_named():
  params, x, y = _problem()
  (eqn,) = [e for e in jax.make_jaxpr(_fake_loss)(params, x[0], y[0]).eqns if e.primitive is fake_p]
  assert _jax.sub_jaxprs(eqn) and _jax.unreadable(eqn) is not None
  plan = jaxclip.ghost_plan(_fake_loss, params, x, y)
  _assert_falls_back(plan, f"`{FAKE}`")
  traced = _ghost.trace(_fake_loss, params, [x, y], [0, 1], has_aux=False)
  for method in ("ghost", "auto"):  # either method takes vmap's program, and says why
    for platform in ("cpu", None):
      plan, why = _ghost.plan_for(traced.plan, method, platform)
      assert plan is None and f"`{FAKE}`" in why, (method, platform, why)
  _compare_methods(_fake_loss, params, x, y, falls_back=f"`{FAKE}`")


def test_unknown_primitive_on_constants_only_changes_nothing():
  params, x, y = _problem()

  def loss(p, x, y):
    (scale,) = fake_call(lambda c: [2.0 * c], jnp.ones(3))  # touches neither params nor batch
    return jnp.sum((jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] * scale - y) ** 2)

  plan = jaxclip.ghost_plan(loss, params, x, y)
  assert plan.rules == {"['b']": "instantiate", "['v']": "dot", "['w']": "dot"}
  assert FAKE not in str(plan)


def test_unknown_primitive_closing_over_a_parameter_is_not_called_unused():
  params, x, y = _problem()

  def loss(p, x, y):
    # The weight is closed over: a constant of the sub-jaxpr, not an input of the equation.
    (h,) = fake_call(lambda c: [jnp.tanh(c @ p["w"])], jnp.ones(4))
    return jnp.sum(((x @ p["w"] + p["b"] + h) @ p["v"] - y) ** 2)

  _assert_falls_back(jaxclip.ghost_plan(loss, params, x, y), f"`{FAKE}`")


def _jit_loss(p, x, y):
  h = jax.jit(lambda w, b, x: _dense(w, b, x)[0])(p["w"], p["b"], x)
  return jnp.sum((h @ p["v"] - y) ** 2)


def _scan_loss(p, x, y):
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x @ p["w"] + p["b"], p["stack"])
  return jnp.sum((h @ p["v"] - y) ** 2)


@pytest.mark.parametrize(
  "loss, table, gone, named",
  [
    (_jit_loss, "CALLS", {"jit", "pjit"}, "`jit` is a higher-order primitive"),
    (_scan_loss, "SCANS", {"scan"}, "`scan` is a higher-order primitive"),
    (_scan_loss, "_SCAN_KEYS", None, "cannot read the parameters of `scan`"),
  ],
)
def test_a_renamed_primitive_falls_back_to_vmap_and_is_named(monkeypatch, loss, table, gone, named):
  params, x, y = _problem()
  params["stack"] = 0.5 * jax.random.normal(jax.random.key(3), (2, 6, 6))
  before = jaxclip.ghost_plan(loss, params, x, y)
  assert before.rules["['w']"] == "dot" and named not in str(before)
  if gone is None:  # a parameter renamed: the engine looks for one that is not there
    monkeypatch.setattr(_jax, table, getattr(_jax, table) + ("body_renamed",))
  else:  # the primitive renamed: its name is no longer in the engine's table
    monkeypatch.setattr(_jax, table, getattr(_jax, table) - gone)
  _assert_falls_back(jaxclip.ghost_plan(loss, params, x, y), named)
  _compare_methods(loss, params, x, y, falls_back=named)


# ----------------------------------------------------------------------------
# Scan constants
# ----------------------------------------------------------------------------


def test_a_weight_a_scan_closes_over_gets_the_dot_rule_or_is_reported_as_a_scan_constant():
  ks = jax.random.split(jax.random.key(1), 5)
  params = {
    "wx": jax.random.normal(ks[0], (3, 5)),
    "wh": 0.3 * jax.random.normal(ks[1], (5, 5)),  # an RNN's hidden-to-hidden matrix
    "wd": jax.random.normal(ks[2], (5, 5)),  # doubled before the scan: truly transformed
    "table": jax.random.normal(ks[4], (4, 5)),  # looked up at each step: no rule over steps
    "out": jax.random.normal(ks[3], (5, 2)),
  }

  def loss(p, xs, y):
    wd = 2.0 * p["wd"]

    def step(h, x):  # wh, wd and table are the scan's consts; xs carries the sequence
      rows = jnp.sum(p["table"][(x[:2] > 0).astype(jnp.int32)], 0)
      return jnp.tanh(x @ p["wx"] + h @ p["wh"].T + jnp.sin(h) @ wd + rows), None

    h, _ = jax.lax.scan(step, jnp.zeros(5), xs)
    return jnp.sum((h @ p["out"] - y) ** 2)

  xs, y = jax.random.normal(ks[0], (4, 6, 3)), jnp.ones((4, 2))
  plan = jaxclip.ghost_plan(loss, params, xs, y)
  reasons = {leaf.path: leaf.reason for leaf in plan.leaves}
  assert plan.rules == {
    "['out']": "dot",
    "['table']": "instantiate",
    "['wd']": "instantiate",
    "['wh']": "dot",  # every step's row together
    "['wx']": "dot",
  }, plan
  assert "`lax.scan` constant" in reasons["['table']"] and "every iteration" in reasons["['table']"]
  assert reasons["['wd']"] == "transformed before `dot_general`"
  got = jax.jit(jaxclip.per_example_clipped_grad(loss, 1.0, method="ghost", return_norms=True))(
    params, xs, y
  )
  ref = jax.jit(jaxclip.per_example_clipped_grad(loss, 1.0, return_norms=True))(params, xs, y)
  assert_tree_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=1e-5)


# ----------------------------------------------------------------------------
# A symbolic batch (jax.export)
# ----------------------------------------------------------------------------


def _mlp_loss(p, x, y):
  return jnp.sum((jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] - y) ** 2)


@jax.jit  # one reference for every method below: compiled once per batch size
def _vmap_reference(p, x, y, mask):
  fn = jaxclip.per_example_clipped_grad(_mlp_loss, 1.5, method="vmap", return_norms=True)
  return fn(p, x, y, example_mask=mask)


@pytest.mark.parametrize(
  "method, microbatch_size", [("vmap", None), ("ghost", None), ("ghost", 2), ("auto", 2)]
)
def test_exports_with_a_symbolic_batch(method, microbatch_size):
  params, x, y = _problem(batch=7)
  grad_fn = jaxclip.per_example_clipped_grad(
    _mlp_loss, 1.5, method=method, microbatch_size=microbatch_size, return_norms=True
  )
  fn = jax.jit(lambda p, x, y, mask: grad_fn(p, x, y, example_mask=mask))
  (b,) = jax.export.symbolic_shape("b")
  spec = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
  exported = jax.export.export(fn)(params, spec(b, 4), spec(b, 3), spec(b, dtype=jnp.bool_))
  assert "b" in str(exported.in_avals[-1])
  for n in (3, 7):
    mask = jnp.arange(n) != 1
    got = exported.call(params, x[:n], y[:n], mask)
    ref = _vmap_reference(params, x[:n], y[:n], mask)
    assert got[2].shape == (n,) and float(got[2][1]) == 0.0
    assert_tree_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_group_size_with_a_symbolic_batch():
  params, x, y = _problem(batch=6)
  grad_fn = jaxclip.per_example_clipped_grad(_mlp_loss, 1.5, group_size=2, method="ghost")
  spec = lambda d, w: jax.ShapeDtypeStruct((d, w), jnp.float32)
  (b,) = jax.export.symbolic_shape("b")
  with pytest.raises(ValueError, match="group_size=2 must divide the batch, whose size b is symb"):
    jax.export.export(jax.jit(grad_fn))(params, spec(b, 4), spec(b, 3))
  (u,) = jax.export.symbolic_shape("2*u")  # a batch known to hold whole groups exports
  exported = jax.export.export(jax.jit(grad_fn))(params, spec(u, 4), spec(u, 3))
  assert_tree_allclose(exported.call(params, x, y), jax.jit(grad_fn)(params, x, y), rtol=1e-5)


def test_symbolic_chunks_cover_every_example_once():
  fn = lambda xs: jnp.sum(xs["a"] ** 2) + xs["c"]
  (b,) = jax.export.symbolic_shape("b")

  def chunked(a, c):
    return _instantiate._symbolic_chunks(fn, {"a": a, "c": c}, a.shape[0], 3)

  exported = jax.export.export(jax.jit(chunked))(
    jax.ShapeDtypeStruct((b, 2), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.float32)
  )
  for n in (1, 3, 7):  # one short chunk, one full chunk, three chunks (the last short)
    a, c = jnp.arange(2.0 * n).reshape(n, 2), jnp.arange(float(n))
    np.testing.assert_allclose(exported.call(a, c), jax.vmap(fn)({"a": a, "c": c}))
