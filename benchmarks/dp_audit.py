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

import jax
import jax.numpy as jnp
import numpy as np
from jax_privacy import auditing

import benchmarks
import jaxclip
from benchmarks import _dpsgd

PUBLIC_SEED = 0  # dp_noise's old default seed: anyone can regenerate its noise


def audit(cfg: _dpsgd.Config, in_scores: np.ndarray, out_scores: np.ndarray) -> dict:
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


def one_run_audits(cfg: _dpsgd.Config, sigma: float, pipelines: tuple[str, ...]) -> dict[str, dict]:
  """One training run per pipeline with ``cfg.canaries`` gradient canaries, each in w.p. 1/2.

  The pipelines share the data and the canaries drawn (one compiled
  program, the noise multiplier and the seed its arguments); each run gets
  its own sampling key, and the correct one its own secret seed.
  """
  rng = np.random.default_rng(secrets.randbits(128))
  data = _dpsgd._data(cfg.examples, cfg.features, rng)
  included = rng.random(cfg.canaries) < 0.5
  data = _dpsgd._concat(data, _dpsgd._canary_rows(np.flatnonzero(included), cfg.features))
  n = len(data["y"])
  program = jax.jit(
    lambda d, noise, seed, key: _dpsgd.train(cfg, d, noise, seed, key, canary_slots=cfg.canaries)
  )
  rows = {}
  for pipeline in pipelines:
    start = time.perf_counter()
    seed = PUBLIC_SEED if pipeline == "public seed" else _dpsgd.secret_seed()
    noise = 0.0 if pipeline == "no noise" else sigma / UNDER_NOISED.get(pipeline, 1)
    params, overflow, _ = program(data, jnp.float32(noise), jnp.uint32(seed), _dpsgd.secret_key())
    scores = np.asarray(params["c"])
    if pipeline == "public seed":  # the attacker subtracts the noise it regenerates
      scores = scores - np.asarray(
        _dpsgd.replay_noise(cfg, n, sigma, PUBLIC_SEED, cfg.canaries)["c"]
      )
    losses = jax.vmap(_dpsgd.example_loss, (None, 0, 0, 0, 0))(
      params, *(jnp.asarray(data[k][: cfg.examples]) for k in ("x", "slot", "s", "y"))
    )
    rows[pipeline] = {
      **audit(cfg, *_split(scores, included)),
      "overflow": int(overflow),
      "data_loss": float(jnp.mean(losses)),
      "seconds": time.perf_counter() - start,
    }
  return rows


def nan_runs_audit(cfg: _dpsgd.Config, sigma: float, *, clip: str) -> dict:
  """One run per canary (vmapped): run ``j`` holds a NaN example with probability 1/2.

  ``clip="textbook"`` clips by hand (:func:`_dpsgd.textbook_clipped_grad`, which
  leaks); ``clip="jaxclip"`` through ``per_example_clipped_grad``
  (:func:`_dpsgd.jaxclip_clipped_grad`). ``counted``: the runs that counted a
  non-finite example; ``drawn``: those that held it in some batch.
  """
  rng = np.random.default_rng(secrets.randbits(128))
  data = _dpsgd._concat(
    _dpsgd._data(cfg.run_examples, cfg.features, rng),
    _dpsgd._canary_rows(np.zeros(1), cfg.features, x_value=float("nan")),
  )
  canary_row = cfg.run_examples
  included = rng.random(cfg.canaries) < 0.5
  grad_fn = (
    _dpsgd.textbook_clipped_grad(_dpsgd.example_loss, cfg.clip)
    if clip == "textbook"
    else _dpsgd.jaxclip_clipped_grad(cfg.clip)
  )
  seeds = jnp.asarray(np.frombuffer(secrets.token_bytes(4 * cfg.canaries), np.uint32))
  keys = jax.random.split(_dpsgd.secret_key(), cfg.canaries)

  def one(inside, seed, key):
    absent = jnp.where(inside, -1, canary_row)
    params, overflow, count = _dpsgd.train(
      cfg, data, sigma, seed, key, canary_slots=1, grad_fn=grad_fn, absent=absent
    )
    poisoned = ~jnp.all(jnp.isfinite(jnp.concatenate([params["w"], params["c"]])))
    drawn = jnp.any(_dpsgd._drawn(cfg, len(data["y"]), key, canary_row)) & inside
    return poisoned.astype(jnp.float32), overflow, count > 0, drawn

  scores, overflow, counted, drawn = jax.jit(jax.vmap(one))(jnp.asarray(included), seeds, keys)
  return {
    **audit(cfg, *_split(scores, included)),
    "overflow": int(jnp.sum(overflow)),
    "counted": int(jnp.sum(counted)),
    "drawn": int(jnp.sum(drawn)),
    "counted_when_drawn": bool(jnp.all(counted == drawn)),
  }


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


def run(cfg: _dpsgd.Config, pipelines: tuple[str, ...] = tuple(PIPELINES)) -> dict:
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


def markdown(cfg: _dpsgd.Config, result: dict, meta: dict) -> str:
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
  cfg = _dpsgd.QUICK if args.quick else _dpsgd.Config()
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
