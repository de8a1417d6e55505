"""Gradient clipping in a flax nnx training loop.

An MLP fits ``y = sin(3x)`` from samples whose noise is heavy-tailed (Student's
t with 1.5 degrees of freedom), so now and then a batch holds an outlier whose
squared error produces a gradient hundreds of times the usual size. jaxclip's
``clip_by_global_norm`` goes first in the optax chain handed to
``nnx.Optimizer``; nothing else in the nnx loop changes. The clip keeps the
norm it saw in its state, which the loop reads with ``optax.tree.get``.

The same model is trained with and without the clip, from the same
initialisation on the same batches, and the test error (on clean targets) of
both is printed.

Run::

  python examples/flax_nnx_example.py            # a few seconds
  python examples/flax_nnx_example.py --steps 2000 --seed 1
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxclip


class MLP(nnx.Module):
  """A two-hidden-layer perceptron from 1 input to 1 output."""

  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.hidden1 = nnx.Linear(1, width, rngs=rngs)
    self.hidden2 = nnx.Linear(width, width, rngs=rngs)
    self.out = nnx.Linear(width, 1, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.gelu(self.hidden1(x))
    x = nnx.gelu(self.hidden2(x))
    return self.out(x)


def make_batch(key: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """Inputs in [-1, 1] and ``sin(3x)`` targets with heavy-tailed noise."""
  k_x, k_noise = jax.random.split(key)
  x = jax.random.uniform(k_x, (size, 1), minval=-1.0, maxval=1.0)
  noise = 0.1 * jax.random.t(k_noise, 1.5, (size, 1))
  return x, jnp.sin(3 * x) + noise


def mse(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
  loss, grads = nnx.value_and_grad(mse)(model, x, y)
  optimizer.update(model, grads)
  return loss


def train(clip: bool, steps: int, seed: int) -> dict[str, float]:
  """Trains one model; returns its clean test error and gradient-norm statistics."""
  model = MLP(64, rngs=nnx.Rngs(seed))
  adam = optax.adam(1e-2)
  # The clip is the first link of the chain: it sees the raw gradients.
  tx = optax.chain(jaxclip.clip_by_global_norm(1.0), adam) if clip else adam
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  data_key = jax.random.key(seed + 1)
  norms = []
  for step in range(steps):
    x, y = make_batch(jax.random.fold_in(data_key, step), 32)
    train_step(model, optimizer, x, y)
    if clip:
      # `pre_clip_norm` lives in the clip's state, wherever it sits in the chain.
      norms.append(float(optax.tree.get(optimizer.opt_state, "pre_clip_norm")[...]))

  x_test = jnp.linspace(-1.0, 1.0, 256)[:, None]
  result = {"test_mse": float(jnp.mean((model(x_test) - jnp.sin(3 * x_test)) ** 2))}
  if clip:
    norms = np.asarray(norms)
    result |= {
      "median_norm": float(np.median(norms)),
      "max_norm": float(norms.max()),
      "clipped": float(np.mean(norms > 1.0)),
    }
  return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
  parser = argparse.ArgumentParser(description="jaxclip in a flax nnx training loop")
  parser.add_argument("--steps", type=int, default=500)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  results = {
    "adam": train(False, args.steps, args.seed),
    "clip_by_global_norm(1.0) + adam": train(True, args.steps, args.seed),
  }
  for name, r in results.items():
    print(f"{name:32s} test MSE on clean targets: {r['test_mse']:.4f}")
  r = results["clip_by_global_norm(1.0) + adam"]
  print(
    f"pre-clip gradient norm: median {r['median_norm']:.3g}, max {r['max_norm']:.3g}; "
    f"{r['clipped']:.0%} of steps clipped"
  )
  return results


if __name__ == "__main__":
  main()
