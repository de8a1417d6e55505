"""Exploding gradients in a vanilla RNN, and what each jaxclip clip does about them.

A tanh RNN reads a sequence of (value, marker) pairs and must output the sum
of the two marked values (the *adding problem* of Hochreiter & Schmidhuber,
used by Pascanu et al. 2013 to study exploding gradients). Backpropagating
through the recurrence multiplies the gradient by the recurrent Jacobian at
every step, so the gradient norm jumps by orders of magnitude when the network
starts to carry information across the sequence. Adam normalises each step,
but one huge gradient still fills its second-moment estimate for thousands of
steps, and learning stalls.

The same network (same initialisation, same batches) is trained with adam
behind each clip, and the script reports, per method:

* the final loss (mean over the last 10% of steps; predicting the mean scores
  about 0.167, so that is "nothing learned"),
* the number of steps whose loss was not finite,
* the share of steps on which the clip changed the gradient,
* the median and maximum global gradient norm *before* clipping,

and draws the loss and gradient-norm curves into a PNG.

Run (``pip install -e ".[examples]"`` gives matplotlib and tqdm)::

  python examples/exploding_gradients.py                 # ~2000 steps per method
  python examples/exploding_gradients.py --steps 5000 --seed 3
  python examples/exploding_gradients.py --tiny          # a few seconds, for tests
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import matplotlib as mpl
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm.auto import tqdm

import jaxclip

DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "exploding_gradients.png"


class Config(NamedTuple):
  """Problem size and optimiser settings."""

  steps: int = 2000
  seed: int = 0
  length: int = 50  # sequence length T
  hidden: int = 64
  batch: int = 64
  learning_rate: float = 2e-3
  chunk: int = 100  # steps per jitted lax.scan call (one progress-bar tick)


# --- the task and the model -------------------------------------------------


def adding_problem(key: jax.Array, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
  """A batch of the adding problem: inputs ``(batch, length, 2)``, targets ``(batch,)``.

  Channel 0 holds uniform values in [0, 1); channel 1 marks one position in
  the first half and one in the second half. The target is the sum of the two
  marked values, so the network must remember a value for up to ``length``
  steps.
  """
  k_val, k_first, k_second = jax.random.split(key, 3)
  values = jax.random.uniform(k_val, (batch, length))
  first = jax.random.randint(k_first, (batch,), 0, length // 2)
  second = jax.random.randint(k_second, (batch,), length // 2, length)
  markers = jax.nn.one_hot(first, length) + jax.nn.one_hot(second, length)
  inputs = jnp.stack([values, markers], axis=-1)
  return inputs, jnp.sum(values * markers, axis=1)


def init_rnn(key: jax.Array, hidden: int) -> dict[str, jax.Array]:
  """Parameters of a one-layer tanh RNN with a linear read-out."""
  k_in, k_rec, k_out = jax.random.split(key, 3)
  return {
    "w_in": 0.5 * jax.random.normal(k_in, (2, hidden)),
    # Gain 1 puts the recurrent Jacobian's spectral radius near 1: the edge
    # where gradients through 50 steps neither vanish nor stay tame.
    "w_rec": jax.random.normal(k_rec, (hidden, hidden)) / math.sqrt(hidden),
    "b": jnp.zeros(hidden),
    "w_out": jax.random.normal(k_out, (hidden, 1)) / math.sqrt(hidden),
    "b_out": jnp.zeros(1),
  }


def rnn_loss(params: dict[str, jax.Array], inputs: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean squared error of the RNN's prediction after the last step."""

  def cell(h, x_t):
    return jnp.tanh(x_t @ params["w_in"] + h @ params["w_rec"] + params["b"]), None

  h0 = jnp.zeros((inputs.shape[0], params["w_rec"].shape[0]))
  h, _ = jax.lax.scan(cell, h0, jnp.swapaxes(inputs, 0, 1))
  prediction = (h @ params["w_out"] + params["b_out"])[:, 0]
  return jnp.mean((prediction - targets) ** 2)


# --- the clips compared -----------------------------------------------------


