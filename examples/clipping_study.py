"""A clipping study: every jaxclip clip on four tasks, many seeds each.

It grounds the threshold advice of the README and docs/which_clip.md (issues #16 and #40).
Each task trains ``--seeds`` seeds per method (``jax.vmap`` over seeds in one ``jax.jit``, as
``exploding_gradients.py``, whose training loop, methods and table this reuses):

* ``adding``: the tanh RNN on the adding problem of ``exploding_gradients.py``
  (T=20, hidden 32, SGD with momentum 0.9 at learning rate 0.05).
* ``copy``: a 2-layer causal transformer (d_model 32, 2 heads, pre-LayerNorm)
  that must copy 8 random tokens (vocabulary 16), trained with Adam at a
  learning rate high enough to spike, without warm-up.
* ``heavy-tail``: an MLP (16-64-64-1, tanh) regressing a fixed random teacher
  MLP from targets with Student-t noise (1.5 degrees of freedom: infinite
  variance), SGD with momentum; the loss recorded is the error on the
  noise-free targets.
* ``text``: a byte-level causal transformer (flax linen layers; d_model 64, 2 layers, context
  64) on the source of Python's own standard library, scored in validation bits per byte on
  held-out files, with loss spikes counted (``examples/_study_text.py``). AdamW at a stable
  and a high peak learning rate, each with and without warm-up, and Muon
  (``optax.contrib.muon`` on the hidden matrices, AdamW on the rest) with the clip before the
  optimizer, inside each of its groups, or after it. It also tests the threshold recipe: the
  threshold from 50, 100 or 300 recorded steps at each percentile, with and without warm-up.

Fixed thresholds come from a short unclipped run of each task on a seed no
method trains on (``RECORD_SEED``): its pre-clip global norms go to
:func:`jaxclip.suggest_threshold` at the 50th, 90th and 99th percentiles.
``clip_by_norm`` gets the 90th percentile divided by sqrt(number of tensors)
(``suggest_threshold(..., num_tensors=k).per_tensor_max_norm``) and
``clip_by_value`` the 90th percentile of the recorded steps' largest absolute
gradient entry, so that, like the global 90th percentile, it acts only on the
largest tenth of steps.

Run::

  python examples/clipping_study.py            # all four tasks (see the page for its time)
  python examples/clipping_study.py --tasks text
  python examples/clipping_study.py --tiny     # a minute or two, for tests

``--tiny`` is compile-bound (36 training loops);
``XLA_FLAGS=--xla_backend_optimization_level=0`` about halves its time.

It prints one table per task and writes ``docs/clipping_study.md`` (settings,
thresholds, tables), one figure per task ``docs/clipping_study_<task>.png`` (median final
loss, or validation bits/byte, with interquartile bars per method) and
``docs/clipping_study.json`` (the rows and thresholds; ``--replot`` redraws the page and
figures from it), or into ``--out``.
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

import flax
import jax
import jax.numpy as jnp
import matplotlib as mpl
import matplotlib.ticker
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _study_text as st  # noqa: E402
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
  return thresholds_from(norms, biggest, len(jax.tree.leaves(params)))


def thresholds_from(norms: Any, biggest: np.ndarray, num_tensors: int) -> Thresholds:
  """Every fixed threshold from recorded norms (or ``record_norms`` states) and max |entries|."""
  suggestions = {
    p: jaxclip.suggest_threshold(norms, p, num_tensors=num_tensors) for p in PERCENTILES
  }
  finite = biggest[np.isfinite(biggest)]
  return Thresholds(
    global_norm={p: s.max_norm for p, s in suggestions.items()},
    per_tensor=float(suggestions[90].per_tensor_max_norm),
    value=float(np.percentile(finite, 90)),
    num_tensors=num_tensors,
    recorded_steps=int(biggest.size),
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


# --- task (d): a byte-level language model on Python's standard library --------

TEXT_WINDOWS = (50, 100, 300)  # recording windows of the recipe test (steps)
TEXT_WINDOWS_TINY = (5, 10, 20)
# Which of the study's methods run in which AdamW setting (all 11 at the high learning rate
# without warm-up; the full matrix would not fit the study's 30 minutes on 2 cores).
TEXT_CORE = ("no clipping", "clip_by_global_norm(p50)", "autoclip(percentile=10)", "adagc()")
TEXT_STABLE = ("no clipping", "clip_by_global_norm(p50)", "autoclip(percentile=10)")
TEXT_STABLE_WARM = ("no clipping", "clip_by_global_norm(p50)")
TEXT_MUON = (
  "no clipping",
  "clip gradient before (global p50)",
  "clip gradient before, per group (p50 each)",
  "clip update after (global p50)",
)
TEXT_MUON_TINY = ("clip update after (global p50)",)


def text_config(tiny: bool) -> st.TextConfig:
  return st.TINY if tiny else st.TextConfig()


def text_plan(config: st.TextConfig, tiny: bool) -> dict[str, tuple[str, ...] | None]:
  """Setting name -> the methods it runs (``None``: all 11); ``--tiny`` runs two settings."""
  stable, stable_warm, high, high_warm, muon = list(st.settings(config))
  if tiny:
    return {high: ("no clipping", "clip_by_global_norm(p50)"), muon: TEXT_MUON_TINY}
  return {
    stable: TEXT_STABLE,
    stable_warm: TEXT_STABLE_WARM,
    high: None,
    high_warm: TEXT_CORE,
    muon: TEXT_MUON,
  }


def window_name(window: int) -> str:
  return f"clip_by_global_norm(p50 of {window} steps)"


def muon_methods(rec: st.Recorded, window: int) -> dict[str, tuple[eg.Method, bool, str]]:
  """Muon's runs: name -> (method, clip after the optimizer?, threshold text)."""
  grad = jaxclip.suggest_threshold(rec.grad_norm[:window], 50).max_norm
  update = jaxclip.suggest_threshold(rec.update_norm[:window], 50).max_norm
  group = {g: jaxclip.suggest_threshold(n[:window], 50).max_norm for g, n in rec.group_norm.items()}
  per_group = optax.multi_transform(
    {g: jaxclip.clip_by_global_norm(c) for g, c in group.items()}, st.muon_labels
  )
  return {
    "no clipping": (eg.Method(optax.identity()), False, "–"),
    "clip gradient before (global p50)": (
      eg.Method(jaxclip.clip_by_global_norm(grad)),
      False,
      f"{grad:.3g}",
    ),
    "clip gradient before, per group (p50 each)": (
      eg.Method(per_group),
      False,
      f"muon {group['muon']:.3g}, adam {group['adam']:.3g}",
    ),
    "clip update after (global p50)": (
      eg.Method(jaxclip.clip_by_global_norm(update)),
      True,
      f"{update:.3g}",
    ),
  }


