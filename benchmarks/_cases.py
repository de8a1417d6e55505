"""The benchmark's train-step cases (clip + adam; a whole GPT step) and what every case uses."""

from __future__ import annotations

import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip
from benchmarks import _model, _timing
from workloads import trees

MAX_NORM = 1.0


def _nbytes(tree: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _temp_mb(compiled: Any) -> float | None:
  try:
    return compiled.memory_analysis().temp_size_in_bytes / 2**20
  except Exception:  # memory_analysis is not implemented on every backend
    return None


# ----------------------------------------------------------------------------
# Train step: clip + adam, donated params and optimizer state.
# ----------------------------------------------------------------------------

TRAIN_CASES = {
  "adam": lambda: optax.adam(1e-4),
  "jaxclip.clip_by_global_norm + adam": lambda: optax.chain(
    jaxclip.clip_by_global_norm(MAX_NORM), optax.adam(1e-4)
  ),
  "optax.clip_by_global_norm + adam": lambda: optax.chain(
    optax.clip_by_global_norm(MAX_NORM), optax.adam(1e-4)
  ),
  "jaxclip.clip_by_norm + adam": lambda: optax.chain(
    jaxclip.clip_by_norm(MAX_NORM), optax.adam(1e-4)
  ),
  "jaxclip.clip_by_value + adam": lambda: optax.chain(
    jaxclip.clip_by_value(-1e-3, 1e-3), optax.adam(1e-4)
  ),
  "optax.clip + adam": lambda: optax.chain(optax.clip(1e-3), optax.adam(1e-4)),
}
# The optax counterpart of each jaxclip case, and how many extra full reads of
# the gradients the clip needs at the floor (a norm pass; value clipping none).
TRAIN_OPTAX = {
  "jaxclip.clip_by_global_norm + adam": "optax.clip_by_global_norm + adam",
  "jaxclip.clip_by_value + adam": "optax.clip + adam",
}
TRAIN_EXTRA_READS = {"adam": 0, "jaxclip.clip_by_value + adam": 0, "optax.clip + adam": 0}


def run_train_steps(shapes: dict, reps: int) -> list[dict]:
  """Median step time of every train case, the cases interleaved.

  All cases are compiled first and then timed in turn, one step each, ``reps``
  times over, so that every case samples the same stretch of time: on a
  shared machine the speed drifts by tens of percent over seconds, and timing
  the cases one after the other would put the drift into their ratios. The
  floor's read pass over the gradients' bytes is timed in the same turns.
  """
  grads = trees.make_tree(shapes, seed=2)
  flat = jnp.full((trees.num_params(shapes),), 1e-3, jnp.float32)
  read = jax.jit(jnp.sum).lower(flat).compile()
  steps = {"floor: read pass": (lambda x: (read(x), x), flat)}
  temps = {}
  for name, make in TRAIN_CASES.items():
    params = trees.make_tree(shapes, seed=1)
    compiled, opt_state = trees.compile_train_step(make(), params, grads)
    steps[name] = (lambda s, c=compiled: (s := c(*s, grads), s), (params, opt_state))
    temps[name] = _temp_mb(compiled)
  seconds = _timing.time_interleaved(steps, reps)
  del steps, flat
  read_floor_s = seconds.pop("floor: read pass")
  rows = [
    {
      "case": name,
      "ms": 1e3 * s,
      "temp_mb": temps[name],
      "extra_reads": TRAIN_EXTRA_READS.get(name, 1),
    }
    for name, s in seconds.items()
  ]
  by_name = {r["case"]: r for r in rows}
  adam_ms = by_name["adam"]["ms"]
  for r in rows:
    r["x_adam"] = r["ms"] / adam_ms
    other = TRAIN_OPTAX.get(r["case"])
    r["x_optax"] = r["ms"] / by_name[other]["ms"] if other else None
    r["x_floor"] = r["ms"] / (adam_ms + r["extra_reads"] * 1e3 * read_floor_s)
  return rows


# ----------------------------------------------------------------------------
# Full train step: forward + backward + clip + adam on a small GPT.
# ----------------------------------------------------------------------------

FULL_STEP_CASES = {
  name: TRAIN_CASES[name]
  for name in ("adam", "jaxclip.clip_by_global_norm + adam", "optax.clip_by_global_norm + adam")
}


def compile_full_step(
  tx: optax.GradientTransformation, cfg: _model.GPTConfig, params: Any, tokens: jax.Array
):
  """``(compiled, opt_state)``: loss, gradients and update of ``tx`` in one jitted step.

  The compiled step maps ``(params, opt_state, tokens)`` to
  ``(params, opt_state, loss)``, the params and optimizer state donated.
  """

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(_model.loss_fn)(params, tokens, cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
  return compiled, opt_state


def run_full_train_steps(cfg: _model.GPTConfig, reps: int) -> dict:
  """Median time and temp memory of a whole train step of a small GPT, per case.

  Each case of :data:`FULL_STEP_CASES` (adam alone, and adam behind jaxclip's
  or optax's global-norm clip) is one jitted step, forward, backward and
  update, with donated params and optimizer state. The cases start from the
  same params and take the same batch of random tokens every step; they are
  timed interleaved (see :func:`_timing.time_interleaved`).

  Returns:
    ``{"model": summary, "params": count, "leaves": count, "reps": reps,
    "rows": [...]}``, one row per case with its median ``ms``, ``x_adam``
    (the ratio of the medians), ``x_adam_iqr`` (the 25th and 75th
    percentiles of its per-round ratios to adam), ``x_optax`` (jaxclip's row
    only), ``temp_mb`` (the compiled step's temporary buffers) and ``loss``
    (the loss of the last step timed).
  """
  tokens = _model.make_tokens(cfg, seed=1)
  steps, temps, losses = {}, {}, {}
  for name, make in FULL_STEP_CASES.items():
    params = _model.init_params(cfg, seed=0)
    compiled, opt_state = compile_full_step(make(), cfg, params, tokens)
    temps[name] = _temp_mb(compiled)

    def one(state, c=compiled, name=name):
      params, opt_state, losses[name] = c(*state, tokens)
      return losses[name], (params, opt_state)

    steps[name] = (one, (params, opt_state))
  samples = _timing.interleaved_samples(steps, reps)
  del steps
  seconds = {name: statistics.median(ts) for name, ts in samples.items()}
  adam_s = seconds["adam"]
  rows = []
  for name, s in seconds.items():
    # The step's time over adam's in the same round: the spread of these
    # paired ratios is the noise of the machine on the ratio itself.
    paired = np.array(samples[name]) / np.array(samples["adam"])
    rows.append(
      {
        "case": name,
        "ms": 1e3 * s,
        "x_adam": s / adam_s,
        "x_adam_iqr": tuple(np.percentile(paired, [25, 75])),
        "temp_mb": temps[name],
        "loss": float(losses[name]),
      }
    )
  for r in rows:
    other = TRAIN_OPTAX.get(r["case"])
    r["x_optax"] = seconds[r["case"]] / seconds[other] if other in seconds else None
  return {
    "model": cfg.describe(),
    "params": _model.num_params(cfg),
    "leaves": len(_model.param_shapes(cfg)),
    "reps": reps,
    "rows": rows,
  }


def temp_bytes_table(shapes: dict) -> list[dict]:
  """Extra (temporary) buffer bytes XLA allocates for each train step, per dtype.

  ``optax.scale(0.5) + adam`` is the control: the cost of any elementwise
  transform in front of adam, which on XLA:CPU materialises the bfloat16
  input of adam's update once.
  """
  cases = {
    name: TRAIN_CASES[name]
    for name in ("adam", "jaxclip.clip_by_global_norm + adam", "optax.clip_by_global_norm + adam")
  }
  cases["optax.scale(0.5) + adam (control)"] = lambda: optax.chain(
    optax.scale(0.5), optax.adam(1e-4)
  )
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    params = trees.make_tree(shapes, dtype)
    for name, make in cases.items():
      compiled, _ = trees.compile_train_step(make(), params, params)
      rows.append(
        {
          "dtype": jnp.dtype(dtype).name,
          "case": name,
          "temp_mb": _temp_mb(compiled),
          "grads_mb": _nbytes(params) / 2**20,
        }
      )
  return rows


def check_numbers(tree_shapes: dict) -> None:
  """Sanity check before timing: jaxclip and optax clip to the same numbers."""
  tree = trees.make_tree(tree_shapes)
  a, _ = jaxclip.clip_by_global_norm(0.1).update(tree, jaxclip.clip_by_global_norm(0.1).init(tree))
  b, _ = optax.clip_by_global_norm(0.1).update(tree, optax.EmptyState())
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
