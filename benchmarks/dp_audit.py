"""An empirical privacy audit of DP-SGD through jaxclip: canaries, one run, a lower bound on ε.

``python -m benchmarks.dp_audit`` trains a small linear regression on
synthetic data with DP-SGD through jaxclip's public API
(:func:`jaxclip.poisson_batch`, :func:`jaxclip.per_example_clipped_grad`,
:func:`jaxclip.dp_noise`, with :func:`jaxclip.calibrate_noise` choosing the
noise for a target ε and :func:`jaxclip.dp_epsilon` giving the claimed ε),
with canaries inserted, scores them as an attacker would, and turns the
scores into a lower bound on ε with ``jax_privacy.auditing``: Steinke, Nasr
and Jagielski's one-run audit (``CanaryScoreAuditor.epsilon_one_run``), at
95% confidence. It writes the table to ``benchmarks/results/dp_audit.md``.

An audit that cannot fail proves nothing, so the same audit runs on four
pipelines: the correct one, whose audited bound must stay at most the
claimed ε, and three broken ones it must flag (audited bound above the
claimed ε):

* **correct**: the noise seed and the sampling key are drawn from the
  operating system's entropy (:mod:`secrets`), σ as calibrated;
* **public seed**: the same, but the noise seed is a public constant (0,
  ``dp_noise``'s old default): the attacker regenerates the noise and
  subtracts it;
* **no noise**: σ = 0 while the calibrated σ's ε is claimed;
* **NaN example**: a hand-written textbook clip (``g * min(1, C / ||g||)``,
  summed), through which one example whose gradient is NaN makes the whole
  sum NaN exactly when it is in the batch.

**The canaries.** The model is ``pred = x @ w + s * c[slot]``: ``w`` is fit
to the data, ``c`` holds one coordinate per canary that no data example
touches (``s = 0`` for data). Canary ``j`` is the example ``(x = 0, slot =
j, s = 1, y = 1000)``: its gradient ``(c_j - 1000) e_j`` is clipped to ``-C
e_j``, a gradient canary pointing along its own coordinate (the strongest
white-box canary; Nasr et al. 2023), whose trained ``c_j`` is the score.
Each canary is put in the dataset with probability 1/2, independently,
from OS entropy; the others stay out. The first three pipelines train one
model with all of them (one run, ``--canaries`` canaries).

**The NaN example** cannot share a run with other canaries: a NaN anywhere
poisons every parameter, so one run tells only whether some canary was
drawn, not which. It gets one run per canary instead (the same pipeline on
a small dataset, every run in one ``jax.vmap``-ed program): run ``j`` holds
the NaN example with probability 1/2, and its score is whether its final
parameters are NaN. The same runs through ``per_example_clipped_grad``
(row ``NaN example, jaxclip's clip``) measure the library, whose clip gives
a non-finite example zero weight and counts it (``return_num_nonfinite=``):
its bound must stay at most the claimed ε, and the runs that drew the NaN
example must have counted it.

The audit's bound is a lower bound on the ε of the pipeline at the stated
confidence; it is not the ε (one-run audits of DP-SGD with Gaussian noise
are loose). The ``f-DP audit`` column is Mahloujifar et al.'s tighter
one-run bound under a Gaussian trade-off curve (``epsilon_one_run_fdp``),
for information: subsampled Gaussian mechanisms are not exactly Gaussian, so
the verdict uses Steinke et al.'s, which holds for any (ε, δ)-DP mechanism.

References:
  Steinke, Nasr, Jagielski, `Privacy Auditing with One (1) Training Run
  <https://arxiv.org/abs/2305.08846>`_, 2023.
  Mahloujifar, Melis, Chaudhuri, `Auditing f-Differential Privacy in One
  Run <https://arxiv.org/abs/2410.22235>`_, 2024.
  Nasr et al., `Tight Auditing of Differentially Private Machine Learning
  <https://arxiv.org/abs/2302.07956>`_, 2023.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import secrets
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_privacy import auditing

import benchmarks
import jaxclip

PUBLIC_SEED = 0  # dp_noise's old default seed: anyone can regenerate its noise
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


def audit(cfg: Config, in_scores: np.ndarray, out_scores: np.ndarray) -> dict:
  """The lower bounds on ε that ``jax_privacy.auditing`` draws from the canaries' scores."""
  auditor = auditing.CanaryScoreAuditor(in_scores, out_scores)
  return {
    "in": len(in_scores),
    "out": len(out_scores),
    "epsilon_lb": float(auditor.epsilon_one_run(cfg.significance, cfg.delta)),
    "epsilon_fdp": float(auditor.epsilon_one_run_fdp(cfg.significance, cfg.delta)),
    "auroc": float(auditor.attack_auroc()),
  }


