"""The DP-SGD that ``benchmarks.dp_audit`` audits: a linear regression, a coordinate per canary."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip

CANARY_LABEL = 1000.0  # far from any c_j the run reaches, so every canary gradient is clipped


@dataclasses.dataclass(frozen=True)
class Config:
  """The audit's parameters.

  Attributes:
    canaries: Canaries of the one-run audit (and runs of the NaN audit).
    examples: Synthetic data rows of the one-run audit.
    run_examples: Data rows of each run of the NaN audit.
    features: Features of the linear model.
    sampling_rate: Poisson sampling rate ``q``.
    steps: DP-SGD steps.
    target_epsilon: The ε the noise is calibrated to (``calibrate_noise``).
    delta: δ of the guarantee and of the audit.
    clip: The clip norm ``C``.
    learning_rate: SGD's learning rate (on the mean gradient).
    significance: The audit's probability of a false claim (one minus its confidence).
  """

  canaries: int = 1000
  examples: int = 1000
  run_examples: int = 32
  features: int = 8
  sampling_rate: float = 0.25
  steps: int = 20
  target_epsilon: float = 1.0
  delta: float = 1e-5
  clip: float = 1.0
  learning_rate: float = 0.5
  significance: float = 0.05


QUICK = Config(canaries=100, examples=100, run_examples=8, steps=4)


def secret_seed() -> int:
  """A noise seed from the operating system's entropy (32 bits: ``jax.random.key`` of an int)."""
  return secrets.randbits(32)


def secret_key() -> jax.Array:
  """A ``jax.random`` key whose 64 bits come from the operating system's entropy."""
  return jax.random.wrap_key_data(np.frombuffer(secrets.token_bytes(8), np.uint32))


def example_loss(params: dict, x: jax.Array, slot: jax.Array, s: jax.Array, y: jax.Array):
  """One example's squared error; ``s * c[slot]`` is a canary's own coordinate (``s = 0``: data)."""
  pred = x @ params["w"] + s * params["c"][slot]
  return 0.5 * (pred - y) ** 2


def textbook_clipped_grad(loss_fn: Callable, l2_norm_clip: float) -> Callable:
  """A hand-written per-example clip, without a guard: BROKEN on purpose.

  ``sum_b g_b * min(1, C / ||g_b||)`` over the rows where ``example_mask`` is
  True: one example whose gradient is NaN makes its norm, its factor and so
  the whole sum NaN (``NaN * 0`` is NaN), exactly when it is in the batch.
  """

  def grad_fn(params, *batch, example_mask):
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, *[0] * len(batch)))(params, *batch)
    sq = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads))
    factor = jnp.minimum(1.0, l2_norm_clip / jnp.sqrt(sq))

    def clipped_sum(g):
      scaled = g * factor.reshape((-1,) + (1,) * (g.ndim - 1))
      kept = jnp.where(example_mask.reshape((-1,) + (1,) * (g.ndim - 1)), scaled, 0.0)
      return jnp.sum(kept, axis=0)

    return jax.tree.map(clipped_sum, grads), None

  return grad_fn


