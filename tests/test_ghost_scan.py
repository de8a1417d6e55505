"""Ghost rules through ``lax.scan`` and rematerialisation (``jax.checkpoint``).

A scan over stacked layers gets the rules per iteration (weights sliced per
iteration or closed over by every one, a lookup per layer, a reversed
scan); an Elman RNN's weights shared by its steps, a nested scan and fixed
lookups get rules, and the RNN's step sites share one output gradient and
keep no per-step records; flax linen's ``nn.scan(nn.remat(...))`` gets the
``dot`` rule per layer; rematerialised layers take two backward passes and
keep no site records. Each against ``method="vmap"`` at the median norm
(``tests.ghost_helpers.compare``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxclip
from jaxclip.privacy import _ghost
from jaxclip.privacy._ghost import _capture
from jaxclip.privacy._ghost._jaxpr import _sites
from tests.ghost_helpers import compare as _compare


def test_plain_scan_over_stacked_layers_gets_the_rules_per_iteration():
  ks = jax.random.split(jax.random.key(0), 6)
  n = lambda k, *s: 0.5 * jax.random.normal(k, s)
  params = {
    "w": n(ks[0], 3, 4, 4),
    "b": n(ks[1], 3, 4),
    "table": n(ks[2], 3, 9, 4),
    "shared": n(ks[3], 4, 4),
    "head": n(ks[4], 2, 4, 4),
  }

  def loss(p, x, ids):
    def step(carry, layer):
      h, i = carry
      h = jnp.tanh(h @ layer["w"] + layer["b"]) + layer["table"][ids] * i  # a counter carry
      return (h @ p["shared"], i + 1), jnp.sum(h)  # a weight closed over: every iteration

    (h, _), ys = jax.lax.scan(step, (x, 0), {k: p[k] for k in ("w", "b", "table")})
    h, _ = jax.lax.scan(lambda h, w: (jnp.sin(h @ w), None), h, p["head"], reverse=True)
    return jnp.sum(h**2) + jnp.sum(ys * jnp.arange(3.0))

  xs = jax.random.normal(ks[5], (10, 5, 4))
  ids = jax.random.randint(ks[5], (10, 5), 0, 9).at[:, 1].set(2)
  _compare(loss, params, xs, ids, batch_argnums=(1, 2))
  plan = jaxclip.ghost_plan(loss, params, xs, ids, batch_argnums=(1, 2))
  assert plan.rules == {
    "['b']": "instantiate",
    "['head']": "dot",
    "['shared']": "dot",  # closed over by the scan: every iteration's rows together
    "['table']": "lookup",
    "['w']": "dot",
  }


def _rnn_loss(p, xs, y):
  """An Elman RNN over ``xs`` (its hidden-to-hidden ``wh`` and input ``wx`` closed over by the
  scan: every step reads them), a position table looked up at fixed ids, a nested scan whose
  inner steps share ``wi`` but whose outer steps slice ``wo``."""
  xs = xs + p["wpe"][jnp.arange(xs.shape[0])] + jnp.take(p["wpe2"], jnp.arange(xs.shape[0]), 0)

  def step(h, x):
    h = jnp.tanh(x @ p["wx"] + h @ p["wh"] + p["b"])
    return h, h

  h, hs = jax.lax.scan(step, jnp.zeros(p["wh"].shape[0]), xs)

  def outer(h, wo):
    h, _ = jax.lax.scan(lambda h, _: (jnp.sin(h @ p["wi"]), None), h @ wo, None, length=2)
    return h, None

  h, _ = jax.lax.scan(outer, h, p["wo"])
  return jnp.sum((h @ p["out"] - y) ** 2) + 0.1 * jnp.sum(hs**2)


def _rnn_problem():
  ks = jax.random.split(jax.random.key(7), 10)
  n = lambda k, *s: 0.5 * jax.random.normal(k, s)
  params = {
    "wx": n(ks[0], 3, 5),
    "wh": n(ks[1], 5, 5),
    "b": n(ks[2], 5),
    "wpe": n(ks[3], 6, 3),
    "wpe2": n(ks[4], 6, 3),
    "wi": n(ks[5], 5, 5),
    "wo": n(ks[6], 2, 5, 5),
    "out": n(ks[7], 5, 2),
  }
  return params, jax.random.normal(ks[8], (8, 6, 3)), jax.random.normal(ks[9], (8, 2))


def test_weights_shared_by_scan_iterations_and_fixed_lookups_get_rules():
  params, xs, y = _rnn_problem()
  remat_loss = jax.checkpoint(_rnn_loss)
  variants = [{}, dict(loss_fn=remat_loss)]  # one vmap reference for both
  _compare(_rnn_loss, params, xs, y, batch_argnums=(1, 2), variants=variants)
  for remat, loss in ((False, _rnn_loss), (True, remat_loss)):
    _check_rnn_plan(jaxclip.ghost_plan(loss, params, xs, y, batch_argnums=(1, 2)), remat)


def _check_rnn_plan(plan, remat):
  assert plan.rules == {
    "['b']": "instantiate",  # a bias: its per-example gradient, summed over the steps
    "['out']": "dot",
    "['wh']": "dot",  # the dot rule over steps x positions
    "['wi']": "dot",  # shared by the inner scan's steps, the outer's added
    "['wo']": "dot",  # sliced per outer step
    "['wpe']": "lookup",  # wpe[jnp.arange(T)]: ids that do not depend on the example
    "['wpe2']": "lookup",  # jnp.take(wpe2, jnp.arange(T), 0)
    "['wx']": "dot",
  }, plan
  assert plan.passes == (2 if remat else 1)


def test_rnn_step_sites_share_one_output_gradient_and_keep_no_per_step_records():
  """Issue #39's memory on the RNN above (its numbers are checked against vmap there).

  ``x @ wx + h @ wh + b``: the three sites' outputs meet through sums, so they
  have one output gradient; the bias, read by every step, is tapped once per
  example (its gradient summed over the steps), not once per step; ``wx`` and
  ``wh`` (read by every step, their per-example gradients smaller than the
  steps' records) have those gradients summed in the backward pass and keep
  no ``a`` or ``g``.
  """
  params, xs, y = _rnn_problem()
  traced = _ghost.trace(_rnn_loss, params, [xs, y], [0, 1], has_aux=False)
  sites = traced.plan.sites
  step = [u for u, s in enumerate(sites) if s.stack and len(s.stack) == 1 and s.stack[0][0] == 0]
  assert [sites[u].name for u in step] == ["dot_general", "dot_general", "add"]
  assert {sites[u].joins for u in step} == {step[0]}
  assert all(s.joins is None for u, s in enumerate(sites) if u not in step)
  bias = step[2]
  assert bias in traced.plan.tapped and sites[bias].summed
  inputs = _ghost.inputs_for(traced, None)
  # h @ wi, read by every inner step: its gradient (5 x 5) is larger than its 2 x 2 steps' g
  nested = [u for u, s in enumerate(sites) if len(s.stack) == 2]
  assert inputs.accumulated == frozenset(step[:2])
  assert dict(inputs.borrowed) == {}  # the two dots accumulate: neither needs g
  own = [u for u in range(len(sites)) if u not in traced.plan.tapped]  # with nothing accumulated
  assert _sites.borrowed(sites, own) == {step[1]: step[0]}
  shapes = {}

  def run():  # abstract: shapes only, no compiles
    cap = _capture.capture(inputs, sites)
    shapes.update({u: (len(cap.drecs[u]), [g.shape for g in cap.gs[u]]) for u in step + nested})
    return 0

  jax.eval_shape(run)
  n = xs.shape[0]
  assert shapes[step[0]] == (0, [(n, 3, 5)])  # wx's per-example gradient, no records
  assert shapes[step[1]] == (0, [(n, 5, 5)])
  assert shapes[bias] == (0, [(n, 5)])  # one bias row per example, not one per step
  assert shapes[nested[0]] == (1, [(n, 2, 2, 5)])  # its a and g, for the dot rule


def test_flax_linen_scan_over_remat_blocks_gets_the_dot_rule_per_layer():
  import flax.linen as linen

  class Block(linen.Module):
    @linen.compact
    def __call__(self, h, _):
      return h + linen.Dense(6)(jnp.tanh(linen.LayerNorm()(h))), None

  class Model(linen.Module):
    @linen.compact
    def __call__(self, x):
      stack = linen.scan(
        linen.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
      )
      h, _ = stack()(linen.Dense(6)(x), None)
      return jnp.sum(linen.Dense(2)(h) ** 2)

  model = Model()
  xs = jax.random.normal(jax.random.key(0), (10, 4, 5))
  params = model.init(jax.random.key(1), xs[0])["params"]
  loss = lambda p, x: model.apply({"params": p}, x)
  _compare(loss, params, xs, batch_argnums=1, rtol=1e-4)
  rules = jaxclip.ghost_plan(loss, params, xs, batch_argnums=1).rules
  assert rules["['ScanCheckpointBlock_0']['Dense_0']['kernel']"] == "dot"
  assert rules["['ScanCheckpointBlock_0']['LayerNorm_0']['scale']"] == "scale"


def _remat_model(remat):
  """A scan over stacked layers (dot, lookup, bias) and a conv stem, optionally rematerialised."""
  ks = jax.random.split(jax.random.key(4), 6)
  n = lambda k, *s: 0.5 * jax.random.normal(k, s)
  params = {
    "conv": n(ks[0], 3, 2, 3, 3),  # OIHW
    "w": n(ks[1], 3, 3, 3),
    "b": n(ks[2], 3, 3),
    "table": n(ks[3], 3, 7, 3),
    "head": n(ks[4], 3, 2),
  }
  wrap = jax.checkpoint if remat else (lambda f: f)

  @wrap
  def stem(kernel, image):
    out = jax.lax.conv_general_dilated(image[None], kernel, (1, 1), "SAME")[0]
    return jnp.tanh(out).reshape(3, -1).T  # (positions, channels)

  def loss(p, image, ids):
    @wrap
    def layer(h, lw):
      return jnp.tanh(h @ lw["w"] + lw["b"]) + lw["table"][ids], None

    h, _ = jax.lax.scan(layer, stem(p["conv"], image), {k: p[k] for k in ("w", "b", "table")})
    return jnp.sum(jnp.sin(h @ p["head"])), jnp.sum(h)

  images = jax.random.normal(ks[5], (10, 2, 3, 3))
  ids = jax.random.randint(ks[5], (10, 9), 0, 7).at[:, 1].set(3)
  return loss, params, images, ids


def test_rematerialised_layers_take_two_passes_and_hold_no_site_records():
  loss, params, images, ids = _remat_model(False)
  remat_loss = _remat_model(True)[0]
  kwargs = dict(batch_argnums=(1, 2), has_aux=True)
  variants = [  # 4: a padded last chunk; one vmap reference for all four
    dict(loss_fn=fn, microbatch_size=size) for fn in (remat_loss, loss) for size in (None, 4)
  ]
  got, ref = _compare(loss, params, images, ids, variants=variants, **kwargs)
  np.testing.assert_allclose(np.asarray(got[3]), np.asarray(ref[3]), rtol=1e-6)
  for remat, fn in ((True, remat_loss), (False, loss)):
    plan = jaxclip.ghost_plan(fn, params, images, ids, batch_argnums=(1, 2), has_aux=True)
    assert plan.rules == {
      "['b']": "instantiate",
      "['conv']": "conv",
      "['head']": "dot",
      "['table']": "lookup",
      "['w']": "dot",
    }
    assert plan.passes == (2 if remat else 1)
    assert ("two backward passes" in str(plan)) == remat
    # Two passes: every ghost site's norms come out of the backward pass, one
    # per example and iteration, and none of its a or g is kept.
    traced = _ghost.trace(fn, params, [images, ids], [0, 1], has_aux=True)
    ghost_sites = {u for u, _, _ in traced.plan.ghost}
    assert traced.plan.probed == (ghost_sites if remat else frozenset())
    probes = {u: _ghost.probe_sumsq(traced.plan.sites[u], k, r) for u, k, r in traced.plan.ghost}
    inputs = _ghost.Inputs(
      traced.closed,
      traced.leaves,
      traced.arg_leaves,
      traced.batched,
      None,
      traced.plan.tapped,
      {u: probes[u] for u in traced.plan.probed},
    )
    records = {}  # what each site keeps, from an abstract run (shapes only: no compiles)

    def run(inputs=inputs, traced=traced, ghost_sites=ghost_sites, records=records):
      cap = _capture.capture(inputs, traced.plan.sites)
      records.update({u: (len(cap.drecs[u]), [g.shape for g in cap.gs[u]]) for u in ghost_sites})
      return 0

    jax.eval_shape(run)
    assert set(records) == ghost_sites != set()
    for u in ghost_sites:
      stack = tuple(length for _, length in traced.plan.sites[u].stack)
      drecs, g_shapes = records[u]
      if remat:
        assert drecs == 0 and g_shapes == [(10,) + stack]
      else:
        assert drecs and g_shapes[0][1:] != stack