def _split(scores: np.ndarray, included: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  scores = np.asarray(scores, np.float64)
  return scores[included], scores[~included]


def one_run_audits(cfg: Config, sigma: float, pipelines: tuple[str, ...]) -> dict[str, dict]:
  """One training run per pipeline with ``cfg.canaries`` gradient canaries, each in w.p. 1/2.

  The pipelines share the data and the canaries drawn (one compiled
  program, the noise multiplier and the seed its arguments); each run gets
  its own sampling key, and the correct one its own secret seed.
  """
  rng = np.random.default_rng(secrets.randbits(128))
  data = _data(cfg.examples, cfg.features, rng)
  included = rng.random(cfg.canaries) < 0.5
  data = _concat(data, _canary_rows(np.flatnonzero(included), cfg.features))
  n = len(data["y"])
  program = jax.jit(
    lambda d, noise, seed, key: train(cfg, d, noise, seed, key, canary_slots=cfg.canaries)
  )
  rows = {}
  for pipeline in pipelines:
    start = time.perf_counter()
    seed = PUBLIC_SEED if pipeline == "public seed" else secret_seed()
    noise = 0.0 if pipeline == "no noise" else sigma / UNDER_NOISED.get(pipeline, 1)
    params, overflow, _ = program(data, jnp.float32(noise), jnp.uint32(seed), secret_key())
    scores = np.asarray(params["c"])
    if pipeline == "public seed":  # the attacker subtracts the noise it regenerates
      scores = scores - np.asarray(replay_noise(cfg, n, sigma, PUBLIC_SEED, cfg.canaries)["c"])
    losses = jax.vmap(example_loss, (None, 0, 0, 0, 0))(
      params, *(jnp.asarray(data[k][: cfg.examples]) for k in ("x", "slot", "s", "y"))
    )
    rows[pipeline] = {
      **audit(cfg, *_split(scores, included)),
      "overflow": int(overflow),
      "data_loss": float(jnp.mean(losses)),
      "seconds": time.perf_counter() - start,
    }
  return rows


def nan_runs_audit(cfg: Config, sigma: float, *, clip: str) -> dict:
  """One run per canary (vmapped): run ``j`` holds a NaN example with probability 1/2.

  ``clip="textbook"`` clips by hand (:func:`textbook_clipped_grad`, which
  leaks); ``clip="jaxclip"`` through ``per_example_clipped_grad``
  (:func:`jaxclip_clipped_grad`). ``counted``: the runs that counted a
  non-finite example; ``drawn``: those that held it in some batch.
  """
  rng = np.random.default_rng(secrets.randbits(128))
  data = _concat(
    _data(cfg.run_examples, cfg.features, rng),
    _canary_rows(np.zeros(1), cfg.features, x_value=float("nan")),
  )
  canary_row = cfg.run_examples
  included = rng.random(cfg.canaries) < 0.5
  grad_fn = (
    textbook_clipped_grad(example_loss, cfg.clip)
    if clip == "textbook"
    else jaxclip_clipped_grad(cfg.clip)
  )
  seeds = jnp.asarray(np.frombuffer(secrets.token_bytes(4 * cfg.canaries), np.uint32))
  keys = jax.random.split(secret_key(), cfg.canaries)

  def one(inside, seed, key):
    absent = jnp.where(inside, -1, canary_row)
    params, overflow, count = train(
      cfg, data, sigma, seed, key, canary_slots=1, grad_fn=grad_fn, absent=absent
    )
    poisoned = ~jnp.all(jnp.isfinite(jnp.concatenate([params["w"], params["c"]])))
    drawn = jnp.any(_drawn(cfg, len(data["y"]), key, canary_row)) & inside
    return poisoned.astype(jnp.float32), overflow, count > 0, drawn

  scores, overflow, counted, drawn = jax.jit(jax.vmap(one))(jnp.asarray(included), seeds, keys)
  return {
    **audit(cfg, *_split(scores, included)),
    "overflow": int(jnp.sum(overflow)),
    "counted": int(jnp.sum(counted)),
    "drawn": int(jnp.sum(drawn)),
    "counted_when_drawn": bool(jnp.all(counted == drawn)),
  }


def _drawn(cfg: Config, n: int, sampling_key: jax.Array, row: int) -> jax.Array:
  """Whether each step's Poisson batch (as :func:`train` draws them) holds ``row``."""
  rows = _max_rows(cfg, n)
  keys = jax.random.split(sampling_key, cfg.steps)
  batch = jax.vmap(lambda k: jaxclip.poisson_batch(k, n, cfg.sampling_rate, rows))(keys)
  return jnp.any(batch.mask & (batch.indices == row), axis=1)


UNDER_NOISED = {"σ / 2": 2, "σ / 4": 4, "σ / 8": 8}
PIPELINES: dict[str, str] = {
  "correct": "secret seed and sampling key (OS entropy), the calibrated σ",
  "public seed": "noise seed 0 (public): the attacker regenerates the noise and subtracts it",
  "no noise": "σ = 0 while the calibrated σ's ε is claimed",
  "NaN example": "a hand-written clip without a guard; one run per canary, NaN or not",
  "NaN example, jaxclip's clip": "the same runs through per_example_clipped_grad",
  **{
    name: f"too little noise: σ / {k} while σ's ε is claimed (the audit's resolution)"
    for name, k in UNDER_NOISED.items()
  },
}
BROKEN = ("public seed", "no noise", "NaN example")


def run(cfg: Config, pipelines: tuple[str, ...] = tuple(PIPELINES)) -> dict:
  """Calibrates σ, runs the audit of each pipeline; returns the claimed ε and a row each."""
  q = cfg.sampling_rate
  sigma = jaxclip.calibrate_noise(cfg.target_epsilon, cfg.delta, q, cfg.steps)
  claimed = jaxclip.dp_epsilon(sigma, q, cfg.steps, cfg.delta)
  one_run = tuple(p for p in pipelines if not p.startswith("NaN example"))
  rows = one_run_audits(cfg, sigma, one_run) if one_run else {}
  for pipeline in pipelines:
    if pipeline.startswith("NaN example"):
      start = time.perf_counter()
      clip = "textbook" if pipeline == "NaN example" else "jaxclip"
      rows[pipeline] = {
        **nan_runs_audit(cfg, sigma, clip=clip),
        "seconds": time.perf_counter() - start,
      }
  rows = {p: rows[p] for p in pipelines}
  for pipeline, r in rows.items():
    r["flagged"] = r["epsilon_lb"] > claimed
    if pipeline in UNDER_NOISED:
      r["true_epsilon"] = jaxclip.dp_epsilon(
        sigma / UNDER_NOISED[pipeline], q, cfg.steps, cfg.delta
      )
    elif pipeline in BROKEN:
      r["true_epsilon"] = math.inf  # the noise is known or absent, or one example leaks a bit
    else:  # correct, and jaxclip's clip, whose NaN example contributes nothing
      r["true_epsilon"] = claimed
    print(pipeline, r, flush=True)
  half = cfg.canaries // 2
  ceiling = auditing.CanaryScoreAuditor(np.ones(half), np.zeros(cfg.canaries - half))
  return {
    "sigma": sigma,
    "claimed": claimed,
    "rows": rows,
    "ceiling": float(ceiling.epsilon_one_run(cfg.significance, cfg.delta)),
  }


HEADER = [
  "pipeline",
  "canaries in / out",
  "claimed ε",
  "ε of what ran",
  "audited ε ≥ (one run, 95%)",
  "flagged",
  "f-DP audit",
  "AUROC",
  "s",
]


def _eps(value: float) -> str:
  return "∞" if math.isinf(value) else f"{value:.3f}"


def markdown(cfg: Config, result: dict, meta: dict) -> str:
  """The audit's report: its parameters, the table, the machine."""
  claimed = result["claimed"]
  lines = [
    "# Empirical privacy audit of DP-SGD through jaxclip",
    "",
    "`python -m benchmarks.dp_audit` (`benchmarks/dp_audit.py`): a linear regression on "
    f"{cfg.examples:,} synthetic rows of {cfg.features} features plus up to "
    f"{cfg.canaries:,} gradient canaries (each in with probability 1/2, from OS entropy), "
    f"DP-SGD through jaxclip: Poisson rate q = {cfg.sampling_rate}, {cfg.steps} steps, "
    f"clip C = {cfg.clip}, σ = {result['sigma']:.4f} from `calibrate_noise("
    f"{cfg.target_epsilon}, {cfg.delta:g}, q, {cfg.steps})`, claimed ε = "
    f"`dp_epsilon(σ, q, {cfg.steps}, {cfg.delta:g})` = {claimed:.4f} at δ = {cfg.delta:g}. "
    "Each canary's trained coordinate is its score; the NaN rows run one model of "
    f"{cfg.run_examples} rows per canary, scored by whether it ends NaN. The bound is "
    "`jax_privacy.auditing.CanaryScoreAuditor.epsilon_one_run` (Steinke et al. 2023) at "
    f"significance {cfg.significance}; a pipeline is flagged when it exceeds the claimed ε. "
    f"With {cfg.canaries:,} canaries, half in, a perfect attack would certify at most "
    f"ε ≥ {result['ceiling']:.2f}: the audit's ceiling. `ε of what ran`: `dp_epsilon` of "
    "the noise the pipeline added (∞: the noise is known or absent, or one example "
    "releases a bit; jaxclip's clip gives a NaN example zero weight, so the claimed ε, "
    "which the audit tests). `f-DP audit`: "
    "`epsilon_one_run_fdp` (Mahloujifar et al. 2024, under a Gaussian trade-off curve), "
    "for information. `s`: seconds of the row (compiles included).",
    "",
    "| " + " | ".join(HEADER) + " |",
    "|" + "---|" * len(HEADER),
  ]
  for name, r in result["rows"].items():
    lines.append(
      f"| {name} | {r['in']} / {r['out']} | {claimed:.3f} | {_eps(r['true_epsilon'])} | "
      f"{r['epsilon_lb']:.3f} | {'yes' if r['flagged'] else 'no'} | "
      f"{r['epsilon_fdp']:.3f} | {r['auroc']:.3f} | {r['seconds']:.1f} |"
    )
  lines += ["", "The pipelines:", ""]
  lines += [f"- **{name}**: {PIPELINES[name]}." for name in result["rows"]]
  for name, r in result["rows"].items():
    if "counted" in r and name != "NaN example":
      lines.append(
        f"- {name}: {r['drawn']} of the {r['in']} runs that held the NaN example drew it into "
        f"a batch; {r['counted']} runs counted a non-finite example (`num_nonfinite`)."
      )
  lines += ["", *(f"- {k}: {v}" for k, v in meta.items())]
  return "\n".join(lines) + "\n"


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _meta(load0: float, seconds: float) -> dict:
  import jax_privacy

  return {
    "machine": f"{_cpu_name()}, {os.cpu_count()} cores, {jax.devices()[0].platform}",
    "versions": f"jax {jax.__version__}, jax_privacy {jax_privacy.__version__}, "
    f"python {platform.python_version()}",
    "load average": f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
    "wall time": f"{seconds:.0f} s",
  }


def main(argv: list[str] | None = None) -> str:
  p = argparse.ArgumentParser(
    prog="python -m benchmarks.dp_audit", description=__doc__.split("\n", 1)[0]
  )
  p.add_argument("--quick", action="store_true", help="a smoke test: few canaries and steps")
  p.add_argument("--canaries", type=int, default=None, help="canaries (default 1000)")
  p.add_argument(
    "--only", nargs="+", default=None, choices=list(PIPELINES), help="audit only these pipelines"
  )
  p.add_argument("--out", default=os.path.join(benchmarks.RESULTS, "dp_audit.md"))
  args = p.parse_args(argv)
  cfg = QUICK if args.quick else Config()
  if args.canaries:
    cfg = dataclasses.replace(cfg, canaries=args.canaries)
  load0, start = os.getloadavg()[0], time.perf_counter()
  result = run(cfg, tuple(args.only or PIPELINES))
  text = markdown(cfg, result, _meta(load0, time.perf_counter() - start))
  with open(args.out, "w") as f:
    f.write(text)
  print(text)
  return text


if __name__ == "__main__":
  main()
