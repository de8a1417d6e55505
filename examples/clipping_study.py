"""A clipping study: every jaxclip clip on three small tasks, many seeds each.

It grounds the threshold advice of the README and docs/which_clip.md (issue #16). Three tasks, each
trained on ``--seeds`` seeds per method (``jax.vmap`` over seeds in one
``jax.jit``, as ``exploding_gradients.py``, whose training loop, methods and
table this reuses):

* ``adding``: the tanh RNN on the adding problem of ``exploding_gradients.py``
  (T=20, hidden 32, SGD with momentum 0.9 at learning rate 0.05).
* ``copy``: a 2-layer causal transformer (d_model 32, 2 heads, pre-LayerNorm)
  that must copy 8 random tokens (vocabulary 16), trained with Adam at a
  learning rate high enough to spike, without warm-up.
* ``heavy-tail``: an MLP (16-64-64-1, tanh) regressing a fixed random teacher
  MLP from targets with Student-t noise (1.5 degrees of freedom: infinite
  variance), SGD with momentum; the loss recorded is the error on the
  noise-free targets.

Fixed thresholds come from a short unclipped run of each task on a seed no
method trains on (``RECORD_SEED``): its pre-clip global norms go to
:func:`jaxclip.suggest_threshold` at the 50th, 90th and 99th percentiles.
``clip_by_norm`` gets the 90th percentile divided by sqrt(number of tensors)
(``suggest_threshold(..., num_tensors=k).per_tensor_max_norm``) and
``clip_by_value`` the 90th percentile of the recorded steps' largest absolute
gradient entry, so that, like the global 90th percentile, it acts only on the
largest tenth of steps.

Run::

  python examples/clipping_study.py            # about 11 minutes on 2 shared CPU cores
  python examples/clipping_study.py --tiny     # a minute or two, for tests

``--tiny`` is compile-bound (33 training loops);
``XLA_FLAGS=--xla_backend_optimization_level=0`` about halves its time.

It prints one table per task and writes ``docs/clipping_study.md`` (settings,
thresholds, table), ``docs/clipping_study.png`` (median final loss with
interquartile bars per task and method) and ``docs/clipping_study.json`` (the
rows and thresholds; ``--replot`` redraws the page and figure from it), or
into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import matplotlib as mpl
import matplotlib.ticker
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import exploding_gradients as eg  # noqa: E402

import jaxclip  # noqa: E402
from tools.figure_record import write_record  # noqa: E402  (on the path that eg set)

DOCS = Path(__file__).resolve().parents[1] / "docs"
RECORD_SEED = 1000  # the seed of the unclipped run that sets the fixed thresholds
PERCENTILES = (50, 90, 99)


class Task(NamedTuple):
  """One problem: a model, its data, its optimizer and what counts as success."""

  name: str
  description: str
  init: Callable[[jax.Array], Any]  # key -> parameters
  batch: Callable[[jax.Array], tuple[jax.Array, ...]]  # key -> one batch
  loss: Callable[..., tuple[jax.Array, jax.Array]]  # (params, *batch) -> (loss, recorded)
  optimizer: optax.GradientTransformation
  optimizer_text: str
  steps: int
  target: float
  baseline: float  # the recorded loss of a model that learned nothing
  loss_text: str


# --- task (a): the adding problem, from exploding_gradients.py ---------------


def adding_task(tiny: bool = False) -> Task:
  length, hidden, batch = (10, 8, 8) if tiny else (20, 32, 32)

  def loss(params, inputs, targets):
    value = eg.rnn_loss(params, inputs, targets)
    return value, value

  config = eg.Config()
  return Task(
    name="adding",
    description=f"tanh RNN, hidden {hidden}, adding problem with T={length}, batch {batch}",
    init=functools.partial(eg.init_rnn, hidden=hidden, gain=config.gain),
    batch=functools.partial(eg.adding_problem, batch=batch, length=length),
    loss=loss,
    optimizer=eg.optimizer("sgd", config),
    optimizer_text=f"SGD lr {config.sgd_learning_rate:g}, momentum {config.momentum:g}",
    steps=40 if tiny else 1000,
    target=config.target,
    baseline=1 / 6,
    loss_text="MSE",
  )


# --- task (b): a small causal transformer copying a token sequence -----------


def copy_batch(key: jax.Array, batch: int, half: int, vocab: int) -> tuple[jax.Array]:
  """Sequences ``x_1..x_half, x_1..x_half`` of uniform random tokens, ``(batch, 2 * half)``."""
  tokens = jax.random.randint(key, (batch, half), 0, vocab)
  return (jnp.concatenate([tokens, tokens], axis=1),)


def init_transformer(key: jax.Array, vocab: int, length: int, d: int, layers: int) -> dict:
  keys = iter(jax.random.split(key, 2 + 4 * layers))

  def dense(n_in, n_out):
    return jax.random.normal(next(keys), (n_in, n_out)) / math.sqrt(n_in)

  params: dict[str, Any] = {
    "embed": jax.random.normal(next(keys), (vocab, d)),
    "pos": 0.1 * jax.random.normal(next(keys), (length, d)),
    "ln_f": jnp.ones(d),
  }
  for i in range(layers):
    params[f"layer{i}"] = {
      "ln1": jnp.ones(d),
      "qkv": dense(d, 3 * d),
      "out": dense(d, d),
      "ln2": jnp.ones(d),
      "up": dense(d, 4 * d),
      "b_up": jnp.zeros(4 * d),
      "down": dense(4 * d, d),
    }
  return params


def transformer_logits(params: dict, tokens: jax.Array, heads: int) -> jax.Array:
  """Pre-LayerNorm causal transformer; the unembedding is the embedding's transpose."""

  def norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return scale * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)

  n, t = tokens.shape
  x = params["embed"][tokens] + params["pos"][:t]
  mask = jnp.tril(jnp.ones((t, t), bool))
  layers = sorted(k for k in params if k.startswith("layer"))
  for name in layers:
    p = params[name]
    q, k, v = jnp.split(norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(n, t, heads, -1) for a in (q, k, v))
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(q.shape[-1])
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    x = x + jnp.einsum("nhqk,nkhd->nqhd", weights, v).reshape(n, t, -1) @ p["out"]
    x = x + jax.nn.gelu(norm(x, p["ln2"]) @ p["up"] + p["b_up"]) @ p["down"]
  return norm(x, params["ln_f"]) @ params["embed"].T


