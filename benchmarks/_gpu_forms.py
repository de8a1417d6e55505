"""The global norm's formulations that ``benchmarks.gpu_norm`` times, and a clip by any of them."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import jaxclip

MAX_NORM = 1.0


def _sq(x):
  x = x.astype(jnp.float32)
  return x * x


def norm_per_leaf_stacked(leaves):
  return jnp.sqrt(jnp.sum(jnp.stack([jnp.sum(_sq(x)) for x in leaves])))


def norm_concat(leaves):
  return jnp.sqrt(jnp.sum(_sq(jnp.concatenate([jnp.ravel(x) for x in leaves]))))


def _rows(n: int, width: int) -> int:
  """The largest power of two <= ``width`` dividing ``n`` (1 if none)."""
  k = width
  while k > 1 and n % k:
    k //= 2
  return k


def norm_two_stage(leaves, width=2048):
  """Each leaf as rows of up to ``width`` entries: row sums, then one sum of them all."""
  parts = []
  for x in leaves:
    k = _rows(x.size, width)
    parts.append(jnp.sum(_sq(jnp.reshape(x, (x.size // k, k))), axis=1))
  return jnp.sqrt(jnp.sum(jnp.concatenate(parts)))


def norm_grouped(leaves, groups=4):
  """Leaves sorted by size into ``groups`` groups of similar bytes, each concatenated."""
  order = sorted(range(len(leaves)), key=lambda i: leaves[i].size)
  total = sum(x.size for x in leaves)
  parts, cur, acc = [], [], 0
  for i in order:
    cur.append(jnp.ravel(leaves[i]))
    acc += leaves[i].size
    if acc >= total * (len(parts) + 1) / groups:
      parts.append(jnp.sum(_sq(jnp.concatenate(cur) if len(cur) > 1 else cur[0])))
      cur = []
  if cur:
    parts.append(jnp.sum(_sq(jnp.concatenate(cur))))
  return jnp.sqrt(jnp.sum(jnp.stack(parts)))


def norm_vdot(leaves):
  return jnp.sqrt(sum(jnp.vdot(jnp.ravel(x), jnp.ravel(x)).astype(jnp.float32) for x in leaves))


def _pallas(**kw):
  from benchmarks import _pallas_norm

  interpret = jax.default_backend() != "gpu"

  def f(leaves):
    return jnp.sqrt(_pallas_norm.sum_of_squares(leaves, interpret=interpret, **kw))

  return f


def _norm_without(*tricks: str) -> Callable[[list[jax.Array]], jax.Array]:
  """``jaxclip.ops.global_norm`` traced without ``tricks`` (``jaxclip.platform.TRICKS``).

  The switch is read while the norm is traced, so it is opened inside the
  function that ``jax.jit`` traces.
  """

  def norm(leaves: list[jax.Array]) -> jax.Array:
    with jaxclip.platform.without(*tricks):
      return jaxclip.ops.global_norm(leaves)

  return norm


def formulations(quick: bool) -> dict[str, Callable[[list[jax.Array]], jax.Array]]:
  forms = {
    "jaxclip.ops.global_norm": lambda leaves: jaxclip.ops.global_norm(leaves),
    "optax.tree.norm": lambda leaves: optax.tree.norm(leaves),
    "per-leaf sums, stacked": norm_per_leaf_stacked,
    "one concatenated buffer": norm_concat,
    "4 groups by size, concatenated": norm_grouped,
    "rows of 2048, then one sum": norm_two_stage,
    "rows of 8192, then one sum": lambda leaves: norm_two_stage(leaves, 8192),
    "vdot per leaf": norm_vdot,
    "pallas: 1 kernel, tiles 1024x32, 4 warps": _pallas(block=1024, steps=32, num_warps=4),
    "pallas: 1 kernel, tiles 2048x16, 8 warps": _pallas(block=2048, steps=16, num_warps=8),
    # On a CUDA GPU jaxclip's global norm is its kernel; on other machines (a smoke run) the
    # plain program.
    "jaxclip's CUDA kernel (scaled tiles 1024x32)": _norm_without(),
    "jaxclip's CUDA kernel, a branch per leaf (unpacked)": _norm_without("cuda_packing"),
    "jaxclip's plain program (XLA reductions, rescue cond)": _norm_without("cuda_norm"),
    "pallas: 1 kernel, tiles 4096x8, 8 warps, 3 stages": _pallas(
      block=4096, steps=8, num_warps=8, num_stages=3
    ),
  }
  if quick:
    forms = {k: v for k, v in forms.items() if "2048x16" not in k and "4096" not in k}
  return forms


def _clip_with(norm_fn) -> optax.GradientTransformation:
  """clip_by_global_norm with the norm computed by ``norm_fn(leaves)``."""

  def update(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    norm = norm_fn(leaves)
    scale = MAX_NORM / jnp.maximum(norm, MAX_NORM)
    return treedef.unflatten([(x * scale).astype(x.dtype) for x in leaves]), state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)
