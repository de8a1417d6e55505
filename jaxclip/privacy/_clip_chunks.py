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
from jaxclip.privacy._clip_factors import Clip, scale_factors
from jaxclip.privacy._clip_options import Options


def clipped_units(
  opts: Options,
  clip: Clip,
  loss: Callable[..., Any],
  params: Any,
  units: Units,
  clip_one: Callable[..., tuple[Any, ...]],
) -> tuple[Any, ...]:
  """The clipped sum over the units by ``clip``, chunk by chunk, with the outputs asked for;
  ``clip_one`` clips one chunk (``(opts, clip, loss, params, args, idx, mask)``, by the method
  asked for) and returns its sum in each parameter's sum dtype
  (:func:`jaxclip.privacy._batching.zero_sums`)."""
  if opts.axis_name is not None:
    params = _sharding.as_varying(params, opts.axis_name)
  chunks = _chunking.chunks_for(units, opts.microbatch_size, opts.spmd_axis_name)
  full_mask, batch = _chunking.stood_in(units, chunks)

  def clip_chunk(batch_args, mask):
    full = list(units.args)
    for i, a in zip(units.idx, batch_args, strict=True):
      full[i] = a
    return clip_one(opts, clip, loss, params, full, units.idx, mask)

  if units.size == 0:
    out = _batching.empty_batch(loss, params, units, clip.group_shape, opts.has_aux)
  elif isinstance(chunks.num, int) and chunks.num == 1:
    out = clip_chunk(batch, full_mask)
  else:
    out = _chunking.scan_chunks(
      clip_chunk, chunks, params, units, batch, full_mask, clip.group_shape
    )
  return _finish(opts, clip, units.mask, *out)


def _finish(
  opts: Options,
  clip: Clip,
  mask: jax.Array | None,
  total: Any,
  counts: tuple[jax.Array, jax.Array],
  norms: jax.Array,
  aux: Any,
) -> tuple[Any, ...]:
  """Masked norms, sums (already in their dtypes: float32 for half precision) summed over
  devices, as returned."""
  num_clipped, num_bad = counts
  if mask is not None:
    norms = jnp.where(rows(mask, norms), norms, jnp.zeros((), norms.dtype))
    # With no real example the stand-in is a masked row itself: drop it whatever it gave.
    any_real = jnp.any(mask)
    total = jax.tree.map(lambda t: jnp.where(any_real, t, jnp.zeros((), t.dtype)), total)
  if opts.axis_name is not None:
    total, num_clipped, num_bad = jax.lax.psum(
      (total, num_clipped, num_bad), _sharding.axis_names(opts.axis_name)
    )
  num_clipped, norms = clip.unflatten(num_clipped, 0), clip.unflatten(norms, 1)
  out = (total, num_clipped) + ((num_bad,) if opts.return_num_nonfinite else ())
  out = out + ((norms,) if opts.return_norms else ())
  return out + (aux,) if opts.has_aux else out


def vmap_chunk(
  opts: Options,
  clip: Clip,
  loss: Callable[..., Any],
  params: Any,
  args: list[Any],
  idx: Sequence[int],
  mask: jax.Array | None,
) -> tuple[Any, tuple[jax.Array, jax.Array], jax.Array, Any]:
  """``method="vmap"``: per-example gradients under ``vmap``, clipped by ``clip`` and summed
  (in float32 or wider: the one upcast on this path, as each term is formed)."""
  in_axes = (None,) + tuple(0 if i in idx else None for i in range(len(args)))
  vgrad = jax.vmap(
    jax.grad(loss, has_aux=opts.has_aux), in_axes=in_axes, spmd_axis_name=opts.spmd_axis_name
  )
  grads, aux = vgrad(params, *args) if opts.has_aux else (vgrad(params, *args), None)
  total, count, norms, bad = _clip_batch._per_example_clip(grads, clip, mask=mask, accumulate=True)
  if not jax.tree.leaves(grads):  # no parameters: every norm is 0, as under ghost
    n = jax.tree.leaves([args[i] for i in idx])[0].shape[0]
    norms = jnp.zeros((n,) + clip.group_shape, _numerics.tree_accumulation_dtype(params))
    count, bad = scale_factors(norms, clip, mask)[1]
  return total, (count, bad), norms, aux
