"""Exploding gradients in a vanilla RNN, and which jaxclip clip fixes them.

A tanh RNN reads a sequence of (value, marker) pairs and must output the sum
of the two marked values (the *adding problem* of Hochreiter & Schmidhuber,
used by Pascanu et al. 2013 to study exploding gradients). Backpropagating
through the recurrence multiplies the gradient by the recurrent Jacobian at
every step, so the gradient norm jumps by orders of magnitude when the network
starts to carry information across the sequence. The default setting (T=20,
recurrent gain 1, SGD with momentum 0.9 at learning rate 0.05) is one where
such a jump throws the unclipped network far from where it can learn, and
most seeds end above chance; a clip that bounds the step keeps them on course.
(adam, ``--optimizer adam``, normalises each step and learns here with or
without a clip.)

One RNN is chaotic: a single seed per method decides nothing (the ranking of
two clips flips between machines). So every method trains ``--seeds`` networks
at once (``jax.vmap`` over seeds inside one ``jax.jit``, a ``lax.scan`` over
steps); seed ``s`` has its own initialisation and batches, the same whether it
runs alone or in the batch. The script prints, per optimizer and method:

* the success rate: seeds whose final loss (mean over the last 10% of steps)
  is below the target (predicting the mean scores about 0.167, "nothing
  learned"),
* the median final loss and its interquartile range (a seed that went
  non-finite counts as ``inf``),
* the number of steps whose loss was not finite, summed over seeds,
* the share of steps clipped: steps on which the clip changed the gradient
  (for a norm clip: its pre-clip norm was above the threshold it applied), or
  for ``skip_on_spike`` the steps it skipped (its ``spike_step_skipped``),
* the median pre-clip global gradient norm,

and draws the median loss curves with interquartile bands and the gradient
norms into a PNG.

Run (``pip install -e ".[examples]"`` gives matplotlib and tqdm)::

  python examples/exploding_gradients.py                 # 8 seeds, 1000 steps
  python examples/exploding_gradients.py --seeds 16 --seed 100
  python examples/exploding_gradients.py --optimizer sgd adam
  python examples/exploding_gradients.py --tiny          # a few seconds, for tests
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
import matplotlib as mpl
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm import tqdm  # not tqdm.auto: it warns in a notebook kernel without ipywidgets

import jaxclip

# The repository root, for the figures' provenance records (tools/figure_record.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.figure_record import save_png, write_record  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "exploding_gradients.png"


class Config(NamedTuple):
  """Problem size and optimiser settings."""

  steps: int = 1000
  seed: int = 0  # base seed: the seeds are seed, seed + 1, ...
  seeds: int = 8
  length: int = 20  # sequence length T
  hidden: int = 32
  batch: int = 32
  gain: float = 1.0  # scale of the recurrent matrix at initialisation
  sgd_learning_rate: float = 0.05
  momentum: float = 0.9
  adam_learning_rate: float = 3e-3
  optimizers: tuple[str, ...] = ("sgd",)
  target: float = 0.05  # a seed succeeds if its final loss is below this
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


def init_rnn(key: jax.Array, hidden: int, gain: float = 1.0) -> dict[str, jax.Array]:
  """Parameters of a one-layer tanh RNN with a linear read-out.

  ``gain`` scales the recurrent matrix: its spectral radius is about
  ``gain``, so above 1 the recurrent Jacobians expand and gradients through
  the sequence explode.
  """
  k_in, k_rec, k_out = jax.random.split(key, 3)
  return {
    "w_in": 0.5 * jax.random.normal(k_in, (2, hidden)),
    "w_rec": gain * jax.random.normal(k_rec, (hidden, hidden)) / math.sqrt(hidden),
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


# --- the methods compared ---------------------------------------------------


class Method(NamedTuple):
  """How a method meets the optimizer: a ``clip`` in front of it, or a ``wrap`` around it.

  A clip is applied as ``optax.chain(clip, optimizer)`` would (the step runs the
  two stages itself to see the gradient in between); a wrap is called with the
  optimizer and must keep ``spike_step_skipped`` in its state (as
  :func:`jaxclip.skip_on_spike` does), which counts as "clipped".
  """

  clip: optax.GradientTransformation | None = None
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None


def methods() -> dict[str, Method]:
  """The methods compared, one entry each.

  The fixed thresholds are round numbers near the typical gradient norm at
  the start of training (about 1): 1 for the global norm, ``1 / sqrt(5)``
  per tensor (5 tensors), 0.1 per entry for ``clip_by_value``. The adaptive
  clips pick their own thresholds as they go.
  """
  out = {
    "no clipping": Method(optax.identity()),
    "clip_by_value(±0.1)": Method(jaxclip.clip_by_value(-0.1, 0.1)),
    "clip_by_norm(0.45)": Method(jaxclip.clip_by_norm(0.45)),
    "clip_by_global_norm(1)": Method(jaxclip.clip_by_global_norm(1.0)),
    "autoclip(percentile=10)": Method(jaxclip.autoclip(percentile=10.0)),
    "zclip()": Method(jaxclip.zclip()),
    "skip_on_spike(opt)": Method(wrap=jaxclip.skip_on_spike),
    "adagc()": Method(jaxclip.adagc()),
    "adaptive_value_clip + adaptive_norm_scale": Method(
      optax.chain(jaxclip.adaptive_value_clip(), jaxclip.adaptive_norm_scale())
    ),
  }
  return out


def optimizer(name: str, config: Config) -> optax.GradientTransformation:
  """``"sgd"`` (with momentum) or ``"adam"``, at the config's learning rate."""
  if name == "sgd":
    return optax.sgd(config.sgd_learning_rate, momentum=config.momentum)
  if name == "adam":
    return optax.adam(config.adam_learning_rate)
  raise ValueError(f"unknown optimizer {name!r}; use 'sgd' or 'adam'")


