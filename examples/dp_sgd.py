"""DP-SGD to a target ε: three ways to clip at the same ε, beside training without privacy.

A small MLP (two hidden layers, a LayerNorm after the first) classifies a
synthetic 10-class Gaussian mixture (three clusters per class), with a
held-out test split and a small *public* split from the same mixture; nothing
is downloaded. Every run starts from the same parameters, sees the same
Poisson batches (:func:`jaxclip.poisson_batch`: each training example joins
each step with probability ``q = B / n``, padded to a fixed shape with a mask)
and uses the same optimizer (SGD with momentum). The private runs:

* clip each real example's gradient and sum (:func:`jaxclip.per_example_clipped_grad`,
  ``method="ghost"``: no per-example gradients), then add Gaussian noise and
  divide by the expected batch size ``B`` (:func:`jaxclip.dp_noise`);
* reach the same ``--epsilon`` at ``--delta`` after ``--steps`` steps: the
  noise multiplier comes from :func:`jaxclip.calibrate_noise` (dp_accounting's
  PLD accountant), and :func:`jaxclip.dp_epsilon` prints the ε it gives.

Each private run goes through one :class:`jaxclip.DPSGD`, built from the
dataset size, ``B``, the steps, ``(ε, δ)`` and its clip: it calibrates ``σ``
(the batches' truncation to ``max_batch_size`` rows, and the adaptive clip's
count, accounted for) and hands out the clipped gradient, the noise (its
sensitivity read from the same clip), each step's Poisson batch and the
accountant, which records the steps that ran. They differ in how each
example's gradient is bounded:

* **fixed C**: clipped to ``C = suggest_threshold(norms).max_norm``, the median
  per-example gradient norm at initialisation, measured on the public split
  (so choosing ``C`` costs no privacy);
* **adaptive C**: clipped to a ``C`` that starts at ``--initial-clip`` and
  follows the median norm (:func:`jaxclip.quantile_clip_norm_update`, Andrew
  et al. 2021, from the centred count of the norms below ``C`` noised with
  ``σ_b = B / 20``). The count is released too, so the gradient noise is
  raised to keep the same ε (``DPSGD(..., count_stddev=B / 20)``);
* **normalized**: every gradient scaled to ``C·g/(‖g‖ + γ)`` (automatic
  clipping, Bu et al. 2023; ``normalize=γ``), ``C`` the fixed arm's, so the
  two see updates of the same scale and share the learning rate.

Randomness: ``--seed`` gives the initialisation and the data. The batches, the
noise and the counts come from one key drawn from the operating system's
entropy each run, secret, since whoever knows it can regenerate the noise and
the batches and undo the privacy; every run shares it, so every run sees the
same batches (and the same noise draws, scaled by its own ``σC``). Steps are
jitted, ``lax.scan`` over chunks (one progress-bar tick each).
The recorded losses and accuracies are diagnostics, not private.

Run (``pip install -e ".[examples,dp]"``)::

  python examples/dp_sgd.py                      # 1000 steps of each run
  python examples/dp_sgd.py --epsilon 1 --steps 2000
  python examples/dp_sgd.py --tiny               # seconds, for tests
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
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

# The repository root, for the figures' provenance records (tools/figure_record.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.figure_record import save_png, write_record  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "dp_sgd.png"
RUNS = ("non-private", "fixed C", "adaptive C", "normalized")


class Config(NamedTuple):
  """Data, model, privacy and training settings."""

  steps: int = 1000
  seed: int = 0
  train_size: int = 20000
  test_size: int = 2000
  public_size: int = 512  # the public split the fixed C is measured on
  dim: int = 20
  classes: int = 10
  clusters: int = 3
  separation: float = 1.0  # scale of the cluster centres (the clusters have unit variance)
  hidden: int = 64
  batch: int = 256  # the expected batch size B: sampling rate q = B / train_size
  learning_rate: float = 0.1
  momentum: float = 0.9
  epsilon: float = 2.0  # the target ε of every private run
  delta: float = 1e-5
  initial_clip: float = 0.1  # the adaptive C's start (the paper's)
  target_quantile: float = 0.5
  clip_learning_rate: float = 0.2
  gamma: float = 0.01  # normalize=γ (Bu et al.'s choice)
  chunk: int = 100  # steps per jitted lax.scan call


class Privacy(NamedTuple):
  """The private runs' DPSGD objects: the fixed C's (the normalized run's too), the adaptive's."""

  fixed: jaxclip.DPSGD
  adaptive: jaxclip.DPSGD

  @property
  def fixed_clip(self) -> float:
    return self.fixed.l2_norm_clip

  @property
  def rows(self) -> int:  # max_batch_size: the same for both (the same run, sizes, δ)
    return self.fixed.max_batch_size

  @property
  def sigma(self) -> float:  # the fixed and normalized runs' noise multiplier
    return self.fixed.noise_multiplier

  @property
  def sigma_adaptive(self) -> float:  # the adaptive run's, whose counts are released too
    return self.adaptive.noise_multiplier

  @property
  def count_stddev(self) -> float:
    return self.adaptive.count_stddev


def secret_key() -> jax.Array:
  """A key from the OS's entropy (os.urandom): nobody can regenerate the noise or the batches."""
  return jax.random.wrap_key_data(jnp.asarray(np.frombuffer(os.urandom(8), np.uint32)))


# --- data and model -------------------------------------------------------------


class Data(NamedTuple):
  x_train: jax.Array
  y_train: jax.Array
  x_test: jax.Array
  y_test: jax.Array
  x_public: jax.Array
  y_public: jax.Array


@functools.partial(jax.jit, static_argnums=(1,))
def make_data(key: jax.Array, config: Config) -> Data:
  """``clusters`` unit-variance clusters per class, centres ``N(0, s² I)``; three splits."""
  k_centres, *k_splits = jax.random.split(key, 4)
  n_clusters = config.classes * config.clusters
  centres = config.separation * jax.random.normal(k_centres, (n_clusters, config.dim))

  def draw(k, n):
    k_cluster, k_noise = jax.random.split(k)
    cluster = jax.random.randint(k_cluster, (n,), 0, n_clusters)
    return centres[cluster] + jax.random.normal(k_noise, (n, config.dim)), cluster % config.classes

  sizes = (config.train_size, config.test_size, config.public_size)
  return Data(*(a for k, n in zip(k_splits, sizes, strict=True) for a in draw(k, n)))


def init_mlp(key: jax.Array, config: Config) -> dict[str, Any]:
  """``dim -> hidden -> LayerNorm -> relu -> hidden -> relu -> classes``, He-initialised."""
  k1, k2, k3 = jax.random.split(key, 3)
  dense = lambda k, n_in, n_out, gain=2.0: {
    "w": jax.random.normal(k, (n_in, n_out)) * math.sqrt(gain / n_in),
    "b": jnp.zeros(n_out),
  }
  return {
    "dense1": dense(k1, config.dim, config.hidden),
    "norm1": {"scale": jnp.ones(config.hidden), "bias": jnp.zeros(config.hidden)},
    "dense2": dense(k2, config.hidden, config.hidden),
    "out": dense(k3, config.hidden, config.classes, gain=1.0),
  }


def logits_fn(params: dict[str, Any], x: jax.Array) -> jax.Array:
  h = x @ params["dense1"]["w"] + params["dense1"]["b"]
  h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
  h = jax.nn.relu(h * params["norm1"]["scale"] + params["norm1"]["bias"])
  h = jax.nn.relu(h @ params["dense2"]["w"] + params["dense2"]["b"])
  return h @ params["out"]["w"] + params["out"]["b"]


def example_loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy of ONE example, returned twice: to differentiate, and to record."""
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y)
  return loss, loss


@jax.jit
def accuracy(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(logits_fn(params, x), axis=-1) == y)


# --- privacy: the fixed C, the noise ------------------------------------------------


def public_norms(params: dict[str, Any], data: Data) -> np.ndarray:
  """The per-example gradient norms of the public split (nothing clipped)."""
  fn = jaxclip.per_example_clipped_grad(example_loss, jnp.inf, return_norms=True, has_aux=True)
  return np.asarray(jax.jit(fn)(params, data.x_public, data.y_public)[2])


def choose_privacy(config: Config, params: dict[str, Any], data: Data) -> Privacy:
  key = secret_key()  # one secret key: every run sees the same batches
  run = dict(
    num_examples=config.train_size,
    expected_batch_size=config.batch,
    steps=config.steps,
    target_epsilon=config.epsilon,
    delta=config.delta,
    key=key,
  )
  fixed_clip = jaxclip.suggest_threshold(public_norms(params, data), 50).max_norm
  return Privacy(
    fixed=jaxclip.DPSGD(**run, l2_norm_clip=fixed_clip),
    adaptive=jaxclip.DPSGD(**run, l2_norm_clip=config.initial_clip, count_stddev=config.batch / 20),
  )


# --- training -----------------------------------------------------------------------


class History(NamedTuple):
  """Per-step records of one run (arrays of shape ``(steps,)``) and its final figures."""

  loss: np.ndarray  # mean loss of the step's real examples, before the update
  clip_norm: np.ndarray  # C used at the step (nan for the non-private run)
  median_norm: np.ndarray  # median per-example gradient norm (nan for the non-private run)
  clipped: np.ndarray  # fraction of the real examples scaled down (nan: non-private)
  batch_size: np.ndarray  # the drawn (Poisson) batch size
  overflow: np.ndarray  # whether the draw exceeded the rows and was truncated
  eval_steps: np.ndarray
  eval_accuracy: np.ndarray
  test_accuracy: float
  seconds: float
  epsilon: float  # the run's accountant after its steps (0 for the non-private run)


def plain_loss(params, x, y, mask, b):
  losses = jax.vmap(example_loss, (None, 0, 0))(params, x, y)[0]
  return jnp.sum(jnp.where(mask, losses, 0)) / b, losses


def make_step(kind: str, config: Config, dp: jaxclip.DPSGD, data: Data):
  """The step ``(carry, i) -> (carry, record)``; carry = (params, opt state, noise state, C).

  ``kind`` is ``"plain"``, ``"fixed"``, ``"adaptive"`` or ``"normalize"``; ``dp``
  gives the batches (every run's: the same key) and, in the private runs, the
  clipped gradient, the noise and the adaptive clip's update.
  """
  tx = optax.sgd(config.learning_rate, momentum=config.momentum)
  b = config.batch

  def step(carry, i):
    params, opt_state, noise_state, clip_norm = carry
    batch = dp.batch(i)
    x, y, mask = data.x_train[batch.indices], data.y_train[batch.indices], batch.mask
    real = jnp.maximum(jnp.sum(mask), 1)
    adaptive = kind == "adaptive"
    if kind == "plain":  # the summed loss of the real examples over B
      grads, losses = jax.grad(plain_loss, has_aux=True)(params, x, y, mask, b)
      norms, clipped = jnp.full(mask.shape, jnp.nan), jnp.nan
    else:
      grad_fn = dp.clipped_grad(
        example_loss,
        l2_norm_clip=clip_norm if adaptive else None,
        return_norms=True,
        has_aux=True,
        normalize=config.gamma if kind == "normalize" else None,
      )
      total, num_clipped, norms, losses = grad_fn(params, x, y, example_mask=mask)
      noise = dp.noise(clip_norm if adaptive else None)  # C moves: build it here
      grads, noise_state = noise.update(total, noise_state)
      clipped = num_clipped / real
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    new_clip = clip_norm
    if adaptive:
      new_clip = dp.update_clip(
        clip_norm,
        norms,
        i,
        example_mask=mask,
        target_quantile=config.target_quantile,
        learning_rate=config.clip_learning_rate,
      )
    record = (
      jnp.sum(jnp.where(mask, losses, 0)) / real,
      clip_norm if kind != "plain" else jnp.nan,
      jnp.nanmedian(jnp.where(mask, norms, jnp.nan)),
      clipped,
      jnp.sum(mask),
      batch.overflow,
    )
    return (params, opt_state, noise_state, new_clip), record

  return step


@functools.partial(jax.jit, static_argnames=("kind", "config", "dp"))
def run_chunk(carry, steps, data, *, kind, config, dp):
  """``lax.scan`` of the step over ``steps``: one compiled program per kind of run."""
  return jax.lax.scan(make_step(kind, config, dp, data), carry, steps)


def train(
  config: Config, run: str, privacy: Privacy, progress: Callable[[int], Any] | None = None
) -> tuple[History, dict[str, Any]]:
  """One run; returns its history and final parameters (its steps recorded by its DPSGD)."""
  k_init, k_data = jax.random.split(jax.random.key(config.seed), 4)[:2]
  data = make_data(k_data, config)
  params = init_mlp(k_init, config)
  dp = privacy.adaptive if run == "adaptive C" else privacy.fixed
  dp.accountant = jaxclip.PrivacyAccountant(dp.delta)  # this run's own record of its steps
  noise_state = dp.noise().init(params)
  clip = jnp.float32(dp.l2_norm_clip)
  carry = (params, optax.sgd(1.0, momentum=0.9).init(params), noise_state, clip)
  kind = {"non-private": "plain", "fixed C": "fixed", "adaptive C": "adaptive"}.get(
    run, "normalize"
  )
  static = dict(kind=kind, config=config, dp=dp)
  records, evals, start = [], [], time.perf_counter()
  for first in range(0, config.steps, config.chunk):
    n = min(config.chunk, config.steps - first)
    carry, record = run_chunk(carry, first + jnp.arange(n), data, **static)
    records.append(jax.device_get(record))
    if kind != "plain":
      dp.record(n)  # the accountant: n more steps ran
    evals.append((first + n, float(accuracy(carry[0], data.x_test, data.y_test))))
    if progress is not None:
      progress(n)
  columns = [np.concatenate(r) for r in zip(*records, strict=True)]
  history = History(
    *columns,
    eval_steps=np.array([t for t, _ in evals]),
    eval_accuracy=np.array([a for _, a in evals]),
    test_accuracy=evals[-1][1],
    seconds=time.perf_counter() - start,
    epsilon=dp.epsilon() if kind != "plain" else 0.0,
  )
  return history, carry[0]


# --- reporting ----------------------------------------------------------------------


def tail_mean(x: np.ndarray) -> float:
  return float(np.mean(x[-max(1, len(x) // 10) :]))


def format_table(results: dict[str, History]) -> str:
  header = (
    f"{'run':<12}  {'final loss':>10}  {'test acc':>8}  {'final C':>7}  {'median norm':>11}  "
    f"{'scaled down':>11}  {'seconds':>7}"
  )
  lines = [header, "-" * len(header)]
  for name, h in results.items():
    extra = (
      f"{'–':>7}  {'–':>11}  {'–':>11}"
      if name == "non-private"
      else f"{h.clip_norm[-1]:>7.3g}  {tail_mean(h.median_norm):>11.3g}  "
      f"{tail_mean(h.clipped):>11.1%}"
    )
    lines.append(
      f"{name:<12}  {tail_mean(h.loss):>10.4f}  {h.test_accuracy:>8.1%}  {extra}  {h.seconds:>7.1f}"
    )
  return "\n".join(lines)


def smooth(x: np.ndarray, window: int) -> np.ndarray:
  window = max(1, min(window, len(x)))
  sums = np.cumsum(x)
  sums[window:] = sums[window:] - sums[:-window]
  return sums / np.minimum(np.arange(1, len(x) + 1), window)


def plot(results: dict[str, History], config: Config, privacy: Privacy, out: Path) -> None:
  """Training loss; C against the median norm; test accuracy: every run against steps."""
  fig = Figure(figsize=(18, 4.5), layout="constrained")
  ax_loss, ax_clip, ax_acc = fig.subplots(1, 3)
  steps, window = np.arange(config.steps), max(1, config.steps // 50)
  colors = dict(zip(RUNS, ("tab:blue", "tab:red", "tab:green", "tab:purple"), strict=True))
  for name, h in results.items():
    ax_loss.plot(steps, smooth(h.loss, window), color=colors[name], lw=1.5, label=name)
    ax_acc.plot(h.eval_steps, h.eval_accuracy, color=colors[name], marker=".", label=name)
    if name != "non-private":
      ax_clip.plot(steps, h.clip_norm, color=colors[name], lw=1.5, label=f"C, {name}")
  ax_clip.plot(
    steps, results["adaptive C"].median_norm, color="gray", lw=1, label="median norm (adaptive run)"
  )
  ax_loss.set(yscale="log", xlabel="step", ylabel=f"training loss ({window}-step moving average)")
  ax_clip.set(yscale="log", xlabel="step", ylabel="L2 norm")
  ax_acc.set(xlabel="step", ylabel="test accuracy", ylim=(0, 1))
  ax_loss.set_title(
    f"SGD lr={config.learning_rate:g} momentum {config.momentum:g}, "
    f"Poisson q={config.batch / config.train_size:.3g}",
    fontsize=10,
  )
  ax_clip.set_title(
    f"fixed C = public median norm; adaptive C from {config.initial_clip:g}; γ={config.gamma:g}",
    fontsize=10,
  )
  ax_acc.set_title(
    f"ε={config.epsilon:g} at δ={config.delta:g}: σ={privacy.sigma:.3f} "
    f"(adaptive: {privacy.sigma_adaptive:.3f}, σ_b={privacy.count_stddev:g})",
    fontsize=10,
  )
  for ax in (ax_loss, ax_clip, ax_acc):
    ax.legend(fontsize=8)
  fig.suptitle(f"DP-SGD at the same ε: MLP on a {config.classes}-class Gaussian mixture")
  out.parent.mkdir(parents=True, exist_ok=True)
  save_png(fig, out)


def main(argv: list[str] | None = None) -> dict[str, History]:
  defaults = Config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=defaults.steps)
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument("--batch", type=int, default=defaults.batch, help="expected batch size B")
  parser.add_argument("--epsilon", type=float, default=defaults.epsilon, help="target ε")
  parser.add_argument("--delta", type=float, default=defaults.delta, help="δ of the guarantee")
  parser.add_argument("--initial-clip", type=float, default=defaults.initial_clip)
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the PNG")
  parser.add_argument("--tiny", action="store_true", help="a seconds-long run (smoke tests)")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.batch < 1 or args.epsilon <= 0 or not 0 < args.delta < 1:
    parser.error("--steps and --batch must be >= 1, --epsilon > 0, --delta in (0, 1)")
  config = defaults._replace(
    steps=args.steps,
    seed=args.seed,
    batch=args.batch,
    epsilon=args.epsilon,
    delta=args.delta,
    initial_clip=args.initial_clip,
  )
  if args.tiny:
    config = config._replace(
      steps=min(args.steps, 60), train_size=1024, test_size=256, public_size=64, hidden=16,
      batch=min(args.batch, 64), chunk=30,
    )  # fmt: skip
  if config.batch > config.train_size:
    parser.error(f"--batch must be at most the {config.train_size} training examples")

  k_init, k_data = jax.random.split(jax.random.key(config.seed), 4)[:2]
  privacy = choose_privacy(config, init_mlp(k_init, config), make_data(k_data, config))
  q = config.batch / config.train_size
  print(
    f"{config.train_size} training / {config.test_size} test / {config.public_size} public "
    f"examples; Poisson batches, sampling rate q={q:.4g} (expected B={config.batch}), padded "
    f"to {privacy.rows} rows; {config.steps} steps"
  )
  print(
    f"target ε={config.epsilon:g} at δ={config.delta:g} (calibrate_noise, PLD): σ="
    f"{privacy.sigma:.4f}; adaptive C, whose count (σ_b=B/20={privacy.count_stddev:g}) is "
    f"released too: σ={privacy.sigma_adaptive:.4f}"
  )
  cut = dict(max_batch_size=privacy.rows, num_examples=config.train_size)
  for name, sigma, count in (
    ("fixed C / normalized", privacy.sigma, None),
    ("adaptive C", privacy.sigma_adaptive, privacy.count_stddev),
  ):
    eps = {
      a: jaxclip.dp_epsilon(
        sigma, q, config.steps, config.delta, accountant=a, count_stddev=count, **cut
      )
      for a in ("pld", "rdp")
    }
    print(f"{name}: ε={eps['pld']:.3f} (PLD), ε={eps['rdp']:.3f} (RDP)")
  print(
    f"fixed C = {privacy.fixed_clip:.4g} (the median per-example norm on the public split); "
    f"the batches' truncation to {privacy.rows} rows is accounted for (truncated Poisson)"
  )
  results: dict[str, History] = {}
  for name in RUNS:
    with tqdm(total=config.steps, desc=f"{name:>11}", unit="step") as bar:
      results[name], _ = train(config, name, privacy, progress=bar.update)

  print("\nfinal loss, median norm, scaled down: means over the last 10% of steps")
  print(format_table(results))
  dp = results["adaptive C"]
  print(
    f"Poisson batch sizes: mean {dp.batch_size.mean():.1f}, min {dp.batch_size.min()}, max "
    f"{dp.batch_size.max()} (expected {config.batch}); truncated draws: {int(dp.overflow.sum())}"
  )
  spent = ", ".join(f"{name} {h.epsilon:.3f}" for name, h in results.items() if name != RUNS[0])
  print(f"ε spent, by each run's accountant (PLD, δ={config.delta:g}): {spent}")
  plot(results, config, privacy, args.out)
  command = " ".join(["python examples/dp_sgd.py", *(sys.argv[1:] if argv is None else argv)])
  write_record(args.out, [__file__], command)
  print(f"\nplot written to {args.out}")
  return results


if __name__ == "__main__":
  main()
