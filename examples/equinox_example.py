"""Gradient clipping in an equinox training loop, with a threshold picked from data.

A GRU (``eqx.nn.GRUCell`` under ``lax.scan``) learns to output the level of a
noisy sequence; the noise is heavy-tailed (Student's t, 2 degrees of freedom),
so a few batches give gradients far larger than the rest. The optimiser is
``optax.chain(clip, adam)`` where the clip is
``jaxclip.clip_by_global_norm`` wrapped in ``optax.inject_hyperparams``, so
its threshold is part of the optimiser state rather than a constant baked into
the compiled step:

1. warm up with ``max_norm=inf`` (the clip only measures), collecting the
   ``pre_clip_norm`` it records at every step;
2. set ``max_norm`` to a high percentile of the norms of the warm-up's second
   half (the first steps' norms are large while the loss falls fast) with ``optax.tree.set``
   and keep training; the jitted step is not recompiled.

Run::

  python examples/equinox_example.py             # a few seconds
  python examples/equinox_example.py --steps 1000 --percentile 95
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip


class SequenceMean(eqx.Module):
  """A GRU that reads a ``(length, 1)`` sequence and returns one number."""

  cell: eqx.nn.GRUCell
  head: eqx.nn.Linear

  def __init__(self, hidden: int, *, key: jax.Array):
    k_cell, k_head = jax.random.split(key)
    self.cell = eqx.nn.GRUCell(1, hidden, key=k_cell)
    self.head = eqx.nn.Linear(hidden, "scalar", key=k_head)

  def __call__(self, xs: jax.Array) -> jax.Array:
    def step(h, x):
      return self.cell(x, h), None

    h, _ = jax.lax.scan(step, jnp.zeros(self.cell.hidden_size), xs)
    return self.head(h)


def make_batch(key: jax.Array, size: int, length: int) -> tuple[jax.Array, jax.Array]:
  """Sequences ``mu + noise`` (heavy-tailed noise) with a random ``mu`` each; targets ``mu``."""
  k_mu, k_noise = jax.random.split(key)
  mu = jax.random.normal(k_mu, (size,))
  xs = mu[:, None, None] + jax.random.t(k_noise, 2.0, (size, length, 1))
  return xs, mu


def loss_fn(model: SequenceMean, xs: jax.Array, ys: jax.Array) -> jax.Array:
  return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
  # inject_hyperparams calls clip_by_global_norm with a jnp array; jaxclip's
  # transforms accept traced thresholds, so the threshold can change later.
  clip = optax.inject_hyperparams(jaxclip.clip_by_global_norm)(max_norm=jnp.inf)
  return optax.chain(clip, optax.adam(learning_rate))


def main(argv: list[str] | None = None) -> dict[str, float]:
  parser = argparse.ArgumentParser(description="jaxclip in an equinox training loop")
  parser.add_argument("--steps", type=int, default=400, help="steps after the warm-up")
  parser.add_argument("--warmup", type=int, default=100, help="measuring-only steps")
  parser.add_argument("--percentile", type=float, default=90.0)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  model_key, data_key = jax.random.split(jax.random.key(args.seed))
  model = SequenceMean(16, key=model_key)
  optimizer = make_optimizer(3e-3)
  opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def train_step(model, opt_state, xs, ys):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, xs, ys)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss, optax.tree.get(opt_state, "pre_clip_norm")

  def run(model, opt_state, first, count):
    losses, norms = [], []
    for step in range(first, first + count):
      xs, ys = make_batch(jax.random.fold_in(data_key, step), 32, 20)
      model, opt_state, loss, norm = train_step(model, opt_state, xs, ys)
      losses.append(float(loss))
      norms.append(float(norm))
    return model, opt_state, np.asarray(losses), np.asarray(norms)

  model, opt_state, warm_losses, warm_norms = run(model, opt_state, 0, args.warmup)
  threshold = float(np.percentile(warm_norms[args.warmup // 2 :], args.percentile))
  opt_state = optax.tree.set(opt_state, max_norm=jnp.asarray(threshold))
  print(
    f"warm-up ({args.warmup} steps): loss {warm_losses[0]:.3f} -> "
    f"{warm_losses[-10:].mean():.3f}; "
    f"pre-clip norm median {np.median(warm_norms):.3g}, max {warm_norms.max():.3g}"
  )
  print(f"max_norm set to the {args.percentile:g}th percentile: {threshold:.3g}")

  model, opt_state, losses, norms = run(model, opt_state, args.warmup, args.steps)
  clipped = float(np.mean(norms > threshold))
  print(
    f"after {args.steps} more steps: loss {losses[-50:].mean():.4f}; {clipped:.0%} of steps clipped"
  )
  return {
    "threshold": threshold,
    "final_loss": float(losses[-50:].mean()),
    "clipped": clipped,
    "max_norm_in_state": float(optax.tree.get(opt_state, "max_norm")),
  }


if __name__ == "__main__":
  main()
