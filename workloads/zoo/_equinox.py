"""The zoo's equinox model: a ViT, Conv2d patches, blocks stacked with filter_vmap, lax.scan."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from workloads.zoo import _common


class _EqxBlock(eqx.Module):
  norm1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  fc1: eqx.nn.Linear
  fc2: eqx.nn.Linear

  def __init__(self, d: int, heads: int, key: jax.Array):
    k1, k2, k3 = jax.random.split(key, 3)
    self.norm1 = eqx.nn.LayerNorm(d)
    self.attn = eqx.nn.MultiheadAttention(
      heads,
      d,
      use_query_bias=True,
      use_key_bias=True,
      use_value_bias=True,
      use_output_bias=True,
      key=k1,
    )
    self.norm2 = eqx.nn.LayerNorm(d)
    self.fc1 = eqx.nn.Linear(d, 4 * d, key=k2)
    self.fc2 = eqx.nn.Linear(4 * d, d, key=k3)

  def __call__(self, h: jax.Array) -> jax.Array:
    x = jax.vmap(self.norm1)(h)
    h = h + self.attn(x, x, x)
    x = jax.vmap(self.norm2)(h)
    return h + jax.vmap(lambda v: self.fc2(jax.nn.gelu(self.fc1(v))))(x)


class _EqxViT(eqx.Module):
  patch: eqx.nn.Conv2d
  pos: jax.Array
  blocks: _EqxBlock
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(
    self, side: int, patch: int, d: int, layers: int, heads: int, classes: int, key: jax.Array
  ):
    kp, kpos, kb, kh = jax.random.split(key, 4)
    self.patch = eqx.nn.Conv2d(3, d, patch, stride=patch, key=kp)
    self.pos = 0.02 * jax.random.normal(kpos, ((side // patch) ** 2, d))
    self.blocks = eqx.filter_vmap(lambda k: _EqxBlock(d, heads, k))(jax.random.split(kb, layers))
    self.norm = eqx.nn.LayerNorm(d)
    self.head = eqx.nn.Linear(d, classes, key=kh)

  def __call__(self, image: jax.Array) -> jax.Array:  # (3, side, side)
    p = self.patch(image)
    h = p.reshape(p.shape[0], -1).T + self.pos
    stacked, static = eqx.partition(self.blocks, eqx.is_array)

    def step(h, layer):
      return eqx.combine(layer, static)(h), None

    h, _ = jax.lax.scan(step, h, stacked)
    return self.head(jnp.mean(jax.vmap(self.norm)(h), axis=0))


def _eqx_vit(size: str) -> _common.Model:
  cfg = dict(_common._IMG[size])
  if size == "bench":  # 36 patches of 4 x 4, width 64
    cfg.update(side=24, width=64)
  create = lambda: _EqxViT(
    cfg["side"],
    cfg["patch"],
    cfg["width"],
    cfg["layers"],
    cfg["heads"],
    cfg["classes"],
    jax.random.key(0),
  )
  shapes = eqx.filter_eval_shape(create)  # the arrays as jax.ShapeDtypeStruct
  static = eqx.partition(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))[1]
  params = _common._run_once(lambda: eqx.partition(create(), eqx.is_inexact_array)[0])

  def loss_fn(params, x, y):
    return _common._xent(eqx.combine(params, static)(x), y)

  n = (cfg["side"] // cfg["patch"]) ** 2
  return _common.Model(
    "eqx_vit",
    f"equinox ViT: Conv2d patch embedding ({cfg['patch']}x{cfg['patch']}, "
    f"{n} patches), learned positions, {cfg['layers']} blocks of LayerNorm + "
    f"MultiheadAttention ({cfg['heads']} heads) + Linear MLP created with "
    f"eqx.filter_vmap and applied with jax.lax.scan, mean pool, Linear head; "
    f"width {cfg['width']}, images 3x{cfg['side']}x{cfg['side']}",
    params,
    loss_fn,
    _common._images((3, cfg["side"], cfg["side"]), cfg["classes"]),
  )
