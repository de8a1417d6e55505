"""The clipped sum over a batch's units, chunk by chunk: the chunks run, ``method="vmap"`` on
one chunk, and the outputs finished as :func:`jaxclip.per_example_clipped_grad` returns them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _sharding
from jaxclip.privacy import _batching, _chunking, _clip_batch
from jaxclip.privacy._batching import Units, rows
from jaxclip.privacy._clip_options import Options


def clipped_units(
  opts: Options,
  loss: Callable[..., Any],
  params: Any,
  units: Units,
  clip_one: Callable[..., tuple[Any, ...]],
) -> tuple[Any, ...]:
  """The clipped sum over the units, chunk by chunk, with the outputs asked for; ``clip_one``
  clips one chunk (``(opts, loss, params, args, idx, mask)``, by the method asked for)."""
  if opts.axis_name is not None:
    params = _sharding.as_varying(params, opts.axis_name)
  chunks = _chunking.chunks_for(units, opts.microbatch_size, opts.spmd_axis_name)
  full_mask, batch = _chunking.stood_in(units, chunks)

  def clip_chunk(batch_args, mask):
    full = list(units.args)
    for i, a in zip(units.idx, batch_args, strict=True):
      full[i] = a
    return clip_one(opts, loss, params, full, units.idx, mask)

  if units.size == 0:
    out = _batching.empty_batch(loss, params, units, opts.group_shape(), opts.has_aux)
  elif isinstance(chunks.num, int) and chunks.num == 1:
    out = clip_chunk(batch, full_mask)
  else:
    out = _chunking.scan_chunks(
      clip_chunk, chunks, params, units, batch, full_mask, opts.group_shape()
    )
  return _finish(opts, params, units.mask, *out)


def _finish(
  opts: Options,
  params: Any,
  mask: jax.Array | None,
  total: Any,
  counts: tuple[jax.Array, jax.Array],
  norms: jax.Array,
  aux: Any,
) -> tuple[Any, ...]:
  """Masked norms, sums in the parameters' dtypes (float32 for half precision) and summed
  over devices, as returned."""
  num_clipped, num_bad = counts
  if mask is not None:
    norms = jnp.where(rows(mask, norms), norms, jnp.zeros((), norms.dtype))
    # With no real example the stand-in is a masked row itself: drop it whatever it gave.
    any_real = jnp.any(mask)
    total = jax.tree.map(lambda t: jnp.where(any_real, t, jnp.zeros((), t.dtype)), total)
  total = jax.tree.map(lambda t, p: t.astype(sum_dtype(p)), total, params)
  if opts.axis_name is not None:
    total, num_clipped, num_bad = jax.lax.psum(
      (total, num_clipped, num_bad), _sharding.axis_names(opts.axis_name)
    )
  num_clipped, norms = opts.groups.unflatten(num_clipped, 0), opts.groups.unflatten(norms, 1)
  out = (total, num_clipped) + ((num_bad,) if opts.return_num_nonfinite else ())
  out = out + ((norms,) if opts.return_norms else ())
  return out + (aux,) if opts.has_aux else out


def sum_dtype(param: Any) -> jnp.dtype:
  """The dtype of a parameter's clipped sum: float32 for bfloat16 and float16, its own
  otherwise (the noise is added before rounding to a half-precision dtype)."""
  return _numerics.compute_dtype(jnp.result_type(param))


def vmap_chunk(
  opts: Options,
  loss: Callable[..., Any],
  params: Any,
  args: list[Any],
  idx: Sequence[int],
  mask: jax.Array | None,
) -> tuple[Any, jax.Array, jax.Array, Any]:
  """``method="vmap"``: per-example gradients under ``vmap``, clipped and summed."""
  in_axes = (None,) + tuple(0 if i in idx else None for i in range(len(args)))
  vgrad = jax.vmap(
    jax.grad(loss, has_aux=opts.has_aux), in_axes=in_axes, spmd_axis_name=opts.spmd_axis_name
  )
  grads, aux = vgrad(params, *args) if opts.has_aux else (vgrad(params, *args), None)
  bound = opts.groups if opts.per_group else opts.l2_norm_clip
  total, count, norms, bad = _clip_batch._per_example_clip(
    grads, bound, mask=mask, accumulate=True, normalize=opts.normalize
  )
  if not jax.tree.leaves(grads):  # no parameters: every norm is 0, as under ghost
    n = jax.tree.leaves([args[i] for i in idx])[0].shape[0]
    norms = jnp.zeros((n,) + opts.group_shape(), _numerics.tree_accumulation_dtype(params))
    count, bad = opts.factors(norms, mask)[1]
  return total, (count, bad), norms, aux
