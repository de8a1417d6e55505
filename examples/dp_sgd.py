"""DP-SGD with a quantile-adaptive clip norm, next to the same training without privacy.

A small MLP (two hidden layers with biases, a LayerNorm after the first)
classifies a synthetic 10-class Gaussian mixture (three clusters per class, so
the classes are not linearly separable), with a held-out test split; nothing
is downloaded. Two runs start from the same parameters and see the same
batches in the same order, with the same optimizer (SGD with momentum):

* **non-private**: the mean gradient of the batch;
* **DP-SGD** (Abadi et al. 2016): each example's gradient is clipped to L2
  norm ``C`` and the clipped gradients summed
  (:func:`jaxclip.per_example_clipped_grad` with ``method="ghost"``, which
  gets the per-example norms without materialising per-example gradients, and
  ``return_norms=True``); Gaussian noise ``noise_multiplier * C * N(0, I)`` is
  added to the sum, which is divided by the batch size ``B`` and handed to the
  optimizer. ``C`` is not tuned: it starts at ``--initial-clip`` and after
  every step :func:`jaxclip.quantile_clip_norm_update` moves it towards the
  median of the batch's per-example norms (Andrew et al. 2021), from a count
  of the norms below ``C`` noised with ``count_stddev = B / 20``.

Everything random has its own key: initialisation, the data, batch sampling
(shared by both runs), the gradient noise and the count noise (one key per
step, ``fold_in`` of the step). Each step is jitted (``lax.scan`` over chunks
of steps, one progress-bar tick per chunk).

**Privacy accounting is out of scope.** The script reports no (ε, δ). Google's
``dp_accounting`` package (``pip install dp-accounting``) computes them from
the noise multiplier, the sampling rate ``B / n`` and the number of steps.
Two things to tell it:

* batches here have a **fixed size** ``B``, drawn uniformly without
  replacement from the ``n`` training examples at every step: they are *not*
  Poisson-sampled, so the accountant must be told so (in ``dp_accounting``: a
  ``SampledWithoutReplacementDpEvent(n, B, ...)``, which its ``RdpAccountant``
  takes under ``NeighboringRelation.REPLACE_ONE``; replacing one example moves
  the clipped sum by up to ``2C`` and the count by up to 1, and noise
  multipliers are relative to those sensitivities). The standard
  Poisson-sampling figures do not apply as they are;
* the adaptive ``C`` releases a noisy count each step, which costs privacy
  too. Andrew et al. (Theorem 1) show that gradient noise ``σ`` together with
  count noise ``σ_b`` is one Gaussian mechanism with noise multiplier
  ``z = (σ⁻² + (2σ_b)⁻²)^(-1/2)``; the script prints that ``z`` beside ``σ``.
  (The paper instead fixes ``z`` and raises the gradient noise to
  ``σ = (z⁻² - (2σ_b)⁻²)^(-1/2)``.)

The recorded training loss of the private run is the loss of the batch before
the step, computed alongside the per-example norms: a diagnostic, itself not
private.

Run (``pip install -e ".[examples]"`` gives matplotlib and tqdm)::

  python examples/dp_sgd.py                      # 1000 steps of each run
  python examples/dp_sgd.py --noise-multiplier 2 --steps 2000
  python examples/dp_sgd.py --tiny               # a few seconds, for tests
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm import tqdm  # not tqdm.auto: it warns in a notebook kernel without ipywidgets

import jaxclip

DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "dp_sgd.png"


class Config(NamedTuple):
  """Data, model and training settings."""

  steps: int = 1000
  seed: int = 0
  train_size: int = 4000
  test_size: int = 2000
  dim: int = 20  # input features
  classes: int = 10
  clusters: int = 3  # Gaussian clusters per class
  separation: float = 1.0  # scale of the cluster centres (the clusters have unit variance)
  hidden: int = 64
  batch: int = 256
  learning_rate: float = 0.1
  momentum: float = 0.9
  noise_multiplier: float = 1.0  # gradient noise σ: std of the noise on the sum is σ C
  initial_clip: float = 0.1  # C before the first step (the paper's starting value)
  target_quantile: float = 0.5
  clip_learning_rate: float = 0.2  # η of the geometric update
  chunk: int = 100  # steps per jitted lax.scan call (one progress-bar tick)


# --- data and model -----------------------------------------------------------


class Data(NamedTuple):
  x_train: jax.Array
  y_train: jax.Array
  x_test: jax.Array
  y_test: jax.Array


@functools.partial(jax.jit, static_argnums=(1,))
def make_data(key: jax.Array, config: Config) -> Data:
  """A Gaussian mixture: ``clusters`` unit-variance clusters per class, centres ``N(0, s² I)``.

  Cluster ``k`` belongs to class ``k % classes``; each example picks a cluster
  uniformly. Train and test are drawn from the same mixture.
  """
  k_centres, k_train, k_test = jax.random.split(key, 3)
  n_clusters = config.classes * config.clusters
  centres = config.separation * jax.random.normal(k_centres, (n_clusters, config.dim))

  def draw(k, n):
    k_cluster, k_noise = jax.random.split(k)
    cluster = jax.random.randint(k_cluster, (n,), 0, n_clusters)
    x = centres[cluster] + jax.random.normal(k_noise, (n, config.dim))
    return x, cluster % config.classes

  return Data(*draw(k_train, config.train_size), *draw(k_test, config.test_size))


def init_mlp(key: jax.Array, dim: int, hidden: int, classes: int) -> dict[str, Any]:
  """``dim -> hidden -> LayerNorm -> relu -> hidden -> relu -> classes``, He-initialised."""
  k1, k2, k3 = jax.random.split(key, 3)

  def dense(k, n_in, n_out, gain=2.0):
    return {"w": jax.random.normal(k, (n_in, n_out)) * math.sqrt(gain / n_in),
            "b": jnp.zeros(n_out)}

  return {
    "dense1": dense(k1, dim, hidden),
    "norm1": {"scale": jnp.ones(hidden), "bias": jnp.zeros(hidden)},
    "dense2": dense(k2, hidden, hidden),
    "out": dense(k3, hidden, classes, gain=1.0),
  }


def logits_fn(params: dict[str, Any], x: jax.Array) -> jax.Array:
  """The MLP's logits for one example ``(dim,)`` or a batch ``(n, dim)``."""
  h = x @ params["dense1"]["w"] + params["dense1"]["b"]
  mean = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.var(h, axis=-1, keepdims=True)
  h = (h - mean) * jax.lax.rsqrt(var + 1e-5) * params["norm1"]["scale"] + params["norm1"]["bias"]
  h = jax.nn.relu(h)
  h = jax.nn.relu(h @ params["dense2"]["w"] + params["dense2"]["b"])
  return h @ params["out"]["w"] + params["out"]["b"]


