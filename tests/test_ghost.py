"""``per_example_clipped_grad(method="ghost")`` against ``method="vmap"``.

Ghost norms must equal the per-example gradients' norms up to float rounding
on every model kind (an MLP, a GPT-like model with a tied head, a flax nnx
model, an equinox convolutional model) and through every path of the engine:
the ``dot_general`` rule on both sides of its mixed ghost/instantiate switch,
the embedding-lookup rule with repeated and out-of-range ids, and the exact
per-group instantiation for everything else (tied weights, scales, biases,
convolutions, ``custom_jvp``, ``lax.scan``). The threshold is always the
median norm, so that some examples are clipped and some are not.

The multi-device checks (``md_*``) run in a subprocess on 8 virtual CPU
devices, as in ``test_per_example.py``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip.privacy import _ghost, _ghost_capture, _ghost_conv, _ghost_sites, _ghost_walk
from tests.helpers import mlp_loss, mlp_problem, multi_device_checks

N_DEVICES = 8


def _compare(
  loss_fn, params, *args, rtol=2e-5, atol=1e-6, method_="ghost", variants=({},), **kwargs
):
  """Runs ``method_`` and vmap at the median norm; returns ``(got, ref)`` of the last variant.

  Each of ``variants`` overrides ``kwargs`` (and ``loss_fn``) on the ``method_`` side only: one
  compiled vmap reference checks a loss with and without remat, or with and without microbatches.
  """

  @jax.jit  # the reference, compiled once: the clip is traced
  def vmap(clip, *a):
    return jaxclip.per_example_clipped_grad(loss_fn, clip, return_norms=True, **kwargs)(*a)

  norms = vmap(1.0, params, *args)[2]
  clip = float(np.median(np.asarray(norms)))
  ref = vmap(clip, params, *args)
  n = norms.shape[0]
  assert 0 < int(ref[1]) < n, (int(ref[1]), n)  # some clipped, some not
  for variant in variants:
    options = dict(kwargs, **variant)
    fn = options.pop("loss_fn", loss_fn)
    got = jax.jit(
      jaxclip.per_example_clipped_grad(fn, clip, method=method_, return_norms=True, **options)
    )(params, *args)
    assert int(got[1]) == int(ref[1]), variant
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=rtol, atol=atol)
    assert jax.tree.structure(got[0]) == jax.tree.structure(ref[0])
    for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(ref[0]), strict=True):
      assert a.shape == e.shape and a.dtype == e.dtype
      scale = float(np.max(np.abs(np.asarray(e, np.float32)))) or 1.0
      np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol + rtol * scale
      )
  return got, ref


def _plan(loss_fn, params, *example):
  leaves, tree = jax.tree.flatten(params)
  closed = jax.make_jaxpr(lambda ls, *xs: loss_fn(jax.tree.unflatten(tree, ls), *xs))(
    leaves, *example
  )
  infos = _ghost.input_infos([x.ndim for x in leaves], [True] * len(example))
  sites, _ = _ghost_walk.analysis(closed, infos)
  return _ghost.make_plan(sites, len(leaves))


# ----------------------------------------------------------------------------
# The four model kinds
# ----------------------------------------------------------------------------


def test_mlp_matches_vmap_and_uses_the_dot_rule():
  params, x, y = mlp_problem(batch=16, seed=3)
  _compare(mlp_loss, params, x, y, batch_argnums=(1, 2))
  plan = _plan(mlp_loss, params, x[0], y[0])
  assert sorted(r for _, _, r in plan.ghost) == ["dot", "dot"]  # w1, w2; b1 instantiated
  assert len(plan.groups) == 1
  # b1's site gives its per-example gradient in the backward pass (8 floats), not its output
  # gradient and input (16): the sites of the two dots record a and g.
  assert plan.tapped == {u for u, s in enumerate(plan.sites) if s.rules == ("generic",)} != set()


V, D, L, H, T = 40, 16, 2, 2, 8


def _gpt_params(seed=0):
  ks = iter(jax.random.split(jax.random.key(seed), 32))
  n = lambda *s: 0.3 * jax.random.normal(next(ks), s)
  p = {"wte": n(V, D), "wpe": n(T, D), "lnf_s": 1 + n(D), "lnf_b": n(D)}
  for i in range(L):
    p[f"{i}"] = {
      "ln1_s": 1 + n(D),
      "ln1_b": n(D),
      "qkv": n(D, 3 * D),
      "qkv_b": n(3 * D),
      "proj": n(D, D),
      "ln2_s": 1 + n(D),
      "ln2_b": n(D),
      "fc": n(D, 4 * D),
      "fc_b": n(4 * D),
      "out": n(4 * D, D),
    }
  return p


def _ln(x, s, b):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b


def gpt_loss(p, tokens):
  """Next-token loss of one sequence: embedding, pre-LN causal attention, MLP, tied head."""
  x, y = tokens[:-1], tokens[1:]
  t = x.shape[0]
  h = p["wte"][x] + p["wpe"][:t]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for i in range(L):
    b = p[f"{i}"]
    q, k, v = jnp.split(
      (_ln(h, b["ln1_s"], b["ln1_b"]) @ b["qkv"] + b["qkv_b"]).reshape(t, 3, H, D // H), 3, axis=1
    )
    att = jnp.einsum("thd,shd->hts", q[:, 0], k[:, 0]) / np.sqrt(D // H)
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    h = h + jnp.einsum("hts,shd->thd", att, v[:, 0]).reshape(t, D) @ b["proj"]
    m = jax.nn.gelu(_ln(h, b["ln2_s"], b["ln2_b"]) @ b["fc"] + b["fc_b"])
    h = h + m @ b["out"]
  logits = _ln(h, p["lnf_s"], p["lnf_b"]) @ p["wte"].T  # tied output head
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _tokens(batch, seed=1, vocab=V):
  return jax.random.randint(jax.random.key(seed), (batch, T + 1), 0, vocab)


def test_gpt_with_tied_head_matches_vmap():
  params, tokens = _gpt_params(), _tokens(24)
  _compare(gpt_loss, params, tokens)
  plan = _plan(gpt_loss, params, tokens[0])
  ghost_dots = sum(r == "dot" for _, _, r in plan.ghost)
  assert ghost_dots == 4 * L  # qkv, proj, fc, out of each block
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  # The tied embedding is used twice (lookup and head): both rules and their cross term.
  (((u, k), _),) = plan.tied
  assert plan.sites[u].infos[k].deps == {names.index("['wte']")}
  assert names.index("['wte']") not in {i for leaves, _ in plan.groups for i in leaves}


@pytest.mark.parametrize("head", ["transposed", "einsum", "contract_rows"])
@pytest.mark.parametrize("lookup", ["index", "take_fill"])
def test_tied_table_cross_term_or_exact_fallback(head, lookup):
  table = jax.random.normal(jax.random.key(0), (11, 6))
  proj = jax.random.normal(jax.random.key(1), (6, 6))

  def loss(p, ids):
    e = p["e"][ids] if lookup == "index" else jnp.take(p["e"], ids, axis=0, fill_value=0)
    h = jnp.tanh(e @ p["w"])
    if head == "transposed":
      logits = h @ p["e"].T
    elif head == "einsum":
      logits = jnp.einsum("td,nd->tn", h, p["e"])
    else:  # contracts the table's rows: not a tied head, instantiated instead
      logits = jnp.einsum("tn,nd->td", jax.nn.one_hot(ids, 11), p["e"]) @ h.T
    return jnp.sum(jax.nn.log_softmax(logits)[:, 0])

  hi = 13  # two ids out of range
  ids = jax.random.randint(jax.random.key(2), (12, 7), 0, hi).at[:, 1].set(3)
  params = {"e": table, "w": proj}
  _compare(loss, params, ids)
  plan = _plan(loss, params, ids[0])
  assert len(plan.tied) == (head != "contract_rows")


def _tied_lm(where):
  """A tied lookup and head around a rematerialised block: a two-pass plan.

  ``where``: ``"outside"``, the lookup and head outside the block (the scan
  GPT's layout); ``"inside"``, the whole loss rematerialised; ``"scan"``, a
  rematerialised scan over positions reading the table at both ends of each
  step, then the block on its outputs.
  """
  block = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))

  def loss(p, tokens):
    x, y = tokens[:-1], tokens[1:]
    if where == "scan":

      @jax.checkpoint
      def step(h, xy):
        h = jnp.tanh(p["e"][xy[0]] + h @ p["w"])
        return h, jax.nn.log_softmax(h @ p["e"].T)[xy[1]]

      h0 = jnp.zeros(p["w"].shape[0], p["w"].dtype)
      hs, lp = jax.lax.scan(step, h0, (x, y))
      return -jnp.mean(lp) + jnp.mean(block(hs, p["v"]) ** 2)  # a rematerialised dot rule
    h = block(p["e"][x], p["w"])  # lookup
    logits = h @ p["e"].T  # tied head
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

  if where == "inside":
    return jax.checkpoint(loss)
  return loss


def _tied_lm_problem(batch=12, vocab=23, width=8, length=7, scan=False):
  ks = jax.random.split(jax.random.key(7), 4)
  params = {
    "e": jax.random.normal(ks[0], (vocab, width)),
    "w": jax.random.normal(ks[1], (width, width)) / np.sqrt(width),
  }
  if scan:
    params["v"] = jax.random.normal(ks[3], (width, 3)) / np.sqrt(width)
  tokens = jax.random.randint(ks[2], (batch, length + 1), 0, vocab).at[:, 2].set(5)
  return params, tokens


def _early_plan(loss, params, tokens):
  """The traced plan, its tied pairs and early heads, and the ``Inputs`` the capture gets."""
  traced = _ghost.trace(loss, params, [tokens], [0], has_aux=False)
  return traced.plan, _ghost._early_heads(traced.plan), _ghost.inputs_for(traced, None)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_two_pass_tied_head_takes_its_own_term_in_the_backward_pass(where):
  # In a two-pass plan the tied head's own squared norm is taken at the head in the
  # backward pass (Forward's ``early``), its cross term with the lookup from the records.
  params, tokens = _tied_lm_problem()
  loss = _tied_lm(where)
  _compare(loss, params, tokens)
  plan, early, inputs = _early_plan(loss, params, tokens)
  assert plan.two_pass and len(plan.tied) == 1
  ((_, head),) = plan.tied
  assert early == [head] and set(inputs.early) == {head[0]}
  assert jaxclip.ghost_plan(loss, params, tokens).rules["['e']"] == "tied"


def test_two_pass_tied_head_in_bfloat16_within_its_rounding_of_float64():
  # The half-precision two-pass plan evaluates its forward pass in float32 copies of the
  # leaves (``wide``); the early head term reads the head's param in its own dtype.
  params, tokens = _tied_lm_problem(batch=16)
  loss = _tied_lm("outside")
  half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  plan, early, _ = _early_plan(loss, half, tokens)
  assert plan.two_pass and early and _ghost_capture._has_half(half, plan.sites)
  with jax.enable_x64(True):
    wide = jax.tree.map(lambda p: np.asarray(p, np.float64), half)  # the same values
    fn = lambda c: jaxclip.per_example_clipped_grad(loss, c, return_norms=True)
    norms = np.asarray(jax.jit(fn(1.0))(wide, tokens)[2])
    # The clip between the two norms with the widest relative gap, some norms on each side.
    ranked = np.sort(norms)
    gaps = ranked[1:] / ranked[:-1]
    j = 2 + int(np.argmax(gaps[2:-2]))
    assert gaps[j] > 1.05, ranked  # wider than bfloat16's error of a norm
    clip = float(np.sqrt(ranked[j] * ranked[j + 1]))
    ref = jax.jit(fn(clip))(wide, tokens)
  ghost = jaxclip.per_example_clipped_grad(loss, clip, method="ghost", return_norms=True)
  got = jax.jit(ghost)(half, tokens)
  assert int(got[1]) == int(ref[1]) == len(norms) - j - 1
  np.testing.assert_allclose(np.asarray(got[2], np.float64), np.asarray(ref[2]), rtol=2e-2)
  for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(ref[0]), strict=True):
    assert a.dtype == jnp.float32  # summed in float32
    a, e = np.asarray(a, np.float64), np.asarray(e)
    np.testing.assert_allclose(a, e, rtol=0, atol=2e-2 * np.max(np.abs(e)))


def test_tied_table_read_inside_a_remat_scan_has_no_early_head():
  # A term per scan iteration is not the norm of the table the iterations share: the
  # table is instantiated, and no head's term is taken early.
  params, tokens = _tied_lm_problem(scan=True)
  loss = _tied_lm("scan")
  _compare(loss, params, tokens, rtol=1e-4)
  plan, early, inputs = _early_plan(loss, params, tokens)
  assert plan.two_pass and plan.tied == () and early == [] and not inputs.early
  rules = jaxclip.ghost_plan(loss, params, tokens).rules
  assert rules["['e']"] == "instantiate" and rules["['v']"] == "dot"


def test_gpt_with_microbatches_padding_and_aux():
  params, tokens = _gpt_params(2), _tokens(10, seed=5)
  aux_loss = lambda p, x: (gpt_loss(p, x), {"first": x[0]})
  got, ref = _compare(aux_loss, params, tokens, microbatch_size=4, has_aux=True)
  np.testing.assert_array_equal(np.asarray(got[3]["first"]), np.asarray(tokens[:, 0]))
  np.testing.assert_array_equal(np.asarray(got[3]["first"]), np.asarray(ref[3]["first"]))


class _NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.hidden = nnx.Linear(D, D, rngs=rngs)
    self.head = nnx.Linear(D, 5, rngs=rngs)

  def __call__(self, ids):
    h = self.norm(self.embed(ids))
    return self.head(jax.nn.relu(self.hidden(h)).mean(axis=0))


def test_flax_nnx_model_matches_vmap():
  graphdef, state = nnx.split(_NnxModel(nnx.Rngs(0)))
  state = jax.tree.map(lambda x: x * 3.0, state)  # a non-trivial LayerNorm scale

  def loss(state, ids, label):
    logits = nnx.merge(graphdef, state)(ids)
    return -jax.nn.log_softmax(logits)[label]

  ids = _tokens(16)[:, :T]
  labels = jnp.arange(16) % 5
  _compare(loss, state, ids, labels, batch_argnums=(1, 2))
  plan = _plan(loss, state, ids[0], labels[0])
  assert sorted(r for _, _, r in plan.ghost) == ["dot", "dot", "gather"]


def test_equinox_conv_model_matches_vmap():
  k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
  model = [
    eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1),
    eqx.nn.Conv2d(4, 4, 3, key=k2),
    eqx.nn.Linear(4 * 6 * 6, 3, key=k3),
  ]
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss(params, image, label):
    c1, c2, lin = eqx.combine(params, static)
    h = jax.nn.relu(c2(jax.nn.relu(c1(image))))
    return -jax.nn.log_softmax(lin(h.reshape(-1)))[label]

  images = jax.random.normal(jax.random.key(5), (12, 2, 8, 8))
  labels = jnp.arange(12) % 3
  _compare(loss, params, images, labels, batch_argnums=(1, 2), rtol=1e-4)


def test_flax_linen_model_with_remat_mixed_precision_and_dropout_keys():
  import flax.linen as linen

  class Block(linen.Module):
    @linen.compact
    def __call__(self, x, key):
      h = linen.LayerNorm()(x)
      h = linen.Dense(12, dtype=jnp.bfloat16)(h).astype(jnp.float32)  # bf16 compute
      keep = jax.random.bernoulli(key, 0.8, h.shape)
      h = jnp.where(keep, jax.nn.relu(h) / 0.8, 0)
      return linen.Dense(3)(h)

  model = linen.remat(Block)()
  x = jax.random.normal(jax.random.key(0), (12, 5, 7))
  keys = jax.random.split(jax.random.key(1), 12)
  variables = model.init(jax.random.key(2), x[0], keys[0])

  def loss(params, xb, key, label):
    return -jax.nn.log_softmax(model.apply({"params": params}, xb, key).mean(0))[label]

  labels = jnp.arange(12) % 3
  _compare(
    loss, variables["params"], x, keys, labels, batch_argnums=(1, 2, 3), rtol=2e-2, atol=1e-3
  )
  plan = _plan(loss, variables["params"], x[0], keys[0], labels[0])
  assert sorted(r for _, _, r in plan.ghost) == ["dot", "dot"]


# ----------------------------------------------------------------------------
# Each rule and each fallback
# ----------------------------------------------------------------------------


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
  assert [r for _, _, r in _plan(loss, table, ids[0]).ghost] == ["gather"]


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
  assert _ghost_sites.borrowed(sites, own) == {step[1]: step[0]}
  shapes = {}

  def run():  # abstract: shapes only, no compiles
    cap = _ghost_capture.capture(inputs, sites)
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
  assert rules["['ScanCheckpointBlock_0']['LayerNorm_0']['scale']"] == "instantiate"


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
    probes = {u: _ghost._probe_sumsq(traced.plan.sites[u], k, r) for u, k, r in traced.plan.ghost}
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
      cap = _ghost_capture.capture(inputs, traced.plan.sites)
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


def test_conv_rule_with_stride_padding_dilation_and_feature_groups():
  import flax.linen as linen

  ks = jax.random.split(jax.random.key(0), 6)
  convs = [
    eqx.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, key=ks[0]),  # kernel gradient
    eqx.nn.Conv2d(6, 8, (3, 2), dilation=(2, 1), padding=((2, 1), (0, 1)), key=ks[1]),
    eqx.nn.Conv2d(8, 8, 3, stride=2, key=ks[2]),
  ]  # 4 positions: the Gram form
  params, static = eqx.partition(convs, eqx.is_inexact_array)

  def loss(p, image):
    h = image
    for conv in eqx.combine(p, static):
      h = jnp.tanh(conv(h))
    return jnp.sum(jnp.sin(h))

  images = jax.random.normal(ks[3], (8, 4, 9, 9))
  _compare(loss, params, images, batch_argnums=1, rtol=1e-4)
  plan = jaxclip.ghost_plan(loss, params, images, batch_argnums=1)
  assert [leaf.rule for leaf in plan.leaves] == ["conv", "instantiate"] * 3

  class Net(linen.Module):  # NHWC, "SAME" padding, kernel dilation, depthwise-style groups
    @linen.compact
    def __call__(self, x):
      x = linen.GroupNorm(num_groups=2)(linen.Conv(8, (3, 3), strides=2, padding="SAME")(x))
      x = linen.Conv(8, (3, 3), feature_group_count=4, kernel_dilation=2, padding="VALID")(
        jax.nn.relu(x)
      )
      return jnp.sum(x**2)

  net = Net()
  xs = jax.random.normal(ks[4], (8, 12, 12, 4))
  params = net.init(ks[5], xs[0])["params"]
  loss = lambda p, x: net.apply({"params": p}, x)
  _compare(loss, params, xs, batch_argnums=1, rtol=1e-4)
  rules = jaxclip.ghost_plan(loss, params, xs, batch_argnums=1).rules
  assert rules["['Conv_0']['kernel']"] == rules["['Conv_1']['kernel']"] == "conv"


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
  assert [leaves for leaves, _ in plan.groups] == [(0, 1)]  # b and s: one per-example pass


def test_ghost_keeps_its_rules_where_per_example_gradients_cost_less():
  # 64 rows of an 8 x 4 weight: the dot rule forms A^T G per example (as vmap
  # does); "ghost" keeps it (the user's choice), "auto" on CPU takes vmap's program.
  w = jax.random.normal(jax.random.key(0), (8, 4))
  long = lambda w, x: jnp.sum(jnp.sin(x @ w))
  xs = jax.random.normal(jax.random.key(1), (6, 64, 8))
  assert jaxclip.ghost_plan(long, w, xs, batch_argnums=1).rules == {"": "dot"}
  auto = jaxclip.ghost_plan(long, w, xs, batch_argnums=1, method="auto", platform="cpu")
  assert (
    auto.rules == {"": "instantiate"} and "the loss runs as method='vmap'" in auto.leaves[0].reason
  )
  assert "auto on cpu" in auto.leaves[0].reason and "(method='auto' on cpu)" in str(auto)
  _compare(long, w, xs, batch_argnums=1)
  for method in ("ghost", "auto"):  # 2 rows of a 64 x 64 weight: the Gram form, on every platform
    for platform in ("cpu", "gpu"):
      short = jaxclip.ghost_plan(
        long,
        jnp.ones((64, 64)),
        jnp.ones((6, 2, 64)),
        batch_argnums=1,
        method=method,
        platform=platform,
      )
      assert short.rules == {"": "dot"}, (method, platform)


def test_loss_that_depends_on_the_parameters_only_for_some_examples():
  loss = lambda w, x: jnp.where(x[0] > 0, jnp.sum(w**2), jnp.sum(w * x))
  w = jnp.arange(3.0)
  xs = jax.random.normal(jax.random.key(3), (12, 3))
  _compare(loss, w, xs)


def test_shared_argument_keep_batch_dim_and_traced_clip():
  params, x, y = mlp_problem(batch=12, seed=4)
  loss = lambda p, scale, xb, yb: mlp_loss(p, xb[0] * scale, yb[0])
  args = (jnp.float32(0.7), x, y)
  ref = jaxclip.per_example_clipped_grad(loss, 20.0, batch_argnums=(2, 3), keep_batch_dim=True)
  fn = lambda c: jaxclip.per_example_clipped_grad(
    loss, c, batch_argnums=(2, 3), keep_batch_dim=True, method="ghost", return_norms=True
  )
  got = jax.jit(lambda c, *a: fn(c)(*a))(20.0, params, *args)
  want = ref(params, *args)
  assert 0 < int(want[1]) < 12 and int(got[1]) == int(want[1])
  for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
    np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-5)


def test_bfloat16_parameters_keep_their_dtype():
  params, x, y = mlp_problem(batch=12, seed=5)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  x, y = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
  _compare(mlp_loss, params, x, y, batch_argnums=(1, 2), rtol=3e-2, atol=1e-2)
  # Nothing clipped: ghost's sum is the sum of the per-example gradients in float32 (jax.grad
  # rounds it to bfloat16; the noise is added before any rounding): within the per-example
  # gradients' bfloat16 rounding of it, and not itself rounded to bfloat16.
  per_example = jax.vmap(jax.grad(mlp_loss), (None, 0, 0))(params, x, y)
  got = jax.jit(
    jaxclip.per_example_clipped_grad(mlp_loss, 1e6, method="ghost", batch_argnums=(1, 2))
  )(params, x, y)[0]
  unrounded = []
  for a, g in zip(jax.tree.leaves(got), jax.tree.leaves(per_example), strict=True):
    assert a.dtype == jnp.float32
    a, g = np.asarray(a, np.float64), np.asarray(g, np.float64)
    assert np.all(np.abs(a - g.sum(0)) <= 2**-7 * np.abs(g).sum(0) + 1e-6)
    unrounded.append(np.any(a != np.asarray(a.astype(jnp.bfloat16), np.float64)))
  assert any(unrounded)


def test_float64_parameters_accumulate_in_float64_as_vmap_does():
  with jax.enable_x64(True):
    params, x, y = mlp_problem(batch=12, seed=9)
    params, x, y = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x, y))
    got, _ = _compare(mlp_loss, params, x, y, batch_argnums=(1, 2), rtol=1e-12, atol=1e-12)
    assert got[2].dtype == jnp.float64


def test_return_norms_are_the_pre_clip_norms_in_batch_order():
  params, x, y = mlp_problem(batch=11, seed=6)
  grads = jax.vmap(jax.grad(mlp_loss), (None, 0, 0))(params, x, y)
  want = jax.vmap(jaxclip.ops.global_norm)(grads)
  options = [(method, mb) for method in ("vmap", "ghost") for mb in (None, 4)]

  @jax.jit  # the four in one program
  def norms(params, x, y):
    return [
      jaxclip.per_example_clipped_grad(
        mlp_loss, 1.0, batch_argnums=(1, 2), method=method, microbatch_size=mb, return_norms=True
      )(params, x, y)[2]
      for method, mb in options
    ]

  for option, got in zip(options, norms(params, x, y), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=str(option))


def test_non_finite_example_contributes_zero_as_with_vmap():
  params, x, y = mlp_problem(batch=6, seed=7)
  bad = x.at[2, 0].set(jnp.nan)
  keep = np.arange(6) != 2
  for method in ("vmap", "ghost"):
    fn = jaxclip.per_example_clipped_grad(
      mlp_loss, 1.0, batch_argnums=(1, 2), method=method, return_num_nonfinite=True
    )
    total, _, num_nonfinite = jax.jit(fn)(params, bad, y)
    want = jax.jit(fn)(params, x[keep], y[keep])[0]
    assert int(num_nonfinite) == 1, method
    for a, e in zip(jax.tree.leaves(total), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=method)


def test_a_parameter_in_a_loop_jax_cannot_differentiate_names_the_primitive():
  def loss(w, x):
    n = x[0].astype(jnp.int32) % 3 + 1  # a data-dependent trip count
    body = lambda c: (jnp.tanh(c[0] @ w), c[1] + 1)
    return jnp.sum(jax.lax.while_loop(lambda c: c[1] < n, body, (x, 0))[0])

  fn = jaxclip.per_example_clipped_grad(loss, 1.0, method="ghost")
  with pytest.raises(ValueError, match="through `while`"):
    fn(jnp.eye(3), jnp.ones((4, 3)))


def test_bad_method_and_complex_parameters_are_refused():
  with pytest.raises(ValueError, match="method must be one of 'vmap', 'ghost', 'auto'"):
    jaxclip.per_example_clipped_grad(mlp_loss, 1.0, method="ghosts")
  with pytest.raises(ValueError, match="ghost_plan takes method 'ghost' or 'auto'"):
    jaxclip.ghost_plan(mlp_loss, *mlp_problem(batch=2, seed=0), method="vmap")
  fn = jaxclip.per_example_clipped_grad(lambda w, x: jnp.abs(jnp.sum(w * x)), 1.0, method="ghost")
  with pytest.raises(ValueError, match="real parameters"):
    fn(jnp.ones(2, jnp.complex64), jnp.ones((3, 2), jnp.complex64))
  fn = jaxclip.per_example_clipped_grad(lambda w, x: w * x, 1.0, method="ghost")
  with pytest.raises(ValueError, match="real scalar"):
    fn(jnp.ones(2), jnp.ones((3, 2)))


@pytest.mark.hlo
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_ghost_lowers_for_gpu_and_tpu_without_cpu_workarounds(platform):
  params, tokens = _gpt_params(), _tokens(12)
  fn = jaxclip.per_example_clipped_grad(
    gpt_loss, 1.0, microbatch_size=8, method="ghost", return_norms=True
  )
  text = jax.export.export(jax.jit(fn), platforms=(platform,))(params, tokens).mlir_module()
  assert "stablehlo.optimization_barrier" not in text
  assert "stablehlo.dot_general" in text


def _auto_problem():
  # 64 rows through an 8 x 4 weight (its per-example gradient costs fewer flops and
  # floats than its rule), then their mean through a 4 x 5 head (its rule costs less
  # of both). On CPU the rules kept still cost more than 0.9x the per-example
  # gradients' flops: vmap's program. Elsewhere (memory first): the head's rule.
  ks = jax.random.split(jax.random.key(3), 3)
  p = {"w1": jax.random.normal(ks[0], (8, 4)), "w2": jax.random.normal(ks[1], (4, 5))}
  xs = jax.random.normal(ks[2], (6, 64, 8))
  return (lambda p, x: jnp.sum(jnp.sin(jnp.mean(jnp.tanh(x @ p["w1"]), 0) @ p["w2"]))), p, xs


def test_auto_chooses_by_the_platform_the_program_is_lowered_for():
  loss, p, xs = _auto_problem()
  cpu = jaxclip.ghost_plan(loss, p, xs, method="auto", platform="cpu")
  gpu = jaxclip.ghost_plan(loss, p, xs, method="auto", platform="gpu")
  assert cpu.rules == {"['w1']": "instantiate", "['w2']": "instantiate"}, cpu
  assert "the loss runs as method='vmap'" in cpu.leaves[1].reason
  assert gpu.rules == {"['w1']": "instantiate", "['w2']": "dot"}, gpu
  assert "auto on gpu" in gpu.leaves[0].reason and "floats per example" in gpu.leaves[0].reason
  _compare(loss, p, xs, method_="auto")  # both plans staged; this CPU runs vmap's program
  fn = jax.jit(jaxclip.per_example_clipped_grad(loss, 1.0, method="auto", return_norms=True))
  head = "tensor<6x4x5xf32>"  # the head's per-example gradients: vmap's program, not the rule's
  texts = {k: jax.export.export(fn, platforms=(k,))(p, xs).mlir_module() for k in ("cpu", "cuda")}
  assert head in texts["cpu"] and head not in texts["cuda"]


def test_ghost_plan_names_each_leaf_rule_reason_and_floats():
  params, tokens = _gpt_params(), _tokens(4)
  plan = jaxclip.ghost_plan(gpt_loss, params, tokens, batch_argnums=1)
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert [leaf.path for leaf in plan.leaves] == paths
  rules = plan.rules
  assert rules["['wte']"] == "tied"
  assert all(
    rules[f"['{i}']['{n}']"] == "dot" for i in range(L) for n in ("qkv", "proj", "fc", "out")
  )
  leaf = plan.leaves[paths.index("['0']['ln1_s']")]
  assert (leaf.rule, leaf.floats, leaf.shape) == ("instantiate", D, (D,))
  assert "mul" in leaf.reason
  assert all((leaf.reason is None) == (leaf.rule != "instantiate") for leaf in plan.leaves)
  sizes = {leaf.path: leaf.floats for leaf in plan.leaves}
  fallen = sum(sizes[p] for p, r in rules.items() if r == "instantiate")
  assert plan.fallback_share == pytest.approx(fallen / sum(sizes.values()))
  assert 0 < plan.fallback_share < 0.2
  text = str(plan)
  assert "['0']['qkv']" in text and "instantiated" in text.splitlines()[-1]
  # Unused leaves, keep_batch_dim and has_aux are taken as per_example_clipped_grad takes them.
  loss = lambda p, x: (jnp.sum(x[0] @ p["w"]), x)
  plan = jaxclip.ghost_plan(
    loss,
    {"w": jnp.ones((3, 2)), "v": jnp.ones(4)},
    jnp.ones((5, 3)),
    batch_argnums=1,
    keep_batch_dim=True,
    has_aux=True,
  )
  assert plan.rules == {"['v']": "unused", "['w']": "dot"} and plan.fallback_share == 0


def test_static_shared_arguments_and_a_loss_that_ignores_the_batch_as_with_vmap():
  def loss(w, flag, name, x):
    assert isinstance(flag, bool) and name == "tanh"
    return jnp.sum(jnp.tanh(x @ w)) if flag else jnp.sum(x @ w)

  w = jax.random.normal(jax.random.key(0), (3, 2))
  xs = jax.random.normal(jax.random.key(1), (6, 3))
  fns = {
    m: jaxclip.per_example_clipped_grad(loss, 1.0, method=m, return_norms=True, batch_argnums=3)
    for m in ("vmap", "ghost")
  }
  # The bool and the str: static arguments, handed to the loss as they are.
  ref, got = (
    jax.jit(fns[m], static_argnums=(1, 2))(w, True, "tanh", xs) for m in ("vmap", "ghost")
  )
  np.testing.assert_allclose(got[2], ref[2], rtol=1e-5, atol=1e-6)  # as _compare
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
  assert int(got[1]) == int(ref[1]) > 0
  # A loss without the example: every example has the same gradient.
  ignore = lambda w, x: jnp.sum(w**2)
  for method in ("vmap", "ghost"):
    total, count, norms = jax.jit(
      jaxclip.per_example_clipped_grad(
        ignore, 1.0, method=method, return_norms=True, batch_argnums=1
      )
    )(w, xs)
    np.testing.assert_allclose(norms, np.full(6, 2 * np.linalg.norm(w)), rtol=1e-6)
    np.testing.assert_allclose(total, 6 * 2 * w / norms[0], rtol=1e-5)
    assert int(count) == 6


# ----------------------------------------------------------------------------
# 8 devices (run in the subprocess)
# ----------------------------------------------------------------------------


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


test_multi_device = multi_device_checks(globals(), N_DEVICES)


@pytest.mark.parametrize(
  "lhs_shape, rhs_shape, dn, kwargs, fits",
  [  # the zoo CNN's first layer (patches larger than the input), NCHW dilated, 1-D, 1 x 1
    (
      (1, 10, 10, 3),
      (3, 3, 3, 16),
      ("NHWC", "HWIO", "NHWC"),
      dict(strides=(2, 2), pad=((0, 1),) * 2),
      True,
    ),
    (
      (1, 2, 6, 5),
      (3, 2, 2, 3),
      ("NCHW", "OIHW", "NCHW"),
      dict(strides=(1, 2), pad=((1, 0), (2, -1)), lhs_dil=(2, 1), rhs_dil=(1, 2)),
      False,
    ),
    ((2, 7, 3), (3, 3, 2), ("NWC", "WIO", "NWC"), dict(strides=(1,), pad=((1, 1),)), False),
    (
      (1, 6, 6, 4),
      (1, 1, 4, 5),
      ("NHWC", "HWIO", "NHWC"),
      dict(strides=(2, 2), pad=((0, 0),) * 2),
      True,
    ),
  ],
)
def test_conv_kernel_gradient_tap_by_tap_equals_the_vjp(lhs_shape, rhs_shape, dn, kwargs, fits):
  """Issue #39 (the CNN's memory): an accumulated convolution's per-example kernel gradient
  taken tap by tap, in any layout, equals ``jax.vjp``'s; a NaN in one example's output
  gradient reaches no other example (the zeros that order the work are shared by the
  examples)."""

  def conv(x, k):
    return jax.lax.conv_general_dilated(
      x,
      k,
      kwargs["strides"],
      kwargs["pad"],
      kwargs.get("lhs_dil"),
      kwargs.get("rhs_dil"),
      dimension_numbers=dn,
      precision=jax.lax.Precision.HIGHEST,
    )

  n = 3
  kx, kk, kg = jax.random.split(jax.random.key(0), 3)
  xs = jax.random.normal(kx, (n, *lhs_shape))
  k = jax.random.normal(kk, rhs_shape)
  (eqn,) = jax.make_jaxpr(conv)(xs[0], k).eqns
  parts = _ghost_capture._jax.conv_parts(eqn)
  assert _ghost_conv.patches_fit(eqn, parts) == fits  # the others: here for their layouts
  gs = jax.random.normal(kg, (n, *eqn.outvars[0].aval.shape))
  gs = gs.at[0].set(gs[0].at[(0,) * gs[0].ndim].set(jnp.nan))
  got = jax.jit(jax.vmap(lambda x, g: _ghost_conv.kernel_gradient(parts, k, x, g)))(xs, gs)
  ref = jax.vmap(lambda x, g: jax.vjp(lambda k: conv(x, k), k)[1](g)[0])(xs, gs)
  assert got.shape == (n, *rhs_shape)
  assert np.isnan(np.asarray(got[0])).any()
  np.testing.assert_allclose(got[1:], ref[1:], rtol=1e-5, atol=1e-5)


def _strided_conv_loss(p, x, y):
  h = jax.lax.conv_general_dilated(
    x[None], p["k"], (2, 2), ((0, 1), (0, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  h = jax.nn.relu(h + p["b"])
  return jnp.sum((h.reshape(-1) @ p["w"] - y) ** 2)


def _strided_conv_problem():
  """The CNN's first layer at a small size: params, images, targets."""
  keys = jax.random.split(jax.random.key(1), 4)
  params = {
    "k": 0.3 * jax.random.normal(keys[0], (3, 3, 3, 16)),
    "b": jnp.zeros(16),
    "w": 0.1 * jax.random.normal(keys[1], (8 * 8 * 16, 2)),
  }
  x = jax.random.normal(keys[2], (6, 16, 16, 3))
  y = jax.random.normal(keys[3], (6, 2))
  return params, x, y


def test_strided_conv_whose_kernel_gradient_is_taken_tap_by_tap_matches_vmap():
  """The kernel's per-example gradient is formed in the backward pass, tap by tap
  (:func:`test_conv_kernel_gradient_tap_by_tap_equals_the_vjp`), and ghost's sums and norms
  equal vmap's."""
  params, x, y = _strided_conv_problem()
  traced = _ghost.trace(_strided_conv_loss, params, [x, y], [0, 1], has_aux=False)
  inputs = _ghost.inputs_for(traced, None)
  (u,) = [u for u, s in enumerate(traced.plan.sites) if s.name == "conv_general_dilated"]
  assert u in inputs.accumulated
  assert _ghost_conv.patches_fit(
    traced.plan.sites[u].eqn, _ghost_capture._jax.conv_parts(traced.plan.sites[u].eqn)
  )
  _compare(_strided_conv_loss, params, x, y, batch_argnums=(1, 2))


@pytest.mark.hlo
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_tap_by_tap_conv_gradient_lowers_for_gpu_and_tpu(platform):
  # The zero that orders the taps (a custom_vmap) lowers for every platform, and the
  # program carries none of the kernel's XLA:CPU workarounds.
  params, x, y = _strided_conv_problem()
  fn = jaxclip.per_example_clipped_grad(
    _strided_conv_loss, 1.0, batch_argnums=(1, 2), method="ghost"
  )
  text = jax.export.export(jax.jit(fn), platforms=(platform,))(params, x, y).mlir_module()
  assert "stablehlo.optimization_barrier" not in text
  assert "stablehlo.convolution" in text
