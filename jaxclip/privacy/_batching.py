"""The batch of a per-example clipping call: checked, grouped into units, each unit's loss.

:func:`jaxclip.per_example_clipped_grad` clips *units* (examples, or groups of
``group_size`` consecutive examples) in chunks of ``microbatch_size`` under
``lax.scan`` (:mod:`jaxclip.privacy._chunking`). Padding and masked-out rows
become copies of the first real example (:func:`stand_in`), so a loss that is
non-finite on zeros is evaluated on real data only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _shapes, _validation


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
  if _shapes.is_symbolic(n) or _shapes.is_symbolic(rows):
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
  if _shapes.is_symbolic(size % k):
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


def zero_sums(params: Any) -> Any:
  """Zeros like ``params``, each in its clipped sum's dtype: float32 for bfloat16 and float16
  (the noise is added before any rounding to half precision), its own otherwise; with each
  parameter's sharding (``zeros_like``)."""
  return jax.tree.map(
    lambda p: jnp.zeros_like(p, _numerics.compute_dtype(jnp.result_type(p))), params
  )


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
  total = zero_sums(params)
  int_ = jax.dtypes.canonicalize_dtype(jnp.int_)
  num_clipped = jnp.zeros(count_shape, int_), jnp.zeros((), int_)
  norms = jnp.zeros((0,) + count_shape, _numerics.tree_accumulation_dtype(params))
  aux = jax.tree.map(lambda s: jnp.zeros((0,) + s.shape, s.dtype), shapes[1]) if has_aux else None
  return total, num_clipped, norms, aux
