"""jaxclip beside its peers, one thread each: ``python -m benchmarks.ghost --peers``.

The GPT of :mod:`benchmarks.ghost` (tied head, 0.83M params), one step's
clipped sum of per-example gradients, for each ``(B, T)``:

* JAX: the non-private ``jax.grad`` of the summed per-example losses (the
  JAX baseline); ``jaxclip.per_example_clipped_grad`` with ``method="vmap"``,
  ``"ghost"`` and, where this jaxclip has it, ``"auto"``; jax_privacy's
  ``clipping.clipped_grad`` (per-example gradients by ``vmap``);
* torch: the same model in torch (:mod:`benchmarks._torch_gpt`, loaded with
  the same weights), its non-private ``loss.backward()`` (the torch baseline);
  Opacus's ghost clipping (``GradSampleModuleFastGradientClipping``, what
  ``make_private(grad_sample_mode="ghost")`` builds: two backward passes;
  it refuses tied parameters, so it runs the model with the head untied,
  against torch's gradient of that model), and Opacus's hooks mode
  (``GradSampleModule``: per-sample gradients, then
  ``DPOptimizer.clip_and_accumulate``).

Every case of a ``(B, T)`` is timed interleaved with the others (one call of
each in turn, ``reps`` rounds), in one process limited to one compute thread:
XLA's CPU client and torch's thread pools are created while the process may
run on one core only (then both cores are allowed again), with
``--xla_cpu_multi_thread_eigen=false`` and ``torch.set_num_threads(1)``. The
busiest thread's share of the process's CPU time during each call is
reported as a check. Each call's CPU time (every thread's) and wall time are
recorded; on a shared machine the CPU time is the steadier. Each private
case is given as a multiple of its own framework's non-private step, the
median over rounds of the ratio of the two calls of the same round, and in
absolute terms. Each result is checked against a reference computed from the
same weights and tokens (jaxclip vmap's clipped sum; ``jax.grad`` for torch's
gradient). Memory: XLA's compiled
temporary memory (JAX only), and for every case the peak resident memory
(``VmHWM``, reset before the call, after ``malloc_trim``) above the resident
memory before it.

The peers are the ``peers`` extra (torch, Opacus, jax_privacy), never in the
test extra; in a venv of their own, with torch's CPU wheel::

  python3 -m venv .venv-peers && .venv-peers/bin/pip install -e ".[peers]" torch==2.13.0
  .venv-peers/bin/python -m benchmarks.ghost --peers

A peer that is not installed reads ``not installed`` and the others run.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import importlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np

from benchmarks import _cases, _ghost_cases, _main, _model, _report

EXTRA = "peers"
INSTALL = 'python3 -m venv .venv-peers && .venv-peers/bin/pip install -e ".[peers]" torch==2.13.0'
# Peer -> the modules it needs.
PEERS = {"Opacus": ("torch", "opacus"), "jax_privacy": ("jax_privacy",)}
BATCHES, SEQ_LENS = (32, 128), (16, 128)
QUICK_BATCHES, QUICK_SEQ_LENS = (2,), (8,)
# (key, framework, method, peer needed or None, baseline key)
CASES = (
  ("jax grad", "JAX", "non-private jax.grad", None, "jax grad"),
  ("jaxclip vmap", "jaxclip", 'method="vmap"', None, "jax grad"),
  ("jaxclip ghost", "jaxclip", 'method="ghost"', None, "jax grad"),
  ("jaxclip auto", "jaxclip", 'method="auto"', None, "jax grad"),
  ("jax_privacy", "jax_privacy", "clipped_grad (vmap)", "jax_privacy", "jax grad"),
  ("torch grad", "torch", "non-private loss.backward()", "Opacus", "torch grad"),
  (
    "torch grad untied",
    "torch",
    "non-private loss.backward(), head untied",
    "Opacus",
    "torch grad untied",
  ),
  (
    "opacus ghost",
    "Opacus",
    "ghost (GradSampleModuleFastGradientClipping), head untied",
    "Opacus",
    "torch grad untied",
  ),
  ("opacus hooks", "Opacus", "hooks (GradSampleModule)", "Opacus", "torch grad"),
)
SUMMARY = (
  "jaxclip ghost",
  "jaxclip auto",
  "jaxclip vmap",
  "jax_privacy",
  "opacus ghost",
  "opacus hooks",
)
# What each case's clipped sum is checked against (the probe call of each). An
# untied gradient is folded into the tied one (wte + head.kernel.T) to meet JAX's.
REFERENCE = {
  "jaxclip vmap": None,
  "jax grad": None,
  "torch grad": "jax grad",
  "torch grad untied": "jax grad",
  "opacus ghost": "opacus hooks untied",
}


def not_installed(peer: str, module: str) -> str:
  """The reason a peer's rows read ``not installed``, naming the extra."""
  return (
    f"{peer} needs `{module}`, which is not installed: it comes with the `{EXTRA}` extra, "
    f"`{INSTALL}`"
  )


