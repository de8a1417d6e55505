"""The benchmark package runs: its quick runs write their tables and figures; its models, tricks."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import jax
import numpy as np

import jaxclip
from benchmarks import (
  _cases,
  _compile_cases,
  _ghost_cases,
  _ghost_report,
  _ghost_zoo,
  _main,
  _model,
  _peers,
  _peers_cases,
  _peers_measure,
  _peers_report,
  _timing,
  ghost,
  ghost_calibrate,
  tricks,
)
from jaxclip._kernel import _platform


def test_benchmark_quick_run_writes_table_and_plot(tmp_path):
  # The full train step runs alone in the next test (--only), so skipped here (--skip).
  text = _main.main(["--quick", "--skip", "full-step", "--out", str(tmp_path)])
  written = (tmp_path / "results.md").read_text()
  assert written.strip() == text.strip()
  assert "## Full train step" not in text
  for section in (
    "## Train step",
    "## Standalone jitted clip",
    "## Compile time",
    "## Compile time (s) of every other transform",
    "## Standalone clip against the tree size",
    "load average",
    "x floor",
  ):
    assert section in text
  for transform in _compile_cases.TRANSFORMS:
    assert f"| {transform} | 10 |" in text
  assert "jaxclip.clip_by_global_norm + adam" in text
  png = (tmp_path / "results.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_full_train_step_alone_in_quick_mode(tmp_path):
  text = _main.main(["--quick", "--only", "full-step", "--out", str(tmp_path)])
  assert "## Full train step: forward + backward + clip + adam" in text
  for section in ("## Train step", "## Standalone jitted clip", "## Compile time"):
    assert section not in text
  cfg = _model.QUICK
  leaves = len(_model.param_shapes(cfg))
  assert f"{_model.num_params(cfg):,} float32 params in {leaves} leaves" in text
  rows = {}
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells[0] in _cases.FULL_STEP_CASES:
      rows[cells[0]] = cells
  assert list(rows) == list(_cases.FULL_STEP_CASES)
  for case, (_, ms, x_adam, iqr, x_optax, temp_mb, _) in rows.items():
    low, high = map(float, iqr.split("-"))
    assert float(ms) > 0 and float(x_adam) > 0 and 0 < low <= high and float(temp_mb) >= 0, case
    assert (x_optax != "n/a") == case.startswith("jaxclip"), case
  # Both clips compute the same update, so the same loss after the same steps.
  jc, ox = rows["jaxclip.clip_by_global_norm + adam"], rows["optax.clip_by_global_norm + adam"]
  assert jc[-1] == ox[-1]
  assert (tmp_path / "results.md").read_text().strip() == text.strip()


def test_full_train_step_model_is_about_20m_params():
  assert 19e6 < _model.num_params(_model.FULL) < 22e6
  cfg = _model.QUICK
  params = _model.init_params(cfg)
  assert {k: v.shape for k, v in params.items()} == _model.param_shapes(cfg)
  loss = _model.loss_fn(params, _model.make_tokens(cfg), cfg)
  # At initialisation the predictions are nearly uniform over the vocabulary.
  assert abs(float(loss) - math.log(cfg.vocab)) < 0.5


def _run_ghost_benchmark(*args: str) -> None:
  """``python -m benchmarks.ghost *args`` in a fresh process, as a user runs it.

  It is compile-bound: it inherits the suite's XLA_FLAGS (tests/conftest.py).
  """
  root = Path(__file__).resolve().parents[1]
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
  }
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.ghost", *args],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]


def _table(text: str) -> tuple[list[str], list[list[str]]]:
  """The header and the rows, as cells, of the table in ``text`` (its lines that start ``| ``)."""
  lines = [line for line in text.splitlines() if line.startswith("| ")]
  header, *rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines)
  return header, rows


def test_ghost_benchmark_quick_run_writes_table_and_plot(tmp_path):
  _run_ghost_benchmark("--quick", "--out", str(tmp_path))
  text = (tmp_path / "ghost.md").read_text()
  assert "- machine: " in text and f"jax {jax.__version__}" in text
  header, cells = _table(text)
  assert header == _ghost_report.HEADER
  rows = [dict(zip(header, row, strict=True)) for row in cells]
  assert [(int(r["B"]), int(r["T"])) for r in rows] == [
    (b, t) for t in ghost.QUICK_SEQ_LENS for b in ghost.QUICK_BATCHES
  ]
  has_ghost = _ghost_cases.ghost_available()
  for r in rows:
    numeric = [
      "B x P x 4 MiB",
      "grad MiB",
      "vmap MiB",
      "grad ms",
      "vmap ms",
      "vmap/grad mem",
      "vmap/grad time",
    ]
    ghost_cols = [c for c in header if "ghost" in c]
    if has_ghost:
      numeric += ghost_cols
    else:
      assert all(r[c] == "n/a" for c in ghost_cols), r
    for c in numeric:
      assert float(r[c]) >= 0 and (float(r[c]) > 0 or "MiB" in c), (c, r)
    assert float(r["vmap ms"]) > 0 and float(r["vmap MiB"]) > 0, r
  # The default clip, the median norm of a sample, clips some of the examples.
  clipped = re.findall(r"examples clipped.*?(\d+) of (\d+)", text)
  assert len(clipped) == len(rows) and any(0 < int(k) < int(n) for k, n in clipped), clipped
  if has_ghost:  # ghost and vmap clip the same examples to the same sum
    assert "ghost's clipped sum differs from vmap's" in text
  png = (tmp_path / "ghost.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_zoo_benchmark_quick_run_writes_its_table(tmp_path):
  # As `python -m benchmarks.ghost --zoo` runs: one tiny model at batch 4.
  _run_ghost_benchmark("--zoo", "--quick", "--models", "jax_scan_mlp", "--out", str(tmp_path))
  text = (tmp_path / "ghost_zoo.md").read_text()
  assert "- machine: " in text and f"jax {jax.__version__}" in text and "load average" in text
  header, cells = _table(text)
  assert header == _ghost_zoo.HEADER
  rows = [dict(zip(header, row, strict=True)) for row in cells]
  assert [(r["model"], r["jax"], int(r["B"])) for r in rows] == [
    ("jax_scan_mlp", jax.__version__, 4)
  ]
  for c in header[4:18]:
    assert float(rows[0][c]) > 0, (c, rows[0])
  assert rows[0]["fallback share"].endswith("%")
  # What auto ran in the row: the program it measured fastest, with the times it measured.
  assert rows[0]["auto"] in {p + " (measured)" for p in _ghost_zoo.PICKS.values()}, rows[0]
  assert re.search(r"- jax_scan_mlp B=4: measured on cpu \(\d+ rounds .* MiB\): .* runs \(", text)
  assert "so a time ratio that close to 1 is noise" in text
  clipped = re.findall(r"examples clipped: vmap (\d+), ghost (\d+), auto (\d+) of 4", text)
  assert len(clipped) == 1 and len(set(clipped[0])) == 1 and 0 < int(clipped[0][0]) < 4
  assert "## The cost model's plan" in text
  assert "`jax_scan_mlp` (" in text  # the model and the leaves that fall back are listed


def test_zoo_benchmark_keeps_the_rows_of_another_jax():
  # One table holds a run on each jax: a run rewriting ghost_zoo.md keeps the rows of another
  # jax (an old table without the jax column takes it from its machine line), not its own.
  old_header = [h for h in _ghost_zoo.HEADER if h != "jax"]
  row = ["jax_scan_mlp", "16", "165,120"] + ["1.0"] * 13 + ["0.8%", "ghost's rules", "none"]
  old = "\n".join(
    [
      "# Ghost norms on the model zoo",
      "",
      "- command: python -m benchmarks.ghost --zoo",
      "- machine: AMD EPYC, 2 cores; jax device: cpu (cpu); jax 0.10.2, jaxlib 0.10.2",
      "",
      "| " + " | ".join(old_header) + " |",
      "|" + "---|" * len(old_header),
      "| " + " | ".join(row) + " |",
    ]
  )
  runs, rows = _ghost_zoo.earlier_runs(old, "0.12.0.1")
  assert rows == [row[:1] + ["0.10.2"] + row[1:]]
  assert len(runs) == 1 and runs[0].startswith("- earlier run on jax 0.10.2")
  assert _ghost_zoo.earlier_runs(old, "0.10.2") == ([], [])  # its own rows are rewritten
  assert _ghost_zoo.earlier_runs(old.replace("| model |", "| name |"), "0.12.0.1")[1] == []
  # The table a 0.12 run wrote, with the 0.10 rows it kept: a new 0.10 run keeps the 0.12 rows
  # and names their run, not the 0.10 run whose rows it rewrites.
  new = "\n".join(
    [
      "# Ghost norms on the model zoo",
      "",
      "- command: python -m benchmarks.ghost --zoo",
      "- machine: AMD EPYC, 2 cores; jax device: cpu (cpu); jax 0.12.0.1, jaxlib 0.12.0.1",
      runs[0],
      "",
      "| " + " | ".join(_ghost_zoo.HEADER) + " |",
      "|" + "---|" * len(_ghost_zoo.HEADER),
      "| " + " | ".join(row[:1] + ["0.12.0.1"] + row[1:]) + " |",
      "| " + " | ".join(rows[0]) + " |",
    ]
  )
  again, kept = _ghost_zoo.earlier_runs(new, "0.10.2")
  assert kept == [row[:1] + ["0.12.0.1"] + row[1:]]
  assert len(again) == 1 and again[0].startswith("- earlier run on jax 0.12.0.1"), again
  assert _ghost_zoo.earlier_runs(new, "0.12.0.1") == (runs, rows)


def test_ghost_benchmark_memory_only_redraws_the_figure_and_times_nothing(tmp_path):
  # ghost.png plots compiled memory, which compiling alone gives: --memory-only redraws it
  # (and its record) without touching ghost.md's timed table.
  ghost.main(["--quick", "--memory-only", "--batch", "2", "--seq", "4", "--out", str(tmp_path)])
  assert not (tmp_path / "ghost.md").exists()
  text = (tmp_path / "ghost_memory.md").read_text()
  header, rows = _table(text)
  assert [row[:2] for row in rows] == [["2", "4"]]
  for row in rows:
    cells = dict(zip(header, row, strict=True))
    assert all(cells[f"{m} ms"] == "not run" for m in _ghost_cases.METHODS), cells
    assert all(float(cells[f"{m} MiB"]) >= 0 for m in _ghost_cases.METHODS), cells
    assert float(cells["vmap MiB"]) > 0, cells
  assert "memory only" in text
  png = (tmp_path / "ghost.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  record = json.loads((tmp_path / "ghost.png.json").read_text())
  assert record["command"] == (
    f"python -m benchmarks.ghost --quick --memory-only --batch 2 --seq 4 --out {tmp_path}"
  )


def test_ghost_benchmark_model_is_a_tied_gpt_of_about_085m_params():
  assert (
    0.8e6
    < _model.num_params(_model.GPTConfig(seq_len=128, tied=True, **_ghost_cases.MODEL))
    < 0.9e6
  )
  cfg = _model.GPTConfig(seq_len=8, batch=3, tied=True, **_ghost_cases.QUICK_MODEL)
  params = _model.init_params(cfg)
  assert "head.kernel" not in params and set(params) == set(_model.param_shapes(cfg))
  tokens = _model.make_tokens(cfg)
  # The loss of one sequence is a per-example loss: their mean is the batch's loss.
  loss = jax.jit(_model.loss_fn, static_argnums=2)
  per_example = jax.jit(jax.vmap(loss, (None, 0, None)), static_argnums=2)(params, tokens, cfg)
  np.testing.assert_allclose(per_example.mean(), loss(params, tokens, cfg), rtol=1e-5)
  assert abs(float(per_example.mean()) - math.log(cfg.vocab)) < 0.5
  # The tied head: the token embedding gets gradient from the output layer too.
  grad = jax.jit(jax.grad(loss), static_argnums=2)(params, tokens[0], cfg)["wte"]
  unused = np.setdiff1d(np.arange(cfg.vocab), np.asarray(tokens[0, :-1]))
  assert np.all(np.abs(np.asarray(grad)[unused]).sum(axis=1) > 0)


def test_each_trick_switch_is_the_public_switch_of_its_trick():
  # The programs each switch changes, and their values: tests/test_platform_tricks.py.
  cpu_tricks = {name for name in jaxclip.platform.TRICKS if not name.startswith("cuda")}
  assert set(tricks.SWITCHES) == set(tricks.ROWS) == cpu_tricks
  for trick, switch in tricks.SWITCHES.items():
    with switch():
      assert [n for n in jaxclip.platform.TRICKS if not _platform.is_on(n)] == [trick]


def test_trick_pairs_turn_their_order_and_switch_only_the_without_side():
  trick = next(iter(tricks.SWITCHES))
  calls = []

  def make_row():
    def run():
      on = _platform.is_on(trick)
      calls.append(on)
      return {"value": 1.0 if on else 2.0, "out": np.zeros(2)}

    return run

  r = tricks.measure(trick, make_row, 4)
  # with, without; then without, with: neither side always runs second.
  assert calls == [True, False, False, True, True, False, False, True]
  assert (r["with"], r["without"], r["same"]) == (1.0, 2.0, True)
  assert _platform.is_on(trick)


def _import_without(*missing):
  def import_module(name):
    if name in missing:
      raise ModuleNotFoundError(f"No module named {name!r}")
    return types.SimpleNamespace(__version__="9.9")

  return import_module


def test_peers_availability_names_the_extra_of_a_missing_peer():
  have = _peers_cases.availability(_import_without("opacus"))
  assert have["jax_privacy"] == ("jax_privacy 9.9", None)
  version, why = have["Opacus"]
  assert (
    version is None and "`opacus`" in why and "`peers` extra" in why and _peers_cases.INSTALL in why
  )
  assert _peers_cases.availability(_import_without("torch"))["Opacus"][1].count("`torch`") == 1
  # The install line is the extra's, and the extra is not the test extra.
  assert 'pip install -e ".[peers]" torch==2.13.0' in _peers_cases.INSTALL
  extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
    "project"
  ]["optional-dependencies"]
  assert {"torch", "opacus", "jax-privacy"} <= {re.split("[<>=]", r)[0] for r in extras["peers"]}
  assert not any(r.startswith(("torch", "opacus", "jaxclip[peers")) for r in extras["test"])


def test_peers_run_without_torch_writes_the_table_and_names_the_extra(
  tmp_path, monkeypatch, capsys
):
  # `--peers` with Opacus missing: its rows read "not installed" and the note names the extra.
  # The measurement is replaced (a real run compiles for minutes); the rows, the ratios, the
  # notes and the file are the benchmark's own code.
  have = _peers_cases.availability(_import_without("torch", "opacus"))
  monkeypatch.setattr(_peers_cases, "availability", lambda: have)
  monkeypatch.setattr(
    _peers_measure, "pin_one_thread", lambda with_torch: f"pinned (torch {with_torch})"
  )
  secs = {"jax grad": [0.10, 0.20, 0.30], "jaxclip ghost": [0.12, 0.26, 0.33]}
  cpus = {"jax grad": [0.10, 0.10, 0.10], "jaxclip ghost": [0.11, 0.11, 0.12]}

  def run(batches, seq_lens, model, clip, reps, probes):
    assert (batches, seq_lens, reps) == ([3], [5], 3)
    rows = _peers_cases.new_rows(3, 5, _peers_cases.availability())
    for key, r in rows.items():
      if r["status"] == "ok":
        r.update(secs=secs.get(key, [0.2, 0.4, 0.6]), cpus=cpus.get(key, [0.2, 0.2, 0.2]))
        r.update(thread=0.99, peak_mb=8.0)
        r.update(
          temp_mb=4.0 if key == "jax grad" else 5.0, check=None if key == "jax grad" else 1e-7
        )
        r["check_ref"] = "jaxclip vmap"
    _peers.add_ratios(rows)
    return list(rows.values())

  monkeypatch.setattr(_peers, "run", run)
  argv = ["--peers", "--batch", "3", "--seq", "5", "--reps", "3", "--out", str(tmp_path)]
  text = ghost.main(argv)
  assert "`peers` extra" in capsys.readouterr().err
  assert (tmp_path / "ghost_peers.md").read_text().strip() == text.strip()
  assert "- threads: pinned (torch False)" in text and "shared with other jobs" in text
  tables = [[]]
  for line in text.splitlines():
    if line.startswith("| "):
      tables[-1].append([c.strip() for c in line.strip("|").split("|")])
    elif tables[-1] and not line.startswith("|---"):
      tables.append([])
  cpu_x, wall_x, peak_x, every = tables[:4]
  assert cpu_x[0][:2] == ["B", "T"] and len(cpu_x[0]) == 2 + len(_peers_report.SUMMARY)
  cpu, wall = (dict(zip(t[0], t[1], strict=True)) for t in (cpu_x, wall_x))
  # Paired wall ratios 1.2, 1.3, 1.1: the median, not the ratio of the medians (1.3 / 0.2).
  assert wall['jaxclip method="ghost"'] == "1.20" and wall['jaxclip method="vmap"'] == "2.00"
  assert cpu['jaxclip method="ghost"'] == "1.10" and cpu['jaxclip method="vmap"'] == "2.00"
  assert cpu["Opacus ghost"] == wall["Opacus hooks"] == "not installed"
  assert dict(zip(peak_x[0], peak_x[1], strict=True))["jax_privacy clipped_grad"] == "1.00"
  assert every[0] == _peers_report.HEADER and len(every) == 1 + len(_peers_cases.CASES)
  rows = {(r[2], r[3]): dict(zip(every[0], r, strict=True)) for r in every[1:]}
  ghost_row = rows[("jaxclip", 'method="ghost"')]
  assert ghost_row["x own wall (IQR)"] == "1.20 (1.15-1.25)" and ghost_row["x own temp"] == "1.25"
  assert ghost_row["wall ms"] == "260.0" and ghost_row["CPU ms"] == "110.0"
  assert ghost_row["busiest thread"] == "99%"
  opacus = [r for (fw, _), r in rows.items() if fw in ("torch", "Opacus")]
  assert len(opacus) == 4 and all(r["CPU ms"] == "not installed" for r in opacus)
  notes = text.split("## Cases not run")[1]
  assert notes.count("`peers` extra") == 4 and _peers_cases.INSTALL in notes


def test_gpu_norm_script_quick_run(tmp_path):
  """benchmarks/gpu_norm.py's smoke run: every formulation gives the float64 norm."""
  from benchmarks import gpu_norm

  forms = "jaxclip.ops|optax|4 groups"  # the kernels' own checks: tests/test_platform_cuda.py
  gpu_norm.main(["--part", "norm", "--out", str(tmp_path), "--quick", "--forms", forms])
  rows = json.loads((tmp_path / "norm.json").read_text())["rows"]
  assert len(rows) == 3, [r["case"] for r in rows]
  assert all("error" not in r and r["rel_err"] < 1e-6 for r in rows), rows
  gpu_norm.main(["--part", "copy", "--out", str(tmp_path), "--quick"])
  cases = [r["case"] for r in json.loads((tmp_path / "copy.json").read_text())["rows"]]
  assert len(cases) >= 5 and any("scale pass" in c for c in cases), cases


