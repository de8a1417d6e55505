"""One leaf's norm reduction on XLA:CPU: half-precision leaves without a float32 copy.

A bfloat16 leaf reaches its reduction behind an optimization barrier, and a
float16 leaf is reduced by a two-output reduction, so that neither gets a
float32 copy (:func:`reduce`, :func:`share`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxclip._kernel._platform._switch import on_cpu
from jaxclip._kernel._platform._tricks import is_on
from jaxclip._kernel._shapes import constant_size

Term = Callable[[jax.Array], jax.Array]

# The two-output float16 reduction accumulates sequentially, so it runs over
# blocks of at most this many terms.
_SEQUENTIAL_BLOCK = 1024


def reduction_input(x: jax.Array) -> jax.Array:
  """``x`` as the input of a norm reduction: behind an optimization barrier if bfloat16 (CPU).

  On XLA:CPU a bfloat16 leaf that feeds both the norm and the scale gets its
  float32 conversion materialised (the reduction kernel cannot absorb a
  convert whose operand has a second user). The barrier gives the reduction
  its own operand, so the convert fuses into it. It is an identity for
  values and gradients. Trick ``bf16_barrier``: off, ``x`` as it is.
  """
  if x.dtype != jnp.bfloat16 or not is_on("bf16_barrier"):
    return x
  return on_cpu(jax.lax.optimization_barrier, lambda y: y, x)


def reduce(
  terms: jax.Array,
  op: str,
  axes: tuple[int, ...] | None = None,
  keepdims: bool = False,
  *,
  of_float16: bool = False,
) -> jax.Array:
  """The sum (``op="sum"``) or max of non-negative ``terms`` over ``axes``.

  ``of_float16`` says that the terms are computed from float16 values, which
  XLA:CPU reduces faster another way (:func:`float16_reduce`).
  """
  if of_float16:
    return float16_reduce(terms, op, axes, keepdims)
  return plain_reduce(terms, op, axes, keepdims)


def plain_reduce(
  terms: jax.Array, op: str, axes: tuple[int, ...] | None, keepdims: bool
) -> jax.Array:
  """``jnp.sum`` (``op="sum"``) or ``jnp.max`` (0 for empty) of ``terms``."""
  if op == "sum":
    return jnp.sum(terms, axis=axes, keepdims=keepdims)
  if all(terms.shape[a] for a in (range(terms.ndim) if axes is None else axes)):
    # No ``initial``: it changes nothing for non-negative terms and adds an op.
    return jnp.max(terms, axis=axes, keepdims=keepdims)
  return jnp.max(terms, axis=axes, keepdims=keepdims, initial=0.0)  # an empty leaf's 0


def float16_reduce(
  terms: jax.Array, op: str, axes: tuple[int, ...] | None, keepdims: bool
) -> jax.Array:
  """:func:`plain_reduce` of terms computed from float16 values.

  XLA:CPU never fuses the float32 conversion of a float16 leaf into a plain
  reduction: it materialises a float32 copy. A two-output reduction keeps
  the conversion inside the reduction kernel (:func:`_float16_reduce_cpu`).
  Trick ``f16_two_output``: off, :func:`plain_reduce`.
  """
  if not constant_size(terms) or not is_on("f16_two_output"):  # empty, or of a symbolic size
    return plain_reduce(terms, op, axes, keepdims)
  axes = tuple(range(terms.ndim)) if axes is None else tuple(axes)
  return on_cpu(
    lambda t: _float16_reduce_cpu(t, op, axes, keepdims),
    lambda t: plain_reduce(t, op, axes, keepdims),
    terms,
  )


def _two_output_reduce(terms: jax.Array, op: str, axes: tuple[int, ...]) -> jax.Array:
  """``op`` over ``axes`` as a reduction with a second output (the max) XLA cannot drop."""
  zero = jnp.zeros((), terms.dtype)
  first = jax.lax.add if op == "sum" else jax.lax.max

  def combine(a, b):
    return first(a[0], b[0]), jax.lax.max(a[1], b[1])

  total, peak = jax.lax.reduce((terms, terms), (zero, zero), combine, axes)
  return jnp.where(peak == 0, zero, total)  # peak is 0 only where every term is


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _float16_reduce_cpu(
  terms: jax.Array, op: str, axes: tuple[int, ...], keepdims: bool
) -> jax.Array:
  """:func:`plain_reduce` of float16-derived terms without a float32 copy (XLA:CPU).

  At most ``_SEQUENTIAL_BLOCK`` terms are one two-output reduction. A whole
  large leaf is reduced in blocks of a divisor of its size (or zero-padded
  to whole blocks), and the block results plainly. A reduction over part of
  the axes of a large leaf is plain. Derivatives are the plain reduction's.
  """
  if math.prod(terms.shape[a] for a in axes) <= _SEQUENTIAL_BLOCK:
    total = _two_output_reduce(terms, op, axes)
  elif len(axes) < terms.ndim:
    return plain_reduce(terms, op, axes, keepdims)
  else:
    flat = jax.lax.reshape(terms, (terms.size,))
    low = _SEQUENTIAL_BLOCK // 8
    block = next((b for b in range(_SEQUENTIAL_BLOCK, low - 1, -1) if terms.size % b == 0), None)
    if block is None:  # zero-pad to whole blocks: no sum or maximum changes
      block = _SEQUENTIAL_BLOCK
      flat = jax.lax.pad(flat, jnp.zeros((), flat.dtype), ((0, -terms.size % block, 0),))
    blocks = jax.lax.reshape(flat, (flat.size // block, block))
    total = plain_reduce(_two_output_reduce(blocks, op, (1,)), op, None, False)
  return jax.lax.expand_dims(total, axes) if keepdims else total


@_float16_reduce_cpu.defjvp
def _float16_reduce_cpu_jvp(op, axes, keepdims, primals, tangents):
  return jax.jvp(lambda t: plain_reduce(t, op, axes, keepdims), primals, tangents)


def share(x: jax.Array, term: Term, op: str) -> jax.Array:
  """One leaf's share of a tree norm: ``op`` over every ``term(x)``."""
  return reduce(term(x), op, of_float16=x.dtype == jnp.float16)


def prescaled(x, fn, e):
  return x if fn is None else fn(x, e)


def prescaled_share(x, term, op, fn, e):
  """:func:`share` of ``fn(x, e)``, reduced as a float16 leaf's where ``x`` is one."""
  return reduce(term(prescaled(x, fn, e)), op, of_float16=x.dtype == jnp.float16)


def combine_scalars(parts: list[jax.Array], op: str) -> jax.Array:
  """The sum (``op="sum"``) or max of scalars, as one reduction."""
  if len(parts) == 1:
    return parts[0]
  stacked = jnp.stack(parts)
  # dtype=: an int32 count stays int32 under jax_enable_x64.
  return jnp.max(stacked) if op == "max" else jnp.sum(stacked, dtype=stacked.dtype)
