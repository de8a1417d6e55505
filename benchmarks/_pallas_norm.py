"""A multi-tensor sum of squares in one Pallas (Triton) kernel, for the GPU benchmark.

One launch reads every leaf: program ``p`` of the grid reduces one tile of
``block * steps`` consecutive entries of one leaf into a float32 partial sum,
and XLA adds the partial sums (a second, tiny kernel). Which leaf a program
reads is a static table: one ``pl.when`` branch per leaf. Leaves are passed
flattened (a reshape, which XLA makes a bitcast); the last tile of a leaf is
read with a mask.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def tile_table(sizes: list[int], block: int, steps: int) -> list[tuple[int, int, int]]:
  """``(first_program, num_programs, steps_per_program)`` of each leaf."""
  table, first = [], 0
  for n in sizes:
    per = min(steps, -(-n // block))
    count = -(-n // (block * per))
    table.append((first, count, per))
    first += count
  return table


def _kernel(*refs, sizes, table, block):
  *x_refs, o_ref = refs
  pid = pl.program_id(0)
  for x_ref, n, (first, count, per) in zip(x_refs, sizes, table, strict=True):

    @pl.when((pid >= first) & (pid < first + count))
    def _(x_ref=x_ref, n=n, first=first, per=per):
      base = (pid - first) * (block * per)

      def body(j, acc):
        start = base + j * block
        idx = start + jnp.arange(block, dtype=jnp.int32)
        v = plgpu.load(x_ref.at[pl.ds(start, block)], mask=idx < n, other=0)
        v = v.astype(jnp.float32)
        return acc + v * v

      acc = jax.lax.fori_loop(0, per, body, jnp.zeros((block,), jnp.float32))
      o_ref[...] = jnp.full((1,), jnp.sum(acc), jnp.float32)


def sum_of_squares(
  leaves: list[jax.Array],
  block: int = 1024,
  steps: int = 32,
  num_warps: int = 4,
  num_stages: int = 1,
  interpret: bool = False,
) -> jax.Array:
  """The float32 sum of ``|x|**2`` over every entry of every real ``leaves``, one kernel."""
  flat = [jnp.reshape(x, (x.size,)) for x in leaves if x.size]
  sizes = [x.size for x in flat]
  table = tile_table(sizes, block, steps)
  programs = table[-1][0] + table[-1][1]
  kwargs: dict[str, Any] = {}
  if not interpret:
    kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  partial = pl.pallas_call(
    functools.partial(_kernel, sizes=sizes, table=table, block=block),
    out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
    grid=(programs,),
    out_specs=pl.BlockSpec((1,), lambda i: (i,)),
    interpret=interpret,
    **kwargs,
  )(*flat)
  return jnp.sum(partial)


def global_norm(tree: Any, **kw: Any) -> jax.Array:
  return jnp.sqrt(sum_of_squares(jax.tree.leaves(tree), **kw))


if __name__ == "__main__":
  import numpy as np

  rng = np.random.default_rng(0)
  shapes = [(7,), (1000, 3), (2049,), (5, 5), (4096,)]
  leaves = [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]
  ref = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in leaves))
  got = float(global_norm(leaves, block=256, steps=4, interpret=True))
  print(got, ref, abs(got - ref) / ref)