def text_row(setting: str, name: str, threshold: str, h: st.TextHistory) -> dict[str, Any]:
  bpb = np.where(np.isfinite(h.validation_bpb), h.validation_bpb, np.inf)
  q25, median, q75 = np.percentile(bpb, [25, 50, 75], method="lower")
  count = st.spikes(h.loss)
  return {
    "setting": setting,
    "method": name,
    "threshold": threshold,
    "seeds": len(bpb),
    "median": float(median),
    "q25": float(q25),
    "q75": float(q75),
    "best": float(bpb.min()),
    "worst": float(bpb.max()),
    "spikes": int(count.sum()),
    "seeds with spikes": int(np.sum(count > 0)),
    "non-finite": int(np.sum(~np.isfinite(h.loss))),
    "clipped": float(np.mean(h.clipped)),
    "max post-clip norm": float(np.max(h.post_clip_norm)),
    "seconds": h.seconds,
  }


def run_text(
  tiny: bool, seeds: list[int], record_steps: int, progress: bool = True
) -> dict[str, Any]:
  """The text task: every setting, its methods, the recipe test; a JSON-ready dict."""
  start = time.perf_counter()
  config = text_config(tiny)
  text = st.Text(config)
  windows = TEXT_WINDOWS_TINY if tiny else TEXT_WINDOWS
  window = min(record_steps, windows[1]) if tiny else record_steps
  chunk = 20 if tiny else 100
  all_settings = st.settings(config)
  rows: list[dict[str, Any]] = []
  recipe: list[dict[str, Any]] = []
  thresholds: dict[str, dict[str, Any]] = {}
  plan = text_plan(config, tiny)
  for sname, setting in all_settings.items():
    if sname not in plan:
      continue
    rec = st.record(text, setting.optimizer, RECORD_SEED, max(*windows, window))
    if setting.muon:
      runs = muon_methods(rec, window)
      thresholds[sname] = {
        "gradient p50": runs["clip gradient before (global p50)"][2],
        "per group p50": runs["clip gradient before, per group (p50 each)"][2],
        "update p50": runs["clip update after (global p50)"][2],
      }
      runs = {n: runs[n] for n in plan[sname]}
    else:
      # suggest_threshold reads record_norms' states, stacked over the recorded steps.
      head = jax.tree.map(lambda a: a[:window], rec.states)
      th = thresholds_from(head, rec.grad_max[:window], rec.num_tensors)
      thresholds[sname] = th._asdict()
      methods = study_methods(th)
      plan = plan or text_plan(config, list(methods))
      runs = {n: (methods[n], False, threshold_of(n, th)) for n in plan[sname] or methods}
      if not tiny and sname in list(all_settings)[2:4]:  # the high learning rate: other windows
        for w in (windows[0], windows[2]):
          c = jaxclip.suggest_threshold(rec.grad_norm[:w], 50).max_norm
          runs[window_name(w)] = (eg.Method(jaxclip.clip_by_global_norm(c)), False, f"{c:.3g}")
    histories = {}
    for name, (method, after, threshold) in runs.items():
      with tqdm(
        total=config.steps, desc=f"text {sname:>14} {name[:30]:>30}", unit="step",
        disable=not progress,
      ) as bar:  # fmt: skip
        h = st.train(
          text, setting.optimizer, seeds, method.clip, method.wrap, after, chunk, bar.update
        )
      histories[name] = h
      rows.append(text_row(sname, name, threshold, h))
      r = rows[-1]
      print(
        f"  {sname}: {name}: validation {r['median']:.3f} bits/byte "
        f"({r['q25']:.3f}-{r['q75']:.3f}), {r['spikes']} spikes, clipped {r['clipped']:.1%}"
      )
    if not setting.muon and "no clipping" in histories:
      pre = histories["no clipping"].pre_clip_norm
      for w in windows:
        for p in PERCENTILES:
          c = jaxclip.suggest_threshold(rec.grad_norm[:w], p).max_norm
          recipe.append(
            {
              "setting": sname,
              "window": w,
              "percentile": p,
              "threshold": c,
              "clipped": float(np.mean(pre > c)),
              "clipped after window": float(np.mean(pre[:, max(windows) :] > c)),
            }
          )
  corpus = text.corpus
  return {
    "config": config._asdict(),
    "corpus": {
      "root": corpus.root,
      "python": platform.python_version(),
      "files": corpus.num_files,
      "validation files": corpus.num_validation_files,
      "train bytes": int(corpus.train.size),
      "validation bytes": int(corpus.validation.size),
      "files_sha256": corpus.files_sha256,
      "bytes_sha256": corpus.bytes_sha256,
    },
    "parameters": int(sum(a.size for a in jax.tree.leaves(text.init([0])))),
    "settings": {n: s.text for n, s in all_settings.items()},
    "record window": window,
    "windows": list(windows),
    "thresholds": thresholds,
    "rows": rows,
    "recipe": recipe,
    "seconds": time.perf_counter() - start,
  }


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


