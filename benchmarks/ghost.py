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
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jaxlib

import benchmarks
from benchmarks import _ghost_cases, _ghost_mask, _ghost_report, _ghost_run, _main, _model
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
    help="the model zoo (workloads/zoo/) instead of the GPT: writes ghost_zoo.md "
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
  rows = _ghost_run.run(
    batches, seq_lens, model, args.clip, reps, args.time_budget, args.max_gb * 1024, timed
  )
  meta["total benchmark time"] = f"{time.perf_counter() - t_start:.0f} s"
  if not timed:
    meta["methods"] = "compiled only, nothing timed or run (--memory-only)"
  text = _ghost_report.markdown(meta, rows)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / ("ghost.md" if timed else "ghost_memory.md")).write_text(text + "\n")
  _ghost_report.plot(str(args.out / "ghost.png"), rows)
  command = " ".join(["python -m benchmarks.ghost", *(sys.argv[1:] if argv is None else argv)])
  write_record(
    args.out / "ghost.png", package_sources("benchmarks") + package_sources("workloads"), command
  )
  print(text)
  return text


if __name__ == "__main__":
  main()
