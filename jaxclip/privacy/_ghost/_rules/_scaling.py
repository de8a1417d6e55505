"""Ghost rules' arithmetic: squared norms neither flushed, overflowed nor under-read.

Every rule works on per-example inputs scaled to a largest entry in
``[0.5, 1)`` by exact powers of two (:func:`exponent`, :func:`down`,
:func:`up`); :func:`safe_sumsq` is a per-example sum of squares,
:func:`mixed_parts` the ``sum ||A^T G||^2`` of a ``dot_general`` (the Gram form
or the gradient, whichever costs less), and :func:`per_iteration` maps a rule
over a site's scan iterations.

A rule's squared norm is read from sums of signed products over rows. Where
large rows cancel and leave a small residual, rounding can leave the result
below the true squared norm (or negative): the example would pass its clip.
So each rule gives :class:`Parts`: the computed value, a bound on its
rounding error, and a floor; :func:`read` takes the value where it lies
well above its error bound, else the value plus the bound, and never less
than the floor (see :class:`Parts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip._kernel._numerics._powers import _pow2
from jaxclip.privacy._ghost._types import Site

HIGHEST = jax.lax.Precision.HIGHEST

# A computed squared norm is read as is where it is at least MARGIN times its rounding error's
# bound (it is then at least 1 - 1 / MARGIN of the true one), else plus that bound.
MARGIN = 2**8


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


def halfway(md: jax.Array, mg: jax.Array) -> jax.Array:
  """The exponent ``k`` that brings largest entries ``md 2**-k`` and ``mg 2**k`` halfway
  between their exponents (:func:`balanced_examples`); ``0`` where either is zero or not
  finite."""
  live = (md > 0) & (mg > 0) & jnp.isfinite(md) & jnp.isfinite(mg)
  e = _numerics.scale_exponent
  return jnp.where(live, (e(md) - e(mg)) // 2, 0)


def largest(x: jax.Array, axes: Iterable[int]) -> jax.Array:
  """The largest ``|x|`` over ``axes``, kept (of size 1); no gradient (guards and scales only)."""
  return jnp.max(jnp.abs(jax.lax.stop_gradient(x)), axis=tuple(axes), keepdims=True)


def balanced_examples(d: jax.Array, g: jax.Array, lead: int) -> tuple[jax.Array, jax.Array]:
  """``(d 2**-k, g 2**k)``, ``k`` one exponent per index of the ``lead`` leading axes,
  halfway between the exponents of ``d``'s and ``g``'s largest entries there: a pull-back
  bilinear in ``d`` and ``g`` (a convolution's kernel gradient) is unchanged in exact
  arithmetic, and neither is flushed or overflows that was not (both lie between the two).
  Where the largest entry of either is zero or not finite, ``k = 0``. Float32 (or wider)
  values, half precision widened. Rows farther apart than the dtype's range within one example
  can still flush: only :func:`jaxclip.privacy._ghost._rules._dot.balanced` (a
  ``dot_general``) goes row by row; the book-keeping drops an example where that could
  move its sum (:func:`jaxclip.privacy._ghost._book.unbounded`, from :func:`example_tops`).
  """
  d, g = _numerics.upcast_for_accumulation(d), _numerics.upcast_for_accumulation(g)
  k = halfway(*example_tops(d, g, lead))
  at = lambda x: k.reshape(k.shape + (1,) * (x.ndim - lead))
  return _numerics.times_pow2(d, -at(d)), _numerics.times_pow2(g, at(g))


def example_tops(d: jax.Array, g: jax.Array, lead: int) -> tuple[jax.Array, jax.Array]:
  """The largest ``|d|`` and ``|g|`` (float32 or wider) per index of the ``lead`` leading
  axes: what :func:`balanced_examples` balances."""
  top = lambda x: largest(x, range(lead, x.ndim)).reshape(x.shape[:lead])
  return top(_numerics.upcast_for_accumulation(d)), top(_numerics.upcast_for_accumulation(g))


def balanced_entries(d: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """:func:`balanced_examples` entry by entry, for ``d`` and ``g`` of one shape (an
  elementwise product's data and output gradient): each product ``d g`` is unchanged
  exactly."""
  d, g = _numerics.upcast_for_accumulation(d), _numerics.upcast_for_accumulation(g)
  ad, ag = jnp.abs(jax.lax.stop_gradient(d)), jnp.abs(jax.lax.stop_gradient(g))
  k = halfway(ad, ag)
  return _numerics.times_pow2(d, -k), _numerics.times_pow2(g, k)


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


# ----------------------------------------------------------------------------
# Reading a squared norm computed from signed products: its rounding error bounded
# ----------------------------------------------------------------------------
#
# In the standard model of floating-point arithmetic (each operation rounded with relative
# error at most u = eps / 2, in any order), a sum of n terms is off by at most
# (n - 1) u sum |terms|, a dot product of length n by n u |x|.|y| (Higham, 2002, Lemma 3.1
# and (3.5)). The bounds below take eps per operation (twice u: room for the rounding of the
# bound's own sums and of the norms it uses). An attacker can come close to them: large rows
# that cancel, with small rows between them that each round away.


class Parts(NamedTuple):
  """A computed squared norm ``s``, ``err`` (a bound on ``|s - S|``, ``S`` the true squared norm)
  and ``floor`` (the least it is read as), per example; :func:`read` reads them.

  The floor is ``FLOOR**2 * M``, ``M`` the squared norm of the gradient's terms in absolute
  value (``||sum_t |a_t| |g_t|^T||^2`` at most): the released sum adds each example's terms
  weighted by its clip factor, ``C / sqrt(read)`` at most, and a read below ``FLOOR * sqrt(M)``
  would let them round the other examples' terms away (they are then up to ``C / FLOOR``
  each, the rounding ``eps * C / FLOOR``) or overflow. That holds even where the read is
  exact: an example whose large rows cancel exactly, read as the small rest, moved the
  released sum by more than its clip. ``FLOOR`` is ``2**-8`` in float32 (``2**-18`` in
  float64): the rounding is then at most ``2**-15 C``; an example's norm is that far below
  ``sqrt(M)`` only where its rows cancel (``1 / sqrt(T)`` of it for rows of random signs).
  """

  s: jax.Array
  err: jax.Array
  floor: jax.Array


def floor_factor(dtype) -> float:
  """``FLOOR**2`` of :class:`Parts` for sums in ``dtype``: ``2**-2 (nmant // 3 + 1)``."""
  return 2.0 ** (-2 * (jnp.finfo(dtype).nmant // 3 + 1))


def read(p: Parts) -> jax.Array:
  """``s`` where it is at least ``MARGIN`` times its error bound, else ``max(s, 0) + err`` (at
  least the true squared norm, ``inf`` where ``err`` is), and at least ``floor``; NaN stays
  NaN. The bound and the floor are guards, not values: no gradient flows into them (their
  square roots' at 0 would make a zero example's gradient NaN)."""
  err, floor = jax.lax.stop_gradient((p.err, p.floor))
  upper = jnp.maximum(p.s, 0) + err
  return jnp.maximum(jnp.where(p.s >= MARGIN * err, p.s, upper), floor)


def up_parts(p: Parts, e: jax.Array) -> Parts:
  return Parts(*(up(x, e) for x in p))


def formed_parts(s: jax.Array, e: jax.Array, m: jax.Array) -> Parts:
  """The parts of ``s = ||W'||^2``, ``W'`` a formed gradient within ``e`` of the true one (in
  norm), ``m`` the squared norm of its terms in absolute value (``M`` of :class:`Parts`).

  ``sqrt(S) <= sqrt(s) + e``, so ``s`` is off by at most ``e (2 sqrt(s) + e)``.
  """
  return Parts(s, e * (2 * jnp.sqrt(jnp.maximum(s, 0)) + e), floor_factor(s.dtype) * m)


def scaled_sumsq(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(q, k)`` per example (leading axis): ``sum |x|^2 = q * 4**k``, ``x`` scaled by ``2**-k``
  to a largest entry in ``[0.5, 1)``."""
  k = exponent(x)
  return jnp.sum(_numerics.abs_sq(down(x, k)).reshape(x.shape[0], -1), axis=1), k


def formed_of(grad: jax.Array, magnitude: jax.Array, terms: int) -> Parts:
  """The parts of a per-example gradient formed unscaled (as ``jax.grad`` forms it), each of
  its entries a sum of at most ``terms`` products, ``magnitude`` that gradient formed from
  the absolute values (so each entry's error is at most ``terms * eps`` of its own).

  Both scaled by ``magnitude``'s exponent: ``|grad| <= magnitude``, so none overflows. A
  non-finite ``magnitude`` (products past the dtype's range) reads as ``inf``.
  """
  m, k = scaled_sumsq(_numerics.upcast_for_accumulation(magnitude))
  grad = down(_numerics.upcast_for_accumulation(grad), k)
  s = jnp.sum(_numerics.abs_sq(grad).reshape(grad.shape[0], -1), axis=1)
  e = terms * jnp.finfo(s.dtype).eps * jnp.sqrt(m)
  return up_parts(formed_parts(s, e, m), 2 * k)


def mixed_sumsq(a: jax.Array, g: jax.Array) -> jax.Array:
  """``sum_i ||A[b, i].T @ G[b, i]||^2`` for each ``b``, as :func:`read` reads it."""
  return read(mixed_parts(a, g))


def frobenius(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """:func:`scaled_sumsq` of ``x`` in its accumulation dtype."""
  return scaled_sumsq(_numerics.upcast_for_accumulation(x))


def mixed_parts(a: jax.Array, g: jax.Array) -> Parts:
  """The :class:`Parts` of ``sum_i ||A[b, i].T @ G[b, i]||^2`` for each ``b``, the cheaper way.

  Args:
    a: ``(examples, n, T, C)``.
    g: ``(examples, n, T, F)``.
  """
  t, c, f = a.shape[2], a.shape[3], g.shape[3]
  if t > 1 and not gram_is_cheaper(t, c, f):
    # The gradient itself costs less: formed as jax.grad forms it, from the records unscaled
    # (its terms are finite wherever the gradient's are), its squares then summed scaled.
    # Scaled row by row, a small row's terms would be flushed where two large rows cancel:
    # an example's norm read as 0 while its gradient is not. Each entry sums t products, so
    # it is within t eps of ||A|| ||G|| (||sum_t |a_t| |g_t|^T|| <= sum_t ||a_t|| ||g_t||
    # <= ||A|| ||G||): two sums over the records, where the rows' norms would hold a copy of
    # them rearranged (a scan's shared weight).
    (qa, ka), (qg, kg) = frobenius(a), frobenius(g)
    k = ka + kg
    s = _numerics.times_pow2(
      safe_sumsq(jnp.einsum("bntc,bntf->bncf", a, g, precision=HIGHEST)), -2 * k
    )
    m = qa * qg
    return up_parts(formed_parts(s, t * jnp.finfo(s.dtype).eps * jnp.sqrt(m), m), 2 * k)

  # Row by row (each of the T rows, per example and dot batch index): a_t = 2**ea_t a'_t and
  # g_t = 2**eg_t g'_t, then g'_t weighted by 2**(ea_t + eg_t - top), top the largest such
  # exponent of the example. A row whose a is huge while its g is 0 (so its term is 0) cannot
  # set the scale and flush every other row's squares.
  (ma, ea), (mg, eg) = _row_max(a), _row_max(g)
  live = (ma > 0) & (mg > 0) & jnp.isfinite(ma) & jnp.isfinite(mg)
  low = jnp.iinfo(jnp.int32).min // 4
  r = jnp.where(live, ea + eg, low)
  top = jnp.max(r.reshape(r.shape[0], -1), axis=1)
  top = jnp.where(top == low, 0, top)
  shift = jnp.maximum(r - top.reshape((-1,) + (1,) * (r.ndim - 1)), low // 2)
  return up_parts(_gram_parts(a, g, ea, eg, shift), 2 * top)


def _row_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each row's largest entry in absolute value and its exponent (:func:`exponent`), the last
  axis kept (size 1); no gradient (guards only)."""
  m = largest(x, (-1,))
  return m, _numerics.scale_exponent(m)


def _gamma(k: int, u: float) -> float:
  """Higham's ``gamma_k = k u / (1 - k u)`` (2002, Lemma 3.1), ``inf`` where ``k u >= 1``."""
  return k * u / (1 - k * u) if k * u < 1 else math.inf


def free_bound(nb: int, t: int, c: int, f: int, dtype) -> float:
  """The factor of :func:`_gram_parts`'s bound from its rows' norms alone: its error is at most
  this times ``M = sum_n (sum_t ||a_t|| ||g_t||)^2`` (``inf`` where the shape is too large)."""
  u = float(jnp.finfo(dtype).eps) / 2
  low = 1 - _gamma(2 * (c + f + t) + nb + 8, u) - 2.0**-36  # M computed: at least low * M
  return _gamma(c + f + (nb + 1) * t, u) / low * (1 + 4 * u) if low > 0.5 else math.inf


def free_bound_suffices(nb: int, t: int, c: int, f: int, dtype) -> bool:
  """Whether :func:`free_bound` leaves rows of random signs read as computed: their ``M`` is
  about ``T S`` (at most, for rows of equal norms: Cauchy-Schwarz), so the bound is about ``T``
  times the factor of ``S``; kept below ``1 / (2 MARGIN)`` of it. For ``n = 1`` in float32:
  ``T (c + f + 2T)`` below ``2**15`` (``T = 32``: ``c + f`` below 960)."""
  return 2 * MARGIN * t * free_bound(nb, t, c, f, dtype) <= 1


def _gram_parts(
  a: jax.Array, g: jax.Array, ea: jax.Array, eg: jax.Array, shift: jax.Array
) -> Parts:
  """``<A A^T, G G^T>`` of the rows ``a_t 2**-ea_t`` and ``g_t 2**(shift_t - eg_t)`` (the
  largest row's ``||a|| ||g||`` at least 1/4: flushed products, at most ``tiny`` each, lie far
  below the bound), and a bound on its rounding error.

  The products ``K_ts L_ts`` (``K = A A^T``, ``L = G G^T``) are summed in two stages, an
  optimization barrier between them so that XLA cannot merge them into one reduction: each
  row's ``T`` products, then the ``n T`` rows' sums, each in any order (XLA:CPU fuses the Gram
  products into the first). Each of the ``nT^2`` products then goes through at most
  ``(n + 1) T`` roundings, where one reduction of them all allows ``n T^2``.

  Standard model (Higham, 2002, Lemma 3.1 and (3.5), ``u = eps / 2``): ``K`` is computed within
  ``gamma_c |a_t|.|a_s| <= gamma_c ||a_t|| ||a_s||`` per entry, so ``|K^_ts| <= (1 + gamma_c)
  ||a_t|| ||a_s||`` (Cauchy-Schwarz); ``L`` likewise with ``f``; the sum is within
  ``gamma_{(n+1)T} sum |K^_ts L^_ts|`` of the exact sum of the computed products. With
  ``w_ts = ||a_t|| ||a_s|| ||g_t|| ||g_s||``, ``|K^ L^ - K L| <= |K^ - K| |L^| + |K| |L^ - L|``
  and Lemma 3.3 (``gamma_i + gamma_j + gamma_i gamma_j <= gamma_{i+j}``)::

    |s - S| <= (gamma_c + gamma_f + gamma_c gamma_f) sum w
               + gamma_{(n+1)T} (1 + gamma_c) (1 + gamma_f) sum w
            <= gamma_{c + f + (n+1)T} M,   M = sum_ts w_ts = sum_n (sum_t ||a_t|| ||g_t||)^2,

  for any input: ``M`` is what the floor already reads (:class:`Parts`), so this bound costs no
  pass of its own. ``M`` is computed from the rows' norms (:func:`row_norms`: sums of squares of
  the rows scaled, each within ``gamma_c`` (``gamma_f``) and a flush of ``2**-40`` of it) times
  ``2**shift_t`` (exactly, or at least ``tiny``: above it): at least
  ``(1 - gamma_{2(c+f+T)+n+8} - 2**-36) M`` (sums of ``c``, ``f``, ``T`` and ``n`` positive
  terms, square roots, products and a square, each rounded, and the flushes, each row's below
  ``sqrt(c f) tiny``, far below ``M >= 1/16``); :func:`free_bound` divides by that and adds
  ``4u`` for its own rounding to the dtype and the product's. Flushed products (``|x| < tiny``:
  ``2 c`` of them at most per Gram entry, ``2 (n + 1) T^2`` in the products and sums) add at most
  ``8 n T^2 (c + 1) (f + 1) tiny`` (``|L^_ts| <= (1 + gamma_f) f``), twice that added as is.

  For rows of random signs ``M`` is about ``T S``, ``S`` being ``sum_t ||a_t||^2 ||g_t||^2``, so
  this bound is about ``(c + f + (n+1)T) u T`` of ``S``; where that is not below ``1 / (2 MARGIN)``
  (:func:`free_bound_suffices`) the bound is taken through the Gram matrices' Frobenius norms
  instead, from two more Gram products (about ``(c + f) sqrt(T) + (n+1)T`` eps of ``S`` for such
  rows): ``<K, L>`` is off by ``c eps ||A||^2 ||L|| + f eps ||G||^2 ||K||`` (Cauchy-Schwarz)
  and the sum by ``(n+1) T eps ||K|| ||L||`` (eps for ``u``: room for the rounding of the
  bound's own sums and norms), each Frobenius norm one product of Gram matrices and one sum
  from rows scaled apart (by powers of two, exactly), which XLA:CPU fuses whole.
  """
  nb, t, c, f = a.shape[1], a.shape[2], a.shape[3], g.shape[3]
  gram = lambda x: jnp.einsum("bntc,bnsc->bnts", x, x, precision=HIGHEST)
  rows = jnp.sum(gram(down_rows(a, ea)) * gram(down_rows(g, eg - shift)), axis=3)
  s = jnp.sum(staged(rows), axis=(1, 2))
  info = jnp.finfo(s.dtype)
  # (examples, n, T); 2**shift at least tiny: above it where it flushes
  na, ng = row_norms(a, ea), row_norms(g, eg) * _pow2(shift[..., 0], s.dtype)
  m = jnp.sum(jnp.square(jnp.sum(na * ng, axis=2)), axis=1)
  floor = floor_factor(s.dtype) * m
  if t == 1:  # one row: a sum of positive terms, off by a relative error
    return Parts(s, (c + f + nb + 2) * info.eps * s, floor)
  if free_bound_suffices(nb, t, c, f, s.dtype):
    flushed = 16 * nb * t * t * (c + 1) * (f + 1) * float(info.tiny)
    return Parts(s, free_bound(nb, t, c, f, s.dtype) * m + flushed, floor)
  frob = lambda x, e: 4 * jnp.sqrt(jnp.sum(jnp.square(gram(down_rows(x, e + 1))), axis=(2, 3)))
  fk, fl = frob(a, ea), frob(g, eg - shift)  # (examples, n)
  sa, sg = jnp.sum(na * na, axis=2), jnp.sum(ng * ng, axis=2)
  bound = c * sa * fl + f * sg * fk + (nb + 1) * t * fk * fl
  err = info.eps * jnp.sum(bound, axis=1) + 3 * (c * info.eps) * (f * info.eps) * m
  return Parts(s, err, floor)


def staged(x: jax.Array) -> jax.Array:
  """``x``, behind an optimization barrier: a sum of it is not merged with the sum that formed
  it. On every platform: the bound of :func:`_gram_parts` counts the two stages' roundings."""
  return jax.lax.optimization_barrier(x)


def row_norms(x: jax.Array, e: jax.Array) -> jax.Array:
  """Each row's ``||x_t 2**-e_t||`` (``e_t`` its exponent, :func:`_row_max`: its largest entry
  ``2**-e_t`` of it in ``[0.5, 1)``), from the squares of the row scaled: no overflow, each
  within ``gamma_width`` of its sum (positive terms), flushed squares (``width tiny`` at most)
  far below ``2**-40`` of a sum of at least ``1/16``. No gradient (a guard).

  The rows are scaled by ``2**-(e_t + 1)`` (exactly), not by the Gram form's ``2**-e_t``: XLA
  would merge the two scaled copies into one and hold it for both the Gram product and this sum
  (``jax_loop_mlp`` at B = 128: 86.3 -> 102 MiB, 28 November 2026). Nor as the Gram matrices'
  diagonals: they would then be held (+10 MiB on ``nnx_llama`` and ``jax_scan_mlp``); nor in
  one reduction with the largest entry: a variadic reduction, which XLA:CPU runs as scalar code.
  """
  x = jax.lax.stop_gradient(x)
  return 2 * jnp.sqrt(jnp.sum(_numerics.abs_sq(down_rows(x, e + 1)), axis=-1))


def down_rows(x: jax.Array, e: jax.Array) -> jax.Array:
  """``x 2**-e``, ``e`` one exponent per row (its last axis of size 1)."""
  return _numerics.times_pow2(x, -e)
