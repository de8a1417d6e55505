"""The clipping study's text task: a byte-level language model on Python's standard library.

Every machine with Python has the same text offline: the source of its standard library. The
corpus is the sorted list of the ``*.py`` files at the top of ``sysconfig.get_paths()["stdlib"]``
(no subfolders); every tenth file (the 10th, 20th, ... in sorted order) is held out for
validation. The study's record keeps the SHA-256 of the file list (names and sizes) and of the
bytes, so two runs on different Pythons are told apart.

The model is a small pre-LayerNorm causal transformer built from flax linen layers (``nn.Embed``,
``nn.Dense``, ``nn.LayerNorm``, ``nn.dot_product_attention``), its unembedding tied to the byte
embedding. The loss is the mean next-byte cross-entropy in nats; the study reports bits per byte
(nats / ln 2) on fixed windows of the held-out files.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 256
HELD_OUT_EVERY = 10  # files 9, 19, 29, ... (0-based) of the sorted list are held out


# --- the corpus ------------------------------------------------------------------


class Corpus(NamedTuple):
  """The training and held-out bytes, and what identifies them."""

  train: np.ndarray  # uint8, the training files concatenated in sorted order
  validation: np.ndarray  # uint8, the held-out files concatenated
  num_files: int
  num_validation_files: int
  files_sha256: str  # of "name<TAB>size" lines of the sorted file list
  bytes_sha256: str  # of the training bytes, then the held-out bytes
  root: str


def corpus_files(root: Path = STDLIB) -> list[Path]:
  """The sorted ``*.py`` files at the top of the standard library folder."""
  files = sorted(p for p in root.glob("*.py") if p.is_file())
  if len(files) < 2 * HELD_OUT_EVERY:
    raise FileNotFoundError(
      f"the text task needs Python's standard-library source, but {root} holds "
      f"{len(files)} *.py files (at least {2 * HELD_OUT_EVERY} are needed)."
    )
  return files


def load_corpus(root: Path = STDLIB, max_files: int | None = None) -> Corpus:
  """Reads the corpus; ``max_files`` keeps only the first files of the sorted list (tests)."""
  files = corpus_files(root)[:max_files]
  held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
  kept = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
  listing = "".join(f"{f.name}\t{f.stat().st_size}\n" for f in files).encode()
  train = b"".join(f.read_bytes() for f in kept)
  validation = b"".join(f.read_bytes() for f in held)
  return Corpus(
    train=np.frombuffer(train, np.uint8),
    validation=np.frombuffer(validation, np.uint8),
    num_files=len(files),
    num_validation_files=len(held),
    files_sha256=hashlib.sha256(listing).hexdigest(),
    bytes_sha256=hashlib.sha256(train + validation).hexdigest(),
    root=str(root),
  )


def window_starts(key: jax.Array, size: int, batch: int, context: int) -> jax.Array:
  """``batch`` uniform random starts of windows of ``context + 1`` bytes in ``size`` bytes."""
  return jax.random.randint(key, (batch,), 0, size - context - 1)


def windows(data: jax.Array, starts: jax.Array, context: int) -> jax.Array:
  """The windows ``data[s : s + context + 1]`` for each start, as int32 ``(..., context + 1)``."""
  return data[starts[..., None] + jnp.arange(context + 1)].astype(jnp.int32)


def validation_windows(validation: np.ndarray, context: int, count: int) -> np.ndarray:
  """``count`` windows of ``context + 1`` bytes spread evenly over the held-out bytes."""
  starts = np.linspace(0, validation.size - context - 1, count).astype(np.int64)
  return validation[starts[:, None] + np.arange(context + 1)].astype(np.int32)


# --- the model -------------------------------------------------------------------


class Block(nn.Module):
  """Pre-LayerNorm block: causal self-attention, then a GELU MLP of width 4 * d."""

  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    n, t, d = x.shape
    qkv = nn.Dense(3 * d, name="qkv")(nn.LayerNorm(name="ln1")(x))
    q, k, v = (a.reshape(n, t, self.heads, d // self.heads) for a in jnp.split(qkv, 3, -1))
    mask = nn.make_causal_mask(jnp.ones((n, t), bool))
    attended = nn.dot_product_attention(q, k, v, mask=mask).reshape(n, t, d)
    x = x + nn.Dense(d, name="out")(attended)
    h = nn.gelu(nn.Dense(4 * d, name="up")(nn.LayerNorm(name="ln2")(x)))
    return x + nn.Dense(d, name="down")(h)


class ByteTransformer(nn.Module):
  """Byte-level causal transformer; the logits reuse the byte embedding (tied weights)."""

  d_model: int
  layers: int
  heads: int
  context: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embed = nn.Embed(VOCAB, self.d_model, name="embed")
    pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.d_model), jnp.float32)
    x = embed(tokens) + pos[: tokens.shape[1]]
    for i in range(self.layers):
      x = Block(self.heads, name=f"block{i}")(x)
    return embed.attend(nn.LayerNorm(name="ln_f")(x))


def nll(model: ByteTransformer, params: Any, sequences: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of ``(batch, context + 1)`` byte windows."""
  logits = model.apply({"params": params}, sequences[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, sequences[:, 1:]).mean()


def bits_per_byte(nats: jax.Array | float) -> jax.Array | float:
  return nats / math.log(2)


# --- which parameters Muon orthogonalises ----------------------------------------


def muon_labels(params: Any) -> Any:
  """``"muon"`` for the hidden layers' weight matrices, ``"adam"`` for embeddings, norms, biases.

  Muon orthogonalises a 2-D weight's update; the byte embedding (also the unembedding, tied)
  and the position table are lookups, not linear maps between hidden spaces, and go to Adam
  with the 1-D LayerNorm scales and biases (the split of Jordan et al.'s Muon).
  """

  def label(path, leaf):
    names = [getattr(k, "key", None) for k in path]
    return "muon" if leaf.ndim == 2 and names[-1] == "kernel" else "adam"

  return jax.tree_util.tree_map_with_path(label, params)


# --- settings ----------------------------------------------------------------------


class TextConfig(NamedTuple):
  """The model, the data and the schedule of the text task."""

  d_model: int = 64
  layers: int = 2
  heads: int = 4
  context: int = 64
  batch: int = 4  # windows per seed and step
  steps: int = 1000
  warmup: int = 100  # steps of linear warm-up, where a setting has one
  validation_windows: int = 512
  stable_lr: float = 3e-3
  high_lr: float = 2e-2
  muon_lr: float = 0.02
  max_files: int | None = None  # None: every file of the sorted list


TINY = TextConfig(
  d_model=16, layers=1, heads=2, context=16, batch=2, steps=40, warmup=8, validation_windows=16,
  max_files=20,
)  # fmt: skip


class Setting(NamedTuple):
  """An optimizer of the text task and how it is described."""

  name: str
  optimizer: optax.GradientTransformation
  text: str
  muon: bool


def schedule(peak: float, config: TextConfig, warmup: bool) -> optax.Schedule:
  """Cosine decay to a tenth of ``peak`` at the last step, after a linear warm-up if asked."""
  if warmup:
    return optax.warmup_cosine_decay_schedule(0.0, peak, config.warmup, config.steps, peak / 10)
  return optax.cosine_decay_schedule(peak, config.steps, alpha=0.1)


def adamw(peak: float, config: TextConfig, warmup: bool) -> optax.GradientTransformation:
  return optax.adamw(schedule(peak, config, warmup), b1=0.9, b2=0.95, weight_decay=0.1)


def muon(config: TextConfig, warmup: bool = False) -> optax.GradientTransformation:
  """Muon on the hidden weight matrices, AdamW (the high learning rate) on the rest.

  The groups are :func:`muon_labels`'s, joined by ``optax.multi_transform``; every leaf of the
  ``"muon"`` group is 2-D, so ``optax.contrib.muon`` orthogonalises all of them.
  """
  return optax.multi_transform(
    {
      "muon": optax.contrib.muon(schedule(config.muon_lr, config, warmup), beta=0.95),
      "adam": adamw(config.high_lr, config, warmup),
    },
    muon_labels,
  )


def settings(config: TextConfig) -> dict[str, Setting]:
  """AdamW at a stable and a high peak learning rate, each with and without warm-up; Muon."""
  out = {}
  for lr in (config.stable_lr, config.high_lr):
    for warm in (False, True):
      name = f"AdamW {lr:g}" + (", warm-up" if warm else "")
      text = (
        f"AdamW peak lr {lr:g} (b2 0.95, weight decay 0.1), "
        + (f"{config.warmup}-step linear warm-up, then " if warm else "no warm-up, ")
        + "cosine decay to lr/10"
      )
      out[name] = Setting(name, adamw(lr, config, warm), text, muon=False)
  name = f"Muon {config.muon_lr:g}"
  text = (
    f"optax.contrib.muon peak lr {config.muon_lr:g} on the hidden weight matrices, AdamW "
    f"{config.high_lr:g} on embeddings, norms and biases (multi_transform); no warm-up, "
    "cosine decay"
  )
  out[name] = Setting(name, muon(config), text, muon=True)
  return out


# --- training ----------------------------------------------------------------------


class TextHistory(NamedTuple):
  """Per-step records ``(seeds, steps)`` and the final validation bits/byte ``(seeds,)``."""

  loss: np.ndarray  # training loss (nats/byte)
  pre_clip_norm: np.ndarray  # global norm of what the clip saw (the gradient, or the update)
  post_clip_norm: np.ndarray  # global norm of what the clip passed on (0 if skipped)
  clipped: np.ndarray  # bool: did the clip change (or skip) it?
  validation_bpb: np.ndarray
  seconds: float


class Text:
  """The text task's data, model and jitted pieces, shared by every run."""

  def __init__(self, config: TextConfig, corpus: Corpus | None = None):
    self.config = config
    self.corpus = corpus if corpus is not None else load_corpus(max_files=config.max_files)
    self.model = ByteTransformer(config.d_model, config.layers, config.heads, config.context)
    self.train = jnp.asarray(self.corpus.train)
    self.validation = jnp.asarray(
      validation_windows(self.corpus.validation, config.context, config.validation_windows)
    )

  def init(self, seeds: list[int]) -> Any:
    """Each seed's parameters, stacked: seed ``s`` initialises from ``key(s)``."""
    tokens = jnp.zeros((1, self.config.context), jnp.int32)
    init = jax.vmap(lambda s: self.model.init(jax.random.key(s), tokens)["params"])
    return jax.jit(init)(jnp.asarray(seeds))

  def starts(self, seeds: list[int], first: int, steps: int) -> jax.Array:
    """Seed ``s`` draws step ``i``'s windows from ``fold_in(key(s + 10_000), i)``.

    The same for every method; shape ``(seeds, steps, batch)``.
    """
    return _starts(
      jnp.asarray(seeds), jnp.asarray(first), steps, self.train.size, self.config.batch,
      self.config.context,
    )  # fmt: skip

  def loss(self, params: Any, starts: jax.Array) -> jax.Array:
    return nll(self.model, params, windows(self.train, starts, self.config.context))

  def validation_bpb(self, params: Any) -> np.ndarray:
    """Bits per byte of each seed's ``params`` on the held-out windows."""
    return np.asarray(_validate(self.model, params, self.validation)) / math.log(2)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _starts(seeds, first, steps, size, batch, context):
  def one(s, i):
    key = jax.random.fold_in(jax.random.key(s + 10_000), i)
    return window_starts(key, size, batch, context)

  steps_ = first + jnp.arange(steps)
  return jax.lax.map(lambda s: jax.lax.map(lambda i: one(s, i), steps_), seeds)


@functools.partial(jax.jit, static_argnums=0)
def _validate(model, params, sequences):
  return jax.vmap(lambda p: nll(model, p, sequences))(params)


def train(
  text: Text,
  optimizer: optax.GradientTransformation,
  seeds: list[int],
  clip: optax.GradientTransformation | None = None,
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None,
  after: bool = False,
  chunk: int = 100,
  progress: Callable[[int], Any] | None = None,
) -> TextHistory:
  """Trains every seed at once (``jax.vmap`` in one ``jax.jit``, ``lax.scan`` over steps).

  ``clip`` goes before the optimizer (``optax.chain(clip, optimizer)``: it clips the gradient)
  or, with ``after=True``, after it (``optax.chain(optimizer, clip)``: it clips the update);
  ``wrap(optimizer)`` wraps it (a skip; it must keep ``spike_step_skipped`` in its state).
  """
  tx = wrap(optimizer) if wrap is not None else optimizer
  clip = clip if clip is not None else optax.identity()
  norm = jaxclip.ops.global_norm

  def step(carry, starts):
    params, clip_state, tx_state = carry
    loss, grads = jax.value_and_grad(text.loss)(params, starts)
    if wrap is not None:
      updates, tx_state = tx.update(grads, tx_state, params, loss=loss)
      changed = optax.tree.get(tx_state, "spike_step_skipped")
      seen, post = norm(grads), jnp.where(changed, 0.0, norm(grads))
    else:
      before = grads
      if after:
        before, tx_state = tx.update(grads, tx_state, params)
      clipped, clip_state = clip.update(before, clip_state, params)
      changed = jax.tree.reduce(
        jnp.logical_or,
        jax.tree.map(lambda a, b: ~jnp.array_equal(a, b, equal_nan=True), before, clipped),
      )
      updates = clipped
      if not after:
        updates, tx_state = tx.update(clipped, tx_state, params)
      seen, post = norm(before), norm(clipped)
    params = optax.apply_updates(params, updates)
    return (params, clip_state, tx_state), (loss, seen, post, changed)

  run_chunk = jax.jit(jax.vmap(lambda carry, data: jax.lax.scan(step, carry, data)))
  params = text.init(seeds)
  carry = jax.jit(jax.vmap(lambda p: (p, clip.init(p), tx.init(p))))(params)
  steps = text.config.steps
  records = []
  start = time.perf_counter()
  for first in range(0, steps, chunk):
    n = min(chunk, steps - first)
    carry, record = run_chunk(carry, text.starts(seeds, first, n))
    records.append(jax.device_get(record))
    if progress is not None:
      progress(n)
  bpb = text.validation_bpb(carry[0])
  seconds = time.perf_counter() - start
  loss, pre, post, changed = (np.concatenate(r, axis=1) for r in zip(*records, strict=True))
  return TextHistory(loss, pre, post, changed, bpb, seconds)


class Recorded(NamedTuple):
  """Per-step norms of one unclipped run (one seed), what the thresholds are taken from."""

  grad_norm: np.ndarray  # global norm of the gradient
  grad_max: np.ndarray  # largest |entry| of the gradient
  update_norm: np.ndarray  # global norm of the optimizer's update
  group_norm: dict[str, np.ndarray]  # global norm of the gradient within each Muon group
  num_tensors: int
  states: Any  # the record_norms states, stacked over the steps (suggest_threshold reads them)


def record(text: Text, optimizer: optax.GradientTransformation, seed: int, steps: int) -> Recorded:
  """Trains ``seed`` for ``steps`` steps without clipping and records its norms.

  The gradient's norms come from :func:`jaxclip.record_norms` in front of the optimizer (its
  state, stacked over the steps, is what :func:`jaxclip.suggest_threshold` reads), the
  update's from :func:`jaxclip.ops.global_norm` behind it.
  """
  tx = optax.chain(jaxclip.record_norms(), optimizer)
  params = jax.tree.map(lambda a: a[0], text.init([seed]))
  data = text.starts([seed], 0, steps)[0]

  @jax.jit
  def go(params, data):
    def step(carry, starts):
      params, state = carry
      grads = jax.grad(text.loss)(params, starts)
      updates, state = tx.update(grads, state, params)
      biggest = jax.tree.reduce(jnp.maximum, jax.tree.map(lambda g: jnp.max(jnp.abs(g)), grads))
      recorded = optax.tree.get(state, "leaf_norms"), optax.tree.get(state, "global_norm")
      out = (jaxclip.RecordNormsState(*recorded), biggest, jaxclip.ops.global_norm(updates))
      return (optax.apply_updates(params, updates), state), out

    return jax.lax.scan(step, (params, tx.init(params)), data)[1]

  states, biggest, update_norm = jax.device_get(go(params, data))
  labels = muon_labels(params)
  groups = {}
  for group in ("muon", "adam"):
    squares = [
      np.asarray(n, np.float64) ** 2
      for n, g in zip(jax.tree.leaves(states.leaf_norms), jax.tree.leaves(labels), strict=True)
      if g == group
    ]
    groups[group] = np.sqrt(np.sum(squares, axis=0))
  return Recorded(
    grad_norm=np.asarray(states.global_norm),
    grad_max=np.asarray(biggest),
    update_norm=np.asarray(update_norm),
    group_norm=groups,
    num_tensors=len(jax.tree.leaves(params)),
    states=states,
  )


# --- measures ----------------------------------------------------------------------

SPIKE_WINDOW = 50  # steps of history a loss is compared with
SPIKE_FACTOR = 1.25  # a loss this many times the window's median is a spike


def spikes(loss: np.ndarray) -> np.ndarray:
  """Loss spikes per seed of a ``(seeds, steps)`` training loss.

  A step spikes if its loss is not finite or above ``SPIKE_FACTOR`` times the median loss of the
  ``SPIKE_WINDOW`` steps before it; consecutive spiking steps count as one spike.
  """
  seeds, steps = loss.shape
  above = np.zeros((seeds, steps), bool)
  for t in range(SPIKE_WINDOW, steps):
    reference = np.nanmedian(loss[:, t - SPIKE_WINDOW : t], axis=1)
    above[:, t] = ~np.isfinite(loss[:, t]) | (loss[:, t] > SPIKE_FACTOR * reference)
  starts = above & ~np.concatenate([np.zeros((seeds, 1), bool), above[:, :-1]], axis=1)
  return starts.sum(axis=1)