def copy_task(tiny: bool = False, learning_rate: float = 0.05) -> Task:
  vocab, half, d, layers, heads, batch = (8, 4, 16, 1, 2, 8) if tiny else (16, 8, 32, 2, 2, 32)

  def loss(params, sequences):
    logits = transformer_logits(params, sequences[:, :-1], heads)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, sequences[:, 1:])
    value = jnp.mean(nll[:, half - 1 :])  # the positions that predict the copy
    return value, value

  return Task(
    name="copy",
    description=(
      f"causal transformer, {layers} layer(s), d_model {d}, {heads} heads; copy "
      f"{half} random tokens (vocabulary {vocab}), batch {batch}"
    ),
    init=functools.partial(init_transformer, vocab=vocab, length=2 * half, d=d, layers=layers),
    batch=functools.partial(copy_batch, batch=batch, half=half, vocab=vocab),
    loss=loss,
    optimizer=optax.adam(learning_rate),
    optimizer_text=f"Adam lr {learning_rate:g}, no warm-up",
    steps=40 if tiny else 1000,
    target=0.1,
    baseline=math.log(vocab),
    loss_text="cross-entropy on the copied half (nats)",
  )


# --- task (c): MLP regression with heavy-tailed label noise ------------------

TEACHER_KEY = 12345


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (a, b)) / math.sqrt(a), "b": jnp.zeros(b)}
    for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return (x @ params[-1]["w"] + params[-1]["b"])[..., 0]


def heavy_tail_batch(key: jax.Array, batch: int, dim: int, df: float, scale: float):
  """Inputs, noisy targets (Student-t noise) and the noise-free targets of a fixed teacher."""
  k_x, k_noise = jax.random.split(key)
  x = jax.random.normal(k_x, (batch, dim))
  clean = 2.0 * mlp(init_mlp(jax.random.key(TEACHER_KEY), (dim, 32, 1)), x)
  noisy = clean + scale * jax.random.t(k_noise, df, (batch,))
  return x, noisy, clean


