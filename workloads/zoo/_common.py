"""What every zoo model is built from: the :class:`Model` record, the sizes, batches, the loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

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