def example_loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy of ONE example, returned twice: to differentiate, and to record."""
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y)
  return loss, loss


def batch_loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y))


@jax.jit
def accuracy(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(logits_fn(params, x), axis=-1) == y)


# --- training -------------------------------------------------------------------


class Keys(NamedTuple):
  """One base key per source of randomness; step ``i`` uses ``fold_in(base, i)``."""

  init: jax.Array
  data: jax.Array
  batches: jax.Array  # batch sampling, shared by both runs
  grad_noise: jax.Array  # DP-SGD only
  count_noise: jax.Array  # DP-SGD only (the adaptive clip norm)


def make_keys(seed: int) -> Keys:
  return Keys(*jax.random.split(jax.random.key(seed), 5))


class History(NamedTuple):
  """Per-step records of one run (arrays of shape ``(steps,)``) and its final figures."""

  loss: np.ndarray  # mean training loss of the step's batch, before the update
  clip_norm: np.ndarray  # C used at the step (nan for the non-private run)
  median_norm: np.ndarray  # median per-example gradient norm (nan for the non-private run)
  clipped: np.ndarray  # fraction of the batch clipped (nan for the non-private run)
  train_accuracy: float
  test_accuracy: float
  seconds: float


def batch_indices(key: jax.Array, first: int, steps: int, n: int, batch: int) -> jax.Array:
  """Indices of the batches of steps ``first .. first + steps``: ``(steps, batch)``.

  Each step draws ``batch`` distinct examples uniformly from the ``n``
  (fixed-size sampling without replacement, *not* Poisson sampling), from
  ``fold_in(key, step)``: a step's batch does not depend on the chunking.
  """
  def one(i):
    return jax.random.choice(jax.random.fold_in(key, i), n, (batch,), replace=False)

  return jax.lax.map(one, first + jnp.arange(steps))


def dp_step(config: Config, tx: optax.GradientTransformation, keys: Keys, data: Data):
  """The jitted DP-SGD step ``(carry, step) -> (carry, record)``; carry = (params, opt state, C)."""
  b = config.batch

  def step(carry, i):
    params, opt_state, clip_norm = carry
    idx = batch_indices(keys.batches, i, 1, config.train_size, b)[0]
    x, y = data.x_train[idx], data.y_train[idx]
    grad_fn = jaxclip.per_example_clipped_grad(
      example_loss, clip_norm, batch_argnums=(1, 2), method="ghost", return_norms=True,
      has_aux=True)
    clipped_sum, num_clipped, norms, losses = grad_fn(params, x, y)
    # Gaussian noise σ C N(0, I) on the sum, an independent key per leaf.
    leaves, treedef = jax.tree.flatten(clipped_sum)
    noise_keys = jax.random.split(jax.random.fold_in(keys.grad_noise, i), len(leaves))
    noisy = [g + config.noise_multiplier * clip_norm * jax.random.normal(k, g.shape, g.dtype)
             for g, k in zip(leaves, noise_keys, strict=True)]
    grads = jax.tree.map(lambda g: g / b, jax.tree.unflatten(treedef, noisy))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    new_clip = jaxclip.quantile_clip_norm_update(
      clip_norm, norms, target_quantile=config.target_quantile,
      learning_rate=config.clip_learning_rate, count_stddev=b / 20,
      key=jax.random.fold_in(keys.count_noise, i))
    record = (jnp.mean(losses), clip_norm, jnp.median(norms), num_clipped / b)
    return (params, opt_state, new_clip), record

  return step


def plain_step(config: Config, tx: optax.GradientTransformation, keys: Keys, data: Data):
  """The non-private step: the batch's mean gradient, same batches, same optimizer."""

  def step(carry, i):
    params, opt_state, clip_norm = carry
    idx = batch_indices(keys.batches, i, 1, config.train_size, config.batch)[0]
    loss, grads = jax.value_and_grad(batch_loss)(params, data.x_train[idx], data.y_train[idx])
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    nan = jnp.full((), jnp.nan)
    return (params, opt_state, clip_norm), (loss, nan, nan, nan)

  return step


