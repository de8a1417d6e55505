"""The report of ``python -m benchmarks.ghost``: its markdown table and its figure of memory."""

from __future__ import annotations

from benchmarks import _ghost_cases, _report


def _grad_mb(b: int, p: int) -> float:
  """MiB of ``b`` float32 per-example gradients of ``p`` params."""
  return 4 * b * p / 2**20


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
