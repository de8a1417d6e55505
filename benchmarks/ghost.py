"""Per-example clipping (DP-SGD) of a small GPT: ``python -m benchmarks.ghost``.

Three ways to get one step's gradient of a GPT-like model with a tied output
head (``logits = h @ wte.T``; about 0.85M float32 params), for a batch of
``B`` sequences of ``T`` tokens, each jitted and compiled on its own:

* ``grad``: the non-private gradient, ``jax.grad`` of the summed per-example
  losses (the baseline);
* ``vmap``: ``jaxclip.per_example_clipped_grad(loss_fn, clip, method="vmap")``,
  ``jax.grad`` vmap-ed over the batch: ``B`` per-example gradients of ``P``
  floats each, clipped and summed;
* ``ghost``: ``method="ghost"``, per-example gradient norms without
  per-example gradients ("ghost norms"). Picked up by itself once
  ``per_example_clipped_grad`` accepts ``method="ghost"``; until then its
  cells read ``n/a``.

For each case and each ``(B, T)``: the compiled program's temporary memory
(XLA's memory analysis, read at compile time, so known even for sizes too
big to run) and the median step time, the cases of one ``(B, T)`` timed
interleaved (one step of each in turn). A case whose step is predicted (from
the next smaller batch) or measured (one probe step) to take more than
``--time-budget`` seconds, or whose temporary memory exceeds ``--max-gb``,
is compiled but not timed: its time reads ``not run``.

It prints a markdown table and writes ``ghost.md`` and ``ghost.png``
(temporary memory against the batch size, one panel per ``T``) into
``--out`` (default ``benchmarks/``). ``--quick`` is a smoke test: a tiny
model, tiny batches, two repetitions.

``--peers`` runs the same model beside jax_privacy's ``clipped_grad`` and
Opacus (ghost and hooks), one thread each, and writes ``ghost_peers.md``
(:mod:`benchmarks._peers`). The peers are the ``peers`` extra, installed in
a venv of their own (torch 2.13.0 is the CPU wheel)::

  python3 -m venv .venv-peers && .venv-peers/bin/pip install -e ".[peers]" torch==2.13.0
  .venv-peers/bin/python -m benchmarks.ghost --peers
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib

import benchmarks
from benchmarks import _cases, _ghost_cases, _ghost_mask, _main, _model, _report, _timing
from tools.figure_record import package_sources, write_record

BATCHES, SEQ_LENS = (32, 128, 512), (16, 128)
QUICK_BATCHES, QUICK_SEQ_LENS = (2, 8), (8,)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m benchmarks.ghost", description=__doc__.split("\n\n")[0]
  )
  p.add_argument(
    "--quick", action="store_true", help="tiny model and batches, two repetitions (a smoke test)"
  )
  p.add_argument(
    "--mask",
    action="store_true",
    help="only the masked Poisson case (benchmarks/_ghost_mask.py): writes ghost_mask.md",
  )
  p.add_argument(
    "--out",
    type=Path,
    default=benchmarks.RESULTS,
    help="folder for ghost.md and ghost.png (default: benchmarks/results/)",
  )
  p.add_argument(
    "--reps", type=int, default=None, help="timed repetitions per case (default 10; 2 with --quick)"
  )
  p.add_argument(
    "--batch",
    type=int,
    nargs="+",
    default=None,
    help=f"batch sizes B (default {' '.join(map(str, BATCHES))})",
  )
  p.add_argument(
    "--seq",
    type=int,
    nargs="+",
    default=None,
    help=f"sequence lengths T (default {' '.join(map(str, SEQ_LENS))})",
  )
  p.add_argument(
    "--time-budget",
    type=float,
    default=20.0,
    help="seconds one step may take to be timed (default 20)",
  )
  p.add_argument(
    "--max-gb",
    type=float,
    default=8.0,
    help="largest compiled temporary memory (GiB) of a case that is run (default 8)",
  )
  p.add_argument(
    "--zoo",
    action="store_true",
    help="the model zoo (workloads/zoo.py) instead of the GPT: writes ghost_zoo.md "
    "(batches 16 and 128; with --quick, the tiny models at batch 4)",
  )
  p.add_argument(
    "--models", nargs="+", default=None, help="with --zoo: the zoo models to run (default: all)"
  )
  p.add_argument(
    "--peers",
    action="store_true",
    help="the GPT beside jax_privacy's clipped_grad and Opacus (ghost and hooks), one thread "
    "each (benchmarks/_peers.py, the `peers` extra): writes ghost_peers.md (B 32 128, T 16 128)",
  )
  p.add_argument(
    "--memory-only",
    action="store_true",
    help="compile every case and read its temporary memory, time nothing: redraws ghost.png "
    "(a figure of memory) and writes ghost_memory.md, leaving ghost.md's timed table as it is",
  )
  p.add_argument(
    "--clip",
    type=float,
    default=None,
    help="l2_norm_clip of the private cases (default: for each T, the median "
    f"per-example gradient norm of {_ghost_cases.NORM_SAMPLE} random sequences)",
  )
  return p


# ----------------------------------------------------------------------------
# The cases.
# ----------------------------------------------------------------------------


def _grad_mb(b: int, p: int) -> float:
  """MiB of ``b`` float32 per-example gradients of ``p`` params."""
  return 4 * b * p / 2**20


def _tree_max_abs(tree: Any) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


def _compare(vmap_out: Any, ghost_out: Any) -> dict:
  """How far ghost's clipped sum is from vmap's, and both clip counts."""
  (gv, nv), (gg, ng) = vmap_out, ghost_out
  diff = _tree_max_abs(jax.tree.map(lambda a, b: a.astype(jnp.float32) - b, gg, gv))
  return {
    "max_rel_diff": diff / max(_tree_max_abs(gv), 1e-30),
    "clipped_vmap": int(nv),
    "clipped_ghost": int(ng),
  }


def run_config(
  cfg: _model.GPTConfig,
  clip: float,
  reps: int,
  time_budget_s: float,
  max_mb: float,
  estimates: dict[str, float | None],
  timed: bool = True,
) -> dict:
  """Compile every case at ``cfg``'s batch and length, then time those within budget.

  ``estimates`` maps a method to a predicted step time in seconds (``None``:
  unknown); a case predicted above ``time_budget_s`` is not run, nor one
  whose probe step (the first call, also a warm-up) takes longer. With
  ``timed=False`` every case is compiled (its memory read) and none is run.
  """
  params = _model.init_params(cfg, seed=0)
  tokens = _model.make_tokens(cfg, seed=1)
  row: dict[str, Any] = {
    "B": cfg.batch,
    "T": cfg.seq_len,
    "params": _model.num_params(cfg),
    "clip": clip,
  }
  compiled, outputs = {}, {}
  for name, (fn, why) in _ghost_cases.make_cases(cfg, clip).items():
    res: dict[str, Any] = {"status": "n/a", "temp_mb": None, "ms": None, "why": why}
    row[name] = res
    if fn is None:
      continue
    try:
      t0 = time.perf_counter()
      c = jax.jit(fn).lower(params, tokens).compile()
      res["compile_s"] = time.perf_counter() - t0
    except Exception as e:  # a method that cannot handle this model: say so, go on
      res.update(status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
      continue
    res["temp_mb"] = _cases._temp_mb(c)
    if not timed:
      res.update(status="not run", why="memory only (--memory-only)")
      continue
    est = estimates.get(name)
    if res["temp_mb"] is not None and res["temp_mb"] > max_mb:
      res.update(status="not run", why=f"temp memory {res['temp_mb']:.4g} MiB > {max_mb:.4g} MiB")
      continue
    if est is not None and est > time_budget_s:
      res.update(
        status="not run",
        why=(
          "not timed at a smaller batch already"
          if math.isinf(est)
          else f"one step predicted at {est:.3g} s > {time_budget_s:g} s from a smaller batch"
        ),
      )
      continue
    t0 = time.perf_counter()
    outputs[name] = jax.block_until_ready(c(params, tokens))
    probe = time.perf_counter() - t0
    if probe > time_budget_s:
      res.update(status="not run", why=f"one step took {probe:.3g} s > {time_budget_s:g} s")
      continue
    res["status"] = "ok"
    compiled[name] = c
  steps = {name: (lambda s, c=c: (c(params, tokens), s), None) for name, c in compiled.items()}
  if steps:
    for name, s in _timing.time_interleaved(steps, reps, warmup=1).items():
      row[name]["ms"] = 1e3 * s
  if "vmap" in outputs:
    row["clipped_vmap"] = int(outputs["vmap"][1])
  if "vmap" in outputs and "ghost" in outputs:
    row["check"] = _compare(outputs["vmap"], outputs["ghost"])
  return row


def run(
  batches: list[int],
  seq_lens: list[int],
  model: dict,
  clip: float | None,
  reps: int,
  time_budget_s: float,
  max_mb: float,
  timed: bool = True,
) -> list[dict]:
  """One row per ``(B, T)``, the batches of each ``T`` in increasing order.

  A case's step time at the next batch is predicted proportional to the
  batch from its last one timed, so that a step far over the budget is
  never started.
  """
  rows = []
  for t in seq_lens:
    last: dict[str, tuple[int, float]] = {}
    t_clip = (
      (_ghost_cases.median_norm(_model.GPTConfig(seq_len=t, tied=True, **model)) if timed else 1.0)
      if clip is None
      else clip
    )
    for b in sorted(batches):
      estimates = {m: s * b / b0 for m, (b0, s) in last.items()}
      cfg = _model.GPTConfig(seq_len=t, batch=b, tied=True, **model)
      print(f"  B={b:4d} T={t:4d} ...", flush=True)
      row = run_config(cfg, t_clip, reps, time_budget_s, max_mb, estimates, timed)
      for m in _ghost_cases.METHODS:
        res = row[m]
        if res["ms"] is not None:
          last[m] = (b, res["ms"] / 1e3)
        elif res["status"] == "not run":
          last[m] = (b, math.inf)
        print(
          f"    {m:5s} temp {_report._f(res['temp_mb'], '{:.1f}'):>8s} MiB  "
          f"{_report._f(res['ms'], '{:.2f}') if res['status'] == 'ok' else res['status']:>8s}"
          f" ms{'  (' + res['why'] + ')' if res['why'] and res['status'] != 'ok' else ''}",
          flush=True,
        )
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------


def _cell(res: dict, key: str) -> str:
  if res["status"] in ("n/a", "error"):
    return res["status"]
  if key == "ms" and res["status"] != "ok":
    return "not run"
  return _report.num(res[key])


def _ratio(a: float | None, b: float | None) -> str:
  return f"{a / b:.2f}" if a is not None and b else "n/a"


HEADER = [
  "B",
  "T",
  "B x P x 4 MiB",
  "grad MiB",
  "vmap MiB",
  "ghost MiB",
  "grad ms",
  "vmap ms",
  "ghost ms",
  "vmap/grad mem",
  "ghost/grad mem",
  "ghost/vmap mem",
  "vmap/grad time",
  "ghost/grad time",
  "ghost/vmap time",
]


def table(rows: list[dict]) -> str:
  body = []
  for r in rows:
    g, v, h = r["grad"], r["vmap"], r["ghost"]
    body.append(
      [str(r["B"]), str(r["T"]), _report.num(_grad_mb(r["B"], r["params"]))]
      + [_cell(x, "temp_mb") for x in (g, v, h)]
      + [_cell(x, "ms") for x in (g, v, h)]
      + [
        _ratio(v["temp_mb"], g["temp_mb"]),
        _ratio(h["temp_mb"], g["temp_mb"]),
        _ratio(h["temp_mb"], v["temp_mb"]),
        _ratio(v["ms"], g["ms"]),
        _ratio(h["ms"], g["ms"]),
        _ratio(h["ms"], v["ms"]),
      ]
    )
  return _report._table(HEADER, body)


def markdown(meta: dict, rows: list[dict]) -> str:
  out = ["# Per-example clipping of a small GPT: ghost norms against vmap", ""]
  out += [f"- {k}: {v}" for k, v in meta.items()]
  out += [
    "",
    "`grad` is the non-private gradient (`jax.grad` of the summed per-example "
    "losses); `vmap` and `ghost` are `jaxclip.per_example_clipped_grad(loss_fn, clip, "
    "method=...)`, the whole batch at once (no `microbatch_size`). `MiB` is the compiled "
    "program's temporary memory (XLA's memory analysis: activations, per-example "
    "gradients; not the params, tokens or output), read at compile time. `B x P x 4 MiB` "
    "is the size of the batch's float32 per-example gradients, which vmap holds at "
    "once. `ms` is the median step time, the cases of a row timed interleaved. "
    "`not run`: compiled (so its memory is known) but not timed, one step being over "
    "the time budget or its memory over the memory budget (see below). `n/a`: the "
    "method is not in this jaxclip. Ratios divide the two cases' figures of the same "
    "row.",
    "",
  ]
  out.append(table(rows))
  out.append("")
  notes = []
  for r in rows:
    for m in _ghost_cases.METHODS:
      res = r[m]
      if res["status"] in ("not run", "error"):
        notes.append(f"- B={r['B']}, T={r['T']}, {m}: {res['status']}: {res['why']}")
  unavailable = {r[m]["why"] for r in rows for m in _ghost_cases.METHODS if r[m]["status"] == "n/a"}
  notes += [f"- n/a: {why}" for why in sorted(unavailable)]
  if notes:
    out += ["## Cases not run or not available", ""] + notes + [""]
  checks = []
  for r in rows:
    c = r.get("check")
    if c:
      checks.append(
        f"- B={r['B']}, T={r['T']}, l2_norm_clip {r['clip']:.3g}: examples "
        f"clipped: vmap {c['clipped_vmap']}, ghost {c['clipped_ghost']} of "
        f"{r['B']}; ghost's clipped sum differs from vmap's by at most "
        f"{c['max_rel_diff']:.1e} of its largest entry"
      )
    elif "clipped_vmap" in r:
      checks.append(
        f"- B={r['B']}, T={r['T']}, l2_norm_clip {r['clip']:.3g}: examples "
        f"clipped (vmap): {r['clipped_vmap']} of {r['B']}"
      )
  if checks:
    out += ["## Checks (the probe step of each case)", ""] + checks + [""]
  return "\n".join(out)


def plot(path: str, rows: list[dict]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  seq_lens = sorted({r["T"] for r in rows})
  fig, axes = plt.subplots(1, len(seq_lens), figsize=(5.5 * len(seq_lens), 4.5), squeeze=False)
  for ax, t in zip(axes[0], seq_lens, strict=True):
    rs = sorted((r for r in rows if r["T"] == t), key=lambda r: r["B"])
    for m, marker in zip(_ghost_cases.METHODS, "osD", strict=True):
      pts = [(r["B"], r[m]["temp_mb"]) for r in rs if r[m]["temp_mb"]]
      if pts:
        ax.plot(*zip(*pts, strict=True), marker=marker, label=m)
      else:
        ax.plot([], [], marker=marker, label=f"{m}: n/a")
    ax.plot(
      [r["B"] for r in rs],
      [_grad_mb(r["B"], r["params"]) for r in rs],
      "k:",
      label="B x P float32 (per-example grads)",
    )
    ax.set(
      xscale="log",
      yscale="log",
      xlabel="batch size B",
      ylabel="compiled temp memory (MiB)",
      title=f"T = {t} (P = {rs[0]['params']:,} params)",
    )
    ax.set_xticks([r["B"] for r in rs], [str(r["B"]) for r in rs])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.legend(fontsize=8)
  fig.suptitle("Per-example clipping of a tied-head GPT: compiled temporary memory")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> str:
  args = _parser().parse_args(argv)
  if args.peers:  # before anything starts jax's backend: it pins the threads
    from benchmarks import _peers

    return _peers.main(
      args, " ".join(["python -m benchmarks.ghost", *(sys.argv[1:] if argv is None else argv)])
    )
  if args.zoo:
    from benchmarks import _ghost_zoo

    return _ghost_zoo.main(args, " ".join(argv if argv is not None else sys.argv[1:]))
  if args.mask:  # what a Poisson batch's mask costs, ghost and vmap
    return _ghost_mask.main(
      args.out,
      args.quick,
      _ghost_cases.QUICK_MODEL if args.quick else _ghost_cases.MODEL,
      args.reps or (2 if args.quick else 20),
      args.clip,
    )
  quick = args.quick
  reps = args.reps or (2 if quick else 10)
  batches = args.batch or list(QUICK_BATCHES if quick else BATCHES)
  seq_lens = args.seq or list(QUICK_SEQ_LENS if quick else SEQ_LENS)
  model = _ghost_cases.QUICK_MODEL if quick else _ghost_cases.MODEL
  device = jax.devices()[0]
  sizes = ", ".join(
    f"{_model.num_params(_model.GPTConfig(seq_len=t, tied=True, **model)):,} at T={t}"
    for t in seq_lens
  )
  meta = {
    "command": "python -m benchmarks.ghost " + " ".join(argv if argv is not None else sys.argv[1:]),
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{_main._cpu_name()}, {os.cpu_count()} cores; jax device: {device.platform} "
    f"({device.device_kind}); jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
    f"python {platform.python_version()}",
    "model": f"GPT-like (benchmarks/_model.py), vocab {model['vocab']}, d_model "
    f"{model['d_model']}, {model['n_layers']} pre-LayerNorm blocks of "
    f"{model['n_heads']} causal attention heads and a GELU MLP of "
    f"{4 * model['d_model']}, token and position embeddings, output head tied to "
    f"the token embedding; per-example loss: next-token cross-entropy of one "
    f"sequence, mean over its T positions; float32 params: {sizes}",
    "methods": "ghost: "
    + ("available" if _ghost_cases.ghost_available() else "n/a (not in this jaxclip)")
    + "; l2_norm_clip "
    + (
      f"{args.clip:g}"
      if args.clip is not None
      else "for each T, the median per-example gradient norm of "
      f"{_ghost_cases.NORM_SAMPLE} random sequences"
    )
    + f"; {reps} timed steps per case",
    "budgets": f"a case is timed if one step takes at most {args.time_budget:g} s and its "
    f"temporary memory is at most {args.max_gb:g} GiB",
    "load average (1, 5, 15 min) at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
  }
  print(f"{meta['model']}\n{meta['methods']}", flush=True)
  t_start = time.perf_counter()
  timed = not args.memory_only
  rows = run(batches, seq_lens, model, args.clip, reps, args.time_budget, args.max_gb * 1024, timed)
  meta["total benchmark time"] = f"{time.perf_counter() - t_start:.0f} s"
  if not timed:
    meta["methods"] = "compiled only, nothing timed or run (--memory-only)"
  text = markdown(meta, rows)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / ("ghost.md" if timed else "ghost_memory.md")).write_text(text + "\n")
  plot(str(args.out / "ghost.png"), rows)
  command = " ".join(["python -m benchmarks.ghost", *(sys.argv[1:] if argv is None else argv)])
  write_record(
    args.out / "ghost.png", package_sources("benchmarks") + package_sources("workloads"), command
  )
  print(text)
  return text


if __name__ == "__main__":
  main()
