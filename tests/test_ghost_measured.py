"""``method="auto"``'s measured choice (:mod:`jaxclip.privacy._measured`).

When a ``method="auto"`` function is traced, it times its candidates (the cost
model's plan, ghost's rules, vmap's program) on stand-in inputs for the backend
this process runs on and runs the fastest in that platform's branch; other
platforms keep the cost model. Where a timing would not be the program's own
(a loss closing over a traced value, a mesh axis, symbolic shapes, a typed key),
or with ``measure=False``, it times nothing, says why, and the cost model
decides. Medians within a few percent are a tie, broken by the least temporary
memory; a candidate that fails to run is left out. ``ghost_plan`` reports the
same measurement. The wiring is tested with a fixed pick; the timing with
programs a thousand times apart.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip.privacy import _measured
from tests.ghost_helpers import compare as _compare

B = 32


def _dense():
  # One row per example through a 64 x 64 weight: the dot rule costs 2 x 64 flops, its
  # per-example gradient 64 x 64, so the cost model keeps the rule on every platform.
  k1, k2 = jax.random.split(jax.random.key(0))
  w = 0.1 * jax.random.normal(k1, (64, 64))
  xs = jax.random.normal(k2, (B, 64))
  return (lambda w, x: jnp.sum(jnp.tanh(x @ w))), w, xs


def _fixed(monkeypatch, pick):
  """Every measurement picks ``pick`` (``None``: times nothing); returns the calls made."""
  calls = []

  def fake(make, candidates, *inputs):
    calls.append(tuple(candidates))
    return _measured.Measured("cpu", pick, f"fixed: {pick}")

  monkeypatch.setattr(_measured, "measure", fake)
  return calls


PER_EXAMPLE = f"tensor<{B}x64x64xf32>"  # vmap's per-example gradients of w


@pytest.mark.parametrize("pick", ["vmap", "auto", None])
def test_the_pick_runs_in_the_branch_of_this_platform_only(monkeypatch, pick):
  calls = _fixed(monkeypatch, pick)
  loss, w, xs = _dense()
  fn = jax.jit(jaxclip.per_example_clipped_grad(loss, 1.0, method="auto"))
  texts = {k: jax.export.export(fn, platforms=(k,))(w, xs).mlir_module() for k in ("cpu", "cuda")}
  assert calls == [("auto", "vmap")]  # once: the cost model's plan (ghost's) and vmap's
  # CPU runs the pick (None, "auto": the cost model's rule); CUDA keeps the cost model's plan.
  assert (PER_EXAMPLE in texts["cpu"]) == (pick == "vmap")
  assert PER_EXAMPLE not in texts["cuda"]


def test_the_pick_gives_the_same_clipped_sum(monkeypatch):
  loss, w, xs = _dense()
  for pick in ("vmap", "auto"):
    _fixed(monkeypatch, pick)
    _compare(loss, w, xs, method_="auto")


def test_auto_measures_once_and_every_batch_size_runs_that_pick(monkeypatch):
  loss, w, xs = _dense()
  fn = jaxclip.per_example_clipped_grad(loss, 1.0, method="auto")
  jax.jit(fn)(w, xs)
  (m,) = fn.measured.values()
  assert m.platform == jax.default_backend() and m.pick in ("auto", "vmap")
  assert "the cost model's plan" in m.why and "vmap's program" in m.why and " ms" in m.why
  # Traced again, with one example more (a neighbouring batch): nothing measured, the same
  # program (a pick per batch size let D and D + x run different programs, whose bfloat16
  # sums differ by rounding beyond C).
  calls = _fixed(monkeypatch, "vmap" if m.pick == "auto" else "auto")
  jax.jit(lambda w, x: fn(w, x))(w, xs)
  vmapped = [
    f"tensor<{len(x)}x64x64xf32>" in jax.jit(fn).lower(w, x).as_text()
    for x in (xs, jnp.concatenate([xs, xs[:1]]))
  ]
  assert calls == [] and len(fn.measured) == 1
  assert vmapped == [m.pick == "vmap"] * 2


def test_measure_picks_the_program_a_thousand_times_faster(monkeypatch):
  # Two stand-in programs of the same inputs, one a long chain of matmuls: measure()
  # picks the short one whichever order it is given, and gives both times.
  def make(c):
    def fn(w, x, example_mask=None):
      y = x @ w
      for _ in range(1 if c == "fast" else 400):
        y = jnp.tanh(y @ w)
      return jnp.sum(y)

    return fn

  monkeypatch.setitem(_measured.PROGRAMS, "fast", "the short program")
  monkeypatch.setitem(_measured.PROGRAMS, "slow", "the long one")
  monkeypatch.setattr(_measured, "TIE", 0.0)  # the fastest, whatever the memory
  w, x = jnp.ones((128, 128)), jnp.ones((B, 128))
  for order in (("fast", "slow"), ("slow", "fast")):
    m = _measured.measure(make, order, w, (x,), None)
    assert m.pick == "fast", m
    assert "the short program" in m.why and "the long one" in m.why


def test_a_tie_goes_to_the_least_memory_and_a_failing_candidate_is_left_out(monkeypatch):
  # With every median taken for a tie, the program of least temporary memory runs (a 1 MiB
  # outer product loses to a plain sum); a candidate that fails to run (out of memory on a
  # device; here a callback that raises) is named and left out, and none left gives no pick.
  def boom(x):
    raise MemoryError("stand-in for running out of memory")

  def make(c):
    if c != "broken":
      return _big_and_small(c)
    return lambda w, x, example_mask=None: jax.pure_callback(
      boom, jax.ShapeDtypeStruct((), x.dtype), x
    )

  monkeypatch.setattr(_measured, "TIE", 1e9)
  monkeypatch.setattr(_measured, "DROP", math.inf)  # under load, a first run can be slow
  monkeypatch.setitem(_measured.PROGRAMS, "big", "the big one")
  monkeypatch.setitem(_measured.PROGRAMS, "small", "the small one")
  monkeypatch.setitem(_measured.PROGRAMS, "broken", "the broken one")
  w, x = jnp.ones(3), jnp.ones(512)
  m = _measured.measure(make, ("big", "broken", "small"), w, (x,), None)
  assert m.pick == "small" and "the least memory" in m.why, m
  assert "the broken one failed to run" in m.why, m
  m = _measured.measure(make, ("broken",), w, (x,), None)
  assert m.pick is None and "the broken one failed to run" in m.why, m


def _big_and_small(c):
  def fn(w, x, example_mask=None):
    if c == "big":
      return jnp.sum(jnp.sort(jnp.outer(x, x).ravel())[::7])  # 1 MiB held whole to be sorted
    return jnp.sum(x) + jnp.sum(w)

  return fn


def test_a_candidate_the_device_cannot_hold_is_not_run(monkeypatch):
  # Its arguments, outputs and temporaries (XLA's memory analysis) against the device's free
  # memory: over it, the candidate is named and not run; with room, both run.
  monkeypatch.setitem(_measured.PROGRAMS, "big", "the big one")
  monkeypatch.setitem(_measured.PROGRAMS, "small", "the small one")
  monkeypatch.setattr(_measured, "TIE", 0.0)
  monkeypatch.setattr(_measured, "DROP", math.inf)  # under load, a first run can be slow
  w, x = jnp.ones(3), jnp.ones(512)
  monkeypatch.setattr(_measured, "room", lambda: 64 * 1024)
  m = _measured.measure(_big_and_small, ("big", "small"), w, (x,), None)
  assert m.pick == "small" and "the big one not run (it needs 1" in m.why, m
  assert "the one left" in m.why, m
  monkeypatch.setattr(_measured, "room", lambda: 64 * 2**20)
  m = _measured.measure(_big_and_small, ("big", "small"), w, (x,), None)
  assert "not run" not in m.why and "rounds" in m.why, m
  assert "the big one" in m.why and "the small one" in m.why, m
  monkeypatch.setattr(_measured, "room", lambda: 0)
  m = _measured.measure(_big_and_small, ("big", "small"), w, (x,), None)
  assert m.pick is None and m.why.count("not run") == 2, m


def test_this_machine_reports_its_free_memory():
  free = _measured.room()
  assert free is not None and 0 < free < 2**50, free


def test_a_candidate_many_times_slower_in_its_first_two_runs_is_not_timed_further(monkeypatch):
  # After one run each, a candidate over DROP times the fastest first run (and over the time
  # the budget allows its first rounds; 0 here) runs once more, and, over again, is named
  # with its time and not run again: the one left runs, with no rounds.
  runs = []

  def make(c):
    def fn(w, x, example_mask=None):
      # The long one a loop (a first run of the short one stalled under load still far below
      # half of it): 20,000 matmuls.
      steps = 1 if c == "fast" else 20_000
      y = jax.lax.fori_loop(0, steps, lambda _, y: jnp.tanh(y @ w), x @ w)
      jax.debug.callback(lambda: runs.append(c))
      return jnp.sum(y)

    return fn

  monkeypatch.setitem(_measured.PROGRAMS, "fast", "the short program")
  monkeypatch.setitem(_measured.PROGRAMS, "slow", "the long one")
  monkeypatch.setattr(_measured, "BUDGET_S", 0.0)
  w, x = jnp.ones((128, 128)), jnp.ones((B, 128))
  m = _measured.measure(make, ("slow", "fast"), w, (x,), None)
  assert m.pick == "fast" and "no rounds" in m.why, m
  assert "the long one" in m.why and "in two runs (over 2x" in m.why, m
  assert runs.count("slow") == 2, runs


def test_a_loss_closing_over_a_traced_value_is_not_timed_and_says_so():
  loss, w, xs = _dense()
  made = []

  @jax.jit
  def step(w, xs, scale):
    made.append(
      jaxclip.per_example_clipped_grad(lambda w, x: scale * loss(w, x), 1.0, method="auto")
    )
    return made[-1](w, xs)

  got = step(w, xs, 2.0)
  ref = jaxclip.per_example_clipped_grad(lambda w, x: 2.0 * loss(w, x), 1.0)(w, xs)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=2e-5, atol=1e-6)
  (m,) = made[0].measured.values()
  assert m.pick is None and "closes over a value traced" in m.why


def test_a_traced_clip_norm_is_timed_with_a_stand_in():
  loss, w, xs = _dense()
  made = []

  @jax.jit
  def step(clip, w, xs):
    made.append(jaxclip.per_example_clipped_grad(loss, clip, method="auto"))
    return made[-1](w, xs)

  step(0.5, w, xs)
  (m,) = made[0].measured.values()
  assert m.pick is not None, m


def test_nothing_is_timed_under_symbolic_shapes_or_a_mesh_axis():
  loss, w, xs = _dense()
  fn = jaxclip.per_example_clipped_grad(loss, 1.0, method="auto")
  (b,) = jax.export.symbolic_shape("b")
  jax.export.export(jax.jit(fn))(w, jax.ShapeDtypeStruct((b, 64), xs.dtype))
  (m,) = fn.measured.values()
  assert m.pick is None and m.why == "symbolic shapes"
  mesh = jax.make_mesh((1,), ("data",))
  sharded = jaxclip.per_example_clipped_grad(loss, 1.0, method="auto", axis_name="data")
  P = jax.sharding.PartitionSpec
  xs = jax.device_put(xs, jax.sharding.NamedSharding(mesh, P("data")))
  jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(w, xs)
  (m,) = sharded.measured.values()
  assert m.pick is None and "mesh axis" in m.why


def test_a_typed_key_among_the_inputs_is_not_timed():
  loss, w, xs = _dense()
  fn = jaxclip.per_example_clipped_grad(
    lambda w, x, key: loss(w, x) + 0.0 * jax.random.normal(key), 1.0, method="auto"
  )
  fn(w, xs, jax.random.split(jax.random.key(1), B))
  (m,) = fn.measured.values()
  assert m.pick is None and "typed PRNG key" in m.why


def test_nothing_is_timed_in_a_job_of_several_processes(monkeypatch):
  # Each process would time its own candidates: two that picked different programs failed at
  # their first collective (tests/test_multihost.py runs two processes for real).
  loss, w, xs = _dense()
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  fn = jaxclip.per_example_clipped_grad(loss, 1.0, method="auto")
  jax.jit(fn)(w, xs)
  (m,) = fn.measured.values()
  assert m.pick is None and m.why.startswith("a job of 2 processes"), m.why
  assert jaxclip.ghost_plan(loss, w, xs, method="auto").measured.startswith("a job of 2")


def test_measure_false_runs_the_cost_models_plan_with_nothing_timed(monkeypatch):
  # The user's switch: one compile at the first trace, and the same plan in every run. Were a
  # measurement made, it would pick vmap's program.
  calls = _fixed(monkeypatch, "vmap")
  loss, w, xs = _dense()
  fn = jaxclip.per_example_clipped_grad(loss, 1.0, method="auto", measure=False)
  assert PER_EXAMPLE not in jax.jit(fn).lower(w, xs).as_text()  # the dot rule
  (m,) = fn.measured.values()
  assert calls == [] and m.pick is None and m.why.startswith("measure=False"), m.why
  _compare(loss, w, xs, method_="auto", measure=False)
  # DPSGD passes it on; the default still measures.
  run = jaxclip.DPSGD(1_000, 32.0, 10, 1.0, 1e-5, 1.0, key=jax.random.key(0), method="auto")
  dp_fn = run.clipped_grad(loss, measure=False)
  dp_fn(w, xs)
  assert calls == [] and next(iter(dp_fn.measured.values())).pick is None
  measured = jaxclip.per_example_clipped_grad(loss, 1.0, method="auto")
  measured(w, xs)
  assert calls == [("auto", "vmap")] and next(iter(measured.measured.values())).pick == "vmap"
  with pytest.raises(TypeError, match="measure must be a bool, got 'no'"):
    jaxclip.per_example_clipped_grad(loss, 1.0, method="auto", measure="no")


def test_ghost_plan_reports_the_measured_pick(monkeypatch):
  loss, w, xs = _dense()
  calls = _fixed(monkeypatch, "vmap")
  plan = jaxclip.ghost_plan(loss, w, xs, batch_argnums=1, method="auto")
  assert calls == [("auto", "vmap")]
  assert plan.rules == {"": "instantiate"} and plan.measured == "fixed: vmap"
  assert "auto measured it fastest on cpu" in plan.leaves[0].reason
  assert str(plan).splitlines()[-1] == "fixed: vmap"
  _fixed(monkeypatch, "auto")
  assert jaxclip.ghost_plan(loss, w, xs, batch_argnums=1, method="auto").rules == {"": "dot"}
  # measure=False, another platform, or method="ghost": the cost model alone, nothing timed.
  calls = _fixed(monkeypatch, "vmap")
  for kw in ({"measure": False}, {"platform": "gpu"}, {"method": "ghost"}):
    plan = jaxclip.ghost_plan(loss, w, xs, batch_argnums=1, **{"method": "auto", **kw})
    assert plan.rules == {"": "dot"} and plan.measured is None, kw
  assert calls == []
