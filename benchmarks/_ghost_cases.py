"""The GPT's cases that ``python -m benchmarks.ghost`` and its peers (``--peers``) time.

The model's sizes, the non-private gradient and ``per_example_clipped_grad``'s
methods on it, and the clip the private cases use: :mod:`benchmarks.ghost` and
:mod:`benchmarks._peers` both build their rows from these.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxclip
from benchmarks import _model

METHODS = ("grad", "vmap", "ghost")
# About 0.85M params: 0.79M in the 4 blocks, 33K in the (tied) token
# embedding, 128 * T in the position embedding.
MODEL = {"vocab": 256, "d_model": 128, "n_layers": 4, "n_heads": 4}
QUICK_MODEL = {"vocab": 32, "d_model": 16, "n_layers": 1, "n_heads": 2}
# The private cases' l2_norm_clip, by default the median of the per-example
# gradient norms of NORM_SAMPLE random sequences of length T (they are about 11
# at T=16 and 4 at T=128 at initialisation), so that some examples are
# clipped and some are not. It does not change the work done; the counts are
# reported as a check.
NORM_SAMPLE = 16


def _has_method_arg() -> bool:
  return "method" in inspect.signature(jaxclip.per_example_clipped_grad).parameters


def private_grad_fn(
  loss_fn: Callable, clip: float, method: str
) -> tuple[Callable | None, str | None]:
  """``(per_example_clipped_grad(loss_fn, clip, method=method), None)``, or ``(None, why)``.

  Before ``per_example_clipped_grad`` had a ``method`` argument, vmap was its
  only way: ``"vmap"`` then calls it without the argument, and ``"ghost"``
  is unavailable. A ``method`` it refuses when called (a ``TypeError`` or
  ``ValueError``) is unavailable too.
  """
  if not _has_method_arg():
    if method == "vmap":
      return jaxclip.per_example_clipped_grad(loss_fn, clip), None
    return None, "per_example_clipped_grad has no `method` argument"
  try:
    return jaxclip.per_example_clipped_grad(loss_fn, clip, method=method), None
  except (TypeError, ValueError, NotImplementedError) as e:
    return None, f"per_example_clipped_grad(method={method!r}) raised {type(e).__name__}: {e}"


def ghost_available() -> bool:
  """Whether this jaxclip's ``per_example_clipped_grad`` takes ``method="ghost"``."""
  return private_grad_fn(lambda p, x: jnp.sum(p * x), 1.0, "ghost")[0] is not None


def make_cases(cfg: _model.GPTConfig, clip: float) -> dict[str, tuple[Callable | None, str | None]]:
  """``{method: (fn(params, tokens), None) or (None, why not)}`` for every method."""

  def loss_fn(params, tokens):  # one example: tokens is (T + 1,)
    return _model.loss_fn(params, tokens, cfg)

  def summed_loss(params, tokens):
    return jnp.sum(jax.vmap(loss_fn, (None, 0))(params, tokens))

  cases = {"grad": (jax.grad(summed_loss), None)}
  for method in METHODS[1:]:
    cases[method] = private_grad_fn(loss_fn, clip, method)
  return cases


def median_norm(cfg: _model.GPTConfig) -> float:
  """The median L2 norm of the per-example gradients of ``NORM_SAMPLE`` random sequences.

  The params and tokens are drawn as :func:`benchmarks._ghost_run.run_config` draws them (another
  batch size gives other sequences from the same distribution).
  """
  cfg = dataclasses.replace(cfg, batch=NORM_SAMPLE)
  params, tokens = _model.init_params(cfg, seed=0), _model.make_tokens(cfg, seed=1)

  @jax.jit
  def median(params, tokens):
    grads = jax.vmap(jax.grad(lambda p, x: _model.loss_fn(p, x, cfg)), (None, 0))(params, tokens)
    sq = sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in jax.tree.leaves(grads))
    return jnp.median(jnp.sqrt(sq))

  return float(median(params, tokens))
