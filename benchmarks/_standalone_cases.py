"""The standalone clip's cases: against the bandwidth floor, optax and torch, and the tree size."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxclip
from benchmarks import _cases, _timing
from workloads import trees

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
    torch.nn.utils.clip_grad_norm_(params, _cases.MAX_NORM, foreach=True)
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
  nbytes, num = _cases._nbytes(trees.make_tree(shapes, dtype)), trees.num_params(shapes)
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
    temps[f"{lib} norm"] = _cases._temp_mb(compiled)
  for lib, make in (("jaxclip", jaxclip.clip_by_global_norm), ("optax", optax.clip_by_global_norm)):
    tx = make(_cases.MAX_NORM)
    tree = trees.make_tree(shapes, dtype)
    state = tx.init(tree)
    compiled = (
      jax.jit(lambda t, tx=tx, state=state: tx.update(t, state)[0], donate_argnums=0)
      .lower(tree)
      .compile()
    )
    steps[f"{lib} clip"] = (lambda t, c=compiled: (y := c(t), y), tree)
    temps[f"{lib} clip"] = _cases._temp_mb(compiled)
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
