"""A zoo of models built from the libraries' own layers, for ghost-norm tests and benchmarks.

Each model is what a user of flax linen, flax nnx, equinox or plain JAX would
write, from the library's layers (no hand-written math where a layer exists):

* ``linen_scan_gpt``: a GPT-like flax linen model, ``nn.Embed`` with the output
  head tied to it (``Embed.attend``), a learned position table, and pre-LayerNorm
  blocks of ``nn.MultiHeadDotProductAttention`` (causal) and a ``nn.Dense`` MLP,
  the blocks stacked and applied by ``nn.scan(nn.remat(Block))``;
* ``linen_resnet``: a ResNet-style flax linen convolutional net, ``nn.Conv`` and
  ``nn.GroupNorm`` residual blocks (one strided, with a projection shortcut),
  global average pooling and a ``nn.Dense`` head;
* ``nnx_llama``: a Llama-like flax nnx model, ``nnx.Embed``, ``nnx.RMSNorm``,
  bias-free ``nnx.Linear`` projections, causal ``jax.nn.dot_product_attention``
  and a SwiGLU MLP, the blocks created stacked with ``nnx.split_rngs`` and
  ``nnx.vmap`` and applied with ``nnx.scan``; an untied head;
* ``eqx_vit``: an equinox ViT, an ``eqx.nn.Conv2d`` patch embedding (stride =
  kernel = patch), a learned position table, blocks of ``eqx.nn.LayerNorm``,
  ``eqx.nn.MultiheadAttention`` and an ``eqx.nn.Linear`` MLP created stacked
  with ``eqx.filter_vmap`` and applied with ``jax.lax.scan``, a mean-pooled
  ``eqx.nn.Linear`` head;
* ``jax_scan_mlp``: plain JAX, a token embedding, residual MLP blocks whose
  weights are one stacked pytree scanned over with ``jax.lax.scan``, and a head;
* ``jax_loop_mlp``: the same stacked pytree, its layers applied in a Python
  loop through static slices ``w[l]``;
* ``linen_lstm``: a flax linen language model, ``nn.Embed``, ``nn.RNN`` over an
  ``nn.LSTMCell`` (its weights read by every step of the scan) and a ``nn.Dense``
  head on every step;
* ``linen_cnn``: a small flax linen CNN, two 3 x 3 ``nn.Conv`` at stride 2 (16 and
  32 channels) and a ``nn.Dense`` head on the flattened features;
* ``linen_shared_gpt``: an ALBERT-style flax linen transformer, one pre-LayerNorm
  block (the GPT's) applied at every layer by ``nn.scan`` with
  ``variable_broadcast="params"`` (its weights read by every iteration), a
  position table looked up at ``jnp.arange(T)`` and an untied ``nn.Dense`` head.

``build(name, size)`` returns a :class:`Model`: its parameters, a per-example
loss ``loss_fn(params, x, y)`` (one example, no batch axis) and
``make_batch(batch, seed) -> (x, y)`` (a synthetic batch, leading axis the
examples). ``size`` is ``"tiny"`` (for tests: a few thousand parameters, a
few tokens) or ``"bench"`` (for ``python -m benchmarks.ghost --zoo``: sequences
of 32 or 36 tokens, images of 16 x 16 or 24 x 24).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from workloads import xla_options

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Model:
  """One zoo model at one size.

  Attributes:
    name: the model's name in :data:`MODELS`.
    description: one line: the library, its layers, the sizes.
    params: the parameters (a pytree of float32 arrays).
    loss_fn: ``loss_fn(params, x, y) -> scalar``, the loss of one example.
    make_batch: ``make_batch(batch, seed) -> (x, y)``, a synthetic batch.
  """

  name: str
  description: str
  params: PyTree
  loss_fn: Callable[[PyTree, jax.Array, jax.Array], jax.Array]
  make_batch: Callable[[int, int], tuple[jax.Array, jax.Array]]

  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))


# Sizes of the sequence models: vocabulary, tokens, width, layers, heads.
_LM = {
  "tiny": {"vocab": 40, "seq": 8, "d": 16, "layers": 2, "heads": 2},
  "bench": {"vocab": 256, "seq": 32, "d": 64, "layers": 4, "heads": 4},
}
# Sizes of the image models: side, channels (ResNet stages / ViT width), classes.
_IMG = {
  "tiny": {"side": 8, "width": 8, "layers": 2, "heads": 2, "patch": 4, "classes": 5},
  "bench": {"side": 16, "width": 16, "layers": 4, "heads": 4, "patch": 4, "classes": 10},
}


# XLA options for programs run once (the initialisations): XLA:CPU compiles a
# convolutional net's init about ten times faster without its backend
# optimisations and fusion emitters, and the parameters are the same.
CHEAP_COMPILE = xla_options.FAST_COMPILE


def _run_once(fn: Callable, *args: Any) -> Any:
  """``jax.jit(fn)(*args)``, compiled with :data:`CHEAP_COMPILE`."""
  return jax.jit(fn).lower(*args).compile(CHEAP_COMPILE)(*args)


def _tokens(cfg: dict) -> Callable[[int, int], tuple[jax.Array, jax.Array]]:
  """Random sequences: ``x`` the inputs, ``y`` the next tokens, each ``(batch, seq)``."""

  def make(batch: int, seed: int) -> tuple[jax.Array, jax.Array]:
    t = jax.random.randint(jax.random.key(seed), (batch, cfg["seq"] + 1), 0, cfg["vocab"])
    return t[:, :-1], t[:, 1:]

  return make


def _images(
  shape: tuple[int, ...], classes: int
) -> Callable[[int, int], tuple[jax.Array, jax.Array]]:
  def make(batch: int, seed: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (batch, *shape)), jax.random.randint(ky, (batch,), 0, classes))

  return make


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


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


def _linen_model(name: str, module: nn.Module, make: Callable, description: str) -> Model:
  """A linen module that maps one example to logits, scored by cross-entropy."""
  params = _run_once(module.init, jax.random.key(0), make(1, 0)[0][0])["params"]

  def loss_fn(params, x, y):
    return _xent(module.apply({"params": params}, x), y)

  return Model(name, description, params, loss_fn, make)


def _linen_scan_gpt(size: str) -> Model:
  cfg = _LM[size]
  model = _LinenGPT(**cfg)
  make = _tokens(cfg)
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


def _linen_lstm(size: str) -> Model:
  cfg = _LM[size]
  model = _LinenLSTM(cfg["vocab"], cfg["d"])
  make = _tokens(cfg)
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


def _linen_cnn(size: str) -> Model:
  cfg = _IMG[size]
  side = 32 if size == "bench" else cfg["side"]
  model = _LinenCNN(cfg["classes"])
  make = _images((side, side, 3), cfg["classes"])
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


def _linen_shared_gpt(size: str) -> Model:
  cfg = _LM[size]
  model = _LinenSharedGPT(**cfg)
  make = _tokens(cfg)
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


def _linen_resnet(size: str) -> Model:
  cfg = _IMG[size]
  model = _LinenResNet(cfg["width"], cfg["classes"])
  make = _images((cfg["side"], cfg["side"], 3), cfg["classes"])
  params = _run_once(model.init, jax.random.key(0), make(1, 0)[0])["params"]

  def loss_fn(params, x, y):  # GroupNorm needs the batch axis: a batch of one
    return _xent(model.apply({"params": params}, x[None])[0], y)

  return Model(
    "linen_resnet",
    f"flax linen ResNet: Conv 3x3 stem + 2 residual blocks of Conv + GroupNorm "
    f"(widths {cfg['width']}, {2 * cfg['width']}, the second strided with a 1x1 "
    f"projection), mean pool, Dense head; images {cfg['side']}x{cfg['side']}x3, "
    f"{cfg['classes']} classes",
    params,
    loss_fn,
    make,
  )


# ----------------------------------------------------------------------------
# flax nnx: a Llama-like model, blocks stacked with split_rngs/vmap, nnx.scan.
# ----------------------------------------------------------------------------


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


def _nnx_llama(size: str) -> Model:
  cfg = _LM[size]
  create = lambda: _NnxLlama(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], nnx.Rngs(0))
  graphdef = nnx.graphdef(nnx.eval_shape(create))
  params = _run_once(lambda: nnx.state(create()))

  def loss_fn(params, x, y):
    return _xent(nnx.merge(graphdef, params)(x), y)

  return Model(
    "nnx_llama",
    f"flax nnx Llama-like: nnx.Embed, {cfg['layers']} blocks of RMSNorm + bias-free "
    f"Linear qkv/out + causal jax.nn.dot_product_attention ({cfg['heads']} heads) + "
    f"SwiGLU MLP created with nnx.split_rngs/nnx.vmap and applied with nnx.scan, "
    f"RMSNorm, untied Linear head; vocab {cfg['vocab']}, d {cfg['d']}, "
    f"T {cfg['seq']}",
    params,
    loss_fn,
    _tokens(cfg),
  )


# ----------------------------------------------------------------------------
# equinox: a ViT, Conv2d patches, blocks stacked with filter_vmap, lax.scan.
# ----------------------------------------------------------------------------


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


def _eqx_vit(size: str) -> Model:
  cfg = dict(_IMG[size])
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
  params = _run_once(lambda: eqx.partition(create(), eqx.is_inexact_array)[0])

  def loss_fn(params, x, y):
    return _xent(eqx.combine(params, static)(x), y)

  n = (cfg["side"] // cfg["patch"]) ** 2
  return Model(
    "eqx_vit",
    f"equinox ViT: Conv2d patch embedding ({cfg['patch']}x{cfg['patch']}, "
    f"{n} patches), learned positions, {cfg['layers']} blocks of LayerNorm + "
    f"MultiheadAttention ({cfg['heads']} heads) + Linear MLP created with "
    f"eqx.filter_vmap and applied with jax.lax.scan, mean pool, Linear head; "
    f"width {cfg['width']}, images 3x{cfg['side']}x{cfg['side']}",
    params,
    loss_fn,
    _images((3, cfg["side"], cfg["side"]), cfg["classes"]),
  )


# ----------------------------------------------------------------------------
# Plain JAX: one stacked pytree of layers, under lax.scan or in a Python loop.
# ----------------------------------------------------------------------------


def _stacked_params(cfg: dict) -> dict:
  d, f, n, v = cfg["d"], 4 * cfg["d"], cfg["layers"], cfg["vocab"]
  init = jax.nn.initializers.lecun_normal()
  ks = jax.random.split(jax.random.key(0), 4)
  return {
    "embed": 0.02 * jax.random.normal(ks[0], (v, d)),
    "layers": {
      "scale": jnp.ones((n, d)),
      "w_in": init(ks[1], (n, d, f)),
      "b_in": jnp.zeros((n, f)),
      "w_out": 0.5 * init(ks[2], (n, f, d)),
    },
    "head": init(ks[3], (d, v)),
  }


def _stacked_layer(h: jax.Array, layer: dict) -> jax.Array:
  x = jax.nn.standardize(h, axis=-1) * layer["scale"]
  return h + jax.nn.gelu(x @ layer["w_in"] + layer["b_in"]) @ layer["w_out"]


def _jax_stacked(size: str, loop: bool) -> Model:
  cfg = _LM[size]

  def loss_fn(params, x, y):
    h = params["embed"][x]
    if loop:
      for i in range(cfg["layers"]):
        h = _stacked_layer(h, jax.tree.map(lambda w, i=i: w[i], params["layers"]))
    else:
      h, _ = jax.lax.scan(lambda h, layer: (_stacked_layer(h, layer), None), h, params["layers"])
    return _xent(h @ params["head"], y)

  how = "a Python loop over static slices w[l]" if loop else "jax.lax.scan"
  return Model(
    "jax_loop_mlp" if loop else "jax_scan_mlp",
    f"plain JAX: token embedding (E[ids]), {cfg['layers']} residual MLP blocks "
    f"(standardize * scale, GELU MLP of {4 * cfg['d']}) whose weights are one "
    f"stacked pytree applied by {how}, Dense head; vocab {cfg['vocab']}, "
    f"d {cfg['d']}, T {cfg['seq']}",
    _run_once(lambda: _stacked_params(cfg)),
    loss_fn,
    _tokens(cfg),
  )


MODELS: dict[str, Callable[[str], Model]] = {
  "linen_scan_gpt": _linen_scan_gpt,
  "linen_resnet": _linen_resnet,
  "nnx_llama": _nnx_llama,
  "eqx_vit": _eqx_vit,
  "jax_scan_mlp": lambda size: _jax_stacked(size, loop=False),
  "jax_loop_mlp": lambda size: _jax_stacked(size, loop=True),
  "linen_lstm": _linen_lstm,
  "linen_shared_gpt": _linen_shared_gpt,
  "linen_cnn": _linen_cnn,
}
SIZES = ("tiny", "bench")


@functools.cache
def build(name: str, size: str = "tiny") -> Model:
  """The zoo model ``name`` (a key of :data:`MODELS`) at ``size`` (``"tiny"`` or ``"bench"``)."""
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size!r}.")
  return MODELS[name](size)
