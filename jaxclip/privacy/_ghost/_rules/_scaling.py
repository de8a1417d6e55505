"""Ghost rules' arithmetic: squared norms neither flushed nor overflowed on the way.

Every rule works on per-example inputs scaled to a largest entry in
``[0.5, 1)`` by exact powers of two (:func:`exponent`, :func:`down`,
:func:`up`); :func:`safe_sumsq` is a per-example sum of squares,
:func:`mixed_sumsq` the ``sum ||A^T G||^2`` of a ``dot_general`` (the Gram form
or the gradient, whichever costs less), and :func:`per_iteration` maps a rule
over a site's scan iterations.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy._ghost._types import Site

HIGHEST = jax.lax.Precision.HIGHEST


def gram_is_cheaper(t: int, c: int, f: int) -> bool:
  """Whether ``<A A^T, G G^T>`` (``t^2 (c + f)`` flops) costs less than ``A^T G`` (``t c f``)."""
  return t * (c + f) <= c * f


# ----------------------------------------------------------------------------
# Scaling: every rule works on per-example inputs scaled to a largest entry in [0.5, 1)
# ----------------------------------------------------------------------------
#
# A Gram product squares its inputs: a.a of entries ~1e-19 is flushed to zero on XLA:CPU, and
# g.g of entries ~1e20 overflows, where the gradient a^T g itself is ~1. An attacker can send
# such an example (a tiny input and a huge target) and have its norm under-read, so its
# contribution passes the clip. Each rule therefore scales each example's a and g by exact
# powers of two (:func:`jaxclip._kernel._numerics.times_pow2`) and scales its squared norm back:
# a result beyond the dtype's range is inf (the example is then zeroed as non-finite), one
# below its normal range is 0 (a norm below ~1e-19 in float32: its contribution is that small).


def exponent(x: jax.Array) -> jax.Array:
  """Each example's (leading axis) scale exponent: ``max|x_b| / 2**e`` in ``[0.5, 1)``."""
  m = jnp.max(jnp.abs(x).reshape(x.shape[0], -1), axis=1) if x.size else jnp.zeros(x.shape[:1])
  return _numerics.scale_exponent(m.astype(x.dtype))


def down(x: jax.Array, e: jax.Array) -> jax.Array:
  return _numerics.times_pow2(x, -e.reshape((-1,) + (1,) * (x.ndim - 1)))


def up(q: jax.Array, e: jax.Array) -> jax.Array:
  return _numerics.times_pow2(q, e)


def safe_sumsq(x: jax.Array) -> jax.Array:
  """Each example's ``sum |x_b|^2`` (leading batch axis), neither flushed nor overflowed on
  the way: computed scaled, the result inf beyond the dtype's range, 0 below its normal one."""
  x = _numerics.upcast_for_accumulation(x)
  e = exponent(x)
  q = jnp.sum(_numerics.abs_sq(down(x, e)).reshape(x.shape[0], -1), axis=1)
  return up(q, 2 * e)


def per_iteration(
  site: Site, fn: Callable[..., jax.Array], *xs: jax.Array, shared: frozenset[int] = frozenset()
) -> jax.Array:
  """``fn(*xs)`` (each ``x`` with a leading batch axis), summed over the site's scan iterations.

  ``fn`` maps per-example records to a value per example; inside scans the
  records have one more axis per scan after the batch axis. The scan levels
  in ``shared`` (a weight every iteration of those scans reads) are not
  mapped over: ``fn`` gets their axes, after the batch axis, in order.
  """
  levels = range(len(site.stack))
  own = [j for j in levels if j not in shared]
  order = [0] + [1 + j for j in own] + [1 + j for j in levels if j in shared]
  xs = tuple(jnp.transpose(x, order + list(range(len(order), x.ndim))) for x in xs)
  for _ in own:
    fn = jax.vmap(fn, in_axes=1, out_axes=1)
  out = fn(*xs)
  return jnp.sum(out.reshape(out.shape[0], -1), axis=1)


def mixed_sumsq(a: jax.Array, g: jax.Array) -> jax.Array:
  """``sum_i ||A[b, i].T @ G[b, i]||^2`` for each ``b``, the cheaper way.

  Args:
    a: ``(examples, n, T, C)``.
    g: ``(examples, n, T, F)``.
  """
  t, c, f = a.shape[2], a.shape[3], g.shape[3]
  if t > 1 and not gram_is_cheaper(t, c, f):
    # The gradient itself costs less: formed as jax.grad forms it, from the records unscaled
    # (its terms are finite wherever the gradient's are), its squares then summed scaled.
    # Scaled row by row as below, a small row's terms would be flushed where two large rows
    # cancel: an example's norm read as 0 while its gradient is not.
    return safe_sumsq(jnp.einsum("bntc,bntf->bncf", a, g, precision=HIGHEST))

  # Row by row (each of the T rows, per example and dot batch index): a_t = 2**ea_t a'_t and
  # g_t = 2**eg_t g'_t, then g'_t weighted by 2**(ea_t + eg_t - top), top the largest such
  # exponent of the example. A row whose a is huge while its g is 0 (so its term is 0) cannot
  # set the scale and flush every other row's squares.
  def rows(x):
    m = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    return m, _numerics.scale_exponent(m)

  (ma, ea), (mg, eg) = rows(a), rows(g)
  live = (ma > 0) & (mg > 0) & jnp.isfinite(ma) & jnp.isfinite(mg)
  low = jnp.iinfo(jnp.int32).min // 4
  r = jnp.where(live, ea + eg, low)
  top = jnp.max(r.reshape(r.shape[0], -1), axis=1)
  top = jnp.where(top == low, 0, top)
  shift = r - top.reshape((-1,) + (1,) * (r.ndim - 1))
  a = _numerics.times_pow2(a, -ea)
  g = _numerics.times_pow2(_numerics.times_pow2(g, -eg), jnp.maximum(shift, low // 2))
  return up(_mixed_sumsq_scaled(a, g), 2 * top)


def _mixed_sumsq_scaled(a: jax.Array, g: jax.Array) -> jax.Array:
  if a.shape[2] == 1:
    return jnp.sum(jnp.sum(a * a, axis=(2, 3)) * jnp.sum(g * g, axis=(2, 3)), axis=1)
  # ghost: <A A^T, G G^T>
  aa = jnp.einsum("bntc,bnsc->bnts", a, a, precision=HIGHEST)
  gg = jnp.einsum("bntf,bnsf->bnts", g, g, precision=HIGHEST)
  return jnp.sum(aa * gg, axis=(1, 2, 3))
