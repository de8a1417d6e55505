"""The ``dot_general`` and embedding-lookup rules one at a time, and the exact fallback.

The ``dot`` rule on both sides of its mixed ghost/instantiate switch, with
the parameter on the left and batch dimensions; the lookup rule with
repeated and out-of-range ids; and the exact per-group instantiation of
everything else (a weight used twice, ``custom_jvp``, param-only terms,
overlapping slices of a weight, leaves instantiated at one site in one
pass), where disjoint static slices of a weight keep their rules. Each
against ``method="vmap"`` at the median norm (``tests.ghost_helpers.compare``).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip.privacy import _ghost
from jaxclip.privacy._ghost._rules import _scaling
from tests.ghost_helpers import compare as _compare
from tests.ghost_helpers import plan as _plan


# T (in + out) > in * out: A^T G per example; else the Gram form
@pytest.mark.parametrize("rows,width", [(6, 3), (4, 48)])
def test_dot_rule_on_both_sides_of_the_mixed_switch(rows, width):
  w = jax.random.normal(jax.random.key(0), (width, 16))
  loss = lambda w, x: jnp.sum(jnp.sin(x @ w))
  xs = jax.random.normal(jax.random.key(1), (10, rows, width))
  _compare(loss, w, xs)
  assert [r for _, _, r in _plan(loss, w, xs[0]).ghost] == ["dot"]


def test_dot_rule_with_the_parameter_on_the_left_and_batch_dims():
  w = jax.random.normal(jax.random.key(0), (3, 5, 4))  # per-head weights: h, out, in
  loss = lambda w, x: jnp.sum(jnp.tanh(jnp.einsum("hoi,thi->hto", w, x)) ** 2)
  xs = jax.random.normal(jax.random.key(1), (10, 7, 3, 4))
  _compare(loss, w, xs)
  assert [r for _, _, r in _plan(loss, w, xs[0]).ghost] == ["dot"]


@pytest.mark.parametrize("lookup", ["index", "take_fill", "clip"])
# 9 ids per example: 5 rows, the per-example table; 40, the sums of each distinct id's
# rows (sorted runs); 300, the Gram form.
@pytest.mark.parametrize("rows", [5, 40, 300])
def test_embedding_lookup_with_repeated_and_out_of_range_ids(lookup, rows):
  table = jax.random.normal(jax.random.key(0), (rows, 3))
  look = {
    "index": lambda e, i: e[i],
    "take_fill": lambda e, i: jnp.take(e, i, axis=0),  # out of range: fill, no gradient
    "clip": lambda e, i: e.at[i].get(mode="clip"),
  }[lookup]
  loss = lambda e, ids: jnp.sum(jnp.cos(look(e, ids)) * jnp.arange(3.0))
  hi = rows + 2  # out of range: E[ids] reads the clamped row, but JAX drops its gradient
  ids = jax.random.randint(jax.random.key(2), (12, 9), 0, hi)
  ids = ids.at[:, 1].set(ids[:, 0])  # every example repeats a token
  _compare(loss, table, ids)
  assert [r for _, _, r in _plan(loss, table, ids[0]).ghost] == ["lookup"]


def test_weight_sharing_custom_jvp_scan_and_param_only_terms_are_exact():
  ks = jax.random.split(jax.random.key(0), 4)
  params = {
    "w": jax.random.normal(ks[0], (4, 4)),
    "stack": jax.random.normal(ks[1], (3, 4, 4)),
    "s": jax.random.normal(ks[2], (4,)),
    "unused": jnp.ones(2),
  }

  @jax.custom_jvp
  def scaled(x, s):
    return x * s

  scaled.defjvp(lambda p, t: (scaled(*p), t[0] * p[1] + p[0] * t[1]))

  def loss(p, x):
    h = jnp.tanh(x @ p["w"]) @ p["w"]  # the same weight twice
    h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, p["stack"])
    h = scaled(h, p["s"])
    return jnp.sum(h**2) + 0.1 * jnp.sum(p["w"] ** 2) + jnp.sum(p["s"])  # param-only terms

  xs = jax.random.normal(ks[3], (10, 4))
  got, _ = _compare(loss, params, xs)
  assert not np.any(np.asarray(got[0]["unused"]))
  plan = jaxclip.ghost_plan(loss, params, xs, batch_argnums=1)
  assert plan.rules == {
    "['s']": "instantiate",
    "['stack']": "dot",
    "['unused']": "unused",
    "['w']": "instantiate",
  }  # the stack: the dot rule in each iteration


def test_static_disjoint_slices_of_a_stacked_weight_add():
  ks = jax.random.split(jax.random.key(0), 4)
  params = {
    "stack": 0.5 * jax.random.normal(ks[0], (3, 4, 4)),
    "halves": jax.random.normal(ks[1], (4, 6)),
    "overlap": jax.random.normal(ks[2], (3, 4)),
  }

  def loss(p, x):
    for layer in range(3):  # a Python loop over W[l]
      x = jnp.tanh(x @ p["stack"][layer])
    y = jnp.concatenate([x @ p["halves"][:, :3], jnp.sin(x @ p["halves"][:, 3:])], axis=-1)
    z = jnp.sum(y[:, :4] * (x @ p["overlap"][:2].T).sum(-1, keepdims=True))
    return z + jnp.sum(x @ p["overlap"][1:].T)  # rows 0-1 and 1-2: row 1 read twice

  xs = jax.random.normal(ks[3], (10, 5, 4))
  _compare(loss, params, xs, batch_argnums=1)
  rules = jaxclip.ghost_plan(loss, params, xs, batch_argnums=1).rules
  assert rules == {"['halves']": "dot", "['overlap']": "instantiate", "['stack']": "dot"}


def test_leaves_instantiated_at_one_site_share_one_pass():
  @jax.custom_jvp
  def affine(x, s, b):
    return x * s + b

  affine.defjvp(lambda p, t: (affine(*p), t[0] * p[1] + p[0] * t[1] + t[2]))
  params = {"s": jnp.arange(1.0, 5.0), "b": jnp.ones(4), "w": jnp.ones((4, 4))}
  loss = lambda p, x: jnp.sum(jnp.tanh(affine(x, p["s"], p["b"]) @ p["w"]))
  xs = jax.random.normal(jax.random.key(0), (8, 4))
  _compare(loss, params, xs, batch_argnums=1)
  leaves, tree = jax.tree.flatten(params)
  plan = _ghost.trace(loss, params, [xs], [0], has_aux=False).plan
  assert [leaves for leaves, _ in plan.instantiated] == [(0, 1)]  # b and s: one per-example pass


def test_two_large_rows_that_cancel_do_not_hide_a_small_one():
  """An example whose rows' products cancel between two large rows (2**127 - 2**127) and leave
  a small one (2**60): its per-example gradient is 2**60, not 0. Where the dot rule formed that
  gradient from scaled rows, the small row's terms were flushed, the norm read as 0 and the
  example not clipped, in bfloat16 (its sum 1e18 against a clip norm of 1); the Gram form (8
  by 8) read NaN. Now neither is read below the exact norm: here the read's floor, 2**-8 of
  the rows' triangle bound (``_scaling.Parts``), is past float32's range, so the example is
  dropped (``vmap`` keeps it, at 2**60); the same rows 2**60 times smaller are read finite,
  at that floor, above the exact norm. The clipped sum stays within the bound
  (``tests/test_ghost_cancel.py`` searches such examples)."""
  for width, scale in itertools.product((1, 8), (1.0, 2.0**-30)):  # formed, Gram form
    a = np.zeros((1, 1, 3, width), np.float32)
    g = np.zeros((1, 1, 3, width), np.float32)
    a[0, 0] = np.array([2.0**100, 2.0**100, 2.0**30])[:, None] * scale
    g[0, 0] = np.array([2.0**27, -(2.0**27), 2.0**30])[:, None] * scale
    exact = (2.0**60 * scale * scale * width) ** 2
    got = float(_scaling.mixed_sumsq(jnp.asarray(a), jnp.asarray(g))[0])
    assert got >= exact and (np.isfinite(got) or scale == 1.0), (width, scale, got)

  def loss(w, x, y):
    return jnp.sum(((x @ w) * y).astype(jnp.float32))

  for width in (1, 8):
    ones = np.ones((1, 3, width), np.float32)
    xs, ys = ([2.0**100, 2.0**100, 2.0**30], [2.0**27, -(2.0**27), 2.0**30])
    x, y = (
      jnp.asarray(
        np.concatenate([np.tile(np.float32(v)[:, None], (1, width))[None], ones]), jnp.bfloat16
      )
      for v in (xs, ys)
    )
    w = jnp.ones((width, width), jnp.bfloat16)
    out = {
      m: jax.jit(jaxclip.per_example_clipped_grad(loss, 1.0, method=m, return_norms=True))(w, x, y)
      for m in ("vmap", "ghost")
    }
    ghost, ref = np.asarray(out["ghost"][2]), np.asarray(out["vmap"][2])
    assert np.all(ghost >= ref * (1 - 1e-6)), (width, ghost, ref)
    np.testing.assert_allclose(ghost[1], ref[1], rtol=1e-6)  # the ordinary example
    assert float(jnp.max(jnp.abs(out["ghost"][0].astype(jnp.float32)))) <= 2.0  # two examples


def test_the_gram_forms_row_norms_read_the_triangle_bound_of_rows_far_apart():
  """The Gram form reads its bound's ``M = (sum_t ||a_t|| ||g_t||)^2`` from its rows' norms
  (``_scaling.row_norms``), each row scaled to its own largest entry, ``g``'s then by ``2**shift``
  below the largest row: rows whose products lie 2**0 to 2**-90 below it read ``M`` within
  float32's rounding of float64's, neither lowered (the bound would be) nor raised, and the
  read is at least the exact squared norm."""
  rng = np.random.default_rng(0)
  t, c, f = 12, 24, 24  # the Gram form: t (c + f) <= c f
  a = rng.standard_normal((2, 1, t, c)) * 2.0 ** rng.integers(-20, 20, (2, 1, t, 1))
  g = rng.standard_normal((2, 1, t, f)) * 2.0 ** rng.integers(-20, 20, (2, 1, t, 1))
  g[:, :, 1:] *= 2.0 ** -np.arange(0, 90, 8)[None, None, : t - 1, None]  # far below
  a, g = a.astype(np.float32), g.astype(np.float32)
  rows = np.linalg.norm(a.astype(np.float64), axis=3) * np.linalg.norm(g.astype(np.float64), axis=3)
  m = np.sum(np.sum(rows, axis=2) ** 2, axis=1)
  parts = _scaling.mixed_parts(jnp.asarray(a), jnp.asarray(g))
  got = np.asarray(parts.floor, np.float64) / _scaling.floor_factor(np.float32)
  np.testing.assert_allclose(got, m, rtol=2e-5)
  exact = np.sum(
    np.einsum("bntc,bntf->bncf", a.astype(np.float64), g.astype(np.float64)) ** 2, (1, 2, 3)
  )
  assert np.all(np.asarray(_scaling.read(parts), np.float64) >= exact * (1 - 1e-6))