def clip_methods(
  suggestion: jaxclip.ThresholdSuggestion,
) -> dict[str, optax.GradientTransformation]:
  """The clips compared, each placed in front of the same adam.

  The fixed thresholds come from :func:`jaxclip.suggest_threshold` applied to
  the pre-clip norms of the unclipped run: their median for the global norm
  (on this task a threshold near the typical norm works better than a high
  percentile: the spikes come in bursts), and that divided by sqrt(number of
  tensors) per tensor.
  ``clip_by_value`` has no norm to translate to; it bounds each entry by 0.1.
  The adaptive clips pick their own thresholds as they go.
  """
  g, t = suggestion.max_norm, suggestion.per_tensor_max_norm
  return {
    "clip_by_value(±0.1)": jaxclip.clip_by_value(-0.1, 0.1),
    f"clip_by_norm({t:.2g})": jaxclip.clip_by_norm(t),
    f"clip_by_global_norm({g:.2g})": jaxclip.clip_by_global_norm(g),
    "autoclip(percentile=10)": jaxclip.autoclip(percentile=10.0),
    "zclip()": jaxclip.zclip(),
  }


# --- training ---------------------------------------------------------------


class History(NamedTuple):
  """Per-step records of one training run (numpy arrays of length ``steps``)."""

  loss: np.ndarray
  pre_clip_norm: np.ndarray  # global norm of the raw gradient
  post_clip_norm: np.ndarray  # global norm of what adam received
  clipped: np.ndarray  # bool: did the clip change the gradient?
  seconds: float


def train(
  clip: optax.GradientTransformation,
  config: Config,
  progress: Callable[[int], Any] | None = None,
) -> History:
  """Trains the RNN with ``optax.chain(clip, optax.adam(lr))`` and records each step.

  The chain is spelled out as its two stages so the step can see the gradient
  before and after the clip; ``optax.chain`` itself does exactly this.
  """
  adam = optax.adam(config.learning_rate)
  params = init_rnn(jax.random.key(config.seed), config.hidden)
  carry = (params, clip.init(params), adam.init(params))
  data_key = jax.random.key(config.seed + 10_000)

  def step(carry, key):
    params, clip_state, adam_state = carry
    inputs, targets = adding_problem(key, config.batch, config.length)
    loss, grads = jax.value_and_grad(rnn_loss)(params, inputs, targets)
    clipped, clip_state = clip.update(grads, clip_state, params)
    updates, adam_state = adam.update(clipped, adam_state, params)
    params = optax.apply_updates(params, updates)
    changed = jax.tree.reduce(
      jnp.logical_or, jax.tree.map(lambda a, b: jnp.any(a != b), grads, clipped)
    )
    record = (loss, jaxclip.ops.global_norm(grads), jaxclip.ops.global_norm(clipped), changed)
    return (params, clip_state, adam_state), record

  @jax.jit
  def run_chunk(carry, first_step):
    keys = jax.vmap(lambda i: jax.random.fold_in(data_key, i))(
      first_step + jnp.arange(config.chunk)
    )
    return jax.lax.scan(step, carry, keys)

  records = []
  start = time.perf_counter()
  for first in range(0, config.steps, config.chunk):
    carry, record = run_chunk(carry, first)
    records.append(jax.device_get(record))
    if progress is not None:
      progress(min(config.chunk, config.steps - first))
  seconds = time.perf_counter() - start
  loss, pre, post, changed = (np.concatenate(r)[: config.steps] for r in zip(*records, strict=True))
  return History(loss, pre, post, changed, seconds)


# --- reporting --------------------------------------------------------------


def summary_row(name: str, h: History) -> dict[str, Any]:
  tail = max(1, len(h.loss) // 10)
  finite_pre = h.pre_clip_norm[np.isfinite(h.pre_clip_norm)]
  return {
    "method": name,
    "final loss": float(np.nanmean(h.loss[-tail:])),
    "non-finite": int(np.sum(~np.isfinite(h.loss))),
    "clipped": float(np.mean(h.clipped)),
    "median norm": float(np.median(finite_pre)) if finite_pre.size else float("nan"),
    "max norm": float(np.max(finite_pre)) if finite_pre.size else float("nan"),
  }


def format_table(rows: list[dict[str, Any]]) -> str:
  width = max(len(r["method"]) for r in rows)
  header = (
    f"{'method':<{width}}  {'final loss':>10}  {'non-finite':>10}  "
    f"{'clipped':>7}  {'median norm':>11}  {'max norm':>9}"
  )
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
      f"{r['method']:<{width}}  {r['final loss']:>10.4f}  {r['non-finite']:>10d}  "
      f"{r['clipped']:>7.0%}  {r['median norm']:>11.3g}  {r['max norm']:>9.3g}"
    )
  return "\n".join(lines)