def train(
  config: Config, private: bool, progress: Callable[[int], Any] | None = None
) -> tuple[History, dict[str, Any]]:
  """One run (DP-SGD if ``private``); returns its history and final parameters."""
  keys = make_keys(config.seed)
  data = make_data(keys.data, config)
  params = init_mlp(keys.init, config.dim, config.hidden, config.classes)
  tx = optax.sgd(config.learning_rate, momentum=config.momentum)
  step = (dp_step if private else plain_step)(config, tx, keys, data)
  carry = (params, tx.init(params), jnp.float32(config.initial_clip))
  run_chunk = jax.jit(lambda carry, steps: jax.lax.scan(step, carry, steps))
  records = []
  start = time.perf_counter()
  for first in range(0, config.steps, config.chunk):
    n = min(config.chunk, config.steps - first)
    carry, record = run_chunk(carry, first + jnp.arange(n))
    records.append(jax.device_get(record))
    if progress is not None:
      progress(n)
  params = carry[0]
  loss, clip_norm, median_norm, clipped = (np.concatenate(r) for r in zip(*records, strict=True))
  history = History(
    loss, clip_norm, median_norm, clipped,
    train_accuracy=float(accuracy(params, data.x_train, data.y_train)),
    test_accuracy=float(accuracy(params, data.x_test, data.y_test)),
    seconds=time.perf_counter() - start,
  )
  return history, params


# --- reporting --------------------------------------------------------------------


def combined_noise_multiplier(sigma: float, count_stddev: float) -> float:
  """Andrew et al.'s Theorem 1: gradient noise σ and count noise σ_b as one multiplier."""
  if sigma == 0:
    return 0.0
  inv = sigma**-2 + ((2 * count_stddev) ** -2 if count_stddev > 0 else 0.0)
  return inv**-0.5


