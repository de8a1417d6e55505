"""The zoo's flax nnx model: a Llama-like model, blocks stacked with split_rngs/vmap, nnx.scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from workloads.zoo import _common


class _NnxBlock(nnx.Module):
  def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
    self.gate = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, use_bias=False, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    t, d = h.shape
    q, k, v = jnp.split(
      self.qkv(self.attn_norm(h)).reshape(t, 3, self.heads, d // self.heads), 3, axis=1
    )
    a = jax.nn.dot_product_attention(q[:, 0], k[:, 0], v[:, 0], is_causal=True)
    h = h + self.out(a.reshape(t, d))
    x = self.mlp_norm(h)
    return h + self.down(nnx.silu(self.gate(x)) * self.up(x))


class _NnxLlama(nnx.Module):
  def __init__(self, vocab: int, d: int, layers: int, heads: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> _NnxBlock:
      return _NnxBlock(d, heads, rngs)

    self.blocks = create(rngs)
    self.norm = nnx.RMSNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(h, block):
      return block(h)

    return self.head(self.norm(forward(self.embed(tokens), self.blocks)))


def _nnx_llama(size: str) -> _common.Model:
  cfg = _common._LM[size]
  create = lambda: _NnxLlama(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], nnx.Rngs(0))
  graphdef = nnx.graphdef(nnx.eval_shape(create))
  params = _common._run_once(lambda: nnx.state(create()))

  def loss_fn(params, x, y):
    return _common._xent(nnx.merge(graphdef, params)(x), y)

  return _common.Model(
    "nnx_llama",
    f"flax nnx Llama-like: nnx.Embed, {cfg['layers']} blocks of RMSNorm + bias-free "
    f"Linear qkv/out + causal jax.nn.dot_product_attention ({cfg['heads']} heads) + "
    f"SwiGLU MLP created with nnx.split_rngs/nnx.vmap and applied with nnx.scan, "
    f"RMSNorm, untied Linear head; vocab {cfg['vocab']}, d {cfg['d']}, "
    f"T {cfg['seq']}",
    params,
    loss_fn,
    _common._tokens(cfg),
  )