# --- training ---------------------------------------------------------------


class History(NamedTuple):
  """Per-step records of one method on every seed (arrays of shape ``(seeds, steps)``)."""

  loss: np.ndarray
  pre_clip_norm: np.ndarray  # global norm of the raw gradient
  post_clip_norm: np.ndarray  # global norm of what the optimizer received (0 if skipped)
  clipped: np.ndarray  # bool: did the clip change (or skip) the gradient?
  seconds: float


def seed_list(config: Config) -> list[int]:
  return [config.seed + i for i in range(config.seeds)]


@functools.partial(jax.jit, static_argnums=(1, 2))
def initial_params(seeds: jax.Array, hidden: int, gain: float) -> dict[str, jax.Array]:
  """Each seed's initial parameters, stacked: seed ``s`` uses ``key(s)``."""
  return jax.lax.map(lambda s: init_rnn(jax.random.key(s), hidden, gain), seeds)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def batches(
  seeds: jax.Array, first_step: jax.Array, steps: int, batch: int, length: int
) -> tuple[jax.Array, jax.Array]:
  """Each seed's batches for ``steps`` steps from ``first_step``: ``(seeds, steps, batch, ...)``.

  Seed ``s`` draws step ``i``'s batch from ``fold_in(key(s + 10_000), i)``.
  Shared by every method (drawing them inside each method's step would
  compile the random number generator once per method, most of the compile time).
  """

  def one(seed, i):
    return adding_problem(jax.random.fold_in(jax.random.key(seed + 10_000), i), batch, length)

  steps_ = first_step + jnp.arange(steps)
  # lax.map, not vmap: a batched random number generator takes far longer to compile.
  return jax.lax.map(lambda s: jax.lax.map(lambda i: one(s, i), steps_), seeds)


