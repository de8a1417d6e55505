"""DP-SGD to an (ε, δ) guarantee, next to the same training without privacy.

A small MLP (two hidden layers with biases, a LayerNorm after the first)
classifies a synthetic 10-class Gaussian mixture (three clusters per class, so
the classes are not linearly separable), with a held-out test split; nothing
is downloaded. Two runs start from the same parameters and see the same
batches in the same order, with the same optimizer (SGD with momentum):

* **non-private**: the gradient of the batch's summed loss divided by the
  expected batch size ``B``;
* **DP-SGD** (Abadi et al. 2016), the whole recipe the standard analysis
  assumes:

  - **Poisson batches**: every step each of the ``n`` training examples joins
    the batch independently with probability ``q = B / n``
    (:func:`jaxclip.poisson_batch`). The batch is padded to a fixed
    ``max_batch`` rows, with a mask, so the step jits once; ``max_batch`` is
    chosen so that a larger draw (which would be truncated) has a
    probability that the script prints, and adds to δ;
  - **clipping**: each real example's gradient is clipped to L2 norm ``C``
    and the clipped gradients summed (:func:`jaxclip.per_example_clipped_grad`
    with ``method="ghost"``, which gets the per-example norms without
    materialising per-example gradients, ``return_norms=True`` and
    ``example_mask=``: padding rows contribute nothing);
  - **noise**: Gaussian noise ``σ C N(0, I)`` is added to the sum, which is
    divided by the *expected* batch size ``B`` (the drawn size is private);
  - **adaptive clip**: ``C`` is not tuned: it starts at ``--initial-clip`` and
    after every step :func:`jaxclip.quantile_clip_norm_update` moves it towards
    the median of the real examples' norms (Andrew et al. 2021), from their
    centred count below ``C`` noised with ``σ_b = B / 20`` and divided by ``B``
    (``expected_batch_size=``);
  - **accounting**: by Andrew et al.'s Theorem 1 a step releasing both the
    noisy sum (multiplier ``σ``) and the noisy count (sensitivity ½, so
    multiplier ``2 σ_b``) is one Gaussian mechanism of multiplier
    ``z = (σ⁻² + (2σ_b)⁻²)^(-1/2)``. As in the paper, ``--noise-multiplier``
    fixes ``z`` and the gradient noise is raised to
    ``σ = (z⁻² - (2σ_b)⁻²)^(-1/2)``. Google's ``dp_accounting`` then gives ε at
    ``--delta`` for ``steps`` compositions of the Poisson-subsampled Gaussian
    mechanism (``q``, ``z``), with its RDP and its PLD accountant (PLD is
    tighter); ε is printed and plotted against steps, beside accuracy.

``--privatizer jax_privacy`` adds the same noise with jax_privacy's
``noise_addition.gaussian_privatizer`` instead (jaxclip's clipped sum, divided
by ``C``, is privatized with ``stddev=σ`` and multiplied back), and the
script also prints ε from jax_privacy's ``DpsgdTrainingAccountant``: a
jax_privacy user keeps its noise and accounting and takes ghost norms,
masks and the adaptive clip from jaxclip.

Everything random has its own key: initialisation, the data, batch sampling
(shared by both runs), the gradient noise and the count noise (one key per
step, ``fold_in`` of the step). Each step is jitted (``lax.scan`` over chunks
of steps, one progress-bar tick per chunk).

The recorded training loss of the private run is the loss of the batch before
the step, computed alongside the per-example norms: a diagnostic, itself not
private (nor are the printed accuracies: a real run would evaluate privately
or on public data).

Run (``pip install -e ".[examples,dp]"`` gives matplotlib, tqdm and
dp_accounting)::

  python examples/dp_sgd.py                      # 1000 steps of each run
  python examples/dp_sgd.py --noise-multiplier 2 --steps 2000
  python examples/dp_sgd.py --privatizer jax_privacy
  python examples/dp_sgd.py --tiny               # a few seconds, for tests
"""

from __future__ import annotations

import argparse
import functools
import math
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


