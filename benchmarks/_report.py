"""Formats the benchmark's results as a markdown report and a PNG plot."""

from __future__ import annotations

import math
from typing import Any


def _f(x: Any, fmt: str = "{:.2f}") -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "n/a"
  return fmt.format(x)


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def _seconds(entry: tuple[str, Any]) -> str:
  status, sec = entry
  if status == "ok":
    return _f(sec)
  return f"> {sec:.0f} (timed out)" if status == "timeout" else status


def _ratio(entry: tuple[str, Any], base: tuple[str, Any]) -> str:
  ok = entry[0] == "ok" and base[0] == "ok" and base[1]
  return _f(entry[1] / base[1]) if ok else "n/a"


def markdown(
  meta: dict,
  train: list[dict],
  standalone: list[list[dict]],
  compile_rows: list[dict],
  impls: tuple[str, ...],
  size_rows: list[dict],
  temp_rows: list[dict],
  transform_rows: list[dict] = (),
  full_step: dict | None = None,
) -> str:
  out = ["# jaxclip benchmark results", ""]
  out += [f"- {k}: {v}" for k, v in meta.items()]
  out += [
    "",
    "Times are medians of the repetitions. The train steps are timed interleaved "
    "(one step of each case in turn, together with the floor's read pass), so that "
    "all of them sample the same stretch of a machine whose speed drifts. `x floor` "
    "divides by the bandwidth floor measured in the same run: for a train step, adam "
    "alone plus one read pass over the gradients (none for value clipping); for a "
    "standalone clip, one read pass plus one in-place scale pass over one flat buffer "
    "of the same bytes.",
    "",
  ]
  if train:
    out += [f"## Train step: clip + adam, {meta['train tree']}", ""]
    out.append(
      _table(
        ["case", "median ms", "x adam", "x optax", "x floor", "temp MiB"],
        [
          [
            r["case"],
            _f(r["ms"], "{:.1f}"),
            _f(r["x_adam"], "{:.3f}"),
            _f(r.get("x_optax"), "{:.3f}"),
            _f(r["x_floor"], "{:.3f}"),
            _f(r["temp_mb"], "{:.1f}"),
          ]
          for r in train
        ],
      )
    )
    out.append("")
  if full_step:
    n = full_step["params"]
    size = f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"
    out += [
      f"## Full train step: forward + backward + clip + adam, a {size}-parameter GPT",
      "",
      f"A GPT-like model in pure JAX ({full_step['model']}; "
      f"{full_step['params']:,} float32 params in {full_step['leaves']} leaves), random "
      f"tokens. Each case is one jitted step (loss, gradients, clip, adam; params and "
      f"optimizer state donated), {full_step['reps']} steps each, timed interleaved. "
      f"`temp MiB` is the compiled step's temporary buffers (activations and gradients "
      f"included). `x adam, per-step IQR` is the interquartile range of the ratios of "
      f"each step to adam's in the same round: the noise on `x adam`. `loss` is the loss "
      f"of the last step timed: the two clips must agree.",
      "",
    ]
    out.append(
      _table(
        ["case", "median ms", "x adam", "x adam, per-step IQR", "x optax", "temp MiB", "loss"],
        [
          [
            r["case"],
            _f(r["ms"], "{:.1f}"),
            _f(r["x_adam"], "{:.3f}"),
            "{:.3f}-{:.3f}".format(*r["x_adam_iqr"]),
            _f(r.get("x_optax"), "{:.3f}"),
            _f(r["temp_mb"], "{:.1f}"),
            _f(r["loss"], "{:.4f}"),
          ]
          for r in full_step["rows"]
        ],
      )
    )
    out.append("")
  for rows in standalone:
    out += [f"## Standalone jitted clip (donated), {meta['clip tree']}", ""]
    out.append(
      _table(
        ["case", "median ms", "GB/s", "% peak", "x floor", "x optax", "x torch", "temp MiB"],
        [
          [
            r["case"],
            _f(r["ms"], "{:.2f}"),
            _f(r.get("gbps"), "{:.1f}"),
            _f(r.get("pct_peak"), "{:.0f}"),
            _f(r.get("x_floor"), "{:.3f}"),
            _f(r.get("x_optax"), "{:.3f}"),
            _f(r.get("x_torch"), "{:.3f}"),
            _f(r.get("temp_mb"), "{:.1f}"),
          ]
          for r in rows
        ],
      )
    )
    out.append("")
  if temp_rows:
    out += ["## Extra buffers of the compiled train step (XLA memory analysis)", ""]
    out.append(
      _table(
        ["dtype", "case", "temp MiB", "gradients MiB"],
        [
          [r["dtype"], r["case"], _f(r["temp_mb"], "{:.2f}"), _f(r["grads_mb"], "{:.1f}")]
          for r in temp_rows
        ],
      )
    )
    out.append("")
  if compile_rows:
    out += [
      "## Compile time (s, trace + lower + compile) against the number of leaves",
      "",
      "Small float32 leaves: `(64,)` each, or mixed 1-D/2-D shapes of 64-100 elements. "
      "`xN` is the ratio to the bare `jax.tree.map(lambda x: x * s, tree)`. Each figure is "
      "the median of the compiles per impl listed above, each in a fresh process, the impls "
      "compiled in turn.",
      "",
    ]
    header = ["leaves"]
    for impl in impls:
      header += [impl] + ([] if impl == impls[0] else ["x"])
    body = []
    for r in compile_rows:
      line = [f"{r['leaves']}{' (mixed)' if r['mixed'] else ''}"]
      for impl in impls:
        line.append(_seconds(r[impl]))
        if impl != impls[0]:
          line.append(_ratio(r[impl], r[impls[0]]))
      body.append(line)
    out.append(_table(header, body))
    out.append("")
  if transform_rows:
    out += [
      "## Compile time (s) of every other transform of `jaxclip.__all__`",
      "",
      "The same trees and method as the sweep above, at its largest leaf count; the "
      "bare tree_map and `optax.adam`'s own update were compiled in the same turns. "
      "`adaptive_grad_clip` also reads "
      "the params, a second tree of the same shapes passed as its own argument. "
      "optax's counterparts (`optax.clip` for clip_by_value, `optax.apply_if_finite` "
      "for skip_nonfinite) were compiled on the uniform tree only.",
      "",
    ]
    out.append(
      _table(
        [
          "transform",
          "leaves",
          "tree_map x*s",
          "adam",
          "jaxclip",
          "x tree_map",
          "x adam",
          "optax",
          "x tree_map",
        ],
        [
          [
            r["transform"],
            f"{r['leaves']}{' (mixed)' if r['mixed'] else ''}",
            _seconds(r["tree_map"]),
            _seconds(r.get("adam", ("none", None))),
            _seconds(r["jaxclip"]),
            _ratio(r["jaxclip"], r["tree_map"]),
            _ratio(r["jaxclip"], r.get("adam", ("none", None))),
            _seconds(r["optax"]),
            _ratio(r["optax"], r["tree_map"]),
          ]
          for r in transform_rows
        ],
      )
    )
    out.append("")
  if size_rows:
    out += ["## Standalone clip against the tree size (GPT-2 shapes, widths divided)", ""]
    out.append(
      _table(
        ["params", "floor ms", "jaxclip ms", "x floor", "jaxclip GB/s", "optax ms", "torch ms"],
        [
          [
            f"{r['params'] / 1e6:.1f}M",
            _f(r["floor_ms"]),
            _f(r["jaxclip_ms"]),
            _f(r["jaxclip_ms"] / r["floor_ms"], "{:.3f}"),
            _f(r["jaxclip_gbps"], "{:.1f}"),
            _f(r["optax_ms"]),
            _f(r["torch_ms"]),
          ]
          for r in size_rows
        ],
      )
    )
    out.append("")
  return "\n".join(out)


