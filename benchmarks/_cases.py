"""The benchmark cases: train step, full train step, standalone clip, compile and size sweeps."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip
from benchmarks import _model, _timing
from workloads import every, trees

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


# ----------------------------------------------------------------------------
# Standalone clip (donated) against the bandwidth floor, optax and torch.
# ----------------------------------------------------------------------------


def _torch_clip_step(shapes: dict, dtype_name: str) -> Callable[[Any], tuple[Any, Any]] | None:
  """A step clipping a torch tree in place with ``clip_grad_norm_(foreach=True)``."""
  try:
    import torch
  except ImportError:
    return None
  torch.set_num_threads(os.cpu_count() or 1)
  # Same device kind as jax's: CUDA tensors when jax runs on a GPU and torch can.
  cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
  device = "cuda" if cuda else "cpu"
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
  params = []
  for shape in shapes.values():
    p = torch.zeros(shape, dtype=dtype, device=device)
    p.grad = torch.randn(shape, dtype=torch.float32, device=device).mul_(1e-2).to(dtype)
    params.append(p)

  def step(state):
    torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
    if cuda:
      torch.cuda.synchronize()
    return None, state

  return step


def run_standalone(
  shapes: dict, dtype: Any, reps: int, peak_gbps: float | None, with_torch: bool = True
) -> list[dict]:
  """The norm pass and the clip, for jaxclip, optax and torch, against the floor.

  Every case, the floor's two passes included, is timed interleaved with the
  others (see :func:`_timing.time_interleaved`).
  """
  nbytes, num = _nbytes(trees.make_tree(shapes, dtype)), trees.num_params(shapes)
  dname = jnp.dtype(dtype).name
  flat = jnp.full((num,), 1e-3, dtype)
  read = jax.jit(jnp.sum).lower(flat).compile()
  scale = (
    jax.jit(lambda x, s: x * s.astype(x.dtype), donate_argnums=0)
    .lower(flat, jnp.float32(0.999))
    .compile()
  )
  steps = {
    "read": (lambda x: (read(x), x), flat),
    "scale": (lambda x: (y := scale(x, jnp.float32(0.999)), y), jnp.full((num,), 1e-3, dtype)),
  }
  temps = {}
  norm_tree = trees.make_tree(shapes, dtype)
  for lib, norm_fn in (("jaxclip", jaxclip.ops.global_norm), ("optax", optax.tree.norm)):
    compiled = jax.jit(norm_fn).lower(norm_tree).compile()
    steps[f"{lib} norm"] = (lambda t, c=compiled: (c(t), t), norm_tree)
    temps[f"{lib} norm"] = _temp_mb(compiled)
  for lib, make in (("jaxclip", jaxclip.clip_by_global_norm), ("optax", optax.clip_by_global_norm)):
    tx = make(MAX_NORM)
    tree = trees.make_tree(shapes, dtype)
    state = tx.init(tree)
    compiled = (
      jax.jit(lambda t, tx=tx, state=state: tx.update(t, state)[0], donate_argnums=0)
      .lower(tree)
      .compile()
    )
    steps[f"{lib} clip"] = (lambda t, c=compiled: (y := c(t), y), tree)
    temps[f"{lib} clip"] = _temp_mb(compiled)
  torch_step = _torch_clip_step(shapes, dname) if with_torch else None
  if torch_step is not None:
    steps["torch clip"] = (torch_step, None)
  seconds = _timing.time_interleaved(steps, reps)
  del steps
  read_s, scale_s = seconds["read"], seconds["scale"]
  floor_s = read_s + scale_s
  rows = [
    {"case": f"floor: read pass ({dname})", "ms": 1e3 * read_s, "bytes": nbytes},
    {"case": f"floor: in-place scale pass ({dname})", "ms": 1e3 * scale_s, "bytes": 2 * nbytes},
  ]
  for lib in ("jaxclip", "optax"):
    s = seconds[f"{lib} norm"]
    rows.append(
      {
        "case": f"{lib} global_norm ({dname})",
        "ms": 1e3 * s,
        "bytes": nbytes,
        "x_floor": s / read_s,
        "temp_mb": temps[f"{lib} norm"],
      }
    )
  clip_rows = {}
  for lib in ("jaxclip", "optax"):
    s = seconds[f"{lib} clip"]
    clip_rows[lib] = {
      "case": f"{lib}.clip_by_global_norm ({dname})",
      "ms": 1e3 * s,
      "bytes": 3 * nbytes,
      "x_floor": s / floor_s,
      "temp_mb": temps[f"{lib} clip"],
    }
    rows.append(clip_rows[lib])
  torch_s = seconds.get("torch clip")
  rows.append(
    {
      "case": f"torch clip_grad_norm_(foreach=True) ({dname})",
      "ms": None if torch_s is None else 1e3 * torch_s,
      "bytes": 3 * nbytes,
      "x_floor": None if torch_s is None else torch_s / floor_s,
    }
  )
  jc = clip_rows["jaxclip"]
  jc["x_optax"] = jc["ms"] / clip_rows["optax"]["ms"]
  jc["x_torch"] = None if torch_s is None else jc["ms"] / (1e3 * torch_s)
  for r in rows:
    if r["ms"]:
      r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
      r["pct_peak"] = 100 * r["gbps"] / peak_gbps if peak_gbps else None
  return rows


# ----------------------------------------------------------------------------
# Compile time against the number of leaves.
# ----------------------------------------------------------------------------

COMPILE_IMPLS = (
  "tree_map x*s",
  "jaxclip.clip_by_global_norm",
  "jaxclip.clip_by_norm",
  "optax.clip_by_global_norm",
)

# Every other transform that touches each leaf, with optax's counterpart where
# it has one, compiled at the sweep's largest leaf count.
TRANSFORMS = {
  "clip_by_value": (lambda: jaxclip.clip_by_value(-1.0, 1.0), lambda: optax.clip(1.0)),
  "clip_by_average_norm": (lambda: jaxclip.clip_by_average_norm(0.01), None),
  "clip_by_block_rms": (
    lambda: jaxclip.clip_by_block_rms(1.0),
    lambda: optax.clip_by_block_rms(1.0),
  ),
  "adaptive_grad_clip": (
    lambda: jaxclip.adaptive_grad_clip(0.01),
    lambda: optax.adaptive_grad_clip(0.01),
  ),
  "zero_nonfinite": (lambda: jaxclip.zero_nonfinite(), None),
  "skip_nonfinite(identity)": (
    lambda: jaxclip.skip_nonfinite(optax.identity()),
    lambda: optax.apply_if_finite(optax.identity(), 10),
  ),
}


# Every other transform of jaxclip.__all__ (workloads/every.py), so that a
# new one is timed without anyone adding it here.
for _name in every.factories():
  if not any(k == _name or k.startswith(_name + "(") for k in TRANSFORMS):
    TRANSFORMS[_name] = (lambda n=_name: every.build(n), None)


def _make(impl: str) -> optax.GradientTransformation:
  lib, name = impl.split(".", 1)
  if name in TRANSFORMS and TRANSFORMS[name][0 if lib == "jaxclip" else 1] is not None:
    return TRANSFORMS[name][0 if lib == "jaxclip" else 1]()
  return getattr(jaxclip if lib == "jaxclip" else optax, name)(MAX_NORM)


def _reads_params(impl: str) -> bool:
  return impl.endswith(".adaptive_grad_clip")


def compile_fn(impl: str):
  """``fn(updates, s)``, or ``fn(updates, params, s)`` for a transform that reads params."""
  if impl == "tree_map x*s":
    return lambda t, s: jax.tree.map(lambda x: x * s, t)
  tx = _make(impl)
  if _reads_params(impl):
    return lambda t, p, s: tx.update(t, tx.init(p), p)[0]
  return lambda t, s: tx.update(t, tx.init(t))[0]


def compile_once(impl: str, leaves: int, mixed: bool) -> float:
  shapes = trees.many_leaf_shapes(leaves, mixed)
  args = [trees.make_tree(shapes)]
  if _reads_params(impl):
    args.append(trees.make_tree(shapes, seed=1))
  return _timing.compile_seconds(compile_fn(impl), *args, jnp.float32(0.5))


def _compile_seconds(impl: str, leaves: int, mixed: bool, timeout_s: float | None) -> float | None:
  """One compile: in a fresh process when ``timeout_s`` is set; ``None`` if it timed out."""
  if timeout_s is None:
    return compile_once(impl, leaves, mixed)
  cmd = [sys.executable, "-m", "benchmarks._compile_one", impl, str(leaves), str(int(mixed))]
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
  except subprocess.TimeoutExpired:
    return None
  return float(out.stdout.strip().splitlines()[-1])


def run_compile_sweep(
  leaf_counts: list[int],
  timeout_s: float | None,
  mixed_at: int | None,
  repeats: int = 1,
  impls: tuple[str, ...] = COMPILE_IMPLS,
  mixed_impls: tuple[str, ...] | None = None,
) -> list[dict]:
  """Seconds to compile each impl, each in a fresh process when ``timeout_s`` is set.

  Each impl is compiled ``repeats`` times, the impls in turn (so that they
  sample the same stretch of the machine's drift), and the median is kept.
  Once an impl runs past ``timeout_s`` it is not run again (reported as
  ``> timeout_s``), nor at larger leaf counts nor on the mixed tree, which
  only ``mixed_impls`` (default: all) are compiled for.
  """
  rows, given_up = [], set()
  jobs = [(n, False) for n in leaf_counts] + ([(mixed_at, True)] if mixed_at else [])
  for n, mixed in jobs:
    row: dict[str, Any] = {"leaves": n, "mixed": mixed}
    seconds: dict[str, list[float]] = {impl: [] for impl in impls}
    for impl in impls:
      if impl in given_up or (mixed and mixed_impls is not None and impl not in mixed_impls):
        row[impl] = ("not run", timeout_s)
    for _ in range(repeats):
      for impl in impls:
        if impl in row:  # timed out in an earlier repeat, or not run
          continue
        sec = _compile_seconds(impl, n, mixed, timeout_s)
        if sec is None:
          row[impl] = ("timeout", timeout_s)
          given_up.add(impl)
        else:
          seconds[impl].append(sec)
        print(
          f"  compile {impl:40s} leaves={n:5d}{' mixed' if mixed else ''}: {row.get(impl, sec)}",
          flush=True,
        )
    for impl, runs in seconds.items():
      if impl not in row:
        row[impl] = ("ok", statistics.median(runs))
    rows.append(row)
  return rows


def run_transform_compiles(
  leaves: int, timeout_s: float | None, repeats: int, mixed: bool = True
) -> list[dict]:
  """Compile seconds of every transform of :data:`TRANSFORMS` at ``leaves`` leaves.

  One row per transform, with the bare tree_map and adam's own update
  compiled in the same turns:
  ``{"transform", "leaves", "mixed", "tree_map", "adam", "jaxclip", "optax"}``, each
  time an ``(status, seconds)`` pair. optax's counterparts are compiled on
  the uniform tree only.
  """
  names = list(TRANSFORMS)
  impls = (
    ("tree_map x*s", "optax.adam")
    + tuple(f"jaxclip.{n}" for n in names)
    + tuple(f"optax.{n}" for n in names if TRANSFORMS[n][1] is not None)
  )
  sweep = run_compile_sweep(
    [leaves],
    timeout_s,
    leaves if mixed else None,
    repeats,
    impls,
    mixed_impls=impls[: len(names) + 2],
  )
  rows = []
  for r in sweep:
    for n in names:
      rows.append(
        {
          "transform": n,
          "leaves": r["leaves"],
          "mixed": r["mixed"],
          "tree_map": r["tree_map x*s"],
          "adam": r["optax.adam"],
          "jaxclip": r[f"jaxclip.{n}"],
          "optax": r.get(f"optax.{n}", ("none", None)),
        }
      )
  return rows


# ----------------------------------------------------------------------------
# Size sweep: standalone clip against the tree size.
# ----------------------------------------------------------------------------


def run_size_sweep(shrinks: list[int], reps: int, with_torch: bool) -> list[dict]:
  rows = []
  for shrink in shrinks:
    shapes = trees.gpt2_shapes(shrink)
    res = {
      r["case"].split(" (")[0]: r
      for r in run_standalone(shapes, jnp.float32, reps, None, with_torch)
    }
    floor_ms = res["floor: read pass"]["ms"] + res["floor: in-place scale pass"]["ms"]
    torch_row = res["torch clip_grad_norm_(foreach=True)"]
    rows.append(
      {
        "params": trees.num_params(shapes),
        "floor_ms": floor_ms,
        "jaxclip_ms": res["jaxclip.clip_by_global_norm"]["ms"],
        "optax_ms": res["optax.clip_by_global_norm"]["ms"],
        "torch_ms": torch_row["ms"],
        "jaxclip_gbps": res["jaxclip.clip_by_global_norm"]["gbps"],
      }
    )
  return rows


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