def plot_text(text: dict[str, Any], out: Path) -> None:
  """The text task: per setting, median validation bits/byte and interquartile bar per method."""
  rows = text["rows"]
  settings = list(text["settings"])
  names = list(dict.fromkeys(r["method"] for r in rows))
  fig = Figure(figsize=(3.3 * len(settings), 0.34 * len(names) + 1.8), layout="constrained")
  axes = fig.subplots(1, len(settings), sharey=True, squeeze=False)[0]
  colors = mpl.colormaps["tab20"].colors
  for ax, setting in zip(axes, settings, strict=True):
    mine = {r["method"]: r for r in rows if r["setting"] == setting}
    finite = [v for r in mine.values() for v in (r["q25"], r["q75"]) if np.isfinite(v)]
    lo, hi = (min(finite) - 0.05, max(finite) + 0.1) if finite else (0.0, 8.0)
    for y, name in enumerate(names):
      r = mine.get(name)
      if r is None:
        continue
      color = colors[y % 20]
      left, mid, right = (min(v, hi) for v in (r["q25"], r["median"], r["q75"]))
      ax.plot([left, right], [y, y], color=color, lw=3, alpha=0.5, solid_capstyle="butt")
      ax.plot([mid], [y], "o" if np.isfinite(r["median"]) else "x", color=color, ms=6)
      ax.text(
        0.99, y, f"{r['spikes']}", transform=ax.get_yaxis_transform(), va="center",
        ha="right", fontsize=7,
      )  # fmt: skip
    if "no clipping" in mine:
      ax.axvline(mine["no clipping"]["median"], color="gray", ls=":", lw=1)
    ax.set_xlim(lo, hi)
    ax.set_title(setting, fontsize=9)
    ax.set_xlabel("validation bits/byte", fontsize=8)
    ax.tick_params(labelsize=7)
  axes[0].set_yticks(range(len(names)), names, fontsize=7)
  axes[0].invert_yaxis()
  seeds = rows[0]["seeds"]
  fig.suptitle(
    f"Byte-level transformer on Python's standard library: median validation bits/byte over "
    f"{seeds} seeds, bar: interquartile range; number: loss spikes (all seeds); "
    "··· no clipping",
    fontsize=9,
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)


