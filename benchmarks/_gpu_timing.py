"""How ``benchmarks.gpu_norm`` times a step: calls back to back, and the device kernels it runs."""

from __future__ import annotations

import glob
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax


def wall(step: Callable[[Any], tuple[Any, Any]], state: Any, reps: int, rounds: int = 5):
  """``(median seconds per call, state)``: ``reps`` calls back to back per round."""
  for _ in range(2):
    out, state = step(state)
  jax.block_until_ready((out, state))
  per = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(reps):
      out, state = step(state)
    jax.block_until_ready((out, state))
    per.append((time.perf_counter() - t0) / reps)
  return statistics.median(per), state


def _gpu_events(path: str) -> list[tuple[int, int, str]]:
  """``(start_ns, duration_ns, name)`` of every device kernel/memcpy in an xplane file."""
  from jax.profiler import ProfileData

  data = ProfileData.from_file(path)
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      events.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
  return sorted(events)


def kernels(step: Callable[[Any], tuple[Any, Any]], state: Any, calls: int = 3):
  """Per-call device kernels of ``step``: ``({count, sum_us, span_us, top}, state)``.

  ``calls`` calls are traced, 20 ms apart; the events are split into calls at
  gaps of more than 5 ms and the median call (by span) is reported.
  """
  if jax.default_backend() != "gpu":
    return None, state
  out, state = step(state)
  jax.block_until_ready((out, state))
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(calls):
      out, state = step(state)
      jax.block_until_ready((out, state))
      time.sleep(0.02)
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    events = _gpu_events(files[-1]) if files else []
  groups: list[list[tuple[int, int, str]]] = []
  for e in events:
    if groups and e[0] - (groups[-1][-1][0] + groups[-1][-1][1]) < 5_000_000:
      groups[-1].append(e)
    else:
      groups.append([e])
  if not groups:
    return {"count": 0}, state
  summary = []
  for g in groups:
    span = (max(s + d for s, d, _ in g) - g[0][0]) / 1e3
    summary.append((span, g))
  summary.sort(key=lambda t: t[0])
  span, g = summary[len(summary) // 2]
  by_name: dict[str, list[float]] = {}
  for _, dur, name in g:
    by_name.setdefault(name, []).append(dur / 1e3)
  top = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:8]
  return {
    "count": len(g),
    "sum_us": sum(d for _, d, _ in g) / 1e3,
    "span_us": span,
    "calls_seen": len(groups),
    "top": [{"name": k[:80], "n": n, "us": round(t, 2)} for t, n, k in top],
  }, state


_SINK: list[Any] = []  # (path, meta): measure() rewrites the part's JSON after every row


def measure(name, step, state, nbytes, reps, rows, ref=None, value=None):
  """Wall time and kernels of ``step``; appends a row; returns the new state."""
  t, state = wall(step, state, reps)
  k, state = kernels(step, state)
  row = {"case": name, "ms": 1e3 * t, "bytes": nbytes, "gbps": nbytes / t / 1e9}
  if k:
    row["kernels"] = k
    if k.get("sum_us"):
      row["kernel_gbps"] = nbytes / (k["sum_us"] * 1e-6) / 1e9
      row["span_gbps"] = nbytes / (k["span_us"] * 1e-6) / 1e9
  if ref is not None and value is not None:
    row["rel_err"] = abs(float(value) - ref) / ref
  rows.append(row)
  if _SINK:
    _SINK[0].write_text(json.dumps({"meta": _SINK[1], "rows": rows}, indent=1))
  k_txt = (
    ""
    if not k or "sum_us" not in k
    else (
      f" kernels {k['count']} sum {k['sum_us']:.0f}us span {k['span_us']:.0f}us "
      f"({row['kernel_gbps']:.0f}/{row['span_gbps']:.0f} GB/s)"
    )
  )
  err = f" err {row['rel_err']:.1e}" if "rel_err" in row else ""
  print(f"{name:48s} {1e3 * t:8.3f} ms {row['gbps']:7.0f} GB/s{k_txt}{err}", flush=True)
  return state
