"""The GPT-like model of :mod:`benchmarks._model` in torch, for the peers of ``--peers``.

Module for module what ``_model.loss_fn`` computes with a tied head, built
from the layers Opacus knows (``nn.Embedding``, ``nn.Linear``,
``nn.LayerNorm``) so that its ghost and hooks modes see the model as a torch
user writes it:

* ``wte``, ``wpe``: ``nn.Embedding(vocab, d)`` and ``nn.Embedding(T, d)``, the
  position ids ``arange(T)`` given one row per example (Opacus reads the
  batch from every layer's first axis);
* per block, pre-LayerNorm (``nn.LayerNorm(d, eps=1e-5)``, as ``_layer_norm``):
  causal attention with one ``nn.Linear(d, 3d)`` for q, k and v (split in
  that order along the features, then into heads), logits scaled by
  ``1/sqrt(d/heads)``, masked with the float32 minimum, softmax, and an
  ``nn.Linear(d, d)`` projection; then an MLP ``nn.Linear(d, 4d)``, tanh GELU
  (``jax.nn.gelu``'s default), ``nn.Linear(4d, d)``; both residual;
* a final LayerNorm and the head, an ``nn.Linear(d, vocab, bias=False)``
  whose weight *is* ``wte.weight`` (one parameter, as ``h @ wte.T``); with
  ``tied=False`` a parameter of its own instead (``head.kernel``: Opacus's
  ghost clipping refuses tied parameters);
* per example, the mean next-token cross-entropy over its ``T`` positions.

:func:`load_jax_params` copies a ``_model.init_params`` dict in (a
``Linear``'s weight is the transposed kernel) and :func:`grads_as_jax`
returns gradients under the JAX names, so a run checks that both models give
the same gradient before it times them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
  """One pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

  def __init__(self, d: int, n_heads: int):
    super().__init__()
    self.n_heads = n_heads
    self.ln_1 = nn.LayerNorm(d, eps=1e-5)
    self.qkv = nn.Linear(d, 3 * d)
    self.attn_proj = nn.Linear(d, d)
    self.ln_2 = nn.LayerNorm(d, eps=1e-5)
    self.fc = nn.Linear(d, 4 * d)
    self.mlp_proj = nn.Linear(4 * d, d)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    h, c = self.n_heads, d // self.n_heads
    q, k, v = (
      y.reshape(b, t, h, c).transpose(1, 2) for y in self.qkv(self.ln_1(x)).split(d, dim=-1)
    )
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(c)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    logits = logits.masked_fill(~causal, torch.finfo(logits.dtype).min)
    y = (logits.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
    x = x + self.attn_proj(y)
    return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
  """Token and position embeddings, ``n_layers`` blocks, a final LayerNorm, a tied head."""

  def __init__(
    self, vocab: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, tied: bool = True
  ):
    super().__init__()
    self.tied = tied
    self.wte = nn.Embedding(vocab, d_model)
    self.wpe = nn.Embedding(seq_len, d_model)
    self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
    self.ln_f = nn.LayerNorm(d_model, eps=1e-5)
    self.head = nn.Linear(d_model, vocab, bias=False)
    if tied:
      self.head.weight = self.wte.weight  # logits = h @ wte.T

  def forward(self, inputs: torch.Tensor) -> torch.Tensor:
    """Logits ``(B, T, vocab)`` of ``inputs``, ``(B, T)`` token ids."""
    b, t = inputs.shape
    positions = torch.arange(t, device=inputs.device).repeat(b, 1)  # contiguous, for Opacus
    x = self.wte(inputs) + self.wpe(positions)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


def per_example_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
  """``(B,)``: each sequence's mean next-token cross-entropy over its positions."""
  b, t, v = logits.shape
  return (
    F.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t), reduction="none")
    .view(b, t)
    .mean(dim=1)
  )


def _names(model: GPT) -> list[tuple[str, nn.Parameter, bool]]:
  """``(JAX name, parameter, transposed)`` for every parameter of ``model``."""
  out = [("wte", model.wte.weight, False), ("wpe", model.wpe.weight, False)]
  for i, blk in enumerate(model.blocks):
    p = f"h{i:02d}."
    out += [
      (p + "ln_1.scale", blk.ln_1.weight, False),
      (p + "ln_1.bias", blk.ln_1.bias, False),
      (p + "attn.qkv.kernel", blk.qkv.weight, True),
      (p + "attn.qkv.bias", blk.qkv.bias, False),
      (p + "attn.proj.kernel", blk.attn_proj.weight, True),
      (p + "attn.proj.bias", blk.attn_proj.bias, False),
      (p + "ln_2.scale", blk.ln_2.weight, False),
      (p + "ln_2.bias", blk.ln_2.bias, False),
      (p + "mlp.fc.kernel", blk.fc.weight, True),
      (p + "mlp.fc.bias", blk.fc.bias, False),
      (p + "mlp.proj.kernel", blk.mlp_proj.weight, True),
      (p + "mlp.proj.bias", blk.mlp_proj.bias, False),
    ]
  out += [("ln_f.scale", model.ln_f.weight, False), ("ln_f.bias", model.ln_f.bias, False)]
  return out if model.tied else [*out, ("head.kernel", model.head.weight, True)]


def load_jax_params(model: GPT, params: dict[str, Any]) -> GPT:
  """Copies ``_model.init_params``'s arrays into ``model`` (in place; returns it)."""
  names = _names(model)
  if {n for n, _, _ in names} != set(params):
    raise ValueError(f"parameter names differ: {sorted({n for n, _, _ in names} ^ set(params))}")
  with torch.no_grad():
    for name, p, transposed in names:
      a = np.asarray(params[name])
      p.copy_(torch.from_numpy(np.ascontiguousarray(a.T if transposed else a)))
  return model


def grads_as_jax(model: GPT, grads: dict[nn.Parameter, torch.Tensor]) -> dict[str, np.ndarray]:
  """``{JAX name: gradient}`` from ``{parameter: gradient}``, kernels transposed back."""
  return {
    name: (grads[p].detach().numpy().T if transposed else grads[p].detach().numpy())
    for name, p, transposed in _names(model)
  }
