"""The zoo's flax linen models: a GPT, an LSTM, a small CNN, an ALBERT-style GPT, a ResNet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from workloads.zoo import _common

# ----------------------------------------------------------------------------
# flax linen: a GPT with nn.scan(nn.remat(Block)) and a tied head.
# ----------------------------------------------------------------------------


class _LinenBlock(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
    d = h.shape[-1]
    x = nn.LayerNorm()(h)
    h = h + nn.MultiHeadDotProductAttention(num_heads=self.heads)(
      x, mask=nn.make_causal_mask(jnp.ones(h.shape[0]))
    )
    x = nn.Dense(4 * d)(nn.LayerNorm()(h))
    return h + nn.Dense(d)(nn.gelu(x)), None


class _LinenGPT(nn.Module):
  vocab: int
  seq: int
  d: int
  layers: int
  heads: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embed = nn.Embed(self.vocab, self.d)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d))
    h = embed(tokens) + pos[: tokens.shape[0]]
    blocks = nn.scan(
      nn.remat(_LinenBlock),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=nn.broadcast,
      length=self.layers,
    )
    h, _ = blocks(self.heads, name="blocks")(h, None)
    return embed.attend(nn.LayerNorm()(h))


def _linen_model(name: str, module: nn.Module, make: Callable, description: str) -> _common.Model:
  """A linen module that maps one example to logits, scored by cross-entropy."""
  params = _common._run_once(module.init, jax.random.key(0), make(1, 0)[0][0])["params"]

  def loss_fn(params, x, y):
    return _common._xent(module.apply({"params": params}, x), y)

  return _common.Model(name, description, params, loss_fn, make)


def _linen_scan_gpt(size: str) -> _common.Model:
  cfg = _common._LM[size]
  model = _LinenGPT(**cfg)
  make = _common._tokens(cfg)
  return _linen_model(
    "linen_scan_gpt",
    model,
    make,
    f"flax linen GPT: nn.Embed (tied head via attend), learned positions, "
    f"{cfg['layers']} blocks of LayerNorm + causal MultiHeadDotProductAttention "
    f"({cfg['heads']} heads) + Dense MLP under nn.scan(nn.remat(Block)); vocab "
    f"{cfg['vocab']}, d {cfg['d']}, T {cfg['seq']}",
  )


class _LinenLSTM(nn.Module):
  vocab: int
  d: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    h = nn.RNN(nn.LSTMCell(self.d))(nn.Embed(self.vocab, self.d)(tokens))
    return nn.Dense(self.vocab)(h)


def _linen_lstm(size: str) -> _common.Model:
  cfg = _common._LM[size]
  model = _LinenLSTM(cfg["vocab"], cfg["d"])
  make = _common._tokens(cfg)
  return _linen_model(
    "linen_lstm",
    model,
    make,
    f"flax linen LSTM language model: nn.Embed, nn.RNN(nn.LSTMCell) (its weights "
    f"read by every step of the scan), Dense head on every step; vocab {cfg['vocab']}, "
    f"d {cfg['d']}, T {cfg['seq']}",
  )


class _LinenCNN(nn.Module):
  classes: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # (side, side, 3)
    x = nn.relu(nn.Conv(16, (3, 3), 2)(x))
    x = nn.relu(nn.Conv(32, (3, 3), 2)(x))
    return nn.Dense(self.classes)(x.reshape(-1))


def _linen_cnn(size: str) -> _common.Model:
  cfg = _common._IMG[size]
  side = 32 if size == "bench" else cfg["side"]
  model = _LinenCNN(cfg["classes"])
  make = _common._images((side, side, 3), cfg["classes"])
  return _linen_model(
    "linen_cnn",
    model,
    make,
    f"flax linen small CNN: Conv 3x3 stride 2 (16 channels), Conv 3x3 stride 2 (32), "
    f"Dense head on the flattened features; images {side}x{side}x3, {cfg['classes']} classes",
  )


class _LinenSharedGPT(nn.Module):
  vocab: int
  seq: int
  d: int
  layers: int
  heads: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d))
    h = nn.Embed(self.vocab, self.d)(tokens) + pos[jnp.arange(tokens.shape[0])]
    block = nn.scan(
      _LinenBlock,
      variable_broadcast="params",
      split_rngs={"params": False},
      in_axes=nn.broadcast,
      length=self.layers,
    )
    h, _ = block(self.heads, name="shared_block")(h, None)
    return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def _linen_shared_gpt(size: str) -> _common.Model:
  cfg = _common._LM[size]
  model = _LinenSharedGPT(**cfg)
  make = _common._tokens(cfg)
  return _linen_model(
    "linen_shared_gpt",
    model,
    make,
    f"flax linen ALBERT-style GPT: nn.Embed, positions looked up at jnp.arange(T), one "
    f"block of LayerNorm + causal MultiHeadDotProductAttention ({cfg['heads']} heads) + "
    f"Dense MLP applied {cfg['layers']} times by nn.scan(variable_broadcast='params'), "
    f"untied Dense head; vocab {cfg['vocab']}, d {cfg['d']}, T {cfg['seq']}",
  )


# ----------------------------------------------------------------------------
# flax linen: a ResNet with Conv + GroupNorm.
# ----------------------------------------------------------------------------


class _LinenResBlock(nn.Module):
  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.Conv(self.features, (3, 3), self.strides, padding="SAME", use_bias=False)(x)
    y = nn.relu(nn.GroupNorm(num_groups=4)(y))
    y = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(y)
    y = nn.GroupNorm(num_groups=4)(y)
    if x.shape[-1] != self.features or self.strides != 1:
      x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x)
      x = nn.GroupNorm(num_groups=4)(x)
    return nn.relu(x + y)


class _LinenResNet(nn.Module):
  width: int
  classes: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # (batch, side, side, 3)
    x = nn.relu(
      nn.GroupNorm(num_groups=4)(nn.Conv(self.width, (3, 3), padding="SAME", use_bias=False)(x))
    )
    x = _LinenResBlock(self.width)(x)
    x = _LinenResBlock(2 * self.width, strides=2)(x)
    return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def _linen_resnet(size: str) -> _common.Model:
  cfg = _common._IMG[size]
  model = _LinenResNet(cfg["width"], cfg["classes"])
  make = _common._images((cfg["side"], cfg["side"], 3), cfg["classes"])
  params = _common._run_once(model.init, jax.random.key(0), make(1, 0)[0])["params"]

  def loss_fn(params, x, y):  # GroupNorm needs the batch axis: a batch of one
    return _common._xent(model.apply({"params": params}, x[None])[0], y)

  return _common.Model(
    "linen_resnet",
    f"flax linen ResNet: Conv 3x3 stem + 2 residual blocks of Conv + GroupNorm "
    f"(widths {cfg['width']}, {2 * cfg['width']}, the second strided with a 1x1 "
    f"projection), mean pool, Dense head; images {cfg['side']}x{cfg['side']}x3, "
    f"{cfg['classes']} classes",
    params,
    loss_fn,
    make,
  )