def test_ghost_calibration_quick_run_writes_its_table_and_rows(tmp_path):
  ghost_calibrate.main(["--quick", "--out", str(tmp_path)])
  md = tmp_path / f"ghost_calibration-{jax.__version__}.md"
  assert "| dense T=8 16x16 | 4 |" in md.read_text()
  rows = json.loads(md.with_suffix(".json").read_text())["rows"]
  assert {r["case"] for r in rows} == {
    "dense T=8 16x16",
    "lookup V=32 d=8 T=4",
    "scan shared L=4 d=8",
  }
  by_case = {r["case"]: r["work"] for r in rows}
  assert by_case["dense T=8 16x16"]["norm dot:gram"] == 8 * 8 * 32  # T^2 (C + F)
  assert by_case["scan shared L=4 d=8"]["calls"] == 4 and all(r["ghost"] > 0 for r in rows)


def test_ghost_calibration_fit_recovers_the_constants_of_synthetic_times():
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(12):
    work = {"norm dot": float(rng.integers(1, 10**6)), "calls": float(rng.integers(1, 300))}
    work["grad dot"] = float(rng.integers(1, 10**6))
    work["writes"] = float(rng.integers(1, 10**5))
    b = int(rng.choice([16, 128]))
    grad = 1e-3
    ghost = grad + b * 2e-10 * work["norm dot"] + 3e-6 * work["calls"]
    vmap = grad + b * (1e-10 * work["grad dot"] + 5e-9 * work["writes"])
    rows.append({"B": b, "grad": grad, "ghost": ghost, "vmap": vmap, "work": work})
  c = ghost_calibrate.fit(rows)
  norm_dot, calls = c["ghost"][ghost_calibrate.NORM_FORMS.index("dot")], c["ghost"][-1]
  grad_dot, writes = c["vmap"][ghost_calibrate.GRAD_RULES.index("dot")], c["vmap"][-1]
  np.testing.assert_allclose(
    [norm_dot, calls, grad_dot, writes], [2e-10, 3e-6, 1e-10, 5e-9], rtol=1e-6
  )
  for r in rows:
    assert ghost_calibrate.fitted_pick(c, r) == ("ghost" if r["ghost"] <= r["vmap"] else "vmap")