def _data(rows: int, features: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Synthetic linear-regression rows (no canary coordinate: ``s = 0``)."""
  x = rng.normal(size=(rows, features)).astype(np.float32)
  w_true = rng.normal(size=features).astype(np.float32)
  y = x @ w_true + 0.1 * rng.normal(size=rows).astype(np.float32)
  return {
    "x": x,
    "slot": np.zeros(rows, np.int32),
    "s": np.zeros(rows, np.float32),
    "y": y.astype(np.float32),
  }


def _canary_rows(slots: np.ndarray, features: int, x_value: float = 0.0) -> dict[str, np.ndarray]:
  n = len(slots)
  return {
    "x": np.full((n, features), x_value, np.float32),
    "slot": slots.astype(np.int32),
    "s": np.ones(n, np.float32),
    "y": np.full(n, CANARY_LABEL, np.float32),
  }


def _concat(a: dict, b: dict) -> dict:
  return {k: np.concatenate([a[k], b[k]]) for k in a}


def _max_rows(cfg: Config, n: int) -> int:
  """Rows of a Poisson batch of ``n`` examples: mean + 8 standard deviations, at most ``n``."""
  mean = cfg.sampling_rate * n
  return min(n, int(np.ceil(mean + 8 * np.sqrt(mean * (1 - cfg.sampling_rate)) + 1)))


def train(
  cfg: Config,
  data: dict,
  noise_multiplier: Any,
  noise_seed: Any,
  sampling_key: jax.Array,
  *,
  canary_slots: int,
  grad_fn: Callable | None = None,
  absent: Any = None,
) -> tuple[dict, jax.Array]:
  """DP-SGD on ``data``: Poisson batches, clipped sum, ``dp_noise``, SGD; traceable.

  Returns the final params, the number of steps whose batch overflowed its
  rows (truncated; the audit checks it is 0) and the number of non-finite
  examples the clip counted (0 for a clip that counts none). ``grad_fn``
  returns ``(clipped sum, non-finite count or None)``; ``None``: jaxclip's
  (:func:`jaxclip_clipped_grad`). ``absent`` (an index or None) is a row
  masked out of every batch: the dataset without it.
  """
  n = len(data["y"])
  rows = _max_rows(cfg, n)
  expected = cfg.sampling_rate * n
  if grad_fn is None:
    grad_fn = jaxclip_clipped_grad(cfg.clip)
  tx = optax.chain(
    jaxclip.dp_noise(cfg.clip, noise_multiplier, seed=noise_seed, expected_batch_size=expected),
    optax.sgd(cfg.learning_rate),
  )
  params = {"w": jnp.zeros(cfg.features), "c": jnp.zeros(canary_slots)}
  data = jax.tree.map(jnp.asarray, data)

  def step(carry, key):
    params, state = carry
    batch = jaxclip.poisson_batch(key, n, cfg.sampling_rate, rows)
    mask = batch.mask if absent is None else batch.mask & (batch.indices != absent)
    rows_ = {k: v[batch.indices] for k, v in data.items()}
    total, count = grad_fn(
      params, rows_["x"], rows_["slot"], rows_["s"], rows_["y"], example_mask=mask
    )
    updates, state = tx.update(total, state, params)
    count = jnp.zeros((), jnp.int32) if count is None else jnp.asarray(count, jnp.int32)
    return (optax.apply_updates(params, updates), state), (batch.overflow, count)

  keys = jax.random.split(sampling_key, cfg.steps)
  (params, _), (overflow, count) = jax.lax.scan(step, (params, tx.init(params)), keys)
  return params, jnp.sum(overflow), jnp.sum(count)


def jaxclip_clipped_grad(l2_norm_clip: float) -> Callable:
  """jaxclip's clip: ``(clipped sum, non-finite examples)``, a non-finite example contributing
  zero (``per_example_clipped_grad(..., return_num_nonfinite=True)``)."""
  fn = jaxclip.per_example_clipped_grad(example_loss, l2_norm_clip, return_num_nonfinite=True)

  def grad_fn(params, *batch, example_mask):
    total, _, num_nonfinite = fn(params, *batch, example_mask=example_mask)
    return total, num_nonfinite

  return grad_fn


def replay_noise(cfg: Config, n: int, noise_multiplier: float, seed: int, canary_slots: int):
  """The attacker's replay of a public seed: the params that the noise alone moves SGD to."""
  tx = optax.chain(
    jaxclip.dp_noise(
      cfg.clip, noise_multiplier, seed=seed, expected_batch_size=cfg.sampling_rate * n
    ),
    optax.sgd(cfg.learning_rate),
  )
  params = {"w": jnp.zeros(cfg.features), "c": jnp.zeros(canary_slots)}

  def step(carry, _):
    params, state = carry
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, state = tx.update(zeros, state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=cfg.steps)
  return params


def _drawn(cfg: Config, n: int, sampling_key: jax.Array, row: int) -> jax.Array:
  """Whether each step's Poisson batch (as :func:`train` draws them) holds ``row``."""
  rows = _max_rows(cfg, n)
  keys = jax.random.split(sampling_key, cfg.steps)
  batch = jax.vmap(lambda k: jaxclip.poisson_batch(k, n, cfg.sampling_rate, rows))(keys)
  return jnp.any(batch.mask & (batch.indices == row), axis=1)