def heavy_tail_task(tiny: bool = False, learning_rate: float = 0.005) -> Task:
  dim, width, batch = (8, 16, 16) if tiny else (16, 64, 32)
  df, scale = 1.5, 0.5

  def loss(params, x, noisy, clean):
    prediction = mlp(params, x)
    return jnp.mean((prediction - noisy) ** 2), jnp.mean((prediction - clean) ** 2)

  # The teacher's output variance, the clean MSE of predicting zero.
  x = jax.random.normal(jax.random.key(0), (4096, dim))
  baseline = float(
    jnp.mean((2.0 * mlp(init_mlp(jax.random.key(TEACHER_KEY), (dim, 32, 1)), x)) ** 2)
  )
  return Task(
    name="heavy-tail",
    description=(
      f"MLP {dim}-{width}-{width}-1 (tanh) fitting a random teacher MLP; label noise "
      f"{scale:g} * Student-t({df:g} dof), batch {batch}"
    ),
    init=functools.partial(init_mlp, sizes=(dim, width, width, 1)),
    batch=functools.partial(heavy_tail_batch, batch=batch, dim=dim, df=df, scale=scale),
    loss=loss,
    optimizer=optax.sgd(learning_rate, momentum=0.9),
    optimizer_text=f"SGD lr {learning_rate:g}, momentum 0.9",
    steps=40 if tiny else 1000,
    target=0.2 * baseline,
    baseline=baseline,
    loss_text="MSE against the noise-free targets",
  )


def tasks(tiny: bool = False) -> dict[str, Task]:
  return {t.name: t for t in (adding_task(tiny), copy_task(tiny), heavy_tail_task(tiny))}


# --- shared data and the recorded run ----------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def stacked_init(init: Callable, seeds: jax.Array) -> Any:
  """Each seed's parameters, stacked: seed ``s`` initialises from ``key(s)``."""
  return jax.lax.map(lambda s: init(jax.random.key(s)), seeds)


@functools.partial(jax.jit, static_argnums=(0, 3))
def stacked_batches(batch: Callable, seeds: jax.Array, first: jax.Array, steps: int) -> Any:
  """Seed ``s`` draws step ``i``'s batch from ``fold_in(key(s + 10_000), i)`` (as the main job)."""
  steps_ = first + jnp.arange(steps)
  return jax.lax.map(
    lambda s: jax.lax.map(
      lambda i: batch(jax.random.fold_in(jax.random.key(s + 10_000), i)), steps_
    ),
    seeds,
  )


def run(task: Task, method: eg.Method, seeds: list[int], chunk: int, progress=None) -> eg.History:
  seed_array = jnp.asarray(seeds)
  return eg.train_loop(
    method,
    task.optimizer,
    task.loss,
    stacked_init(task.init, seed_array),
    lambda first, n: stacked_batches(task.batch, seed_array, first, n),
    task.steps,
    chunk,
    progress,
  )


class Thresholds(NamedTuple):
  """The fixed thresholds of one task, from its recorded unclipped run."""

  global_norm: dict[int, float]  # percentile -> suggest_threshold(norms, percentile).max_norm
  per_tensor: float  # suggest_threshold(norms, 90, num_tensors=k).per_tensor_max_norm
  value: float  # 90th percentile of the recorded steps' largest |gradient entry|
  num_tensors: int
  recorded_steps: int
  nonfinite: int
  explanation: str


def record_thresholds(task: Task, steps: int) -> Thresholds:
  """Trains ``RECORD_SEED`` unclipped for ``steps`` steps and derives every fixed threshold."""
  params = task.init(jax.random.key(RECORD_SEED))
  data = stacked_batches(task.batch, jnp.asarray([RECORD_SEED]), 0, steps)
  data = jax.tree.map(lambda a: a[0], data)

  @jax.jit
  def go(params, data):
    def step(carry, batch):
      params, state = carry
      (_, _), grads = jax.value_and_grad(task.loss, has_aux=True)(params, *batch)
      updates, state = task.optimizer.update(grads, state, params)
      biggest = jax.tree.reduce(jnp.maximum, jax.tree.map(lambda g: jnp.max(jnp.abs(g)), grads))
      return (optax.apply_updates(params, updates), state), (
        jaxclip.ops.global_norm(grads),
        biggest,
      )

    return jax.lax.scan(step, (params, task.optimizer.init(params)), data)[1]

  norms, biggest = (np.asarray(a) for a in go(params, data))
  k = len(jax.tree.leaves(params))
  suggestions = {p: jaxclip.suggest_threshold(norms, p, num_tensors=k) for p in PERCENTILES}
  finite = biggest[np.isfinite(biggest)]
  return Thresholds(
    global_norm={p: s.max_norm for p, s in suggestions.items()},
    per_tensor=float(suggestions[90].per_tensor_max_norm),
    value=float(np.percentile(finite, 90)),
    num_tensors=k,
    recorded_steps=steps,
    nonfinite=suggestions[90].num_nonfinite,
    explanation=suggestions[90].explanation.replace("\n", " "),
  )