def plot(
  path: str, compile_rows: list[dict], impls: tuple[str, ...], size_rows: list[dict]
) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  rows = [r for r in compile_rows if not r["mixed"]]
  for impl in impls:
    pts = [(r["leaves"], r[impl][1]) for r in rows if r[impl][0] == "ok"]
    if pts:
      ax1.plot(*zip(*pts, strict=True), marker="o", label=impl)
    cut = [(r["leaves"], r[impl][1]) for r in rows if r[impl][0] == "timeout"]
    if cut:
      ax1.scatter(*zip(*cut, strict=True), marker="^", color="red", zorder=3)
  ax1.set(
    xscale="log",
    yscale="log",
    xlabel="number of leaves",
    ylabel="compile time (s)",
    title="Compile time (red ^: timed out)",
  )
  if ax1.lines:
    ax1.legend(fontsize=8)
  if size_rows:
    params = [r["params"] for r in size_rows]
    for key, label in (
      ("floor_ms", "bandwidth floor"),
      ("jaxclip_ms", "jaxclip"),
      ("optax_ms", "optax"),
      ("torch_ms", "torch foreach"),
    ):
      vals = [r[key] for r in size_rows]
      if all(v is not None for v in vals):
        style = "--" if key == "floor_ms" else "-"
        ax2.plot(params, vals, marker="o", label=label, linestyle=style)
    ax2.set(
      xscale="log",
      yscale="log",
      xlabel="parameters",
      ylabel="clip_by_global_norm (ms)",
      title="Standalone jitted clip (donated)",
    )
    ax2.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def num(x: float | None) -> str:
  """Three significant figures or so, never in scientific notation."""
  if x is None or math.isnan(x) or math.isinf(x):
    return "n/a"
  if abs(x) >= 100:
    return f"{x:.0f}"
  return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3f}"
