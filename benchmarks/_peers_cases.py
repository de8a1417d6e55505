"""The cases of ``--peers``: which peers are installed, each case's step, its row and its check."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import _ghost_cases, _model

EXTRA = "peers"
INSTALL = 'python3 -m venv .venv-peers && .venv-peers/bin/pip install -e ".[peers]" torch==2.13.0'
# Peer -> the modules it needs.
PEERS = {"Opacus": ("torch", "opacus"), "jax_privacy": ("jax_privacy",)}
# (key, framework, method, peer needed or None, baseline key)
CASES = (
  ("jax grad", "JAX", "non-private jax.grad", None, "jax grad"),
  ("jaxclip vmap", "jaxclip", 'method="vmap"', None, "jax grad"),
  ("jaxclip ghost", "jaxclip", 'method="ghost"', None, "jax grad"),
  ("jaxclip auto", "jaxclip", 'method="auto"', None, "jax grad"),
  ("jax_privacy", "jax_privacy", "clipped_grad (vmap)", "jax_privacy", "jax grad"),
  ("torch grad", "torch", "non-private loss.backward()", "Opacus", "torch grad"),
  (
    "torch grad untied",
    "torch",
    "non-private loss.backward(), head untied",
    "Opacus",
    "torch grad untied",
  ),
  (
    "opacus ghost",
    "Opacus",
    "ghost (GradSampleModuleFastGradientClipping), head untied",
    "Opacus",
    "torch grad untied",
  ),
  ("opacus hooks", "Opacus", "hooks (GradSampleModule)", "Opacus", "torch grad"),
)
# What each case's clipped sum is checked against (the probe call of each). An
# untied gradient is folded into the tied one (wte + head.kernel.T) to meet JAX's.
REFERENCE = {
  "jaxclip vmap": None,
  "jax grad": None,
  "torch grad": "jax grad",
  "torch grad untied": "jax grad",
  "opacus ghost": "opacus hooks untied",
}


def not_installed(peer: str, module: str) -> str:
  """The reason a peer's rows read ``not installed``, naming the extra."""
  return (
    f"{peer} needs `{module}`, which is not installed: it comes with the `{EXTRA}` extra, "
    f"`{INSTALL}`"
  )


def availability(import_module: Callable[[str], Any] = importlib.import_module) -> dict:
  """``{peer: (version, None)}`` for each peer installed, ``{peer: (None, why not)}`` otherwise."""
  out = {}
  for peer, modules in PEERS.items():
    versions = []
    for module in modules:
      try:
        versions.append(f"{module} {getattr(import_module(module), '__version__', '?')}")
      except ImportError:
        out[peer] = (None, not_installed(peer, module))
        break
    else:
      out[peer] = (", ".join(versions), None)
  return out


def _as_numpy(tree: Any) -> dict[str, np.ndarray]:
  return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def jax_cases(cfg: _model.GPTConfig, clip: float, have: dict) -> dict:
  """``{key: (fn(params, tokens) -> {name: array}, None) or (None, why not)}``."""

  def loss_fn(params, tokens):
    return _model.loss_fn(params, tokens, cfg)

  out = {}
  for key, (fn, why) in _ghost_cases.make_cases(cfg, clip).items():
    out["jax grad" if key == "grad" else f"jaxclip {key}"] = (fn, why)
  out["jaxclip auto"] = _ghost_cases.private_grad_fn(loss_fn, clip, "auto")
  if have["jax_privacy"][1] is None:
    from jax_privacy import clipping

    fn = clipping.clipped_grad(loss_fn, l2_clip_norm=clip, batch_argnums=1, keep_batch_dim=False)
    out["jax_privacy"] = (fn, None)
  return out