def availability(import_module: Callable[[str], Any] = importlib.import_module) -> dict:
  """``{peer: (version, None)}`` for each peer installed, ``{peer: (None, why not)}`` otherwise."""
  out = {}
  for peer, modules in PEERS.items():
    versions = []
    for module in modules:
      try:
        versions.append(f"{module} {getattr(import_module(module), '__version__', '?')}")
      except ImportError:
        out[peer] = (None, not_installed(peer, module))
        break
    else:
      out[peer] = (", ".join(versions), None)
  return out


def pin_one_thread(with_torch: bool) -> str:
  """Makes XLA's CPU client (and torch) run each step on one thread; says how.

  XLA sizes its CPU thread pool from the cores the process may run on when
  the client is made: the process is restricted to one core for that moment,
  then given all of them back, so the one compute thread may run on either.
  """
  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized():
    return "not pinned: jax's backend was started before --peers could pin it"
  flag = "--xla_cpu_multi_thread_eigen=false"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"
  cpus = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {min(cpus)})
  try:
    jax.devices()
    if with_torch:
      import torch

      torch.set_num_threads(1)
      torch.set_num_interop_threads(1)
  finally:
    os.sched_setaffinity(0, cpus)
  return (
    f"XLA's CPU client made on one core ({flag}), torch.set_num_threads(1) and "
    f"set_num_interop_threads(1), OMP_NUM_THREADS=1; then all {len(cpus)} cores allowed"
  )


# ----------------------------------------------------------------------------
# Measuring: per-thread CPU time and peak resident memory.
# ----------------------------------------------------------------------------


def _thread_cpu_ns() -> dict[str, int]:
  out = {}
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/schedstat") as f:
        out[tid] = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
      pass
  return out


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status")


def _block(out: Any) -> None:
  for leaf in jax.tree.leaves(out):
    if isinstance(leaf, jax.Array):
      leaf.block_until_ready()


def peak_mb(step: Callable[[], Any]) -> float | None:
  """MiB of resident memory that one call of ``step`` adds at its peak (Linux only)."""
  try:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: RSS is what is live
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets VmHWM to the current RSS
    out = step()
    _block(out)
    peak = _status_kib("VmHWM")
    del out
  except (OSError, RuntimeError, AttributeError):
    return None
  return (peak - before) / 1024


def time_interleaved(steps: dict[str, Callable[[], Any]], reps: int, warmup: int = 1) -> dict:
  """The steps called in turn, ``reps`` rounds: ``{name: (wall s, CPU s, busiest share)}``.

  Each is a list, one entry per round: the call's wall-clock seconds, the CPU
  seconds of all the process's threads during it (``time.process_time``), and
  the busiest thread's share of the CPU time (from each thread's
  ``schedstat``, which lags by up to a scheduler tick).
  """
  out: dict[str, tuple[list[float], list[float], list[float]]] = {
    name: ([], [], []) for name in steps
  }
  for i in range(warmup + reps):
    for name, step in steps.items():
      before = _thread_cpu_ns()
      c0, t0 = time.process_time(), time.perf_counter()
      _block(step())
      dt, dc = time.perf_counter() - t0, time.process_time() - c0
      after = _thread_cpu_ns()
      used = [after[t] - before.get(t, 0) for t in after]
      if i >= warmup:
        out[name][0].append(dt)
        out[name][1].append(dc)
        out[name][2].append(max(used) / sum(used) if sum(used) > 0 else float("nan"))
  return out