class Config(NamedTuple):
  """Data, model and training settings."""

  steps: int = 1000
  seed: int = 0
  train_size: int = 20000
  test_size: int = 2000
  dim: int = 20  # input features
  classes: int = 10
  clusters: int = 3  # Gaussian clusters per class
  separation: float = 1.0  # scale of the cluster centres (the clusters have unit variance)
  hidden: int = 64
  batch: int = 256  # the expected batch size B: sampling rate q = B / train_size
  learning_rate: float = 0.1
  momentum: float = 0.9
  noise_multiplier: float = 1.0  # z, the whole step's (gradient and count noise together)
  initial_clip: float = 0.1  # C before the first step (the paper's starting value)
  target_quantile: float = 0.5
  clip_learning_rate: float = 0.2  # η of the geometric update
  chunk: int = 100  # steps per jitted lax.scan call (one progress-bar tick)
  delta: float = 1e-5
  privatizer: str = "jaxclip"  # or "jax_privacy": who adds the gradient noise


# --- privacy: the noise split and the accountant ------------------------------------


def count_stddev(config: Config) -> float:
  """σ_b = B / 20, Andrew et al.'s choice for the noisy count."""
  return config.batch / 20


def gradient_noise_multiplier(z: float, count_std: float) -> float:
  """σ such that the gradient noise σ and the count noise σ_b together make multiplier ``z``.

  Andrew et al., Theorem 1: ``z⁻² = σ⁻² + (2 σ_b)⁻²`` (the centred count has
  sensitivity ½), so ``σ = (z⁻² - (2 σ_b)⁻²)^(-1/2)``.
  """
  if z == 0:
    return 0.0
  rest = z**-2 - (2 * count_std) ** -2
  if rest <= 0:
    raise ValueError(
      f"noise multiplier z={z} is too large for count noise σ_b={count_std}: "
      "the count alone would spend more than the budget."
    )
  return rest**-0.5


def max_batch_size(n: int, q: float, steps: int, delta: float) -> tuple[int, float]:
  """The padded batch rows, and ``p = P[Binomial(n + 1, q) > rows]`` (a truncated draw).

  The smallest row count with ``steps · p ≤ 10⁻⁵ δ``: truncation then adds
  ``(1 + e^ε) · steps · p`` to δ (see :func:`jaxclip.poisson_batch`).
  """
  from scipy import stats  # a dependency of dp_accounting

  mean, std = n * q, math.sqrt(n * q * (1 - q))
  rows = max(1, math.ceil(mean + 4 * std))
  while rows < n + 1 and steps * stats.binom.sf(rows, n + 1, q) > delta * 1e-5:
    rows += max(1, math.ceil(std / 4))
  return min(rows, n), float(stats.binom.sf(rows, n + 1, q))


def epsilon(q: float, z: float, steps: int, delta: float, accountant: str = "pld") -> float:
  """ε at ``delta`` after ``steps`` Poisson-subsampled Gaussian steps (rate ``q``, noise ``z``).

  ``dp_accounting``'s RDP or PLD accountant, under add-or-remove-one adjacency.
  """
  from dp_accounting import dp_event, pld, rdp

  if steps == 0:
    return 0.0
  if z == 0:
    return math.inf
  event = dp_event.SelfComposedDpEvent(
    dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps
  )
  account = {"rdp": rdp.RdpAccountant, "pld": pld.PLDAccountant}[accountant]()
  return float(account.compose(event).get_epsilon(delta))