def torch_cases(cfg: _model.GPTConfig, clip: float, params: dict, tokens: Any) -> tuple:
  """``({key: step() -> {name: array}}, {key: check-only step})`` of torch and Opacus.

  Opacus's ghost clipping raises ``NotImplementedError: Parameter tying is not
  supported with Ghost Clipping``, so it runs the model with an untied head
  (initialised to ``wte``'s weight, so the same function), beside torch's
  non-private gradient of that model (its baseline) and, for the check only,
  Opacus's hooks mode on it.
  """
  import torch
  from opacus import GradSampleModule
  from opacus.grad_sample import GradSampleModuleFastGradientClipping
  from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
  from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

  from benchmarks import _torch_gpt

  b, t, v = cfg.batch, cfg.seq_len, cfg.vocab
  data = torch.from_numpy(np.asarray(tokens).astype(np.int64))
  inputs, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

  untied_params = {**params, "head.kernel": np.asarray(params["wte"]).T}

  def model(tied=True):
    m = _torch_gpt.GPT(v, t, cfg.d_model, cfg.n_layers, cfg.n_heads, tied=tied)
    return _torch_gpt.load_jax_params(m, params if tied else untied_params)

  def grad_step(plain):
    def step():
      for p in plain.parameters():
        p.grad = None
      _torch_gpt.per_example_loss(plain(inputs), targets).sum().backward()
      return _torch_gpt.grads_as_jax(plain, {p: p.grad for p in plain.parameters()})

    return step

  # Ghost: per-example losses (each a mean over its T positions) through Opacus's
  # DPLoss, whose backward() runs the norm pass and the clipped pass; p.grad is then
  # the clipped sum (the optimizer's step, not run, would add noise and divide by B).
  ghost_model = model(tied=False)
  gsm = GradSampleModuleFastGradientClipping(
    ghost_model, batch_first=True, loss_reduction="mean", max_grad_norm=clip
  )
  ghost_opt = DPOptimizerFastGradientClipping(
    torch.optim.SGD(gsm.parameters(), lr=0.0),
    noise_multiplier=0.0,
    max_grad_norm=clip,
    expected_batch_size=b,
    loss_reduction="mean",
  )
  criterion = DPLossFastGradientClipping(
    gsm, ghost_opt, torch.nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean"
  )

  def opacus_ghost():
    ghost_opt.zero_grad(set_to_none=True)
    logits = gsm(inputs)
    criterion(logits.reshape(b * t, v), targets.reshape(b * t), shape=logits.shape).backward()
    return _torch_gpt.grads_as_jax(ghost_model, {p: p.grad for p in ghost_model.parameters()})

  # Hooks: per-sample gradients in p.grad_sample, clipped and summed by the DP
  # optimizer's own clip_and_accumulate (what its step() runs before the noise).
  def hooks_step(hooks_model):
    hsm = GradSampleModule(hooks_model, batch_first=True, loss_reduction="mean")
    hooks_opt = DPOptimizer(
      torch.optim.SGD(hsm.parameters(), lr=0.0),
      noise_multiplier=0.0,
      max_grad_norm=clip,
      expected_batch_size=b,
      loss_reduction="mean",
    )

    def step():
      hooks_opt.zero_grad(set_to_none=True)
      _torch_gpt.per_example_loss(hsm(inputs), targets).mean().backward()
      hooks_opt.clip_and_accumulate()
      return _torch_gpt.grads_as_jax(
        hooks_model, {p: p.summed_grad for p in hooks_model.parameters()}
      )

    return step

  steps = {
    "torch grad": grad_step(model()),
    "torch grad untied": grad_step(model(tied=False)),
    "opacus ghost": opacus_ghost,
    "opacus hooks": hooks_step(model()),
  }
  return steps, {"opacus hooks untied": hooks_step(model(tied=False))}


def _rel_diff(x: dict, ref: dict) -> float:
  if "head.kernel" in x and "head.kernel" not in ref:  # untied against tied: fold the head in
    x = {**x, "wte": x["wte"] + x["head.kernel"].T}
  scale = max(float(np.max(np.abs(r))) for r in ref.values())
  return max(float(np.max(np.abs(x[k] - ref[k]))) for k in ref) / max(scale, 1e-30)


def new_rows(batch: int, seq_len: int, have: dict) -> dict[str, dict]:
  """``{key: row}`` for every case of :data:`CASES`, a missing peer's rows ``not installed``."""
  rows = {}
  for key, fw, method, peer, base in CASES:
    why = have[peer][1] if peer else None
    rows[key] = {
      "B": batch,
      "T": seq_len,
      "case": key,
      "framework": fw,
      "method": method,
      "baseline": base,
      "status": "ok" if why is None else "not installed",
      "why": why,
    }
  return rows
