"""``per_example_clipped_grad(method="ghost")`` against ``method="vmap"`` on each kind of model.

Ghost norms must equal the per-example gradients' norms up to float rounding
on every model kind: an MLP, a GPT-like model with a tied head (also with
microbatches, padding and an aux output), a flax nnx model, an equinox
convolutional model and a flax linen model with remat, bfloat16 compute and
dropout keys; their dense and embedding weights get their rules. The
threshold is always the median norm (``tests.ghost_helpers.compare``), so
that some examples are clipped and some are not. The GPT's program lowers
for GPU and TPU without XLA:CPU's workarounds.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxclip
from jaxclip.privacy._ghost._rules import _scaling
from tests.ghost_helpers import D, L, T, V, gpt_loss
from tests.ghost_helpers import compare as _compare
from tests.ghost_helpers import gpt_params as _gpt_params
from tests.ghost_helpers import gpt_tokens as _tokens
from tests.ghost_helpers import plan as _plan
from tests.helpers import mlp_loss, mlp_problem


def test_mlp_matches_vmap_and_uses_the_dot_rule():
  params, x, y = mlp_problem(batch=16, seed=3)
  _compare(mlp_loss, params, x, y, batch_argnums=(1, 2))
  plan = _plan(mlp_loss, params, x[0], y[0])
  assert sorted(r for _, _, r in plan.ghost) == ["dot", "dot"]  # w1, w2; b1 instantiated
  assert len(plan.instantiated) == 1
  # b1's site gives its per-example gradient in the backward pass (8 floats), not its output
  # gradient and input (16): the sites of the two dots record a and g.
  assert (
    plan.tapped == {u for u, s in enumerate(plan.sites) if s.rules == ("instantiate",)} != set()
  )


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
  assert names.index("['wte']") not in {i for leaves, _ in plan.instantiated for i in leaves}


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
  assert sorted(r for _, _, r in plan.ghost) == ["dot", "dot", "lookup", "scale"]


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
  assert sorted(r for _, _, r in plan.ghost) == ["dot", "dot", "scale"]  # the LayerNorm's scale


@pytest.mark.hlo
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_ghost_lowers_for_gpu_and_tpu_without_cpu_workarounds(platform, monkeypatch):
  # The Gram form's two-stage sum keeps its barrier on every platform: left out here.
  monkeypatch.setattr(_scaling, "staged", lambda x: x)
  params, tokens = _gpt_params(), _tokens(12)
  fn = jaxclip.per_example_clipped_grad(
    gpt_loss, 1.0, microbatch_size=8, method="ghost", return_norms=True
  )
  text = jax.export.export(jax.jit(fn), platforms=(platform,))(params, tokens).mlir_module()
  assert "stablehlo.optimization_barrier" not in text
  assert "stablehlo.dot_general" in text


@pytest.mark.hlo
def test_the_gram_forms_two_stage_sum_keeps_its_barrier_for_gpu():
  """The Gram form's rounding bound counts its sum's two stages on every platform: the program
  lowered for cuda keeps the barrier between them (the GPT's dense layers at T = 12 take the
  Gram form)."""
  params, tokens = _gpt_params(), _tokens(12)
  fn = jaxclip.per_example_clipped_grad(gpt_loss, 1.0, method="ghost")
  text = jax.export.export(jax.jit(fn), platforms=("cuda",))(params, tokens).mlir_module()
  assert "stablehlo.optimization_barrier" in text