def tail_mean(x: np.ndarray) -> float:
  """Mean over the last 10% of steps."""
  return float(np.mean(x[-max(1, len(x) // 10):]))


def format_table(results: dict[str, History]) -> str:
  header = (f"{'run':<12}  {'final loss':>10}  {'train acc':>9}  {'test acc':>8}  "
            f"{'final C':>7}  {'median norm':>11}  {'clipped':>7}  {'seconds':>7}")
  lines = [header, "-" * len(header)]
  for name, h in results.items():
    private = not np.all(np.isnan(h.clip_norm))
    extra = (f"{h.clip_norm[-1]:>7.3g}  {tail_mean(h.median_norm):>11.3g}  "
             f"{tail_mean(h.clipped):>7.1%}" if private else f"{'–':>7}  {'–':>11}  {'–':>7}")
    lines.append(f"{name:<12}  {tail_mean(h.loss):>10.4f}  {h.train_accuracy:>9.1%}  "
                 f"{h.test_accuracy:>8.1%}  {extra}  {h.seconds:>7.1f}")
  return "\n".join(lines)


def smooth(x: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (shorter windows at the start)."""
  window = max(1, min(window, len(x)))
  sums = np.cumsum(x)
  sums[window:] = sums[window:] - sums[:-window]
  return sums / np.minimum(np.arange(1, len(x) + 1), window)


def plot(results: dict[str, History], config: Config, out: Path) -> None:
  """Training loss of both runs (left); DP-SGD's C and median per-example norm (right)."""
  fig = Figure(figsize=(12, 4.5), layout="constrained")
  ax_loss, ax_clip = fig.subplots(1, 2)
  steps = np.arange(config.steps)
  window = max(1, config.steps // 50)
  colors = {"non-private": "tab:blue", "DP-SGD": "tab:red"}
  for name, h in results.items():
    ax_loss.plot(steps, smooth(h.loss, window), color=colors.get(name), lw=1.5,
                 label=f"{name} (test accuracy {h.test_accuracy:.1%})")
  ax_loss.set_yscale("log")
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel(f"training loss (batch cross-entropy, {window}-step moving average)")
  ax_loss.set_title(f"SGD lr={config.learning_rate:g} momentum {config.momentum:g}, "
                    f"batch {config.batch} of {config.train_size}", fontsize=10)
  ax_loss.legend()
  dp = results["DP-SGD"]
  ax_clip.plot(steps, dp.clip_norm, color="tab:red", lw=1.5, label="clip norm C")
  ax_clip.plot(steps, dp.median_norm, color="gray", lw=1, alpha=0.8,
               label="median per-example gradient norm (pre-clip)")
  ax_clip.set_yscale("log")
  ax_clip.set_xlabel("step")
  ax_clip.set_ylabel("L2 norm")
  ax_clip.set_title(
    f"DP-SGD: σ={config.noise_multiplier:g}, C from {config.initial_clip:g} towards the "
    f"{config.target_quantile:g}-quantile (count noise B/20)", fontsize=10)
  ax_clip.legend()
  fig.suptitle(f"DP-SGD vs non-private: MLP on a {config.classes}-class Gaussian mixture "
               f"({config.dim} features)")
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, History]:
  defaults = Config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps per run")
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument("--batch", type=int, default=defaults.batch, help="batch size B")
  parser.add_argument("--noise-multiplier", type=float, default=defaults.noise_multiplier,
                      help="gradient noise σ (std of the noise on the clipped sum is σ C)")
  parser.add_argument("--initial-clip", type=float, default=defaults.initial_clip,
                      help="clip norm C before the first step")
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the PNG")
  parser.add_argument("--tiny", action="store_true", help="a seconds-long run (smoke tests)")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.batch < 1:
    parser.error("--steps and --batch must be at least 1")

  config = defaults._replace(
    steps=args.steps, seed=args.seed, batch=args.batch,
    noise_multiplier=args.noise_multiplier, initial_clip=args.initial_clip,
  )
  if args.tiny:
    config = config._replace(steps=min(args.steps, 60), train_size=512, test_size=256,
                             hidden=16, batch=min(args.batch, 64), chunk=30)
  if config.batch > config.train_size:
    parser.error(f"--batch must be at most the {config.train_size} training examples")

  count_stddev = config.batch / 20
  print(f"{config.train_size} training / {config.test_size} test examples, {config.classes} "
        f"classes; batches of B={config.batch} drawn without replacement (fixed size, not "
        f"Poisson): sampling rate {config.batch / config.train_size:.3g}, {config.steps} steps")
  print(f"gradient noise σ={config.noise_multiplier:g}, count noise σ_b=B/20={count_stddev:g}: "
        "one Gaussian mechanism of noise multiplier z="
        f"{combined_noise_multiplier(config.noise_multiplier, count_stddev):.4g} "
        "(Andrew et al., Thm 1; no ε is computed here)")
  results: dict[str, History] = {}
  for name, private in (("non-private", False), ("DP-SGD", True)):
    with tqdm(total=config.steps, desc=f"{name:>11}", unit="step") as bar:
      results[name], _ = train(config, private, progress=bar.update)

  print("\nfinal loss, median norm, clipped: means over the last 10% of steps")
  print(format_table(results))
  dp = results["DP-SGD"]
  checkpoints = sorted({0, config.steps // 10, config.steps // 2, config.steps - 1})
  print("DP-SGD clip norm C: " + ", ".join(
    f"step {i}: {dp.clip_norm[i]:.3g} (median norm {dp.median_norm[i]:.3g})" for i in checkpoints))
  plot(results, config, args.out)
  print(f"\nplot written to {args.out}")
  return results


if __name__ == "__main__":
  main()