# ----------------------------------------------------------------------------
# The cases.
# ----------------------------------------------------------------------------


def _as_numpy(tree: Any) -> dict[str, np.ndarray]:
  return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def jax_cases(cfg: _model.GPTConfig, clip: float, have: dict) -> dict:
  """``{key: (fn(params, tokens) -> {name: array}, None) or (None, why not)}``."""

  def loss_fn(params, tokens):
    return _model.loss_fn(params, tokens, cfg)

  out = {}
  for key, (fn, why) in _ghost_cases.make_cases(cfg, clip).items():
    out["jax grad" if key == "grad" else f"jaxclip {key}"] = (fn, why)
  out["jaxclip auto"] = _ghost_cases.private_grad_fn(loss_fn, clip, "auto")
  if have["jax_privacy"][1] is None:
    from jax_privacy import clipping

    fn = clipping.clipped_grad(loss_fn, l2_clip_norm=clip, batch_argnums=1, keep_batch_dim=False)
    out["jax_privacy"] = (fn, None)
  return out


def torch_cases(cfg: _model.GPTConfig, clip: float, params: dict, tokens: Any) -> tuple:
  """``({key: step() -> {name: array}}, {key: check-only step})`` of torch and Opacus.

  Opacus's ghost clipping raises ``NotImplementedError: Parameter tying is not
  supported with Ghost Clipping``, so it runs the model with an untied head
  (initialised to ``wte``'s weight, so the same function), beside torch's
  non-private gradient of that model (its baseline) and, for the check only,
  Opacus's hooks mode on it.
  """
  import torch
  from opacus import GradSampleModule
  from opacus.grad_sample import GradSampleModuleFastGradientClipping
  from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
  from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

  from benchmarks import _torch_gpt

  b, t, v = cfg.batch, cfg.seq_len, cfg.vocab
  data = torch.from_numpy(np.asarray(tokens).astype(np.int64))
  inputs, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

  untied_params = {**params, "head.kernel": np.asarray(params["wte"]).T}

  def model(tied=True):
    m = _torch_gpt.GPT(v, t, cfg.d_model, cfg.n_layers, cfg.n_heads, tied=tied)
    return _torch_gpt.load_jax_params(m, params if tied else untied_params)

  def grad_step(plain):
    def step():
      for p in plain.parameters():
        p.grad = None
      _torch_gpt.per_example_loss(plain(inputs), targets).sum().backward()
      return _torch_gpt.grads_as_jax(plain, {p: p.grad for p in plain.parameters()})

    return step

  # Ghost: per-example losses (each a mean over its T positions) through Opacus's
  # DPLoss, whose backward() runs the norm pass and the clipped pass; p.grad is then
  # the clipped sum (the optimizer's step, not run, would add noise and divide by B).
  ghost_model = model(tied=False)
  gsm = GradSampleModuleFastGradientClipping(
    ghost_model, batch_first=True, loss_reduction="mean", max_grad_norm=clip
  )
  ghost_opt = DPOptimizerFastGradientClipping(
    torch.optim.SGD(gsm.parameters(), lr=0.0),
    noise_multiplier=0.0,
    max_grad_norm=clip,
    expected_batch_size=b,
    loss_reduction="mean",
  )
  criterion = DPLossFastGradientClipping(
    gsm, ghost_opt, torch.nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean"
  )

  def opacus_ghost():
    ghost_opt.zero_grad(set_to_none=True)
    logits = gsm(inputs)
    criterion(logits.reshape(b * t, v), targets.reshape(b * t), shape=logits.shape).backward()
    return _torch_gpt.grads_as_jax(ghost_model, {p: p.grad for p in ghost_model.parameters()})

  # Hooks: per-sample gradients in p.grad_sample, clipped and summed by the DP
  # optimizer's own clip_and_accumulate (what its step() runs before the noise).
  def hooks_step(hooks_model):
    hsm = GradSampleModule(hooks_model, batch_first=True, loss_reduction="mean")
    hooks_opt = DPOptimizer(
      torch.optim.SGD(hsm.parameters(), lr=0.0),
      noise_multiplier=0.0,
      max_grad_norm=clip,
      expected_batch_size=b,
      loss_reduction="mean",
    )

    def step():
      hooks_opt.zero_grad(set_to_none=True)
      _torch_gpt.per_example_loss(hsm(inputs), targets).mean().backward()
      hooks_opt.clip_and_accumulate()
      return _torch_gpt.grads_as_jax(
        hooks_model, {p: p.summed_grad for p in hooks_model.parameters()}
      )

    return step

  steps = {
    "torch grad": grad_step(model()),
    "torch grad untied": grad_step(model(tied=False)),
    "opacus ghost": opacus_ghost,
    "opacus hooks": hooks_step(model()),
  }
  return steps, {"opacus hooks untied": hooks_step(model(tied=False))}