def text_table(rows: list[dict[str, Any]]) -> str:
  lines = [
    "| setting | method | threshold | median bits/byte | IQR | best–worst | spikes (seeds) "
    "| non-finite steps | clipped |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['setting']} | {r['method']} | {r['threshold']} | {r['median']:.3f} "
      f"| {r['q25']:.3f}–{r['q75']:.3f} | {r['best']:.3f}–{r['worst']:.3f} "
      f"| {r['spikes']} ({r['seeds with spikes']}) | {r['non-finite']} | {r['clipped']:.1%} |"
    )
  return "\n".join(lines)


def recipe_table(recipe: list[dict[str, Any]]) -> str:
  lines = [
    "| setting | window (steps) | percentile | threshold | clipped (all steps) "
    "| clipped (after the longest window) |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in recipe:
    lines.append(
      f"| {r['setting']} | {r['window']} | {r['percentile']} | {r['threshold']:.3g} "
      f"| {r['clipped']:.1%} | {r['clipped after window']:.1%} |"
    )
  return "\n".join(lines)


def text_section(text: dict[str, Any], figure_name: str) -> str:
  c, cfg, corpus = text["config"], text["config"], text["corpus"]
  settings = "\n".join(f"| {n} | {t} |" for n, t in text["settings"].items())
  th_rows = []
  for n, t in text["thresholds"].items():
    if "global_norm" in t:
      g = {int(p): v for p, v in t["global_norm"].items()}
      th_rows.append(
        f"| {n} | p50 {g[50]:.3g}, p90 {g[90]:.3g}, p99 {g[99]:.3g}; p90/√k "
        f"{t['per_tensor']:.3g} (k = {t['num_tensors']}); value ±{t['value']:.3g} |"
      )
    else:
      th_rows.append(
        f"| {n} | gradient p50 {t['gradient p50']}; per group p50 {t['per group p50']}; "
        f"update p50 {t['update p50']} |"
      )
  thresholds = "\n".join(th_rows)
  w = text["windows"]
  return f"""## Text task: a byte-level language model

![Median validation bits/byte per setting and method]({figure_name})

**Data.** The bytes of Python's own standard library: the sorted `*.py` files at the top of
`sysconfig.get_paths()["stdlib"]` (here `{corpus["root"]}`, Python {corpus["python"]},
{corpus["files"]} files); every tenth file of the sorted list ({corpus["validation files"]} files,
{corpus["validation bytes"]:,} bytes) is held out, the rest ({corpus["train bytes"]:,} bytes)
trains. SHA-256 of the file list (`name<TAB>size` lines): `{corpus["files_sha256"]}`; of the
bytes: `{corpus["bytes_sha256"]}`. Another Python version has other files and other numbers.

**Model.** A pre-LayerNorm causal transformer from flax linen layers (`nn.Embed`, `nn.Dense`,
`nn.LayerNorm`, `nn.dot_product_attention`): d_model {c["d_model"]}, layers {c["layers"]},
{c["heads"]} heads, MLP width {4 * c["d_model"]}, context {c["context"]} bytes, byte embedding
tied to the unembedding, {text["parameters"]:,} parameters. Each seed trains on
{cfg["batch"]} random windows per step for {cfg["steps"]} steps (seed `s` draws step `i`'s windows
from `fold_in(key(s + 10000), i)`), then is scored on {cfg["validation_windows"]} fixed windows
spread over the held-out files: **validation bits per byte** (next-byte cross-entropy / ln 2;
a model that learned nothing scores 8).

**Loss spikes.** A step spikes when its training loss is not finite or above
{st.SPIKE_FACTOR:g} times the median of the {st.SPIKE_WINDOW} steps before it; consecutive
spiking steps count as one spike. The table gives spikes summed over the seeds and, in
brackets, the number of seeds with at least one.

| setting | optimizer |
|---|---|
{settings}

**Thresholds.** As for the other tasks, from seed {RECORD_SEED} trained without clipping in
each setting, its first {text["record window"]} steps (`suggest_threshold` reads the
`record_norms` states of that run, stacked over the steps). For Muon the run also records the
global norm of the optimizer's update (for a clip after it) and of the gradient within each
group (`muon`: the hidden weight matrices; `adam`: embeddings, norms, biases).

| setting | fixed thresholds |
|---|---|
{thresholds}

### Results

Median, quartiles, best and worst are over seeds (`method="lower"`); "clipped" is the share
of steps on which the clip changed what it saw (for Muon's clip after the optimizer: the
update).

{text_table(text["rows"])}

### The recipe: recording window, percentile, warm-up

The threshold `suggest_threshold` gives after recording the first {w[0]}, {w[1]} or {w[2]}
steps of the unclipped run of seed {RECORD_SEED}, and the share of the steps of the
{text["rows"][0]["seeds"]} seeds trained without clipping (all {cfg["steps"]} steps; only those
after step {w[2]}) whose gradient norm is above it: about the share such a clip would act on.

{recipe_table(text["recipe"])}

The text task took {text["seconds"]:.0f} s of the study's wall time.
"""


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
  command: str,
  text: dict[str, Any] | None = None,
  task_seconds: dict[str, float] | None = None,
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
  figures = "\n\n".join(
    f"![{name}: median final loss per method]({figure_name(name)})" for name in all_tasks
  )
  timing = ""
  if task_seconds:
    timing = " Per task: " + ", ".join(f"{n} {v:.0f} s" for n, v in task_seconds.items()) + "."
  page = f"""# Clipping study

Which clip, and which threshold, on three small tasks and a byte-level language model,
{seeds} seeds per method. What it means for choosing a clip and a threshold is summarised in
[Which clip?](which_clip.md). Generated by `{command}`
(`examples/clipping_study.py` and `examples/_study_text.py`; the numbers below are from that
run).

{figures}

## The synthetic tasks

Every method trains the same {seeds} seeds (seed `s` initialises from `key(s)` and draws
batch `i` from `fold_in(key(s + 10000), i)`), all seeds at once (`jax.vmap` inside one
`jax.jit`). The final loss of a seed is the mean of its recorded loss over the last 10% of
steps (`inf` if any of them is not finite); a seed succeeds if it is below the target.

| task | model and data | optimizer | steps | recorded loss | success | nothing learned |
|---|---|---|---:|---|---|---:|
{settings}

### Thresholds

Each task first trains seed {RECORD_SEED} (no method trains it) for
{next((t.recorded_steps for t in thresholds.values()), 0)} steps without clipping and records the
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

### Results

"clipped" is the share of steps on which the method changed the gradient (a norm clip:
the pre-clip norm was above its threshold) or, for skip_on_spike, skipped the step.
Median and quartiles are over seeds (`method="lower"`: always one seed's value).

{markdown_table(rows)}

{text_section(text, figure_name("text")) if text else ""}
Wall time {wall:.0f} s on {platform.machine()} CPU ({os.cpu_count()} cores, shared), load
average (1, 5, 15 min) {load_start} at the start and {load_end} at the end; jax
{jax.__version__}, optax {optax.__version__}, flax {flax.__version__}.{timing}
"""
  path.write_text(page)


def figure_name(task: str) -> str:
  return f"clipping_study_{task}.png"


def draw(rows, all_tasks, text, out: Path, inputs: list, command: str) -> list[Path]:
  """One figure per task, each with its provenance record."""
  paths = []
  for name, task in all_tasks.items():
    paths.append(out / figure_name(name))
    plot([r for r in rows if r["task"] == name], {name: task}, paths[-1])
  if text is not None:
    paths.append(out / figure_name("text"))
    plot_text(text, paths[-1])
  for path in paths:
    write_record(path, inputs, command)
  return paths


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
  parser.add_argument(
    "--tasks", nargs="+", default=None, help="a subset of adding copy heavy-tail text"
  )
  parser.add_argument(
    "--out",
    type=Path,
    default=DOCS,
    help="folder for clipping_study.md, .json and the figures (default docs/)",
  )
  parser.add_argument("--tiny", action="store_true", help="a seconds-long run (smoke tests)")
  parser.add_argument(
    "--replot",
    type=Path,
    default=None,
    help="redraw the page and figures from a saved clipping_study.json",
  )
  args = parser.parse_args(argv)
  if args.seeds < 1:
    parser.error("--seeds must be at least 1")
  record_steps = min(args.record_steps, 20) if args.tiny else args.record_steps
  all_tasks = tasks(args.tiny)
  names = args.tasks or [*all_tasks, "text"]
  all_tasks = {n: all_tasks[n] for n in names if n != "text"}
  seeds = [args.seed + i for i in range(args.seeds)]
  inputs = [__file__, st.__file__, eg.__file__]
  if args.replot is not None:
    saved = json.loads(args.replot.read_text())
    all_tasks = {n: all_tasks[n] for n in saved["thresholds"]}
    thresholds = {
      n: Thresholds(**{**t, "global_norm": {int(p): v for p, v in t["global_norm"].items()}})
      for n, t in saved["thresholds"].items()
    }
    command = " ".join(
      ["python examples/clipping_study.py", *(sys.argv[1:] if argv is None else argv)]
    )
    text = saved.get("text")
    draw(saved["rows"], all_tasks, text, args.out, [*inputs, args.replot], command)
    write_page(
      args.out / "clipping_study.md",
      saved["rows"],
      all_tasks,
      thresholds,
      saved["seeds"],
      saved["wall"],
      saved["load_start"],
      saved["load_end"],
      saved["command"],
      text,
      saved.get("task_seconds"),
    )
    return saved["rows"]
  load_start = load_average()
  start = time.perf_counter()
  rows, thresholds, histories, task_seconds = [], {}, {}, {}
  for tname, task in all_tasks.items():
    task_start = time.perf_counter()
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
    task_seconds[tname] = time.perf_counter() - task_start
  text = None
  if "text" in names:
    print("\ntext: byte-level transformer on Python's standard library")
    text = run_text(args.tiny, seeds, record_steps)
    task_seconds["text"] = text["seconds"]
  wall = time.perf_counter() - start
  args.out.mkdir(parents=True, exist_ok=True)
  command = "python examples/clipping_study.py" + (" " + " ".join(argv) if argv else "")
  load_end = load_average()
  (args.out / "clipping_study.json").write_text(
    json.dumps(
      {
        "rows": rows,
        "seeds": len(seeds),
        "wall": wall,
        "task_seconds": task_seconds,
        "load_start": load_start,
        "load_end": load_end,
        "command": command,
        "thresholds": {n: t._asdict() for n, t in thresholds.items()},
        "text": text,
      },
      indent=1,
    )
  )
  paths = draw(
    rows, all_tasks, text, args.out, [*inputs, args.out / "clipping_study.json"], command
  )
  write_page(
    args.out / "clipping_study.md",
    rows,
    all_tasks,
    thresholds,
    len(seeds),
    wall,
    load_start,
    load_end,
    command,
    text,
    task_seconds,
  )
  print(f"\nwall time {wall:.0f} s; load average {load_start} -> {load_average()}")
  print(f"wrote {args.out / 'clipping_study.md'} and {', '.join(p.name for p in paths)}")
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
