"""A small GPT-like language model in pure JAX, for the full train step benchmark.

Token and position embeddings, pre-LayerNorm transformer blocks (causal
multi-head self-attention, then a GELU MLP), a final LayerNorm and an output
head, untied by default or tied to the token embedding (``logits = h @ wte.T``,
as in GPT-2; the per-example clipping benchmark :mod:`benchmarks.ghost` uses
it). The loss takes one sequence or a batch of them, so it also serves as a
per-example loss. The parameters are a flat dict of arrays, one leaf per weight
and bias as in most JAX models (no stacking of the layers), so that a
gradient transformation sees a realistic number of leaves.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Sizes of the model and of its batch.

  Attributes:
    vocab: number of tokens.
    seq_len: tokens per sequence (the context length).
    d_model: width of the residual stream.
    n_layers: number of transformer blocks.
    n_heads: attention heads per block (``d_model`` must be a multiple).
    batch: sequences per train step.
    tied: whether the output head is the transposed token embedding (no
      ``head.kernel`` parameter).
  """

  vocab: int = 8192
  seq_len: int = 128
  d_model: int = 384
  n_layers: int = 8
  n_heads: int = 6
  batch: int = 4
  tied: bool = False

  def describe(self) -> str:
    """A one-line summary of the sizes."""
    return (
      f"vocab {self.vocab}, seq len {self.seq_len}, d_model {self.d_model}, "
      f"{self.n_layers} layers of {self.n_heads} heads, MLP {4 * self.d_model}, "
      f"{'tied' if self.tied else 'untied'} head, batch {self.batch}"
    )


# About 20.5M parameters: 14.2M in the blocks, 3.1M in each of the token
# embedding and the output head.
FULL = GPTConfig()
# A tiny model for ``--quick`` (a smoke test: a few thousand parameters).
QUICK = GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, batch=2)


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
  """The shape of every parameter, by name."""
  d, v = cfg.d_model, cfg.vocab
  shapes = {"wte": (v, d), "wpe": (cfg.seq_len, d)}
  for i in range(cfg.n_layers):
    p = f"h{i:02d}."
    shapes.update(
      {
        p + "ln_1.scale": (d,),
        p + "ln_1.bias": (d,),
        p + "attn.qkv.kernel": (d, 3 * d),
        p + "attn.qkv.bias": (3 * d,),
        p + "attn.proj.kernel": (d, d),
        p + "attn.proj.bias": (d,),
        p + "ln_2.scale": (d,),
        p + "ln_2.bias": (d,),
        p + "mlp.fc.kernel": (d, 4 * d),
        p + "mlp.fc.bias": (4 * d,),
        p + "mlp.proj.kernel": (4 * d, d),
        p + "mlp.proj.bias": (d,),
      }
    )
  shapes.update({"ln_f.scale": (d,), "ln_f.bias": (d,)})
  if not cfg.tied:
    shapes["head.kernel"] = (d, v)
  return shapes


def num_params(cfg: GPTConfig) -> int:
  """The number of parameters of the model."""
  return int(sum(math.prod(s) for s in param_shapes(cfg).values()))


def init_params(cfg: GPTConfig, seed: int = 0) -> dict[str, jax.Array]:
  """GPT-2-style initial parameters.

  LayerNorm scales are one, biases zero, weights N(0, 0.02), the residual
  projections scaled down by ``sqrt(2 * n_layers)``.
  """
  key = jax.random.key(seed)
  params = {}
  for i, (name, shape) in enumerate(param_shapes(cfg).items()):
    if name.endswith(".scale"):
      params[name] = jnp.ones(shape, jnp.float32)
    elif name.endswith(".bias"):
      params[name] = jnp.zeros(shape, jnp.float32)
    else:
      std = 0.02 / (math.sqrt(2 * cfg.n_layers) if name.endswith("proj.kernel") else 1.0)
      params[name] = std * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
  return params


def make_tokens(cfg: GPTConfig, seed: int = 0) -> jax.Array:
  """Random tokens, ``(batch, seq_len + 1)``: inputs and next-token targets."""
  return jax.random.randint(jax.random.key(seed), (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab)


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def _attention(params: dict, p: str, x: jax.Array, n_heads: int) -> jax.Array:
  # x is (..., t, d): one sequence or a batch of them.
  t, d = x.shape[-2:]
  qkv = x @ params[p + "attn.qkv.kernel"] + params[p + "attn.qkv.bias"]
  q, k, v = (y.reshape(x.shape[:-1] + (n_heads, d // n_heads)) for y in jnp.split(qkv, 3, axis=-1))
  logits = jnp.einsum("...qhc,...khc->...hqk", q, k) / math.sqrt(d // n_heads)
  causal = np.tril(np.ones((t, t), bool))
  logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
  y = jnp.einsum("...hqk,...khc->...qhc", jax.nn.softmax(logits, axis=-1), v).reshape(x.shape)
  return y @ params[p + "attn.proj.kernel"] + params[p + "attn.proj.bias"]


def _mlp(params: dict, p: str, x: jax.Array) -> jax.Array:
  h = jax.nn.gelu(x @ params[p + "mlp.fc.kernel"] + params[p + "mlp.fc.bias"])
  return h @ params[p + "mlp.proj.kernel"] + params[p + "mlp.proj.bias"]


def loss_fn(params: dict, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
  """Mean next-token cross-entropy of ``tokens``, ``(batch, seq_len + 1)`` or ``(seq_len + 1,)``.

  With one sequence of ``seq_len + 1`` tokens it is a per-example loss: the
  mean over its ``seq_len`` positions.
  """
  inputs, targets = tokens[..., :-1], tokens[..., 1:]
  x = params["wte"][inputs] + params["wpe"][: inputs.shape[-1]]
  for i in range(cfg.n_layers):
    p = f"h{i:02d}."
    x = x + _attention(
      params, p, _layer_norm(x, params[p + "ln_1.scale"], params[p + "ln_1.bias"]), cfg.n_heads
    )
    x = x + _mlp(params, p, _layer_norm(x, params[p + "ln_2.scale"], params[p + "ln_2.bias"]))
  x = _layer_norm(x, params["ln_f.scale"], params["ln_f.bias"])
  logits = x @ (params["wte"].T if cfg.tied else params["head.kernel"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
