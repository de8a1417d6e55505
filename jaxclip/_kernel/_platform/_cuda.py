"""The global 2-norm on CUDA GPUs: every leaf in one Pallas (Triton) kernel, overflow-safe.

Measured on one H200 (``benchmarks/results/gpu.md``), XLA reduces a tree of 148
float32 leaves (GPT-2 small) in 130-200 kernels whose fixed cost and ramp
keep the norm at about a third of the card's bandwidth, and the overflow
rescue's ``lax.cond`` makes XLA:GPU copy its predicate to the host and wait:
the device idles for the round trip in every step. Here one kernel reads
every leaf once: program ``p`` of its grid reduces one tile of one leaf (a
static table says which: one ``pl.when`` branch per leaf, the small ones
packed into one), scaled by the power of two of the tile's largest
magnitude, so no sum overflows or underflows, and XLA combines the tiles'
``(exponent, sum)`` pairs. There is
no conditional. Derivatives are the plain norm's (:func:`cuda_norm`'s JVP).

Only for what was measured there: float32 and bfloat16 leaves, whole on
one device, at most ``MAX_LEAVES`` of them. Elsewhere the plain programs
run (:func:`cuda_norm_applies`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _sharding
from jaxclip._kernel._platform._tricks import is_on
from jaxclip._kernel._shapes import constant_size

# The tile of one program: BLOCK entries per step, STEPS steps (the fastest
# of the three measured; 4 warps). The kernel has one branch per input, and
# its compile time grows with them: on the one tree measured (148 leaves) 32-34 s
# with a branch per leaf, 5.5 s with the small ones packed (51 branches;
# XLA's reductions 5-6 s). MAX_LEAVES bounds it.
BLOCK, STEPS, WARPS = 1024, 32, 4
MAX_LEAVES = 256
# Leaves smaller than one program's tile are packed into one float32 buffer
# first (a copy of few bytes), so they share one branch: GPT-2 small's 98
# biases and norms' scales would otherwise be 98 of its 148 branches.
PACK_BELOW = BLOCK * STEPS
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_MIN_EXP, _MAX_EXP = -126, 126  # 2**-e stays a normal float32


@functools.cache
def _has_triton_pallas() -> bool:
  """Whether this jax has Pallas' Triton backend (deprecated in jax 0.12)."""
  try:
    from jax.experimental.pallas import triton  # noqa: F401
  except ImportError:
    return False
  return True


def cuda_norm_applies(leaves: list[Any]) -> bool:
  """Whether :func:`cuda_norm` may compute the 2-norm of ``leaves`` on CUDA."""
  if not _has_triton_pallas():
    return False
  sizes = [constant_size(x) for x in leaves]
  if None in sizes or not 0 < sum(s > 0 for s in sizes) <= MAX_LEAVES:
    return False
  return all(
    getattr(x, "dtype", None) in _DTYPES
    and s < 2**31 - BLOCK * STEPS
    and (s == 0 or _sharding.layout(x) is _sharding.LOCAL)
    for x, s in zip(leaves, sizes, strict=True)
  )


def _exponent(m: jax.Array) -> jax.Array:
  """``e`` (int32) with ``2**e <= m < 2**(e + 1)`` for normal ``m >= 0``, clipped to [-126, 126]."""
  bits = jax.lax.bitcast_convert_type(m, jnp.int32)
  return jnp.clip(((bits >> 23) & 0xFF) - 127, _MIN_EXP, _MAX_EXP)


