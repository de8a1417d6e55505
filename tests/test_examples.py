"""Smoke tests: each script in examples/ runs at a tiny size and does its job."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.figure_record import sha256

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[1]


def load(name):
  spec = importlib.util.spec_from_file_location(
    f"jaxclip_example_{name}", ROOT / "examples" / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_exploding_gradients_tiny_run(tmp_path, capsys):
  example = load("exploding_gradients")
  out = tmp_path / "plot.png"
  results = example.main(["--tiny", "--seed", "3", "--seeds", "3", "--out", str(out)])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Its provenance record (tests/test_figures.py): the script that drew it, and how.
  record = json.loads((tmp_path / "plot.png.json").read_text())
  script = ROOT / "examples" / "exploding_gradients.py"
  assert record["inputs"] == {"examples/exploding_gradients.py": sha256(script)}
  command = f"python examples/exploding_gradients.py --tiny --seed 3 --seeds 3 --out {out}"
  assert record["command"] == command
  assert record["figure_sha256"] == sha256(out)
  printed = capsys.readouterr().out
  assert f"plot written to {out}" in printed
  assert "3 seeds (3..5) per method" in printed
  assert "sgd: success = final loss < 0.05 on k of 3 seeds" in printed
  header = next(line for line in printed.splitlines() if line.startswith("method"))
  assert header.split() == [
    "method",
    "success",
    "final",
    "loss",
    "IQR",
    "non-finite",
    "clipped",
    "median",
    "norm",
  ]
  assert list(results) == ["sgd"]
  histories = results["sgd"]
  names = list(histories)
  assert names == list(example.methods())
  assert names[0] == "no clipping"
  for prefix in (
    "clip_by_value",
    "clip_by_norm",
    "clip_by_global_norm",
    "autoclip",
    "zclip",
    "skip_on_spike",
  ):
    assert any(n.startswith(prefix) for n in names), prefix
  # One table row per method: name, k/3 successes, median, IQR, non-finite, clipped, norm.
  rows = [line for line in printed.splitlines() if "/3 " in line]
  assert [r[: len(n)] for r, n in zip(rows, names, strict=True)] == names
  table = {n: r[len(n) :].split() for r, n in zip(rows, names, strict=True)}
  for name, h in histories.items():
    assert h.loss.shape == h.pre_clip_norm.shape == h.clipped.shape == (3, 40), name
    assert np.all(np.isfinite(h.loss)), name
  # Same initialisation and batches per seed for every method; different across seeds.
  first = np.stack([h.pre_clip_norm[:, 0] for h in histories.values()])
  np.testing.assert_array_equal(first, np.broadcast_to(first[0], first.shape))
  assert len(set(first[0].tolist())) == 3
  # Unclipped: nothing clipped, the optimizer sees the raw gradient.
  none = histories["no clipping"]
  assert not none.clipped.any()
  np.testing.assert_array_equal(none.pre_clip_norm, none.post_clip_norm)
  assert table["no clipping"][3:5] == ["0", "0.0%"]
  # The global-norm clip never lets a norm above its threshold through, and
  # "clipped" means exactly that the pre-clip norm was above it.
  g = histories["clip_by_global_norm(1)"]
  assert np.all(g.post_clip_norm <= 1 + 1e-5)
  np.testing.assert_array_equal(g.clipped, g.pre_clip_norm > 1)
  # skip_on_spike: a skipped step hands the optimizer nothing.
  s = histories["skip_on_spike(opt)"]
  np.testing.assert_array_equal(s.post_clip_norm == 0, s.clipped)


def test_exploding_gradients_seed_runs_the_same_alone_and_in_a_batch():
  example = load("exploding_gradients")
  config = example.Config(steps=30, length=8, hidden=8, batch=8, chunk=15)
  for name in ("clip_by_global_norm(1)", "zclip()", "skip_on_spike(opt)"):
    method = example.methods()[name]
    batch = example.train(method, config, "sgd", seeds=[3, 4, 5])
    alone = example.train(method, config, "sgd", seeds=[4])
    np.testing.assert_allclose(alone.loss[0], batch.loss[1], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(alone.clipped[0], batch.clipped[1], err_msg=name)
    assert not np.allclose(batch.loss[0], batch.loss[1])


def test_exploding_gradients_table_counts_dead_seeds_as_failures():
  example = load("exploding_gradients")
  loss = np.full((4, 20), 0.01)
  loss[1, -1] = np.nan  # goes non-finite at the end
  loss[2] = 0.3  # never learns
  loss[3, 5:] = 0.02
  clipped = np.zeros((4, 20), bool)
  clipped[0, :5] = True
  h = example.History(loss, np.ones_like(loss), np.ones_like(loss), clipped, 0.0)
  np.testing.assert_array_equal(example.final_losses(h), [0.01, np.inf, 0.3, 0.02])
  row = example.summary_row("m", h, target=0.05)
  assert (row["success"], row["seeds"], row["non-finite"]) == (2, 4, 1)
  assert (row["q25"], row["median"], row["q75"]) == (0.01, 0.02, 0.3)
  assert row["clipped"] == 5 / 80
  line = example.format_table([row]).splitlines()[-1].split()
  assert line[:3] == ["m", "2/4", "0.02"] and line[4:6] == ["1", "6.2%"]


def test_exploding_gradients_pieces():
  example = load("exploding_gradients")
  import jax

  inputs, targets = example.adding_problem(jax.random.key(0), 4, 10)
  assert inputs.shape == (4, 10, 2) and targets.shape == (4,)
  markers = np.asarray(inputs[..., 1])
  np.testing.assert_array_equal(markers.sum(1), 2)
  np.testing.assert_allclose(
    np.asarray((inputs[..., 0] * inputs[..., 1]).sum(1)), np.asarray(targets), rtol=1e-6
  )
  np.testing.assert_allclose(
    example.smooth(np.array([1.0, np.nan, 3.0, 5.0]), 2), [1.0, 1.0, 3.0, 4.0]
  )
  np.testing.assert_allclose(
    example.smooth(np.array([[1.0, 3.0], [2.0, np.nan]]), 2), [[1.0, 2.0], [2.0, 2.0]]
  )


def test_flax_nnx_example_runs(capsys):
  results = load("flax_nnx_example").main(["--steps", "30"])
  clipped = results["clip_by_global_norm(1.0) + adam"]
  assert np.isfinite(clipped["test_mse"]) and np.isfinite(results["adam"]["test_mse"])
  assert clipped["max_norm"] >= clipped["median_norm"] > 0
  assert "test MSE" in capsys.readouterr().out


def test_equinox_example_runs(capsys):
  results = load("equinox_example").main(["--warmup", "10", "--steps", "20"])
  # The threshold set after the warm-up is the one in the optimizer state.
  assert results["max_norm_in_state"] == pytest.approx(results["threshold"], rel=1e-6)
  assert 0.0 < results["threshold"] < np.inf
  assert np.isfinite(results["final_loss"])
  assert "max_norm set to" in capsys.readouterr().out


def test_clipping_study_tiny_run(tmp_path):
  # In a fresh process, as users run it. The tiny study is compile-bound (36
  # training loops): it inherits the suite's XLA_FLAGS (tests/conftest.py).
  path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
  done = subprocess.run(
    [
      sys.executable,
      str(ROOT / "examples" / "clipping_study.py"),
      "--tiny",
      "--seeds",
      "2",
      "--out",
      str(tmp_path),
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "wall time" in done.stdout
  study = load("clipping_study")
  saved = json.loads((tmp_path / "clipping_study.json").read_text())
  rows, thresholds = saved["rows"], saved["thresholds"]
  task_names = list(study.tasks(tiny=True))
  assert task_names == ["adding", "copy", "heavy-tail"] == list(thresholds)
  check_study_text(study, saved["text"])
  method_names = [r["method"] for r in rows if r["task"] == "adding"]
  assert len(method_names) == 11 and method_names[0] == "no clipping"
  # One row per task and method, in order, with sane values.
  assert [(r["task"], r["method"]) for r in rows] == [
    (t, m) for t in task_names for m in method_names
  ]
  for r in rows:
    assert r["seeds"] == 2 and 0 <= r["success"] <= 2, r
    assert 0 < r["q25"] <= r["median"] <= r["q75"], r
    assert 0.0 <= r["clipped"] <= 1.0 and r["non-finite"] >= 0, r
    if r["method"] == "no clipping":
      assert r["clipped"] == 0.0 and r["threshold"] == "–"
  for name, t in thresholds.items():
    # The fixed thresholds come from suggest_threshold on the recorded run ...
    norm = {int(p): v for p, v in t["global_norm"].items()}
    assert 0 < norm[50] <= norm[90] <= norm[99] < np.inf, name
    assert t["per_tensor"] == pytest.approx(norm[90] / np.sqrt(t["num_tensors"])), name
    assert 0 < t["value"] < np.inf and t["recorded_steps"] == 20, name
    # ... and a global-norm clip lets no norm above its threshold through.
    for p in (50, 90, 99):
      method = f"clip_by_global_norm(p{p})"
      (row,) = [r for r in rows if r["task"] == name and r["method"] == method]
      assert row["max post-clip norm"] <= norm[p] * (1 + 1e-5), (name, p)
      assert row["threshold"] == f"{norm[p]:.3g}"
  # The page holds the table; the figure is a PNG; --replot redraws both from the JSON.
  page = (tmp_path / "clipping_study.md").read_text()
  for r in rows:
    assert f"| {r['task']} | {r['method']} | {r['threshold']} | {r['success']}/2 |" in page
  for name in [*task_names, "text"]:  # one figure per task, each linked from the page
    figure = f"clipping_study_{name}.png"
    assert (tmp_path / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({figure})" in page
  for r in saved["text"]["rows"]:
    assert f"| {r['setting']} | {r['method']} | {r['threshold']} | {r['median']:.3f} |" in page
  again = tmp_path / "again"
  study.main(["--tiny", "--replot", str(tmp_path / "clipping_study.json"), "--out", str(again)])
  assert (again / "clipping_study.md").read_text() == page
  record = json.loads((again / "clipping_study_text.png.json").read_text())
  assert set(record["inputs"]) == {
    "examples/clipping_study.py",
    "examples/_study_text.py",  # the text task
    "examples/exploding_gradients.py",  # its training loop made the data
    str((tmp_path / "clipping_study.json").resolve()),  # the data it drew
  }


def check_study_text(study, text):
  """The tiny study's text task: its corpus, scores, spikes, Muon placements and recipe table."""
  corpus = study.st.load_corpus(max_files=20)
  assert text["corpus"]["files"] == 20 and text["corpus"]["validation files"] == 2
  assert text["corpus"]["files_sha256"] == corpus.files_sha256
  assert text["corpus"]["bytes_sha256"] == corpus.bytes_sha256
  assert text["corpus"]["train bytes"] == corpus.train.size > 0
  settings = list(text["settings"])
  assert [s.split()[0] for s in settings] == ["AdamW"] * 4 + ["Muon"]
  rows = {(r["setting"], r["method"]): r for r in text["rows"]}
  high, muon = settings[2], settings[4]
  assert list(rows) == [
    (high, "no clipping"),
    (high, "clip_by_global_norm(p50)"),
    *((muon, m) for m in study.TEXT_MUON_TINY),
  ]
  for r in text["rows"]:
    # Bits per byte: below the 8 of a model that learned nothing, on every seed.
    assert 0 < r["best"] <= r["q25"] <= r["median"] <= r["q75"] <= r["worst"] < 8, r
    assert r["seeds"] == 2 and 0 <= r["seeds with spikes"] <= 2 and r["spikes"] >= 0, r
  assert rows[high, "no clipping"]["clipped"] == 0.0
  p50 = text["thresholds"][high]["global_norm"]["50"]
  assert rows[high, "clip_by_global_norm(p50)"]["max post-clip norm"] <= p50 * (1 + 1e-5)
  # Muon: the clip after the optimizer bounds the update's norm by its threshold.
  after = rows[muon, "clip update after (global p50)"]
  assert after["max post-clip norm"] <= float(after["threshold"]) * (1 + 1e-3)
  assert 0 < after["clipped"] < 1
  # The recipe table: every window and percentile; a higher percentile, a higher threshold.
  recipe = text["recipe"]
  assert [(r["window"], r["percentile"]) for r in recipe] == [
    (w, p) for w in text["windows"] for p in (50, 90, 99)
  ]
  for w in text["windows"]:
    mine = [r for r in recipe if r["window"] == w]
    assert mine[0]["threshold"] <= mine[1]["threshold"] <= mine[2]["threshold"], w
    assert mine[0]["clipped"] >= mine[1]["clipped"] >= mine[2]["clipped"], w