def train(
  method: Method | optax.GradientTransformation,
  config: Config,
  opt: str = "adam",
  progress: Callable[[int], Any] | None = None,
  seeds: list[int] | None = None,
) -> History:
  """Trains the RNN with ``method`` and ``optimizer(opt)`` on every seed at once.

  ``method`` may be a bare clip, placed in front of the optimizer. Seed ``s``
  initialises with ``key(s)`` and draws its batches from ``key(s + 10_000)``,
  so its run does not depend on which other seeds share the batch.
  """
  seed_array = jnp.asarray(seed_list(config) if seeds is None else list(seeds))

  def loss_fn(params, inputs, targets):
    loss = rnn_loss(params, inputs, targets)
    return loss, loss

  return train_loop(
    method,
    optimizer(opt, config),
    loss_fn,
    initial_params(seed_array, config.hidden, config.gain),
    lambda first, steps: batches(seed_array, first, steps, config.batch, config.length),
    config.steps,
    config.chunk,
    progress,
  )


def train_loop(
  method: Method | optax.GradientTransformation,
  inner: optax.GradientTransformation,
  loss_fn: Callable[..., tuple[jax.Array, jax.Array]],
  params: Any,
  data: Callable[[int, int], Any],
  steps: int,
  chunk: int,
  progress: Callable[[int], Any] | None = None,
) -> History:
  """Trains any model with ``method`` and the optimizer ``inner`` on stacked seeds at once.

  ``params`` are the seeds' initial parameters stacked on a leading axis;
  ``data(first, n)`` returns the seeds' batches for steps ``first`` to
  ``first + n`` (leading axes: seed, step); ``loss_fn(params, *batch)``
  returns the loss to differentiate and the value to record as the loss
  (the same, or e.g. the error on noise-free targets).
  """
  if not isinstance(method, Method):
    method = Method(method)
  tx = method.wrap(inner) if method.wrap is not None else inner
  clip = method.clip if method.clip is not None else optax.identity()

  def step(carry, batch):
    params, clip_state, tx_state = carry
    (loss, recorded), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
    clipped, clip_state = clip.update(grads, clip_state, params)
    if method.wrap is not None:
      updates, tx_state = tx.update(clipped, tx_state, params, loss=loss)
      changed = optax.tree.get(tx_state, "spike_step_skipped")
      post = jnp.where(changed, 0.0, jaxclip.ops.global_norm(clipped))
    else:
      updates, tx_state = tx.update(clipped, tx_state, params)
      changed = jax.tree.reduce(
        jnp.logical_or,
        jax.tree.map(lambda a, b: ~jnp.array_equal(a, b, equal_nan=True), grads, clipped),
      )
      post = jaxclip.ops.global_norm(clipped)
    params = optax.apply_updates(params, updates)
    record = (recorded, jaxclip.ops.global_norm(grads), post, changed)
    return (params, clip_state, tx_state), record

  run_chunk = jax.jit(jax.vmap(lambda carry, data: jax.lax.scan(step, carry, data)))
  carry = jax.jit(jax.vmap(lambda p: (p, clip.init(p), tx.init(p))))(params)
  records = []
  start = time.perf_counter()
  for first in range(0, steps, chunk):
    carry, record = run_chunk(carry, data(first, chunk))
    records.append(jax.device_get(record))
    if progress is not None:
      progress(min(chunk, steps - first))
  seconds = time.perf_counter() - start
  loss, pre, post, changed = (
    np.concatenate(r, axis=1)[:, :steps] for r in zip(*records, strict=True)
  )
  return History(loss, pre, post, changed, seconds)


# --- reporting --------------------------------------------------------------