# --- the methods ---------------------------------------------------------------


def study_methods(t: Thresholds) -> dict[str, eg.Method]:
  """The main job's adaptive methods, with fixed thresholds from the recorded run."""
  main_job = eg.methods()
  return {
    "no clipping": main_job["no clipping"],
    "clip_by_value(p90 max|g|)": eg.Method(jaxclip.clip_by_value(-t.value, t.value)),
    "clip_by_norm(p90/√k)": eg.Method(jaxclip.clip_by_norm(t.per_tensor)),
    **{
      f"clip_by_global_norm(p{p})": eg.Method(jaxclip.clip_by_global_norm(t.global_norm[p]))
      for p in PERCENTILES
    },
    "autoclip(percentile=10)": main_job["autoclip(percentile=10)"],
    "zclip()": main_job["zclip()"],
    "adagc()": main_job["adagc()"],
    "adaptive_value_clip + adaptive_norm_scale": main_job[
      "adaptive_value_clip + adaptive_norm_scale"
    ],
    "skip_on_spike(opt)": main_job["skip_on_spike(opt)"],
  }


def threshold_of(name: str, t: Thresholds) -> str:
  if name.startswith("clip_by_value"):
    return f"±{t.value:.3g}"
  if name.startswith("clip_by_norm"):
    return f"{t.per_tensor:.3g}"
  for p in PERCENTILES:
    if name == f"clip_by_global_norm(p{p})":
      return f"{t.global_norm[p]:.3g}"
  return "adaptive" if name != "no clipping" else "–"


# --- reporting -----------------------------------------------------------------


