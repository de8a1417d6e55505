"""One example's gradient of a convolution's kernel, tap by tap (ghost norms).

Where a ghost site's per-example kernel gradient is formed in the backward
pass (:meth:`jaxclip.privacy._ghost._rules._base.Rule.accumulates`), ``jax.vjp`` forms it
as a convolution grouped by example; for a convolution with few taps against
its channels, :func:`kernel_gradient` forms it one tap at a time instead,
reading the output gradient where it lies (:func:`patches_fit` says where).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip.privacy._ghost._jaxpr import _internals as _jax

_HIGHEST = jax.lax.Precision.HIGHEST


def patches_fit(eqn: Any, parts: _jax.ConvParts) -> bool:
  """Whether a convolution's input patches (one row per output position, one column per
  input channel and tap) would be no larger than its input and output together.

  There, few taps against the channels, :func:`kernel_gradient` forms an
  example's kernel gradient tap by tap. ``jax.vjp`` forms it as a convolution
  grouped by example, for which XLA:CPU takes copies of the input and of the
  output gradient in other layouts, and of the output gradient a second time
  where a bias reads it too, all live at once (benchmarks/results/ghost_zoo.md).
  """
  dn = parts.dimension_numbers
  if dn is None or parts.feature_group_count != 1 or parts.batch_group_count != 1:
    return False
  if isinstance(parts.padding, str):
    return False
  lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
  positions = math.prod(out.shape[d] for d in (dn.out_spec[0], *dn.out_spec[2:]))
  taps = math.prod(rhs.shape[d] for d in dn.rhs_spec[1:])
  return positions * taps <= math.prod(lhs.shape) + math.prod(out.shape)


def kernel_gradient(
  parts: _jax.ConvParts, kernel: jax.Array, lhs: jax.Array, g: jax.Array
) -> jax.Array:
  """One example's gradient of a convolution's kernel, ``P^T G`` over its output positions.

  ``P`` are the input's patches (one row per output position, one column per
  input channel and tap), never formed whole: each tap's columns are a
  strided slice of the padded (and dilated) input, multiplied by ``G`` (read
  where it lies) on its own. Zeros read from earlier values
  (:func:`_zero_after`) order the work for XLA: each tap's slice after the
  previous tap's product (one slice live at a time) and, where the patches
  would be larger than the input, the padded input after ``g``, in the
  backward pass, rather than kept from the forward pass.

  Args:
    parts: The convolution's parameters (one feature group, one batch group).
    kernel: Its kernel (operand 1).
    lhs: Its input (operand 0), one example.
    g: The gradient with respect to its output.
  """
  dn = parts.dimension_numbers
  spatial = [kernel.shape[d] for d in dn.rhs_spec[2:]]
  outs = [g.shape[d] for d in dn.out_spec[2:]]
  if not g.size:
    return jnp.zeros(kernel.shape, jnp.result_type(lhs, g))
  x = jnp.moveaxis(lhs, dn.lhs_spec, range(lhs.ndim))  # (batch, channels, spatial...)
  x = jnp.moveaxis(x, 1, -1)  # (batch, spatial..., channels)
  g = jnp.moveaxis(g, dn.out_spec, range(g.ndim))
  g = jnp.moveaxis(g, 1, -1).reshape(-1, g.shape[1])  # (batch and positions, outputs)
  if g.shape[0] * math.prod(spatial) * x.shape[-1] > lhs.size:  # patches larger than lhs
    fill = _zero_after(jax.lax.stop_gradient(g)).astype(x.dtype)
  else:
    fill = jnp.zeros((), x.dtype)
  pads = [(lo, hi, d - 1) for (lo, hi), d in zip(parts.padding, parts.lhs_dilation, strict=True)]
  x = jax.lax.pad(x, fill, [(0, 0, 0), *pads, (0, 0, 0)])
  grads = []
  for tap in itertools.product(*map(range, spatial)):
    start = [t * d for t, d in zip(tap, parts.rhs_dilation, strict=True)]
    strides = parts.window_strides
    limit = [s0 + (n - 1) * st + 1 for s0, n, st in zip(start, outs, strides, strict=True)]
    rows = jax.lax.slice(
      x, [0, *start, 0], [x.shape[0], *limit, x.shape[-1]], [1, *strides, 1]
    ).reshape(-1, x.shape[-1])
    if grads:  # one tap's rows at a time: each after the previous tap's product
      rows = rows + _zero_after(jax.lax.stop_gradient(grads[-1])).astype(rows.dtype)
    grads.append(jnp.einsum("pc,po->co", rows, g, precision=_HIGHEST))
  grad = jnp.stack(grads).reshape(*spatial, x.shape[-1], g.shape[-1])
  src = [*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0]]
  return jnp.transpose(grad, [src.index(d) for d in range(kernel.ndim)])


@jax.custom_batching.custom_vmap
def _zero_after(g: jax.Array) -> jax.Array:
  """A zero that XLA cannot compute before ``g``; the same for every example.

  It is read from ``g``'s first element (zero for any value, NaN included), so
  nothing of one example reaches another. Under ``vmap`` it stays unbatched:
  a zero per example, added to a convolution's kernel, would turn that
  convolution into one grouped by example.
  """
  first = jnp.abs(g.reshape(-1)[0])
  return jnp.where(first == 0, first, 0)


@_zero_after.def_vmap
def _zero_after_vmap(axis_size: int, in_batched: Sequence[bool], g: jax.Array):
  del axis_size, in_batched
  return _zero_after(g), False