def test_the_committed_memory_figure_is_what_this_library_compiles(tmp_path):
  # ghost.png's record hashes the benchmark's sources, not jaxclip's: a change to the engine
  # that moves its memory leaves the figure stale. Its row at B = 32, T = 128 (moved by the dot
  # rule's unscaled records: 375 -> 350 MiB) is compiled again here
  # and read against ghost_memory.md, on the jax it was drawn with (memory is deterministic).
  committed = (Path(__file__).parents[1] / "benchmarks/results/ghost_memory.md").read_text()
  if f"jax {jax.__version__}," not in committed.splitlines()[4]:
    return  # drawn with another jax: its figures are that XLA's
  ghost.main(["--memory-only", "--batch", "32", "--seq", "128", "--out", str(tmp_path)])
  fresh = (tmp_path / "ghost_memory.md").read_text()
  (head, rows), (fresh_head, fresh_rows) = _table(committed), _table(fresh)
  row = dict(zip(head, next(r for r in rows if r[:2] == ["32", "128"]), strict=True))
  new = dict(zip(fresh_head, fresh_rows[0], strict=True))
  for m in _ghost_cases.METHODS:
    assert row[f"{m} MiB"] == new[f"{m} MiB"], (m, row, new)


def test_interleaved_timing_turns_its_order_by_one_step_each_round():
  calls = []
  steps = {k: (lambda s, k=k: (calls.append(k), s), None) for k in "abc"}
  samples = _timing.interleaved_samples(steps, reps=6, warmup=0)
  assert {k: len(v) for k, v in samples.items()} == {"a": 6, "b": 6, "c": 6}
  rounds = ["".join(calls[i : i + 3]) for i in range(0, len(calls), 3)]
  assert rounds == ["abc", "bca", "cab"] * 2
  # The peers' timing turns its order alike.
  calls.clear()
  _peers_measure.time_interleaved({k: lambda k=k: calls.append(k) for k in "ab"}, reps=3, warmup=1)
  assert "".join(calls) == "abbaabba"
  assert _timing.round_order([], 3) == []