def _rel_diff(x: dict, ref: dict) -> float:
  if "head.kernel" in x and "head.kernel" not in ref:  # untied against tied: fold the head in
    x = {**x, "wte": x["wte"] + x["head.kernel"].T}
  scale = max(float(np.max(np.abs(r))) for r in ref.values())
  return max(float(np.max(np.abs(x[k] - ref[k]))) for k in ref) / max(scale, 1e-30)


def new_rows(batch: int, seq_len: int, have: dict) -> dict[str, dict]:
  """``{key: row}`` for every case of :data:`CASES`, a missing peer's rows ``not installed``."""
  rows = {}
  for key, fw, method, peer, base in CASES:
    why = have[peer][1] if peer else None
    rows[key] = {
      "B": batch,
      "T": seq_len,
      "case": key,
      "framework": fw,
      "method": method,
      "baseline": base,
      "status": "ok" if why is None else "not installed",
      "why": why,
    }
  return rows


def run_config(
  cfg: _model.GPTConfig, clip: float, reps: int, mem_probes: int, have: dict
) -> list[dict]:
  """One dict per case of :data:`CASES` at ``cfg``'s batch and length."""
  params = _model.init_params(cfg, seed=0)
  tokens = _model.make_tokens(cfg, seed=1)
  rows = new_rows(cfg.batch, cfg.seq_len, have)
  steps: dict[str, Callable[[], Any]] = {}
  for key, (fn, why) in jax_cases(cfg, clip, have).items():
    if rows[key]["status"] != "ok":
      continue
    if fn is None:
      rows[key].update(status="n/a", why=why)
      continue
    try:
      c = jax.jit(fn).lower(params, tokens).compile()
    except Exception as e:  # a method that cannot handle this model: say so, go on
      rows[key].update(status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
      continue
    rows[key]["temp_mb"] = _cases._temp_mb(c)
    steps[key] = lambda c=c: c(params, tokens)
  checks: dict[str, Callable[[], Any]] = {}
  if have["Opacus"][1] is None:
    torch_steps, checks = torch_cases(cfg, clip, params, tokens)
    steps.update(torch_steps)
  # The probe call of each case (also a warm-up): its clipped sum against the reference.
  outputs = {}
  for key, step in {**steps, **checks}.items():
    out = step()
    _block(out)
    out = out[0] if isinstance(out, tuple) else out  # jaxclip: (clipped sum, num_clipped)
    outputs[key] = _as_numpy(out)
  for key in steps:
    ref = REFERENCE.get(key, "jaxclip vmap")
    if ref is not None and ref in outputs:
      rows[key]["check"] = _rel_diff(outputs[key], outputs[ref])
      rows[key]["check_ref"] = ref
  del outputs
  for key, (secs, cpus, shares) in time_interleaved(steps, reps).items():
    shares = [x for x in shares if x == x]  # NaN: no CPU time seen during the call
    thread = statistics.median(shares) if shares else None
    rows[key].update(secs=secs, cpus=cpus, thread=thread)
    wall, cpu = ([round(1e3 * x) for x in xs] for xs in (secs, cpus))
    print(f"    {key}: wall ms {wall}, CPU ms {cpu}", flush=True)
  for key, step in steps.items():
    probes = [peak_mb(step) for _ in range(mem_probes)]
    probes = [p for p in probes if p is not None]
    rows[key]["peak_mb"] = statistics.median(probes) if probes else None
  add_ratios(rows)
  return list(rows.values())


def add_ratios(rows: dict[str, dict]) -> None:
  """Adds to each case of ``{key: row}`` its medians and its ratios to its baseline, in place.

  ``ms`` and ``cpu_ms`` are the medians of the rounds' wall and CPU times
  (``secs``, ``cpus``); ``x_time`` and ``x_cpu`` the medians over rounds of
  the ratio of the two calls of the same round, ``x_time_iqr`` and
  ``x_cpu_iqr`` their interquartile ranges; ``x_temp_mb`` and ``x_peak_mb``
  divide the memories.
  """
  for r in rows.values():
    for k, key in (("secs", "ms"), ("cpus", "cpu_ms")):
      if k in r:
        r[key] = 1e3 * statistics.median(r[k])
  for r in rows.values():
    base = rows[r["baseline"]]
    if r["case"] == r["baseline"] or "secs" not in r or "secs" not in base:
      continue
    for k, key in (("secs", "x_time"), ("cpus", "x_cpu")):
      ratios = sorted(a / b for a, b in zip(r[k], base[k], strict=True) if b > 0)
      if not ratios:
        continue
      q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
      r.update({key: statistics.median(ratios), key + "_iqr": (q[0], q[2])})
    for k in ("temp_mb", "peak_mb"):
      if r.get(k) is not None and base.get(k):
        r["x_" + k] = r[k] / base[k]


def run(
  batches: list[int], seq_lens: list[int], model: dict, clip: float | None, reps: int, probes: int
) -> list[dict]:

  have = availability()
  rows = []
  for t in seq_lens:
    base = _model.GPTConfig(seq_len=t, tied=True, **model)
    t_clip = _ghost_cases.median_norm(base) if clip is None else clip
    for b in batches:
      print(f"  B={b:4d} T={t:4d} l2_norm_clip {t_clip:.3g} ...", flush=True)
      cfg = _model.GPTConfig(seq_len=t, batch=b, tied=True, **model)
      for r in run_config(cfg, t_clip, reps, probes, have):
        r["clip"] = t_clip
        rows.append(r)
        print(
          f"    {r['case']:14s} {_report._f(r.get('ms'), '{:9.1f}')} ms "
          f"x{_report._f(r.get('x_time'))}  CPU x{_report._f(r.get('x_cpu'))}  "
          f"peak {_report._f(r.get('peak_mb'), '{:.1f}')} MiB "
          f"x{_report._f(r.get('x_peak_mb'))}  {r['status']}",
          flush=True,
        )
  return rows


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------

HEADER = [
  "B",
  "T",
  "framework",
  "method",
  "CPU ms",
  "x own CPU (IQR)",
  "wall ms",
  "x own wall (IQR)",
  "XLA temp MiB",
  "x own temp",
  "peak MiB",
  "x own peak",
  "busiest thread",
  "clipped sum vs",
]


def _cell(r: dict, key: str, fmt: str = "{:.3g}") -> str:
  if r["status"] != "ok":
    return r["status"]
  return _report._f(r.get(key), fmt)


def _x_time(r: dict, key: str) -> str:
  if r["status"] != "ok":
    return r["status"]
  if r["case"] == r["baseline"]:
    return "1 (baseline)"
  if r.get(key) is None:
    return "n/a"
  lo, hi = r[key + "_iqr"]
  return f"{r[key]:.2f} ({lo:.2f}-{hi:.2f})"


def _x(r: dict, key: str) -> str:
  if r["status"] != "ok":
    return r["status"]
  if r["case"] == r["baseline"]:
    return "1" if r.get(key[2:]) is not None else "n/a"
  return _report._f(r.get(key))


def _check(r: dict) -> str:
  if r["status"] != "ok":
    return r["status"]
  if r.get("check") is None:
    return "reference"
  return f"{r['check_ref']}: {r['check']:.1e}"


def table(rows: list[dict]) -> str:
  """The table of every case, one row per ``(B, T, case)``."""
  body = [
    [
      str(r["B"]),
      str(r["T"]),
      r["framework"],
      r["method"],
      _cell(r, "cpu_ms", "{:.1f}"),
      _x_time(r, "x_cpu"),
      _cell(r, "ms", "{:.1f}"),
      _x_time(r, "x_time"),
      "-" if r["framework"] in ("torch", "Opacus") else _cell(r, "temp_mb"),
      "-" if r["framework"] in ("torch", "Opacus") else _x(r, "x_temp_mb"),
      _cell(r, "peak_mb"),
      _x(r, "x_peak_mb"),
      _cell(r, "thread", "{:.0%}"),
      _check(r),
    ]
    for r in rows
  ]
  return _report._table(HEADER, body)


def summary(rows: list[dict], key: str) -> str:
  """Each private case's ``key`` ratio to its own non-private step, one row per ``(B, T)``."""
  names = {c[0]: f"{c[1]} {c[2].split(' ')[0]}" for c in CASES}
  configs = list(dict.fromkeys((r["B"], r["T"]) for r in rows))
  by = {(r["B"], r["T"], r["case"]): r for r in rows}
  body = []
  for b, t in configs:
    cells = []
    for case in SUMMARY:
      r = by.get((b, t, case))
      if r is None:
        cells.append("n/a")
      elif r["status"] != "ok":
        cells.append(r["status"])
      else:
        cells.append(_report._f(r.get(key)))
    body.append([str(b), str(t), *cells])
  return _report._table(["B", "T", *(names[c] for c in SUMMARY)], body)


def markdown(meta: dict, rows: list[dict]) -> str:
  out = ["# Per-example clipping of a small GPT beside its peers: jax_privacy and Opacus", ""]
  out += [f"- {k}: {v}" for k, v in meta.items()]
  out += [
    "",
    "Every private case computes one step's sum of per-example gradients clipped to "
    "`l2_norm_clip` (no noise, no optimizer step) and is compared with its own framework's "
    "non-private gradient of the same model and batch: JAX's `jax.grad` for jaxclip and "
    "jax_privacy, torch's `loss.backward()` for Opacus (for Opacus ghost, of the untied "
    "model it runs). The cases of a `(B, T)` are timed interleaved, one call each in turn, "
    "round after round. `CPU ms` is the CPU time of the process's threads during a call "
    "(`time.process_time`), `wall ms` its wall-clock time, each the median "
    "over the rounds. On a machine shared with other jobs the wall time includes the time "
    "the step waited for a core; the CPU time does not, so it is the steadier measure of the "
    "work done. `x own` is the median over the rounds of the ratio of the two calls of the "
    "same round, with its interquartile range. `XLA temp MiB` is the compiled program's "
    "temporary memory (XLA's memory analysis). `peak MiB` is the resident memory one call "
    "adds at its peak above what was resident before it (Linux `VmHWM`, reset before the "
    "call, after `malloc_trim`; the median of the probes): activations, per-example "
    "gradients or norms, the output gradient. `busiest thread` is the share of the "
    "process's CPU time taken by its busiest thread during a call (median over the rounds): "
    "100% is one thread. `clipped sum vs`: the largest difference of the case's result from "
    "the reference's, divided by the reference's largest entry, both from the same weights "
    "and tokens (an untied gradient is folded into the tied one, `wte + head.kernel.T`, to "
    "meet JAX's).",
    "",
    "## CPU time of each private step as a multiple of its framework's non-private step",
    "",
    summary(rows, "x_cpu"),
    "",
    "## Wall time of each private step as a multiple of its framework's non-private step",
    "",
    summary(rows, "x_time"),
    "",
    "## Peak memory of each private step as a multiple of its framework's non-private step",
    "",
    summary(rows, "x_peak_mb"),
    "",
    "## Every case",
    "",
    table(rows),
    "",
  ]
  notes = sorted({f"- {r['framework']} {r['method']}: {r['why']}" for r in rows if r["why"]})
  if notes:
    out += ["## Cases not run", "", *notes, ""]
  return "\n".join(out)


def _source() -> str:
  """The commit measured, and whether jaxclip/ differed from it."""
  root = Path(__file__).resolve().parents[1]
  try:
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
      [*git, "status", "--porcelain", "--", "jaxclip"], capture_output=True, text=True
    )
  except OSError:
    return "unknown (no git)"
  if head.returncode != 0:
    return "unknown (not a git checkout)"
  changed = len(dirty.stdout.splitlines())
  return f"commit {head.stdout.strip()}" + (
    f" with uncommitted changes to {changed} files of jaxclip/" if changed else ""
  )


