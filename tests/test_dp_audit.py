"""The empirical privacy audit (benchmarks/dp_audit.py) passes correct DP-SGD and flags broken.

An audit that cannot fail proves nothing: the same audit (canaries, one
training run, ``jax_privacy.auditing``'s one-run lower bound on ε) must stay
at most the claimed ε on the correct pipeline and exceed it, by a wide
margin, on each broken one (a public noise seed, no noise, a NaN example
through a clip without a guard). The runs draw their randomness from the
operating system, as a private run must: the correct pipeline's bound
exceeds the claimed ε with probability at most the audit's significance
(5%) if jaxclip is right, and far less in practice (the audit is loose:
its bound there is about 0.0-0.2 against a claimed ε of 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxclip
from benchmarks import _dpsgd, dp_audit


def _table(text: str) -> dict[str, dict[str, str]]:
  """The audit's markdown table, a row (cells by column) per pipeline."""
  lines = [line for line in text.splitlines() if line.startswith("| ")]
  header, *rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines)
  assert header == dp_audit.HEADER
  return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def test_audit_passes_the_correct_pipeline_and_flags_each_broken_one(tmp_path):
  cfg = _dpsgd.Config()
  out = tmp_path / "dp_audit.md"
  text = dp_audit.main(["--only", "correct", *dp_audit.BROKEN, "--out", str(out)])
  assert out.read_text() == text
  rows = _table(text)
  assert list(rows) == ["correct", *dp_audit.BROKEN]
  claimed = float(rows["correct"]["claimed ε"])
  assert 0.9 * cfg.target_epsilon <= claimed <= cfg.target_epsilon
  for name, row in rows.items():
    in_, out_ = map(int, row["canaries in / out"].split(" / "))
    assert in_ + out_ == cfg.canaries and min(in_, out_) > 0.4 * cfg.canaries, name
  correct = float(rows["correct"]["audited ε ≥ (one run, 95%)"])
  assert correct <= claimed and rows["correct"]["flagged"] == "no"
  for name in dp_audit.BROKEN:
    # A perfect attack on 1,000 canaries certifies about 4.7: each broken pipeline comes
    # within a few canaries of it (those never drawn), over 4 times the claimed ε.
    assert float(rows[name]["audited ε ≥ (one run, 95%)"]) > 4 * claimed, name
    assert rows[name]["flagged"] == "yes" and rows[name]["ε of what ran"] == "∞", name


def test_every_batch_fits_its_rows_and_the_canaries_are_clipped():
  # The audited pipeline is the accounted one: no batch truncated (the Poisson analysis
  # holds), and every canary's gradient is clipped to -C e_j (so a drawn canary moves its
  # coordinate by exactly lr C / B without noise).
  cfg = _dpsgd.QUICK
  rows = dp_audit.one_run_audits(cfg, 1.0, ("correct", "no noise"))
  assert rows["correct"]["overflow"] == rows["no noise"]["overflow"] == 0
  data = _dpsgd._canary_rows(np.arange(3), cfg.features)
  params = {"w": jnp.zeros(cfg.features), "c": jnp.full(cfg.canaries, 10.0)}
  total, num_clipped = jaxclip.per_example_clipped_grad(_dpsgd.example_loss, cfg.clip)(
    params, *(jnp.asarray(data[k]) for k in ("x", "slot", "s", "y"))
  )
  assert int(num_clipped) == 3
  np.testing.assert_allclose(total["c"][:3], -cfg.clip, rtol=1e-6)
  assert not np.any(total["c"][3:]) and not np.any(total["w"])


def test_textbook_clip_is_the_library_clip_but_for_non_finite_examples():
  # The broken pipeline differs from jaxclip's only in what a NaN example does.
  cfg = _dpsgd.QUICK
  rng = np.random.default_rng(0)
  data = _dpsgd._concat(
    _dpsgd._data(6, cfg.features, rng), _dpsgd._canary_rows(np.array([1]), cfg.features)
  )
  keys = ("x", "slot", "s", "y")
  batch = [jnp.asarray(data[k]) for k in keys]
  params = {"w": jnp.ones(cfg.features), "c": jnp.zeros(4)}
  mask = jnp.array([True, False, True, True, True, True, True])
  ours = jaxclip.per_example_clipped_grad(_dpsgd.example_loss, 0.5)(
    params, *batch, example_mask=mask
  )[0]
  textbook = _dpsgd.textbook_clipped_grad(_dpsgd.example_loss, 0.5)(
    params, *batch, example_mask=mask
  )[0]
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  jax.tree.map(close, ours, textbook)
  nan_row = _dpsgd._canary_rows(np.array([0]), cfg.features, x_value=float("nan"))
  nan_batch = [jnp.concatenate([jnp.asarray(data[k]), nan_row[k]]) for k in keys]
  leaky = _dpsgd.textbook_clipped_grad(_dpsgd.example_loss, 0.5)
  present = leaky(params, *nan_batch, example_mask=jnp.append(mask, True))[0]
  absent = leaky(params, *nan_batch, example_mask=jnp.append(mask, False))[0]
  assert np.all(np.isnan(present["w"])) and np.all(np.isnan(present["c"]))
  jax.tree.map(close, absent, textbook)


def test_audit_passes_jaxclips_clip_with_a_nan_example():
  # The same NaN-example runs that flag the hand-written clip, through per_example_clipped_grad:
  # a non-finite example contributes zero (issue #48, point 1), so the runs with it and without
  # it are the same, and the audit's bound stays at most the claimed ε; every run that drew the
  # example into a batch counted it (return_num_nonfinite=), and no other run did.
  cfg = _dpsgd.Config()
  result = dp_audit.run(cfg, ("NaN example, jaxclip's clip",))
  row = result["rows"]["NaN example, jaxclip's clip"]
  assert row["epsilon_lb"] <= result["claimed"] and not row["flagged"]
  assert row["true_epsilon"] == result["claimed"]
  assert row["drawn"] > 0.9 * row["in"] and row["counted"] == row["drawn"]
  assert row["counted_when_drawn"]