def markdown_table(rows: list[dict[str, Any]]) -> str:
  lines = [
    "| task | method | threshold | success | median final loss | IQR | non-finite steps "
    "| clipped |",
    "|---|---|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['task']} | {r['method']} | {r['threshold']} | {r['success']}/{r['seeds']} "
      f"| {r['median']:.3g} | {r['q25']:.3g}–{r['q75']:.3g} | {r['non-finite']} "
      f"| {r['clipped']:.1%} |"
    )
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], all_tasks: dict[str, Task], out: Path) -> None:
  """Per task: median final loss and interquartile bar per method, log scale."""
  names = list(dict.fromkeys(r["method"] for r in rows))
  fig = Figure(figsize=(5.0 * len(all_tasks), 0.42 * len(names) + 1.6), layout="constrained")
  axes = fig.subplots(1, len(all_tasks), sharey=True, squeeze=False)[0]
  colors = mpl.colormaps["tab10"].colors
  for ax, (tname, task) in zip(axes, all_tasks.items(), strict=True):
    task_rows = {r["method"]: r for r in rows if r["task"] == tname}
    finite = [
      v
      for r in task_rows.values()
      for v in (r["q25"], r["median"], r["q75"])
      if np.isfinite(v) and v > 0
    ]
    lo = min([*finite, task.target]) / 2
    hi = max([*finite, task.baseline]) * 3
    for y, name in enumerate(names):
      r = task_rows[name]
      color = colors[y % 10]
      left, mid, right = (
        min(v, hi) if np.isfinite(v) else hi for v in (r["q25"], r["median"], r["q75"])
      )
      ax.plot([left, right], [y, y], color=color, lw=3, alpha=0.5, solid_capstyle="butt")
      ax.plot([mid], [y], "o" if np.isfinite(r["median"]) else "x", color=color, ms=7)
      ax.text(
        0.99,
        y,
        f"{r['success']}/{r['seeds']}",
        transform=ax.get_yaxis_transform(),
        va="center",
        ha="right",
        fontsize=8,
      )
    ax.axvline(task.target, color="gray", ls="--", lw=1)
    ax.axvline(task.baseline, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(mpl.ticker.NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_title(f"{tname}: {task.optimizer_text}", fontsize=10)
    ax.set_xlabel(
      f"final {task.loss_text}\n(-- target, ··· nothing learned; x: median diverged)", fontsize=8
    )
  axes[0].set_yticks(range(len(names)), names, fontsize=8)
  axes[0].invert_yaxis()
  seeds = rows[0]["seeds"]
  fig.suptitle(
    f"Median final loss over {seeds} seeds, bar: interquartile range; "
    "k/n: seeds that reached the target",
    fontsize=10,
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)


def load_average() -> str:
  try:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


def write_page(
  path: Path,
  rows,
  all_tasks,
  thresholds,
  seeds,
  wall,
  load_start,
  load_end,
  figure_name: str,
  command: str,
) -> None:
  settings = "\n".join(
    f"| {t.name} | {t.description} | {t.optimizer_text} | {t.steps} | {t.loss_text} "
    f"| < {t.target:.3g} | {t.baseline:.3g} |"
    for t in all_tasks.values()
  )
  recorded = "\n".join(
    f"| {name} | {th.num_tensors} | "
    + " | ".join(f"{th.global_norm[p]:.3g}" for p in PERCENTILES)
    + f" | {th.per_tensor:.3g} | ±{th.value:.3g} | {th.nonfinite} |"
    for name, th in thresholds.items()
  )
  text = f"""# Clipping study

Which clip, and which threshold, on three small tasks, {seeds} seeds per method.
What it means for choosing a clip and a threshold is summarised in
[Which clip?](which_clip.md). Generated by `{command}`
(`examples/clipping_study.py`; the numbers below are from that run).

![Median final loss per task and method]({figure_name})

## Tasks

Every method trains the same {seeds} seeds (seed `s` initialises from `key(s)` and draws
batch `i` from `fold_in(key(s + 10000), i)`), all seeds at once (`jax.vmap` inside one
`jax.jit`). The final loss of a seed is the mean of its recorded loss over the last 10% of
steps (`inf` if any of them is not finite); a seed succeeds if it is below the target.

| task | model and data | optimizer | steps | recorded loss | success | nothing learned |
|---|---|---|---:|---|---|---:|
{settings}

## Thresholds

Each task first trains seed {RECORD_SEED} (no method trains it) for
{next(iter(thresholds.values())).recorded_steps} steps without clipping and records the
pre-clip global norm and the largest absolute gradient entry of every step. Then:

* `clip_by_global_norm(pP)`: `jaxclip.suggest_threshold(norms, percentile=P).max_norm`
  for P = 50, 90, 99;
* `clip_by_norm(p90/√k)`: `suggest_threshold(norms, 90, num_tensors=k).per_tensor_max_norm`,
  the 90th percentile divided by the square root of the number of tensors k;
* `clip_by_value(p90 max|g|)`: the 90th percentile over the recorded steps of the largest
  absolute gradient entry, so it acts on about the largest tenth of steps, like p90;
* autoclip, zclip, adagc, adaptive_value_clip + adaptive_norm_scale and skip_on_spike
  (around the optimizer) run with their defaults, as in `examples/exploding_gradients.py`.

| task | tensors k | p50 | p90 | p99 | p90/√k | value | non-finite recorded |
|---|---:|---:|---:|---:|---:|---:|---:|
{recorded}

## Results

"clipped" is the share of steps on which the method changed the gradient (a norm clip:
the pre-clip norm was above its threshold) or, for skip_on_spike, skipped the step.
Median and quartiles are over seeds (`method="lower"`: always one seed's value).

{markdown_table(rows)}

Wall time {wall:.0f} s on {platform.machine()} CPU ({os.cpu_count()} cores, shared), load
average (1, 5, 15 min) {load_start} at the start and {load_end} at the end; jax
{jax.__version__}, optax {optax.__version__}.
"""
  path.write_text(text)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, default=8, help="seeds per task and method")
  parser.add_argument("--seed", type=int, default=0, help="base seed")
  parser.add_argument(
    "--record-steps",
    type=int,
    default=100,
    help="steps of the unclipped run that sets the fixed thresholds",
  )
  parser.add_argument("--tasks", nargs="+", default=None, help="a subset of adding copy heavy-tail")
  parser.add_argument(
    "--out",
    type=Path,
    default=DOCS,
    help="folder for clipping_study.md and clipping_study.png (default docs/)",
  )
  parser.add_argument("--tiny", action="store_true", help="a seconds-long run (smoke tests)")
  parser.add_argument(
    "--replot",
    type=Path,
    default=None,
    help="redraw the page and figure from a saved clipping_study.json",
  )
  args = parser.parse_args(argv)
  if args.seeds < 1:
    parser.error("--seeds must be at least 1")
  record_steps = min(args.record_steps, 20) if args.tiny else args.record_steps
  all_tasks = tasks(args.tiny)
  if args.tasks:
    all_tasks = {n: all_tasks[n] for n in args.tasks}
  seeds = [args.seed + i for i in range(args.seeds)]
  if args.replot is not None:
    saved = json.loads(args.replot.read_text())
    all_tasks = {n: all_tasks[n] for n in saved["thresholds"]}
    thresholds = {
      n: Thresholds(**{**t, "global_norm": {int(p): v for p, v in t["global_norm"].items()}})
      for n, t in saved["thresholds"].items()
    }
    plot(saved["rows"], all_tasks, args.out / "clipping_study.png")
    write_record(
      args.out / "clipping_study.png",
      [__file__, eg.__file__, args.replot],
      " ".join(["python examples/clipping_study.py", *(sys.argv[1:] if argv is None else argv)]),
    )
    write_page(
      args.out / "clipping_study.md",
      saved["rows"],
      all_tasks,
      thresholds,
      saved["rows"][0]["seeds"],
      saved["wall"],
      saved["load_start"],
      saved["load_end"],
      "clipping_study.png",
      saved["command"],
    )
    return saved["rows"]
  load_start = load_average()
  start = time.perf_counter()
  rows, thresholds, histories = [], {}, {}
  for tname, task in all_tasks.items():
    thresholds[tname] = th = record_thresholds(task, record_steps)
    print(f"\n{tname}: {task.description}; {task.optimizer_text}\n  thresholds: {th.explanation}")
    histories[tname] = {}
    for name, method in study_methods(th).items():
      with tqdm(total=task.steps, desc=f"{tname} {name:>26}", unit="step") as bar:
        h = run(task, method, seeds, chunk=20 if args.tiny else 200, progress=bar.update)
      histories[tname][name] = h
      rows.append(
        {
          "task": tname,
          "threshold": threshold_of(name, th),
          **eg.summary_row(name, h, task.target),
          "max post-clip norm": float(np.max(h.post_clip_norm)),
        }
      )
    print(f"\n{tname}: success = final loss < {task.target:.3g} on k of {len(seeds)} seeds")
    print(eg.format_table([eg.summary_row(n, h, task.target) for n, h in histories[tname].items()]))
  wall = time.perf_counter() - start
  args.out.mkdir(parents=True, exist_ok=True)
  plot(rows, all_tasks, args.out / "clipping_study.png")
  command = "python examples/clipping_study.py" + (" " + " ".join(argv) if argv else "")
  load_end = load_average()
  (args.out / "clipping_study.json").write_text(
    json.dumps(
      {
        "rows": rows,
        "wall": wall,
        "load_start": load_start,
        "load_end": load_end,
        "command": command,
        "thresholds": {n: t._asdict() for n, t in thresholds.items()},
      },
      indent=1,
    )
  )
  figure_inputs = [__file__, eg.__file__, args.out / "clipping_study.json"]
  write_record(args.out / "clipping_study.png", figure_inputs, command)
  write_page(
    args.out / "clipping_study.md",
    rows,
    all_tasks,
    thresholds,
    len(seeds),
    wall,
    load_start,
    load_end,
    "clipping_study.png",
    command,
  )
  print(f"\nwall time {wall:.0f} s; load average {load_start} -> {load_average()}")
  print(f"wrote {args.out / 'clipping_study.md'} and {args.out / 'clipping_study.png'}")
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