def main(args: argparse.Namespace, command: str) -> str:
  """Runs the peers (``args`` from :func:`benchmarks.ghost._parser`), writes ghost_peers.md."""

  have = availability()
  for peer, (_, why) in have.items():
    if why is not None:
      print(f"{peer}: not installed; its rows read `not installed`. {why}", file=sys.stderr)
  threads = pin_one_thread(with_torch=have["Opacus"][1] is None)
  quick = args.quick
  reps = args.reps or (2 if quick else 7)
  probes = 1 if quick else 3
  batches = args.batch or list(QUICK_BATCHES if quick else BATCHES)
  seq_lens = args.seq or list(QUICK_SEQ_LENS if quick else SEQ_LENS)
  model = _ghost_cases.QUICK_MODEL if quick else _ghost_cases.MODEL
  device = jax.devices()[0]
  load = " ".join(f"{x:.2f}" for x in os.getloadavg())
  meta = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{_main._cpu_name()}, {os.cpu_count()} cores, shared with other jobs; jax "
    f"device: {device.platform} ({device.device_kind})",
    "versions": f"python {platform.python_version()}, jax {jax.__version__}, jaxlib "
    f"{jaxlib.__version__}, "
    + "; ".join(f"{peer}: {v or 'not installed'}" for peer, (v, _) in have.items()),
    "model": f"GPT-like, tied head (benchmarks/_model.py; in torch benchmarks/_torch_gpt.py), "
    f"vocab {model['vocab']}, d_model {model['d_model']}, {model['n_layers']} blocks of "
    f"{model['n_heads']} heads; per-example loss: mean next-token cross-entropy of one sequence",
    "jaxclip source": _source(),
    "threads": threads,
    "l2_norm_clip": f"{args.clip:g}"
    if args.clip is not None
    else f"for each T, the median per-example gradient norm of {_ghost_cases.NORM_SAMPLE} random "
    "sequences",
    "repetitions": f"{reps} timed rounds after one warm-up call, {probes} memory probes per case",
    "load average (1, 5, 15 min) at start": load,
    "install": f"`{INSTALL}`, then `.venv-peers/bin/{command}`",
  }
  t0 = time.perf_counter()
  rows = run(batches, seq_lens, model, args.clip, reps, probes)
  meta["load average (1, 5, 15 min) at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  meta["total benchmark time"] = f"{time.perf_counter() - t0:.0f} s"
  text = markdown(meta, rows)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "ghost_peers.md").write_text(text + "\n")
  print(text)
  return text