def final_losses(h: History) -> np.ndarray:
  """Per seed: mean loss over the last 10% of steps; ``inf`` if any of them is not finite."""
  tail = h.loss[:, -max(1, h.loss.shape[1] // 10) :]
  return np.where(np.all(np.isfinite(tail), axis=1), np.mean(tail, axis=1), np.inf)


def summary_row(
  name: str, h: History, target: float = Config._field_defaults["target"]
) -> dict[str, Any]:
  """One table row: success count, median and quartiles of the final loss, counts and shares.

  With an even number of seeds the median and quartiles are the lower of the
  two middle values (``method="lower"``), so a value is always a seed's own.
  """
  final = final_losses(h)
  q25, median, q75 = np.percentile(final, [25, 50, 75], method="lower")
  finite_pre = h.pre_clip_norm[np.isfinite(h.pre_clip_norm)]
  return {
    "method": name,
    "success": int(np.sum(final < target)),
    "seeds": len(final),
    "median": float(median),
    "q25": float(q25),
    "q75": float(q75),
    "non-finite": int(np.sum(~np.isfinite(h.loss))),
    "clipped": float(np.mean(h.clipped)),
    "median norm": float(np.median(finite_pre)) if finite_pre.size else float("nan"),
  }


def format_table(rows: list[dict[str, Any]]) -> str:
  width = max(len(r["method"]) for r in rows)
  header = (
    f"{'method':<{width}}  {'success':>7}  {'final loss':>10}  {'IQR':>15}  "
    f"{'non-finite':>10}  {'clipped':>7}  {'median norm':>11}"
  )
  lines = [header, "-" * len(header)]
  for r in rows:
    iqr = f"{r['q25']:.3g}–{r['q75']:.3g}"
    lines.append(
      f"{r['method']:<{width}}  {r['success']:>3d}/{r['seeds']:<3d}  {r['median']:>10.4g}  "
      f"{iqr:>15}  {r['non-finite']:>10d}  {r['clipped']:>7.1%}  {r['median norm']:>11.3g}"
    )
  return "\n".join(lines)


def smooth(x: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average along the last axis that ignores non-finite entries."""
  window = max(1, min(window, x.shape[-1]))
  finite = np.isfinite(x)
  sums = np.cumsum(np.where(finite, x, 0.0), axis=-1)
  counts = np.cumsum(finite, axis=-1)
  sums[..., window:] = sums[..., window:] - sums[..., :-window]
  counts[..., window:] = counts[..., window:] - counts[..., :-window]
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def seed_quartiles(x: np.ndarray, window: int) -> np.ndarray:
  """25th, 50th and 75th percentile over seeds of the smoothed curves; a dead seed counts as inf."""
  s = smooth(x, window)
  dead = np.cumsum(~np.isfinite(x), axis=-1) > 0  # once non-finite, the run is lost
  s = np.where(dead | np.isnan(s), np.inf, s)
  return np.percentile(s, [25, 50, 75], axis=0, method="lower")


def plot(results: dict[str, dict[str, History]], config: Config, out: Path) -> None:
  """Per optimizer: median loss with IQR band (top) and median pre-clip norm (bottom)."""
  colors = mpl.colormaps["tab10"].colors
  # A bare Figure draws without pyplot, so importing this module from a
  # notebook leaves the notebook's plotting backend alone.
  fig = Figure(figsize=(max(8.0, 6.5 * len(results)), 9), layout="constrained")
  axes = fig.subplots(2, len(results), squeeze=False, sharex=True, height_ratios=[1.6, 1])
  window = max(1, config.steps // 40)
  for col, (opt, histories) in enumerate(results.items()):
    ax_loss, ax_norm = axes[0, col], axes[1, col]
    steps = np.arange(config.steps)
    for i, (name, h) in enumerate(histories.items()):
      color = colors[i % 10]
      q25, med, q75 = seed_quartiles(h.loss, window)
      ax_loss.plot(steps, np.where(np.isfinite(med), med, np.nan), color=color, lw=1.6, label=name)
      ax_loss.fill_between(
        steps, np.minimum(q25, 1e3), np.minimum(q75, 1e3), color=color, alpha=0.15, lw=0
      )
      _, norm_med, _ = seed_quartiles(h.pre_clip_norm, window)
      ax_norm.plot(
        steps, np.where(np.isfinite(norm_med), norm_med, np.nan), color=color, lw=1.2, label=name
      )
    # The reference lines are labelled in the legend: text on the plot hides behind the curves.
    ax_loss.axhline(1 / 6, color="gray", ls=":", lw=1, label="predict the mean (1/6)")
    ax_loss.axhline(config.target, color="gray", ls="--", lw=1, label=f"target ({config.target:g})")
    ax_loss.set_yscale("log")
    ax_loss.set_ylim(1e-3, 1.0)
    lr = config.sgd_learning_rate if opt == "sgd" else config.adam_learning_rate
    extra = f", momentum {config.momentum:g}" if opt == "sgd" else ""
    ax_loss.set_title(
      f"{opt} lr={lr:g}{extra}: median over {config.seeds} seeds, IQR band", fontsize=10
    )
    ax_loss.set_ylabel(f"training loss (MSE, {window}-step moving average)")
    ax_norm.set_yscale("log")
    # Headroom above the curves for the legend.
    low, high = ax_norm.get_ylim()
    ax_norm.set_ylim(low, high * (high / low) ** 0.6)
    ax_norm.set_ylabel("median pre-clip global gradient norm")
    ax_norm.set_xlabel("step")
    ax_norm.legend(loc="upper left", fontsize=7, ncol=3)
  axes[0, 0].legend(loc="lower left", fontsize=8)
  fig.suptitle(
    f"Adding problem, tanh RNN, T={config.length}, hidden {config.hidden}, "
    f"recurrent gain {config.gain:g}"
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  save_png(fig, out)


def main(argv: list[str] | None = None) -> dict[str, dict[str, History]]:
  defaults = Config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps per method")
  parser.add_argument("--seed", type=int, default=defaults.seed, help="base seed")
  parser.add_argument("--seeds", type=int, default=defaults.seeds, help="seeds per method")
  parser.add_argument("--length", type=int, default=defaults.length, help="sequence length T")
  parser.add_argument(
    "--optimizer",
    nargs="+",
    choices=["sgd", "adam"],
    default=list(defaults.optimizers),
    help="optimizer(s) behind the clips: sgd (with momentum) and/or adam",
  )
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the PNG")
  parser.add_argument("--tiny", action="store_true", help="a seconds-long run (smoke tests)")
  args = parser.parse_args(argv)
  if args.seeds < 1:
    parser.error("--seeds must be at least 1")

  config = Config(
    steps=args.steps,
    seed=args.seed,
    seeds=args.seeds,
    length=args.length,
    optimizers=tuple(dict.fromkeys(args.optimizer)),
  )
  if args.tiny:
    config = config._replace(
      steps=min(args.steps, 40), length=min(args.length, 10), hidden=8, batch=8, chunk=20
    )

  print(
    f"{config.seeds} seeds ({config.seed}..{config.seed + config.seeds - 1}) per method; "
    f"success: final loss (mean of the last 10% of steps) below {config.target:g}"
  )
  results: dict[str, dict[str, History]] = {}
  for opt in config.optimizers:
    results[opt] = {}
    for name, method in methods().items():
      with tqdm(total=config.steps, desc=f"{opt} {name:>24}", unit="step") as bar:
        results[opt][name] = train(method, config, opt, progress=bar.update)

  for opt, histories in results.items():
    print(f"\n{opt}: success = final loss < {config.target:g} on k of {config.seeds} seeds")
    print(format_table([summary_row(n, h, config.target) for n, h in histories.items()]))
  plot(results, config, args.out)
  args_given = sys.argv[1:] if argv is None else argv
  command = " ".join(["python examples/exploding_gradients.py", *args_given])
  write_record(args.out, [__file__], command)
  print(f"\nplot written to {args.out}")
  return results


if __name__ == "__main__":
  main()
