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

Each library's models are in a module of their own (``_linen``, ``_nnx``,
``_equinox``, ``_plain_jax``), built on ``_common``'s :class:`Model`, sizes,
synthetic batches and loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from workloads.zoo import _equinox, _linen, _nnx, _plain_jax
from workloads.zoo._common import CHEAP_COMPILE, Model

__all__ = ["CHEAP_COMPILE", "MODELS", "SIZES", "Model", "build"]


MODELS: dict[str, Callable[[str], Model]] = {
  "linen_scan_gpt": _linen._linen_scan_gpt,
  "linen_resnet": _linen._linen_resnet,
  "nnx_llama": _nnx._nnx_llama,
  "eqx_vit": _equinox._eqx_vit,
  "jax_scan_mlp": lambda size: _plain_jax._jax_stacked(size, loop=False),
  "jax_loop_mlp": lambda size: _plain_jax._jax_stacked(size, loop=True),
  "linen_lstm": _linen._linen_lstm,
  "linen_shared_gpt": _linen._linen_shared_gpt,
  "linen_cnn": _linen._linen_cnn,
}
SIZES = ("tiny", "bench")


@functools.cache
def build(name: str, size: str = "tiny") -> Model:
  """The zoo model ``name`` (a key of :data:`MODELS`) at ``size`` (``"tiny"`` or ``"bench"``)."""
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size!r}.")
  return MODELS[name](size)