def smooth(x: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average that ignores non-finite entries."""
  window = max(1, min(window, len(x)))
  finite = np.isfinite(x)
  sums = np.cumsum(np.where(finite, x, 0.0))
  counts = np.cumsum(finite)
  sums[window:] = sums[window:] - sums[:-window]
  counts[window:] = counts[window:] - counts[:-window]
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def plot(histories: dict[str, History], config: Config, out: Path) -> None:
  """Loss curves of every method (left) and each method's gradient norms (right)."""
  names = list(histories)
  colors = mpl.colormaps["tab10"].colors
  # A bare Figure draws without pyplot, so importing this module from a
  # notebook leaves the notebook's plotting backend alone.
  fig = Figure(figsize=(13, 1.9 * max(len(names), 3) + 0.8), layout="constrained")
  grid = fig.add_gridspec(len(names), 2, width_ratios=[1.25, 1])
  window = max(1, config.steps // 40)

  ax_loss = fig.add_subplot(grid[:, 0])
  for i, name in enumerate(names):
    ax_loss.plot(smooth(histories[name].loss, window), color=colors[i % 10], lw=1.8, label=name)
  ax_loss.axhline(1 / 6, color="gray", ls=":", lw=1)
  ax_loss.text(0, 1 / 6, " predict the mean", color="gray", va="bottom", fontsize=8)
  ax_loss.set_yscale("log")
  ax_loss.set_ylim(top=0.4)
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel(f"training loss (MSE, {window}-step moving average)")
  ax_loss.set_title(
    f"Adding problem, tanh RNN, T={config.length}, adam lr={config.learning_rate:g}"
  )
  ax_loss.legend(loc="lower left", fontsize=9)

  ax_first = None
  for i, name in enumerate(names):
    h = histories[name]
    ax = fig.add_subplot(grid[i, 1], sharex=ax_first, sharey=ax_first)
    ax_first = ax_first or ax
    steps = np.arange(len(h.pre_clip_norm))
    ax.plot(steps, h.pre_clip_norm, color="0.6", lw=0.6, label="before clip")
    ax.plot(steps, h.post_clip_norm, color=colors[i % 10], lw=0.8, label="after clip")
    ax.set_yscale("log")
    ax.set_title(name, fontsize=9, loc="left", pad=2)
    if i == 0:
      ax.legend(loc="upper right", fontsize=8, ncols=2)
    if i == len(names) - 1:
      ax.set_xlabel("step")
    else:
      ax.tick_params(labelbottom=False)
  fig.supylabel("global gradient norm", x=1.0, rotation=270, fontsize=10)

  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, History]:
  defaults = Config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps per method")
  parser.add_argument("--seed", type=int, default=defaults.seed, help="init and data seed")
  parser.add_argument("--length", type=int, default=defaults.length, help="sequence length T")
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the PNG")
  parser.add_argument("--tiny", action="store_true", help="a seconds-long run (smoke tests)")
  args = parser.parse_args(argv)

  if args.tiny:
    config = Config(
      steps=min(args.steps, 40),
      seed=args.seed,
      length=min(args.length, 10),
      hidden=8,
      batch=8,
      chunk=20,
    )
  else:
    config = Config(steps=args.steps, seed=args.seed, length=args.length)

  def run(name: str, clip: optax.GradientTransformation) -> History:
    with tqdm(total=config.steps, desc=f"{name:>26}", unit="step") as bar:
      return train(clip, config, progress=bar.update)

  histories = {"no clipping": run("no clipping", optax.identity())}
  # Pick the fixed thresholds from the unclipped run's norms, as one would from
  # a short trial run (see notebooks/03_choosing_threshold.ipynb).
  num_tensors = len(jax.tree.leaves(init_rnn(jax.random.key(0), config.hidden)))
  suggestion = jaxclip.suggest_threshold(
    histories["no clipping"].pre_clip_norm, 50.0, num_tensors=num_tensors
  )
  print(suggestion.explanation)
  for name, clip in clip_methods(suggestion).items():
    histories[name] = run(name, clip)

  print()
  print(format_table([summary_row(name, h) for name, h in histories.items()]))
  plot(histories, config, args.out)
  print(f"\nplot written to {args.out}")
  return histories


if __name__ == "__main__":
  main()
