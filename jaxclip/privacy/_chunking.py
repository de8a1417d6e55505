"""The units of a per-example clipping call cut into chunks of ``microbatch_size``, run one
after the other under ``lax.scan``; padding and masked-out rows are copies of a real example."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _shapes, _sharding
from jaxclip._kernel._typing import AxisName
from jaxclip.privacy._batching import Units, pad_rows, stand_in, zero_sums


def mesh_axis_size(axis_name: AxisName | None) -> int | None:
  """The number of devices along ``axis_name`` of the current mesh, if known."""
  if axis_name is None:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  names = _sharding.axis_names(axis_name)
  if mesh.empty or any(n not in mesh.axis_names for n in names):
    return None
  return math.prod(mesh.shape[n] for n in names)


class Chunks(NamedTuple):
  """How the units are cut into chunks: ``num`` chunks of ``size`` units (``padded`` in all).

  With a symbolic batch (``jax.export``), ``size`` and ``num`` are symbolic
  too: ``min(batch, microbatch_size)`` and as many chunks as that takes.
  """

  size: Any
  num: Any

  @property
  def padded(self) -> Any:
    return self.size * self.num

  def pads(self, units: int) -> bool:
    """Whether the chunks hold more than ``units`` rows (always, for a symbolic batch: the
    padding rows are then masked, whether there are any or not)."""
    if _shapes.is_symbolic(units):
      return self.padded != units
    return self.padded > units

  def split(self, x: Any) -> jax.Array:
    """``x`` (padded to ``padded`` rows) as ``(num, size, ...)``.

    Example ``i * num + j`` goes to chunk ``j``, row ``i``: a device holding a
    contiguous block of the batch holds whole rows of every chunk.
    """
    x = pad_rows(jnp.asarray(x), self.padded)
    return jnp.swapaxes(x.reshape((self.size, self.num) + x.shape[1:]), 0, 1)

  def join(self, a: jax.Array, size: int) -> jax.Array:
    """The inverse of :meth:`split`, the first ``size`` rows."""
    return jnp.swapaxes(a, 0, 1).reshape((self.padded,) + a.shape[2:])[:size]


def chunks_for(
  units: Units, microbatch_size: int | None, spmd_axis_name: AxisName | None
) -> Chunks:
  """How ``units`` are cut into chunks (``microbatch_size`` counts examples)."""
  micro = units.microbatch
  size = units.size if micro is None else _shapes.min_dim(units.size, int(micro))
  if _shapes.is_symbolic(units.size):  # a symbolic batch has at least one example
    num = -(-units.size // size)
    several = micro is not None  # chunks of microbatch_size, unless the batch is smaller
    size_devices = int(micro) if several else None
  else:
    num = -(-units.size // size) if size else 1
    several, size_devices = num > 1, size
  devices = mesh_axis_size(spmd_axis_name)
  if several and devices and size_devices % devices:
    raise ValueError(
      f"microbatch_size={microbatch_size} must be a multiple of the {devices} "
      f"devices of spmd_axis_name={spmd_axis_name!r}, so that every device "
      "takes the same number of examples of each chunk."
    )
  return Chunks(size, num)


def stood_in(units: Units, chunks: Chunks) -> tuple[jax.Array | None, list[Any]]:
  """Which of the chunks' rows are real (``None``: all), and the batched arguments over them.

  Padding and masked-out rows become copies of the first real example, to be
  taken at weight 0: a loss that is non-finite on zeros (or on the masked
  rows) is then evaluated on real data only, so no NaN reaches the sum.
  """
  mask = units.mask
  if mask is None and not chunks.pads(units.size):
    return None, [units.args[i] for i in units.idx]
  full_mask = jnp.arange(chunks.padded) < units.size
  if mask is not None:
    full_mask = full_mask & pad_rows(mask, chunks.padded)
  batch = [
    jax.tree.map(lambda x: stand_in(x, full_mask, chunks.padded), units.args[i]) for i in units.idx
  ]
  return full_mask, batch


def scan_chunks(
  clip_chunk: Callable[..., Any],
  chunks: Chunks,
  params: Any,
  units: Units,
  batch: list[Any],
  full_mask: jax.Array | None,
  count_shape: tuple[int, ...] = (),
) -> tuple[Any, tuple[jax.Array, jax.Array], jax.Array, Any]:
  """The chunks one after the other under ``lax.scan``, their sums in float32 (or wider), and
  the counts ``(scaled down, not finite)``."""
  xs = [jax.tree.map(chunks.split, b) for b in batch]
  masks = chunks.split(full_mask) if full_mask is not None else None
  init = (
    zero_sums(params),
    (
      jnp.zeros(count_shape, jax.dtypes.canonicalize_dtype(jnp.int_)),
      jnp.zeros((), jax.dtypes.canonicalize_dtype(jnp.int_)),
    ),
  )

  def body(carry, chunk_in):
    batch_args, mask = chunk_in
    part, count, norms, aux = clip_chunk(batch_args, mask)
    return jax.tree.map(jnp.add, carry, (part, count)), (norms, aux)

  # Inside shard_map the sums vary over the axes the inputs vary over; the
  # scan carry must have that type from the start.
  vary = frozenset().union(*map(_sharding.varying_axes, jax.tree.leaves((params, units.args))))
  if vary:
    init = _sharding.cast_varying(init, tuple(sorted(vary, key=str)))
  (total, num_clipped), (norms, aux) = jax.lax.scan(body, init, (xs, masks))
  norms, aux = jax.tree.map(lambda a: chunks.join(a, units.size), (norms, aux))
  return total, num_clipped, norms, aux
