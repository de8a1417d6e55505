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
each in turn, ``reps`` rounds, the order turned each round), in one process
limited to one compute thread:
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
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jaxlib

from benchmarks import (
  _cases,
  _ghost_cases,
  _main,
  _model,
  _peers_cases,
  _peers_measure,
  _peers_report,
  _report,
)

BATCHES, SEQ_LENS = (32, 128), (16, 128)
QUICK_BATCHES, QUICK_SEQ_LENS = (2,), (8,)


def run_config(
  cfg: _model.GPTConfig, clip: float, reps: int, mem_probes: int, have: dict
) -> list[dict]:
  """One dict per case of :data:`_peers_cases.CASES` at ``cfg``'s batch and length."""
  params = _model.init_params(cfg, seed=0)
  tokens = _model.make_tokens(cfg, seed=1)
  rows = _peers_cases.new_rows(cfg.batch, cfg.seq_len, have)
  steps: dict[str, Callable[[], Any]] = {}
  for key, (fn, why) in _peers_cases.jax_cases(cfg, clip, have).items():
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
    torch_steps, checks = _peers_cases.torch_cases(cfg, clip, params, tokens)
    steps.update(torch_steps)
  # The probe call of each case (also a warm-up): its clipped sum against the reference.
  outputs = {}
  for key, step in {**steps, **checks}.items():
    out = step()
    _peers_measure._block(out)
    out = out[0] if isinstance(out, tuple) else out  # jaxclip: (clipped sum, num_clipped)
    outputs[key] = _peers_cases._as_numpy(out)
  for key in steps:
    ref = _peers_cases.REFERENCE.get(key, "jaxclip vmap")
    if ref is not None and ref in outputs:
      rows[key]["check"] = _peers_cases._rel_diff(outputs[key], outputs[ref])
      rows[key]["check_ref"] = ref
  del outputs
  for key, (secs, cpus, shares) in _peers_measure.time_interleaved(steps, reps).items():
    shares = [x for x in shares if x == x]  # NaN: no CPU time seen during the call
    thread = statistics.median(shares) if shares else None
    rows[key].update(secs=secs, cpus=cpus, thread=thread)
    wall, cpu = ([round(1e3 * x) for x in xs] for xs in (secs, cpus))
    print(f"    {key}: wall ms {wall}, CPU ms {cpu}", flush=True)
  for key, step in steps.items():
    probes = [_peers_measure.peak_mb(step) for _ in range(mem_probes)]
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

  have = _peers_cases.availability()
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


def main(args: argparse.Namespace, command: str) -> str:
  """Runs the peers (``args`` from :func:`benchmarks.ghost._parser`), writes ghost_peers.md."""

  have = _peers_cases.availability()
  for peer, (_, why) in have.items():
    if why is not None:
      print(f"{peer}: not installed; its rows read `not installed`. {why}", file=sys.stderr)
  threads = _peers_measure.pin_one_thread(with_torch=have["Opacus"][1] is None)
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
    "jaxclip source": _peers_report._source(),
    "threads": threads,
    "l2_norm_clip": f"{args.clip:g}"
    if args.clip is not None
    else f"for each T, the median per-example gradient norm of {_ghost_cases.NORM_SAMPLE} random "
    "sequences",
    "repetitions": f"{reps} timed rounds after one warm-up call, {probes} memory probes per case",
    "load average (1, 5, 15 min) at start": load,
    "install": f"`{_peers_cases.INSTALL}`, then `.venv-peers/bin/{command}`",
  }
  t0 = time.perf_counter()
  rows = run(batches, seq_lens, model, args.clip, reps, probes)
  meta["load average (1, 5, 15 min) at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  meta["total benchmark time"] = f"{time.perf_counter() - t0:.0f} s"
  text = _peers_report.markdown(meta, rows)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "ghost_peers.md").write_text(text + "\n")
  print(text)
  return text
