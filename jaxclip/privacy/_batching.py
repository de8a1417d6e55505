"""The batch of a per-example clipping call: checked, grouped into units, cut into chunks.

:func:`jaxclip.per_example_clipped_grad` clips *units* (examples, or groups of
``group_size`` consecutive examples) in chunks of ``microbatch_size`` under
``lax.scan``. Padding and masked-out rows become copies of the first real
example (:func:`stand_in`), so a loss that is non-finite on zeros is evaluated
on real data only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _sharding, _validation
from jaxclip._kernel._typing import AxisName


def mesh_axis_size(axis_name: AxisName | None) -> int | None:
  """The number of devices along ``axis_name`` of the current mesh, if known."""
  if axis_name is None:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  names = _sharding.axis_names(axis_name)
  if mesh.empty or any(n not in mesh.axis_names for n in names):
    return None
  return math.prod(mesh.shape[n] for n in names)


def batch_size(args: Sequence[Any], batch_argnums: tuple[int, ...]) -> int:
  sizes = {
    jnp.shape(x)[0] if jnp.ndim(x) else None
    for i in batch_argnums
    for x in jax.tree.leaves(args[i])
  }
  if len(sizes) != 1 or None in sizes:
    shapes = [jax.tree.map(jnp.shape, args[i]) for i in batch_argnums]
    raise ValueError(
      "per_example_clipped_grad needs every array of the batch arguments to "
      f"share one batch dimension on axis 0; got shapes {shapes}."
    )
  return sizes.pop()


def rows(mask: jax.Array, like: jax.Array) -> jax.Array:
  """A ``(rows,)`` mask shaped to broadcast against ``like`` (``(rows,)`` or ``(rows, groups)``)."""
  return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


def first_onehot(mask: jax.Array) -> jax.Array:
  """A one-hot row selector of ``mask``'s first True row (row 0 where none is).

  ``jnp.argmax`` would do, but on a batch axis sharded over devices XLA
  gathers its (value, index) pairs from every device: a minimum of the indices
  combines with an all-reduce instead.
  """
  n = mask.shape[0]
  index = jnp.arange(n)
  first = jnp.min(jnp.where(mask, index, n))
  return index == jnp.where(first == n, 0, first)


def first_real_row(x: jax.Array, onehot: jax.Array) -> jax.Array:
  """Row ``argmax(onehot)`` of ``x``, as a masked sum: safe on a sharded batch axis (for
  ``jax.random`` keys, a row of their data)."""
  if jnp.issubdtype(jax.typeof(x).dtype, jax.dtypes.extended):
    data = first_real_row(jax.random.key_data(x), onehot)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  x = jnp.asarray(x)
  work = jnp.int32 if x.dtype == jnp.bool_ else x.dtype
  picked = jnp.where(
    onehot.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(work), jnp.zeros((), work)
  )
  return jnp.sum(picked, axis=0, dtype=work).astype(x.dtype)


def pad_rows(x: jax.Array, rows: Any) -> jax.Array:
  """``x`` with ``rows >= len(x)`` rows: zeros appended.

  With a symbolic batch (``jax.export``), where how many rows to append is not
  known when tracing, the rows appended are copies of the last one: callers
  mask them out.
  """
  n = x.shape[0]
  if n == rows:
    return x
  if _validation.is_symbolic(n) or _validation.is_symbolic(rows):
    return jnp.take(x, jnp.minimum(jnp.arange(rows), n - 1), axis=0)
  return jnp.pad(x, [(0, rows - n)] + [(0, 0)] * (x.ndim - 1))


def stand_in(x: Any, mask: jax.Array, padded: Any) -> jax.Array:
  """``x`` padded to ``padded`` rows, every row where ``mask`` is False replaced by the first
  real example (so a loss that is non-finite on zeros or on masked rows stays finite)."""
  x = jnp.asarray(x)
  onehot = first_onehot(mask[: x.shape[0]])
  first = first_real_row(x, onehot)
  x = pad_rows(x, padded)
  return jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, first)


def warn_shared_like_batch(args: Sequence[Any], idx: Sequence[int], size: int) -> bool:
  """Warns if a shared argument has a leading dimension of the batch size; True if it did."""
  for i, a in enumerate(args):
    if i in idx:
      continue
    if any(getattr(x, "shape", None) and x.shape[0] == size for x in jax.tree.leaves(a)):
      warnings.warn(
        f"per_example_clipped_grad: argument {i + 1} is shared (not in batch_argnums) but "
        f"has a leading dimension of the batch size {size}: if it holds one row per "
        "example, add it to batch_argnums, or it is given whole to every example. "
        "(Warned once per function.)",
        UserWarning,
        stacklevel=4,
      )
      return True
  return False


class Batch(NamedTuple):
  """A call's arguments, checked.

  Attributes:
    args: The arguments after ``params``.
    idx: The positions in ``args`` of the batched ones.
    size: The number of examples.
    mask: The ``example_mask`` as a boolean ``(size,)`` array, or ``None``.
  """

  args: list[Any]
  idx: list[int]
  size: int
  mask: jax.Array | None


def argnums(
  batch_argnums: int | Sequence[int] | None, num_args: int | None = None
) -> tuple[int, ...] | None:
  """``batch_argnums`` as a tuple of positions after ``params`` (``1`` the first); an int is
  one position. ``None`` is every one of ``num_args`` arguments, or stays ``None`` where
  ``num_args`` is not given (before a call)."""
  if batch_argnums is None:
    return None if num_args is None else tuple(range(1, num_args + 1))
  return (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)


def batch_of(
  batch_argnums: tuple[int, ...] | None,
  params: Any,
  args: Sequence[Any],
  example_mask: Any,
  warned: list[bool],
) -> Batch:
  """A call's arguments, checked; ``warned`` (the shared-argument warning, given once per
  function) is appended to when it is given."""
  nums = argnums(batch_argnums, len(args))
  if not nums:
    raise ValueError("per_example_clipped_grad needs a batch: at least one argument after params.")
  if max(nums) > len(args):
    raise ValueError(f"batch_argnums={nums} but only {len(args)} arguments follow params.")
  _validation.check_inexact_leaves(params, "per_example_clipped_grad")
  idx = [i - 1 for i in nums]
  size = batch_size(args, idx)
  if batch_argnums is not None and not warned and warn_shared_like_batch(args, idx, size):
    warned.append(True)
  return Batch(list(args), idx, size, _validation.check_mask(example_mask, size))


class Units(NamedTuple):
  """The batch in clipping units: examples, or (``group_size > 1``) groups of examples.

  Attributes:
    args: The loss's arguments; those at ``idx`` carry the units on axis 0 (a
      group's examples on axis 1, and its real-example flags last).
    idx: The positions in ``args`` of the batched ones.
    size: The number of units.
    mask: Which units hold a real example, or ``None``.
    microbatch: The units per chunk, or ``None`` for all at once.
  """

  args: list[Any]
  idx: list[int]
  size: int
  mask: jax.Array | None
  microbatch: int | None


def grouped(batch: Batch, k: int, microbatch_size: int | None) -> Units:
  """``batch`` in units of ``k`` (``group_size``) consecutive examples."""
  size, mask = batch.size, batch.mask
  if k == 1:
    return Units(batch.args, batch.idx, size, mask, microbatch_size)
  if _validation.is_symbolic(size % k):
    raise ValueError(
      f"group_size={k} must divide the batch, whose size {size} is symbolic (jax.export) "
      f"and not known to be a multiple of {k}: export it as one, such as "
      f"jax.export.symbolic_shape('{k}*u')."
    )
  if size % k:
    raise ValueError(
      f"group_size={k} must divide the batch of {size} examples "
      "(groups are consecutive examples; pad a user's data with masked rows)."
    )
  units = size // k
  real = jnp.ones((size,), jnp.bool_) if mask is None else mask
  regroup = lambda x: jnp.reshape(x, (units, k) + jnp.shape(x)[1:])
  real_rows = lambda x: stand_in(x, real, size) if mask is not None else jnp.asarray(x)
  args = [
    jax.tree.map(lambda x: regroup(real_rows(x)), a) if i in batch.idx else a
    for i, a in enumerate(batch.args)
  ] + [regroup(real)]
  micro = None if microbatch_size is None else microbatch_size // k
  unit_mask = None if mask is None else jnp.any(regroup(real), axis=1)
  return Units(args, batch.idx + [len(batch.args)], units, unit_mask, micro)


def with_batch_dim(args: Sequence[Any], idx: Sequence[int]) -> list[Any]:
  """``args`` with a leading axis of one on every leaf of the batched ones (at ``idx``): one
  example as a batch of one, for a loss written for batches (``keep_batch_dim``)."""
  return [
    jax.tree.map(lambda x: jnp.expand_dims(x, 0), a) if i in idx else a for i, a in enumerate(args)
  ]


def check_loss(loss: Any, shown: str | None = None) -> None:
  """Raises unless ``loss`` (one example's loss, or its abstract value) is a real scalar;
  the error shows it as ``shown``, else by its type."""
  if jnp.shape(loss) or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise ValueError(
      "per_example_clipped_grad needs loss_fn to return a real scalar for one example, "
      f"got {jax.typeof(loss).str_short() if shown is None else shown}."
    )


def unit_loss(
  loss_fn: Callable[..., Any],
  idx: Sequence[int],
  group_size: int,
  has_aux: bool,
  keep_batch_dim: bool,
) -> Callable[..., Any]:
  """The loss of one unit: one example, or (``group_size > 1``) one group's sum."""

  def example_loss(params, *args):
    if keep_batch_dim:
      args = with_batch_dim(args, idx)
    out = loss_fn(params, *args)
    check_loss(out[0] if has_aux and isinstance(out, (tuple, list)) and out else out)
    return out

  if group_size == 1:
    return example_loss

  def group_loss(params, *args):
    *args, real = args  # args' batched leaves hold the group's k examples
    in_axes = (None,) + tuple(0 if i in idx else None for i in range(len(args)))
    out = jax.vmap(example_loss, in_axes=in_axes)(params, *args)
    losses, aux = out if has_aux else (out, None)
    loss = jnp.sum(jnp.where(real, losses, jnp.zeros((), losses.dtype)))
    return (loss, aux) if has_aux else loss

  return group_loss


def empty_batch(
  loss: Callable[..., Any],
  params: Any,
  units: Units,
  count_shape: tuple[int, ...],
  has_aux: bool,
) -> tuple[Any, tuple[jax.Array, jax.Array], jax.Array, Any]:
  """Zeros, counts of 0, no norms and an empty aux: what both methods give for no examples."""
  example = [
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)), a)
    if i in units.idx
    else a
    for i, a in enumerate(units.args)
  ]
  shapes = jax.eval_shape(loss, params, *example)
  total = jax.tree.map(
    lambda p: jnp.zeros_like(p, _numerics.compute_dtype(jnp.result_type(p))), params
  )
  int_ = jax.dtypes.canonicalize_dtype(jnp.int_)
  num_clipped = jnp.zeros(count_shape, int_), jnp.zeros((), int_)
  norms = jnp.zeros((0,) + count_shape, _numerics.tree_accumulation_dtype(params))
  aux = jax.tree.map(lambda s: jnp.zeros((0,) + s.shape, s.dtype), shapes[1]) if has_aux else None
  return total, num_clipped, norms, aux


# ----------------------------------------------------------------------------
# Chunking: microbatches under lax.scan, padded with copies of a real example
# ----------------------------------------------------------------------------


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
    if _validation.is_symbolic(units):
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
  size = units.size if micro is None else _validation.min_dim(units.size, int(micro))
  if _validation.is_symbolic(units.size):  # a symbolic batch has at least one example
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
  # zeros_like keeps each parameter's sharding for the running sum.
  init = (
    jax.tree.map(lambda p: jnp.zeros_like(p, _numerics.compute_dtype(jnp.result_type(p))), params),
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