def test_study_spikes_count_each_run_of_high_losses_once():
  study = load("clipping_study")
  loss = np.full((2, 120), 2.0)
  loss[0, 60:63] = 3.0  # one spike of three steps
  loss[0, 90] = 2.4  # under 1.25 times the median: not a spike
  loss[1, 70] = np.nan  # a non-finite loss is a spike
  loss[1, 100] = 2.6
  loss[1, 10] = 9.0  # before a full window of history: not counted
  np.testing.assert_array_equal(study.st.spikes(loss), [1, 2])


def test_dp_sgd_tiny_run(tmp_path, capsys):
  pytest.importorskip("dp_accounting")
  import jaxclip

  example = load("dp_sgd")
  out = tmp_path / "dp.png"
  results = example.main(["--tiny", "--out", str(out)])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Its provenance record (tests/test_figures.py): the script that drew it, and how.
  record = json.loads((tmp_path / "dp.png.json").read_text())
  script = ROOT / "examples" / "dp_sgd.py"
  assert record["inputs"] == {"examples/dp_sgd.py": sha256(script)}
  assert record["command"] == f"python examples/dp_sgd.py --tiny --out {out}"
  assert record["figure_sha256"] == sha256(out)
  printed = capsys.readouterr().out
  assert f"plot written to {out}" in printed
  assert "Poisson batches, sampling rate q=0.0625" in printed
  # The noise comes from calibrate_noise for the target ε = 2: the printed ε (dp_epsilon,
  # PLD) of both multipliers is at most 2, and 1% less noise would miss it.
  q, steps = 64 / 1024, 60
  sigmas = [float(s) for s in re.findall(r"σ=(\d+\.\d{4})", printed)]
  epsilons = [float(e) for e in re.findall(r"ε=(\d+\.\d{3}) \(PLD\)", printed)]
  assert len(sigmas) == 2 and sigmas[1] > sigmas[0] and len(epsilons) == 2
  assert all(1.9 < e <= 2.0 for e in epsilons), epsilons
  for sigma, count in zip(sigmas, (None, 64 / 20), strict=True):
    assert jaxclip.dp_epsilon(sigma / 1.01, q, steps, 1e-5, count_stddev=count) > 2.0
  assert list(results) == ["non-private", "fixed C", "adaptive C", "normalized"]
  plain = results["non-private"]
  for name, h in results.items():
    assert h.loss.shape == h.clip_norm.shape == h.median_norm.shape == (60,), name
    assert np.all(np.isfinite(h.loss)), name
    assert 0.0 <= h.test_accuracy <= 1.0, name
    assert f"\n{name} " in printed, name  # a table row
    assert list(h.eval_steps) == [30, 60] and h.eval_accuracy[-1] == h.test_accuracy, name
    # Poisson batches: every run draws the same ones, around the expected 64.
    np.testing.assert_array_equal(h.batch_size, plain.batch_size)
    assert not h.overflow.any(), name
  assert np.all(np.isnan(plain.clip_norm))
  assert len(set(plain.batch_size.tolist())) > 5 and 50 < plain.batch_size.mean() < 78
  # The fixed C is the public median norm, the same in the fixed and normalized runs.
  fixed, adaptive, normalized = (results[n] for n in ("fixed C", "adaptive C", "normalized"))
  assert np.all(fixed.clip_norm == fixed.clip_norm[0]) and fixed.clip_norm[0] > 0.1
  np.testing.assert_array_equal(normalized.clip_norm, fixed.clip_norm)
  assert f"fixed C = {fixed.clip_norm[0]:.4g}" in printed
  # The adaptive C starts at --initial-clip, far below the norms, and moves up to them:
  # it ends within a factor 3 of the median norm, from a factor of over 10 below.
  assert adaptive.clip_norm[0] == pytest.approx(0.1)
  assert np.all(np.isfinite(adaptive.clip_norm)) and np.all(adaptive.clip_norm > 0)
  assert adaptive.median_norm[0] > 10 * adaptive.clip_norm[0]
  late_norm = np.median(adaptive.median_norm[-10:])
  assert late_norm / 3 < adaptive.clip_norm[-1] < 3 * late_norm
  assert adaptive.clipped[0] == 1.0  # C = 0.1 clips every example of the first batch
  for h in (fixed, adaptive, normalized):
    assert np.all((h.clipped >= 0) & (h.clipped <= 1))
  # The non-private run learns.
  assert np.mean(plain.loss[-10:]) < 0.8 * np.mean(plain.loss[:10])


def test_dp_sgd_without_noise_or_clipping_is_the_plain_run():
  # No noise and a C far above every norm: the private step is the mean gradient,
  # so with the same initialisation, batches and optimizer it retraces the plain run.
  example = load("dp_sgd")
  pytest.importorskip("scipy")
  config = example.Config(steps=20, train_size=256, test_size=64, hidden=8, batch=32, chunk=20)
  import jaxclip

  dp = jaxclip.DPSGD(256, 32, 20, 1.0, 1e-5, 1e6, max_batch_size=64, accountant="rdp")
  dp.noise_multiplier = 0.0  # no noise
  privacy = example.Privacy(fixed=dp, adaptive=dp)
  plain, _ = example.train(config, "non-private", privacy)
  dp, _ = example.train(config, "fixed C", privacy)
  assert np.all(dp.clipped == 0) and np.all(dp.clip_norm == 1e6)
  np.testing.assert_allclose(dp.loss, plain.loss, rtol=1e-4)
