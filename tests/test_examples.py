"""Smoke tests: each script in examples/ runs at a tiny size and does its job."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

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
  histories = example.main(["--tiny", "--seed", "3", "--out", str(out)])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  printed = capsys.readouterr().out
  assert f"plot written to {out}" in printed
  assert "final loss" in printed and "clipped" in printed
  names = list(histories)
  assert names[0] == "no clipping"
  assert any(n.startswith("clip_by_value") for n in names)
  assert any(n.startswith("clip_by_norm") for n in names)
  assert any(n.startswith("clip_by_global_norm") for n in names)
  assert any(n.startswith("autoclip") for n in names)
  assert any(n.startswith("zclip") for n in names)
  for name, h in histories.items():
    assert h.loss.shape == h.pre_clip_norm.shape == h.clipped.shape == (40,)
    assert np.all(np.isfinite(h.loss)), name
  # Same initialisation and batches: the first step's gradient is the same for all.
  first = {float(h.pre_clip_norm[0]) for h in histories.values()}
  assert len(first) == 1
  # Unclipped: nothing clipped, adam sees the raw gradient.
  none = histories["no clipping"]
  assert not none.clipped.any()
  np.testing.assert_array_equal(none.pre_clip_norm, none.post_clip_norm)
  # The global-norm clip never lets a norm above its threshold through.
  name = next(n for n in names if n.startswith("clip_by_global_norm"))
  threshold = float(np.median(none.pre_clip_norm))
  assert np.all(histories[name].post_clip_norm <= threshold * (1 + 1e-5))
  assert histories[name].clipped.any()


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