def epsilon_curve(
  q: float, z: float, steps: int, delta: float, points: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """ε against steps, RDP and PLD, at ``points`` step counts up to ``steps``."""
  import absl.logging  # dp_accounting's RDP warns for orders it skips

  absl.logging.set_verbosity(absl.logging.ERROR)
  at = np.unique(np.linspace(0, steps, points + 1).round().astype(int))[1:]
  return {
    name: (at, np.array([epsilon(q, z, int(t), delta, name) for t in at]))
    for name in ("rdp", "pld")
  }


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
    return {
      "w": jax.random.normal(k, (n_in, n_out)) * math.sqrt(gain / n_in),
      "b": jnp.zeros(n_out),
    }

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

  loss: np.ndarray  # mean training loss of the step's real examples, before the update
  clip_norm: np.ndarray  # C used at the step (nan for the non-private run)
  median_norm: np.ndarray  # median per-example gradient norm (nan for the non-private run)
  clipped: np.ndarray  # fraction of the real examples clipped (nan for the non-private run)
  batch_size: np.ndarray  # the drawn (Poisson) batch size
  overflow: np.ndarray  # whether the draw exceeded max_batch and was truncated
  eval_steps: np.ndarray  # steps after which the test accuracy was measured
  eval_accuracy: np.ndarray  # the test accuracy then
  train_accuracy: float
  test_accuracy: float
  seconds: float


def draw_batch(config: Config, keys: Keys, i: jax.Array, rows: int) -> jaxclip.PoissonBatch:
  """Step ``i``'s Poisson batch (from ``fold_in(keys.batches, i)``: both runs draw the same)."""
  return jaxclip.poisson_batch(
    jax.random.fold_in(keys.batches, i), config.train_size, config.batch / config.train_size, rows
  )


def add_noise(
  config: Config, keys: Keys, i: jax.Array, clipped_sum: Any, clip_norm: jax.Array, sigma: float
) -> Any:
  """``clipped_sum + σ C N(0, I)``: jaxclip's own noise, or jax_privacy's privatizer."""
  key = jax.random.fold_in(keys.grad_noise, i)
  if config.privatizer == "jax_privacy":
    from jax_privacy import noise_addition

    # The privatizer's stddev is fixed when it is made, C moves: privatize the
    # sum in units of C (sensitivity 1) and scale back.
    privatizer = noise_addition.gaussian_privatizer(stddev=sigma, prng_key=key)
    unit = jax.tree.map(lambda g: g / clip_norm, clipped_sum)
    noisy, _ = privatizer.update(unit, privatizer.init(unit))
    return jax.tree.map(lambda g: g * clip_norm, noisy)
  leaves, treedef = jax.tree.flatten(clipped_sum)
  noise_keys = jax.random.split(key, len(leaves))
  noisy = [
    g + sigma * clip_norm * jax.random.normal(k, g.shape, g.dtype)
    for g, k in zip(leaves, noise_keys, strict=True)
  ]
  return jax.tree.unflatten(treedef, noisy)


def dp_step(config: Config, tx: optax.GradientTransformation, keys: Keys, data: Data, rows: int):
  """The jitted DP-SGD step ``(carry, step) -> (carry, record)``; carry = (params, opt state, C)."""
  b = config.batch
  sigma = gradient_noise_multiplier(config.noise_multiplier, count_stddev(config))

  def step(carry, i):
    params, opt_state, clip_norm = carry
    batch = draw_batch(config, keys, i, rows)
    x, y = data.x_train[batch.indices], data.y_train[batch.indices]
    grad_fn = jaxclip.per_example_clipped_grad(
      example_loss, clip_norm, method="ghost", return_norms=True, has_aux=True
    )
    clipped_sum, num_clipped, norms, losses = grad_fn(params, x, y, example_mask=batch.mask)
    noisy = add_noise(config, keys, i, clipped_sum, clip_norm, sigma)
    grads = jax.tree.map(lambda g: g / b, noisy)  # the expected batch size: B is public
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    new_clip = jaxclip.quantile_clip_norm_update(
      clip_norm,
      norms,
      target_quantile=config.target_quantile,
      learning_rate=config.clip_learning_rate,
      count_stddev=count_stddev(config),
      key=jax.random.fold_in(keys.count_noise, i),
      example_mask=batch.mask,
      expected_batch_size=b,
    )
    real = jnp.maximum(jnp.sum(batch.mask), 1)
    record = (
      jnp.sum(jnp.where(batch.mask, losses, 0)) / real,
      clip_norm,
      jnp.nanmedian(jnp.where(batch.mask, norms, jnp.nan)),
      num_clipped / real,
      jnp.sum(batch.mask),
      batch.overflow,
    )
    return (params, opt_state, new_clip), record

  return step


def plain_step(config: Config, tx: optax.GradientTransformation, keys: Keys, data: Data, rows: int):
  """The non-private step: same batches, the summed loss over ``B``, same optimizer."""

  def masked_loss(params, x, y, mask):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y)
    return jnp.sum(jnp.where(mask, losses, 0)) / config.batch, losses

  def step(carry, i):
    params, opt_state, clip_norm = carry
    batch = draw_batch(config, keys, i, rows)
    x, y = data.x_train[batch.indices], data.y_train[batch.indices]
    grads, losses = jax.grad(masked_loss, has_aux=True)(params, x, y, batch.mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    nan = jnp.full((), jnp.nan)
    real = jnp.maximum(jnp.sum(batch.mask), 1)
    loss = jnp.sum(jnp.where(batch.mask, losses, 0)) / real
    return (params, opt_state, clip_norm), (
      loss,
      nan,
      nan,
      nan,
      jnp.sum(batch.mask),
      batch.overflow,
    )

  return step


def train(
  config: Config, private: bool, progress: Callable[[int], Any] | None = None
) -> tuple[History, dict[str, Any]]:
  """One run (DP-SGD if ``private``); returns its history and final parameters."""
  keys = make_keys(config.seed)
  data = make_data(keys.data, config)
  params = init_mlp(keys.init, config.dim, config.hidden, config.classes)
  tx = optax.sgd(config.learning_rate, momentum=config.momentum)
  rows, _ = max_batch_size(
    config.train_size, config.batch / config.train_size, config.steps, config.delta
  )
  step = (dp_step if private else plain_step)(config, tx, keys, data, rows)
  carry = (params, tx.init(params), jnp.float32(config.initial_clip))
  run_chunk = jax.jit(lambda carry, steps: jax.lax.scan(step, carry, steps))
  records, evals = [], []
  start = time.perf_counter()
  for first in range(0, config.steps, config.chunk):
    n = min(config.chunk, config.steps - first)
    carry, record = run_chunk(carry, first + jnp.arange(n))
    records.append(jax.device_get(record))
    evals.append((first + n, float(accuracy(carry[0], data.x_test, data.y_test))))
    if progress is not None:
      progress(n)
  params = carry[0]
  loss, clip_norm, median_norm, clipped, size, overflow = (
    np.concatenate(r) for r in zip(*records, strict=True)
  )
  history = History(
    loss,
    clip_norm,
    median_norm,
    clipped,
    size,
    overflow,
    eval_steps=np.array([t for t, _ in evals]),
    eval_accuracy=np.array([a for _, a in evals]),
    train_accuracy=float(accuracy(params, data.x_train, data.y_train)),
    test_accuracy=float(accuracy(params, data.x_test, data.y_test)),
    seconds=time.perf_counter() - start,
  )
  return history, params


# --- reporting --------------------------------------------------------------------


def jax_privacy_epsilon(config: Config) -> float:
  """ε from jax_privacy's own DP-SGD accountant (RDP), for the same q, z, steps and δ."""
  from jax_privacy.accounting import accountants, analysis

  params = analysis.DpParams(
    noise_multipliers=config.noise_multiplier,
    num_samples=config.train_size,
    delta=config.delta,
    batch_size=config.batch,
  )
  accountant = analysis.DpsgdTrainingAccountant(accountants.RdpAccountantConfig())
  return float(accountant.compute_epsilon(config.steps, params))


def tail_mean(x: np.ndarray) -> float:
  """Mean over the last 10% of steps."""
  return float(np.mean(x[-max(1, len(x) // 10) :]))


def format_table(results: dict[str, History]) -> str:
  header = (
    f"{'run':<12}  {'final loss':>10}  {'train acc':>9}  {'test acc':>8}  "
    f"{'final C':>7}  {'median norm':>11}  {'clipped':>7}  {'seconds':>7}"
  )
  lines = [header, "-" * len(header)]
  for name, h in results.items():
    private = not np.all(np.isnan(h.clip_norm))
    extra = (
      f"{h.clip_norm[-1]:>7.3g}  {tail_mean(h.median_norm):>11.3g}  {tail_mean(h.clipped):>7.1%}"
      if private
      else f"{'–':>7}  {'–':>11}  {'–':>7}"
    )
    lines.append(
      f"{name:<12}  {tail_mean(h.loss):>10.4f}  {h.train_accuracy:>9.1%}  "
      f"{h.test_accuracy:>8.1%}  {extra}  {h.seconds:>7.1f}"
    )
  return "\n".join(lines)


def smooth(x: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (shorter windows at the start)."""
  window = max(1, min(window, len(x)))
  sums = np.cumsum(x)
  sums[window:] = sums[window:] - sums[:-window]
  return sums / np.minimum(np.arange(1, len(x) + 1), window)


def plot(results: dict[str, History], config: Config, eps: dict[str, Any], out: Path) -> None:
  """Training loss of both runs; DP-SGD's C and median norm; ε and test accuracy against steps."""
  fig = Figure(figsize=(18, 4.5), layout="constrained")
  ax_loss, ax_clip, ax_eps = fig.subplots(1, 3)
  steps = np.arange(config.steps)
  window = max(1, config.steps // 50)
  colors = {"non-private": "tab:blue", "DP-SGD": "tab:red"}
  for name, h in results.items():
    ax_loss.plot(
      steps,
      smooth(h.loss, window),
      color=colors.get(name),
      lw=1.5,
      label=f"{name} (test accuracy {h.test_accuracy:.1%})",
    )
  ax_loss.set_yscale("log")
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel(f"training loss (batch cross-entropy, {window}-step moving average)")
  ax_loss.set_title(
    f"SGD lr={config.learning_rate:g} momentum {config.momentum:g}, "
    f"expected batch {config.batch} of {config.train_size}",
    fontsize=10,
  )
  ax_loss.legend()
  dp = results["DP-SGD"]
  ax_clip.plot(steps, dp.clip_norm, color="tab:red", lw=1.5, label="clip norm C")
  ax_clip.plot(
    steps,
    dp.median_norm,
    color="gray",
    lw=1,
    alpha=0.8,
    label="median per-example gradient norm (pre-clip)",
  )
  ax_clip.set_yscale("log")
  ax_clip.set_xlabel("step")
  ax_clip.set_ylabel("L2 norm")
  ax_clip.set_title(
    f"DP-SGD: z={config.noise_multiplier:g}, C from {config.initial_clip:g} towards the "
    f"{config.target_quantile:g}-quantile (count noise B/20)",
    fontsize=10,
  )
  ax_clip.legend()
  for name, style in (("pld", "-"), ("rdp", "--")):
    at, values = eps[name]
    ax_eps.plot(at, values, "k" + style, lw=1.5, label=f"ε ({name.upper()})")
  ax_eps.set_xlabel("step")
  ax_eps.set_ylabel(f"ε at δ={config.delta:g}")
  ax_acc = ax_eps.twinx()
  for name, h in results.items():
    ax_acc.plot(
      h.eval_steps,
      h.eval_accuracy,
      color=colors.get(name),
      lw=1.5,
      marker=".",
      label=f"{name} test accuracy",
    )
  ax_acc.set_ylabel("test accuracy")
  ax_acc.set_ylim(0, 1)
  lines = ax_eps.get_legend_handles_labels()
  more = ax_acc.get_legend_handles_labels()
  ax_eps.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right")
  ax_eps.set_title(f"Poisson q={config.batch / config.train_size:.3g}, dp_accounting", fontsize=10)
  fig.suptitle(
    f"DP-SGD vs non-private: MLP on a {config.classes}-class Gaussian mixture "
    f"({config.dim} features)"
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  save_png(fig, out)


def main(argv: list[str] | None = None) -> dict[str, History]:
  defaults = Config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps per run")
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument(
    "--batch",
    type=int,
    default=defaults.batch,
    help="expected batch size B (Poisson sampling rate B / n)",
  )
  parser.add_argument(
    "--noise-multiplier",
    type=float,
    default=defaults.noise_multiplier,
    help="z: the noise multiplier of the whole step (gradient and count "
    "noise together); the gradient gets σ ≥ z",
  )
  parser.add_argument("--delta", type=float, default=defaults.delta, help="δ of the guarantee")
  parser.add_argument(
    "--privatizer",
    choices=("jaxclip", "jax_privacy"),
    default=defaults.privatizer,
    help="who adds the gradient noise",
  )
  parser.add_argument(
    "--initial-clip",
    type=float,
    default=defaults.initial_clip,
    help="clip norm C before the first step",
  )
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the PNG")
  parser.add_argument("--tiny", action="store_true", help="a seconds-long run (smoke tests)")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.batch < 1:
    parser.error("--steps and --batch must be at least 1")
  if not 0 < args.delta < 1:
    parser.error("--delta must be in (0, 1)")

  config = defaults._replace(
    steps=args.steps,
    seed=args.seed,
    batch=args.batch,
    noise_multiplier=args.noise_multiplier,
    initial_clip=args.initial_clip,
    delta=args.delta,
    privatizer=args.privatizer,
  )
  if args.tiny:
    config = config._replace(
      steps=min(args.steps, 60),
      train_size=1024,
      test_size=256,
      hidden=16,
      batch=min(args.batch, 64),
      chunk=30,
    )
  if config.batch > config.train_size:
    parser.error(f"--batch must be at most the {config.train_size} training examples")

  q = config.batch / config.train_size
  count_std = count_stddev(config)
  sigma = gradient_noise_multiplier(config.noise_multiplier, count_std)
  rows, p_over = max_batch_size(config.train_size, q, config.steps, config.delta)
  print(
    f"{config.train_size} training / {config.test_size} test examples, {config.classes} "
    f"classes; Poisson batches, sampling rate q={q:.4g} (expected B={config.batch}), "
    f"padded to {rows} rows; {config.steps} steps"
  )
  print(
    f"noise multiplier z={config.noise_multiplier:g} for the step: gradient noise "
    f"σ={sigma:.5g}, count noise σ_b=B/20={count_std:g} (Andrew et al., Thm 1: "
    f"z⁻² = σ⁻² + (2σ_b)⁻²); noise added by {config.privatizer}"
  )
  eps = epsilon_curve(
    q, config.noise_multiplier, config.steps, config.delta, points=4 if args.tiny else 10
  )
  final = {name: float(values[-1]) for name, (_, values) in eps.items()}
  print(
    f"privacy after {config.steps} steps at δ={config.delta:g} (dp_accounting, Poisson "
    f"subsampled Gaussian): ε={final['pld']:.3f} (PLD), ε={final['rdp']:.3f} (RDP)"
  )
  truncation = (1 + math.exp(final["pld"])) * config.steps * p_over
  print(
    f"a draw over {rows} rows (truncated) has probability {p_over:.2g} per step: "
    f"it adds (1 + e^ε)·T·p = {truncation:.2g} to δ"
  )
  if config.privatizer == "jax_privacy":
    print(f"jax_privacy's DpsgdTrainingAccountant: ε={jax_privacy_epsilon(config):.3f} (RDP)")
  results: dict[str, History] = {}
  for name, private in (("non-private", False), ("DP-SGD", True)):
    with tqdm(total=config.steps, desc=f"{name:>11}", unit="step") as bar:
      results[name], _ = train(config, private, progress=bar.update)

  print("\nfinal loss, median norm, clipped: means over the last 10% of steps")
  print(format_table(results))
  dp = results["DP-SGD"]
  checkpoints = sorted({0, config.steps // 10, config.steps // 2, config.steps - 1})
  print(
    "DP-SGD clip norm C: "
    + ", ".join(
      f"step {i}: {dp.clip_norm[i]:.3g} (median norm {dp.median_norm[i]:.3g})" for i in checkpoints
    )
  )
  print(
    f"Poisson batch sizes: mean {dp.batch_size.mean():.1f}, min {dp.batch_size.min()}, max "
    f"{dp.batch_size.max()} (expected {config.batch}); truncated draws: "
    f"{int(dp.overflow.sum())}"
  )
  print(
    "ε (PLD) and test accuracy against steps: "
    + ", ".join(f"step {t}: ε={e:.2f}" for t, e in zip(*eps["pld"], strict=True))
  )
  plot(results, config, eps, args.out)
  command = " ".join(["python examples/dp_sgd.py", *(sys.argv[1:] if argv is None else argv)])
  write_record(args.out, [__file__], command)
  print(f"\nplot written to {args.out}")
  return results


if __name__ == "__main__":
  main()
