"""skip_above, skip_bad_microbatches, record_norms, and where each goes around optax.MultiSteps.

The claims of docs/accumulation.md are tested here, and its code blocks run.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from tests.test_robust import assert_bit_identical

NAN, INF = float("nan"), float("inf")
ROOT = Path(__file__).resolve().parents[1]


def vec(*values):
  return jnp.array(values, jnp.float32)


def steps(tx, grads, params):
  """Steps ``tx`` over ``grads``: per step (updates, state, new state, params, new params)."""
  update, state, out = jax.jit(tx.update), tx.init(params), []
  for g in grads:
    updates, new_state = update(g, state, params)
    new_params = optax.apply_updates(params, updates)
    out.append((updates, state, new_state, params, new_params))
    state, params = new_state, new_params
  return out


# -------------------------------------------------------------------- skip_above


def test_skip_above_skips_large_and_nonfinite_steps_bit_identically():
  tx = jaxclip.skip_above(optax.adam(0.1), 10.0)
  grads = [
    vec(3.0, 4.0),
    vec(30.0, 40.0),
    vec(NAN, 1.0),
    vec(1.0, INF),
    vec(6.0, 8.0),
    vec(1e30, 1e30),
  ]
  out = steps(tx, grads, jnp.zeros(2))
  bad = [False, True, True, True, False, True]
  for (updates, old, new, p_old, p_new), is_bad in zip(out, bad, strict=True):
    assert bool(new.above_step_skipped) == is_bad
    if is_bad:
      assert_bit_identical(new.inner_state, old.inner_state)
      assert_bit_identical(p_new, p_old)
      assert not np.any(np.asarray(updates))
    else:
      assert np.all(np.isfinite(np.asarray(p_new))) and np.any(np.asarray(updates))
  assert int(out[-1][2].num_above_skipped) == 4
  assert int(optax.tree.get(out[-1][2], "count")) == 2  # adam moved on the two good steps
  np.testing.assert_allclose(out[1][2].skip_above_norm, 50.0)
  assert np.isnan(out[2][2].skip_above_norm) and out[2][2].skip_above_norm.dtype == jnp.float32


def test_skip_above_around_clip_skips_above_d_and_clips_to_c():
  c, d = 1.0, 10.0
  tx = jaxclip.skip_above(optax.chain(jaxclip.clip_by_global_norm(c), optax.sgd(1.0)), d)
  out = steps(tx, [vec(0.3, 0.4), vec(3.0, 4.0), vec(30.0, 40.0)], jnp.zeros(2))
  np.testing.assert_allclose(out[0][0], -vec(0.3, 0.4), rtol=1e-6)  # below c: as is
  np.testing.assert_allclose(out[1][0], -vec(0.6, 0.8), rtol=1e-6)  # between: clipped to c
  np.testing.assert_array_equal(out[2][0], vec(0.0, 0.0))  # above d: skipped
  assert [bool(o[2].above_step_skipped) for o in out] == [False, False, True]
  # pre_clip_norm (inside) kept the last step that went through.
  np.testing.assert_allclose(optax.tree.get(out[2][2], "pre_clip_norm"), 5.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, INF, NAN, [1.0, 2.0]])
def test_skip_above_and_skip_bad_microbatches_validate_max_norm(bad):
  with pytest.raises(ValueError, match="max_norm"):
    jaxclip.skip_above(optax.sgd(1.0), bad)
  with pytest.raises(ValueError, match="max_norm"):
    jaxclip.skip_bad_microbatches(bad)


def test_skip_above_under_inject_hyperparams_and_jit():
  tx = optax.inject_hyperparams(jaxclip.skip_above)(optax.sgd(1.0), max_norm=4.0)
  out = steps(tx, [vec(3.0, 4.0), vec(1.0, 1.0)], jnp.zeros(2))
  assert [bool(optax.tree.get(o[2], "above_step_skipped")) for o in out] == [True, False]
  state = out[-1][2]
  state.hyperparams["max_norm"] = jnp.asarray(6.0)
  updates, state = jax.jit(tx.update)(vec(3.0, 4.0), state, jnp.zeros(2))
  assert not bool(optax.tree.get(state, "above_step_skipped"))
  np.testing.assert_allclose(updates, -vec(3.0, 4.0))


def test_skip_above_with_axis_name_under_vmap():
  # Two shards of w: only their norm together is above 6, so both skip.
  tx = jaxclip.skip_above(optax.sgd(1.0), 6.0, axis_name="i")

  def step(g):
    updates, state = tx.update(g, tx.init(g), g)
    return updates, state.above_step_skipped, state.skip_above_norm

  updates, skipped, norm = jax.vmap(step, axis_name="i")(jnp.array([[3.0, 4.0], [0.0, 5.0]]))
  np.testing.assert_allclose(norm, [np.sqrt(50.0)] * 2, rtol=1e-6)
  assert np.all(np.asarray(skipped)) and not np.any(np.asarray(updates))


# -------------------------------------------------------- skip_bad_microbatches


@pytest.mark.parametrize("max_norm", [None, 100.0])
def test_dropped_microbatch_is_not_counted_and_never_reaches_the_accumulator(max_norm):
  clean = [vec(1.0, -1.0), vec(2.0, 0.5), vec(3.0, 2.0), vec(4.0, 1.0)]
  bad = vec(NAN, 1.0) if max_norm is None else vec(1e3, 1.0)
  tx = optax.MultiSteps(
    optax.sgd(1.0),
    every_k_schedule=4,
    should_skip_update_fn=jaxclip.skip_bad_microbatches(max_norm),
  )
  out = steps(tx, clean[:2] + [bad] + clean[2:], jnp.zeros(2))
  mini = [int(o[2].mini_step) for o in out]
  assert mini == [1, 2, 2, 3, 0]  # the bad microbatch did not count towards k
  # Dropped: MultiSteps' whole state is as before it.
  assert_bit_identical(out[2][2]._replace(skip_state=()), out[2][1]._replace(skip_state=()))
  assert bool(out[2][2].skip_state["microbatch_skipped"])
  for o in out:
    assert np.all(np.isfinite(jax.tree.leaves(o[2].acc_grads)[0]))
  np.testing.assert_allclose(out[-1][0], -np.mean(np.stack(clean), 0), rtol=1e-6)
  if max_norm is not None:
    np.testing.assert_allclose(out[2][2].skip_state["microbatch_norm"], np.hypot(1e3, 1.0))


def test_skip_bad_microbatches_signature_and_skip_state_shape():
  fn = jaxclip.skip_bad_microbatches(2.0)
  skip, info = fn({"a": vec(1.0, 1.0), "b": jnp.ones((2, 2), jnp.bfloat16)}, jnp.array(0), None)
  assert skip.dtype == jnp.bool_ and skip.shape == () and bool(skip)
  assert info["microbatch_norm"].dtype == jnp.float32
  np.testing.assert_allclose(info["microbatch_norm"], np.sqrt(6.0), rtol=1e-6)
  skip, info = jaxclip.skip_bad_microbatches()(vec(1.0, INF), jnp.array(0), None)
  assert bool(skip) and set(info) == {"microbatch_skipped"}


# ------------------------------------------------ where each goes around MultiSteps


def test_skip_nonfinite_inside_multisteps_is_poisoned_for_good():
  # Measured: one NaN microbatch leaves the accumulator NaN for ever (reset
  # is 0 * acc), so every later step is skipped and the params stand still.
  grads = [vec(1.0, 0.0), vec(NAN, 0.0)] + [vec(1.0, 0.0)] * 6
  out = steps(optax.MultiSteps(jaxclip.skip_nonfinite(optax.sgd(1.0)), 2), grads, jnp.zeros(2))
  for o in out[1:]:
    assert np.isnan(np.asarray(o[2].acc_grads)[0])
    np.testing.assert_array_equal(o[4], out[0][4])  # params never move again
  assert int(optax.tree.get(out[-1][2], "num_nonfinite_skipped")) == 4
  # The fix, as should_skip_update_fn or as a wrapper: every clean step goes through.
  for tx in (
    optax.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=jaxclip.skip_bad_microbatches()),
    jaxclip.skip_nonfinite(optax.MultiSteps(optax.sgd(1.0), 2)),
  ):
    fixed = steps(tx, grads, jnp.zeros(2))
    np.testing.assert_allclose(fixed[-1][4], vec(-3.0, 0.0))  # 6 clean microbatches in 3 steps
    assert all(
      np.all(np.isfinite(jax.tree.leaves(optax.tree.get(o[2], "acc_grads"))[0])) for o in fixed
    )


def test_wrappers_outside_multisteps_drop_single_microbatches():
  grads = [
    vec(1.0, 0.0),
    vec(30.0, 40.0),
    vec(3.0, 0.0),
    vec(NAN, 0.0),
    vec(5.0, 0.0),
    vec(7.0, 0.0),
  ]
  tx = jaxclip.skip_nonfinite(jaxclip.skip_above(optax.MultiSteps(optax.sgd(1.0), 2), 10.0))
  out = steps(tx, grads, jnp.zeros(2))
  np.testing.assert_allclose(out[2][0], -vec(2.0, 0.0))
  np.testing.assert_allclose(out[-1][0], -vec(6.0, 0.0))
  assert int(optax.tree.get(out[-1][2], "num_above_skipped")) == 1
  assert int(optax.tree.get(out[-1][2], "num_nonfinite_skipped")) == 1


def test_skip_above_inside_multisteps_drops_the_whole_accumulated_step():
  tx = optax.MultiSteps(jaxclip.skip_above(optax.sgd(1.0), 10.0), 2)
  out = steps(
    tx,
    [vec(1.0, 0.0), vec(3.0, 0.0), vec(30.0, 0.0), vec(0.0, 0.0), vec(5.0, 0.0), vec(7.0, 0.0)],
    jnp.zeros(2),
  )
  np.testing.assert_allclose(out[1][0], -vec(2.0, 0.0))
  np.testing.assert_array_equal(out[3][0], vec(0.0, 0.0))  # mean 15 > 10: skipped
  np.testing.assert_allclose(out[5][0], -vec(6.0, 0.0))  # the accumulator restarted
  assert int(optax.tree.get(out[-1][2], "num_above_skipped")) == 1


def test_clip_inside_multisteps_clips_the_mean_before_clips_each_microbatch():
  grads = [vec(3.0, 0.0), vec(0.0, 1.0)]
  inside = steps(
    optax.MultiSteps(optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(1.0)), 2),
    grads,
    jnp.zeros(2),
  )
  mean = np.array([1.5, 0.5])
  np.testing.assert_allclose(inside[-1][0], -mean / np.linalg.norm(mean), rtol=1e-6)
  before = steps(
    optax.chain(jaxclip.clip_by_global_norm(1.0), optax.MultiSteps(optax.sgd(1.0), 2)),
    grads,
    jnp.zeros(2),
  )
  np.testing.assert_allclose(before[-1][0], -vec(0.5, 0.5), rtol=1e-6)


def test_record_norms_before_and_inside_multisteps():
  grads = [vec(3.0, 4.0), vec(1.0, 0.0)]
  before = steps(
    optax.chain(jaxclip.record_norms(), optax.MultiSteps(optax.sgd(1.0), 2)), grads, jnp.zeros(2)
  )
  np.testing.assert_allclose(optax.tree.get(before[-1][2], "global_norm"), 1.0)
  inside = steps(
    optax.MultiSteps(optax.chain(jaxclip.record_norms(), optax.sgd(1.0)), 2), grads, jnp.zeros(2)
  )
  np.testing.assert_allclose(optax.tree.get(inside[-1][2], "global_norm"), np.hypot(2.0, 2.0))


def test_the_code_of_the_accumulation_page_runs(capsys):
  text = (ROOT / "docs" / "accumulation.md").read_text()
  code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
  exec(compile(code, "docs/accumulation.md", "exec"), {})  # noqa: S102 - our own docs
  printed = capsys.readouterr().out.split("\n")
  assert printed[0] == "[-2.5 -0. ]" and printed[1] == "False"
  assert printed[2] == "[-2. -0.] 1" and printed[3] == "[nan  0.]" and printed[4] == "4"
  assert printed[5] == "['dense']['b'] 5.0" and printed[7] == "7.0"


# ------------------------------------------------------------------- record_norms


def _record_tree(dtype):
  rng = np.random.default_rng(0)
  tree = {
    "big": rng.normal(size=(40, 50)),
    "scalar": np.array(2.5),
    "same": [rng.normal(size=(8, 4)) for _ in range(20)],  # stacked together
    "other": [rng.normal(size=(32,)) for _ in range(5)],
    "tiny": rng.normal(size=(3,)),
    "none": None,
  }
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


@pytest.mark.parametrize("ord", [None, 1, "inf"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_record_norms_match_numpy_in_float32_under_jit(dtype, ord):
  tree = _record_tree(dtype)
  tx = optax.chain(jaxclip.record_norms(ord=ord), optax.adam(1e-3))
  updates, state = jax.jit(tx.update)(tree, tx.init(tree), tree)
  assert jax.tree.structure(updates) == jax.tree.structure(tree)
  p = {None: 2, 1: 1, "inf": np.inf}[ord]
  as64 = lambda x: np.asarray(x, np.float64).ravel()
  norms = optax.tree.get(state, "leaf_norms")
  assert jax.tree.structure(norms) == jax.tree.structure(tree)
  for n, x in zip(jax.tree.leaves(norms), jax.tree.leaves(tree), strict=True):
    assert n.dtype == jnp.float32 and n.shape == ()
    np.testing.assert_allclose(n, np.linalg.norm(as64(x), p), rtol=1e-5)
  whole = np.concatenate([as64(x) for x in jax.tree.leaves(tree)])
  total = optax.tree.get(state, "global_norm")
  assert total.dtype == jnp.float32
  np.testing.assert_allclose(total, np.linalg.norm(whole, p), rtol=1e-5)


def test_record_norms_is_the_identity_and_counts_replicated_leaves_once():
  tree = _record_tree(jnp.float32)
  rec = jaxclip.record_norms()
  out, _ = rec.update(tree, rec.init(tree))
  assert_bit_identical(out, tree)
  tx = jaxclip.record_norms(axis_name="i", replicated={"w": False, "b": True})

  def step(w, b):
    return tx.update({"w": w, "b": b}, tx.init({"w": w, "b": b}))[1]

  state = jax.vmap(step, in_axes=(0, None), axis_name="i")(
    jnp.array([[3.0, 0.0], [0.0, 4.0]]), jnp.array([12.0])
  )
  np.testing.assert_allclose(state.leaf_norms["w"], [5.0, 5.0])
  np.testing.assert_allclose(state.leaf_norms["b"], [12.0, 12.0])
  np.testing.assert_allclose(state.global_norm, [13.0, 13.0])
  # The library's policy for non-float leaves: an integer leaf is a number
  # (passed through unchanged, its norm recorded); a PRNG key is refused.
  ints = {"n": jnp.arange(3)}
  out, state = rec.update(ints, rec.init(ints))
  assert out["n"].dtype == jnp.int32
  np.testing.assert_allclose(state.leaf_norms["n"], np.sqrt(5.0), rtol=1e-6)
  with pytest.raises(TypeError, match=r"record_norms.*\['k'\]"):
    rec.update({"k": jax.random.key(0)}, rec.init({"k": jax.random.key(0)}))
  with pytest.raises(TypeError, match="record_norms.*state"):
    rec.update(tree, None)