def _pow2(k: jax.Array) -> jax.Array:
  """``2.0**k`` in float32, exactly, for int32 ``k`` in ``[-126, 127]``."""
  return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def tile_table(sizes: list[int]) -> list[tuple[int, int, int]]:
  """``(first_program, num_programs, steps_per_program)`` of each leaf."""
  table, first = [], 0
  for n in sizes:
    steps = min(STEPS, -(-n // BLOCK))
    count = -(-n // (BLOCK * steps))
    table.append((first, count, steps))
    first += count
  return table


def _kernel(*refs, sizes, table):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  *x_refs, e_ref, s_ref = refs
  pid = pl.program_id(0)
  for x_ref, n, (first, count, steps) in zip(x_refs, sizes, table, strict=True):

    @pl.when((pid >= first) & (pid < first + count))
    def _(x_ref=x_ref, n=n, first=first, steps=steps):
      base = (pid - first) * (BLOCK * steps)

      def body(j, carry):
        top, total = carry
        start = base + j * BLOCK
        idx = start + jnp.arange(BLOCK, dtype=jnp.int32)
        v = plgpu.load(x_ref.at[pl.ds(start, BLOCK)], mask=idx < n, other=0)
        v = v.astype(jnp.float32)
        e = _exponent(jnp.max(jnp.abs(v)))
        w = v * _pow2(-e)
        new_top = jnp.maximum(top, e)
        total = total * _pow2(jnp.maximum(2 * (top - new_top), _MIN_EXP)) + jnp.sum(w * w) * _pow2(
          jnp.maximum(2 * (e - new_top), _MIN_EXP)
        )
        return new_top, total

      top, total = jax.lax.fori_loop(
        0, steps, body, (jnp.int32(_MIN_EXP), jnp.float32(0)), unroll=False
      )
      e_ref[...] = jnp.full((1,), top, jnp.int32)
      s_ref[...] = jnp.full((1,), total, jnp.float32)


def kernel_inputs(leaves: list[jax.Array], pack: bool = True) -> list[jax.Array]:
  """The kernel's flat inputs, one branch each: the leaves of ``PACK_BELOW`` or more entries,
  then the smaller ones packed into one float32 buffer (with ``pack``; else none)."""
  flat = [jnp.reshape(x, (x.size,)) for x in leaves if x.size]
  small = [x for x in flat if x.size < PACK_BELOW] if pack else []
  if len(small) < 2:
    return flat
  packed = jnp.concatenate([x.astype(jnp.float32) for x in small])
  return [x for x in flat if x.size >= PACK_BELOW] + [packed]


def _parts(leaves: list[jax.Array], interpret: bool, pack: bool) -> tuple[jax.Array, jax.Array]:
  """Every tile's ``(exponent, scaled sum of squares)``: one kernel."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  flat = kernel_inputs(leaves, pack)
  sizes = [x.size for x in flat]
  table = tile_table(sizes)
  programs = table[-1][0] + table[-1][1]
  kwargs: dict[str, Any] = {"interpret": interpret}
  if not interpret:
    kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=WARPS, num_stages=1)
  return pl.pallas_call(
    functools.partial(_kernel, sizes=sizes, table=table),
    out_shape=(
      jax.ShapeDtypeStruct((programs,), jnp.int32),
      jax.ShapeDtypeStruct((programs,), jnp.float32),
    ),
    grid=(programs,),
    out_specs=(pl.BlockSpec((1,), lambda i: (i,)), pl.BlockSpec((1,), lambda i: (i,))),
    **kwargs,
  )(*flat)


def cuda_norm(leaves: list[jax.Array], interpret: bool = False) -> jax.Array:
  """The float32 2-norm of every entry of ``leaves`` together (see :func:`cuda_norm_applies`).

  ``interpret=True`` runs the kernel's program on any backend (tests). The
  small leaves are packed into one input (:func:`kernel_inputs`) unless the
  trick ``cuda_packing`` is off; the choice is an argument of the custom JVP
  function, since jax caches such a function's trace by its arguments.
  """
  return _norm(leaves, interpret, is_on("cuda_packing"))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _norm(leaves: list[jax.Array], interpret: bool, pack: bool) -> jax.Array:
  if not any(x.size for x in leaves):
    return jnp.zeros((), jnp.float32)
  exps, sums = _parts(leaves, interpret, pack)
  top = jnp.max(exps)
  total = jnp.sum(sums * _pow2(jnp.maximum(2 * (exps - top), _MIN_EXP)))
  root = _pow2(top) * jnp.sqrt(total)
  # As the plain norm: finite entries whose norm passes float32's range saturate at its max;
  # an inf entry gives inf and a NaN NaN (``total`` is then not finite).
  return jnp.where(jnp.isfinite(total), jnp.minimum(root, jnp.finfo(jnp.float32).max), root)


@_norm.defjvp
def _norm_jvp(interpret, pack, primals, tangents):
  (leaves,), (dleaves,) = primals, tangents
  n = _norm(leaves, interpret, pack)
  safe = jnp.where(n > 0, n, 1)
  dots = [
    jnp.sum((x.astype(jnp.float32) / safe) * dx.astype(jnp.float32))
    for x, dx in zip(leaves, dleaves, strict=True)
    if x.size
  ]
  dn = jnp.sum(jnp.stack(dots)) if dots else jnp.zeros((), jnp.float32)
  return n, jnp.where(n > 0, dn, 0)
