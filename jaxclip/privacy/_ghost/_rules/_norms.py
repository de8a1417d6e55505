"""Ghost norms: each example's squared gradient norm from a site's ``a`` and ``g``.

The rules (``dot``, ``conv``, ``lookup`` and a tied table's cross term) work
from the data inputs ``a`` and output gradients ``g`` that
:mod:`jaxclip.privacy._ghost._capture` records (the parameters no rule covers
are :mod:`jaxclip.privacy._ghost._rules._instantiate`'s). What each rule costs, and
where the Gram form is cheaper than the per-example gradient, is
:mod:`jaxclip.privacy._ghost._costs`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy._ghost._costs import (
  conv_dims,
  dot_dims,
  gram_is_cheaper,
  lookup_gram_is_cheaper,
)
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._types import Site

_HIGHEST = jax.lax.Precision.HIGHEST


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


def _exponent(x: jax.Array) -> jax.Array:
  """Each example's (leading axis) scale exponent: ``max|x_b| / 2**e`` in ``[0.5, 1)``."""
  m = jnp.max(jnp.abs(x).reshape(x.shape[0], -1), axis=1) if x.size else jnp.zeros(x.shape[:1])
  return _numerics.scale_exponent(m.astype(x.dtype))


def _down(x: jax.Array, e: jax.Array) -> jax.Array:
  return _numerics.times_pow2(x, -e.reshape((-1,) + (1,) * (x.ndim - 1)))


def _up(q: jax.Array, e: jax.Array) -> jax.Array:
  return _numerics.times_pow2(q, e)


def safe_sumsq(x: jax.Array) -> jax.Array:
  """Each example's ``sum |x_b|^2`` (leading batch axis), neither flushed nor overflowed on
  the way: computed scaled, the result inf beyond the dtype's range, 0 below its normal one."""
  x = _numerics.upcast_for_accumulation(x)
  e = _exponent(x)
  q = jnp.sum(_numerics.abs_sq(_down(x, e)).reshape(x.shape[0], -1), axis=1)
  return _up(q, 2 * e)


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


def _dot_operands(site: Site, pos: int, a: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A ``dot_general`` site's data operand and output gradient, canonicalised.

  Returns ``A`` of shape ``(examples, n, T, C)`` and ``G`` of shape
  ``(examples, n, T, F)`` (float32) such that each example's gradient of the
  param operand is ``A[b, i].T @ G[b, i]`` for each of its ``n`` dot batch
  indices: ``T`` runs over the data operand's free dims, ``C`` over the
  contracting dims (in the data operand's order) and ``F`` over the param
  operand's free dims.

  Args:
    site: A ``dot_general`` site whose operand ``pos`` is the parameter.
    pos: 0 or 1.
    a: The other operand, for every example (leading batch axis).
    g: The gradient with respect to the output, for every example.
  """
  (nb, t, c, f), (batch, free, contract) = dot_dims(site, pos)
  n = a.shape[0]
  perm = [0] + [1 + i for i in (*batch, *free, *contract)]
  a = _numerics.upcast_for_accumulation(jnp.transpose(a, perm).reshape(n, nb, t, c))
  g = _numerics.upcast_for_accumulation(g)
  if pos == 1:  # output dims: batch, data free, param free
    return a, g.reshape(n, nb, t, f)
  return a, jnp.swapaxes(g.reshape(n, nb, f, t), 2, 3)  # batch, param free, data free


def dot_sumsq(site: Site, pos: int, a: jax.Array, g: jax.Array, shared: int = 0) -> jax.Array:
  """Each example's ``||grad of the dot_general's param operand||^2``.

  Args as :func:`_dot_operands`, but for ``shared``: the number of scan axes
  (after the batch axis of ``a`` and ``g``) over whose iterations the
  parameter is the same value. Its gradient is then the sum over those
  iterations, ``[A_1; A_2; ...]^T [G_1; G_2; ...]``: one ``dot_general`` whose
  rows are every iteration's rows.
  """
  operands = lambda a, g: _dot_operands(site, pos, a, g)
  for _ in range(shared):
    operands = jax.vmap(operands, in_axes=1, out_axes=2)
  a, g = operands(a, g)  # (examples, n, iterations..., T, C or F)
  n, nb = a.shape[0], a.shape[1]
  return _mixed_sumsq(a.reshape(n, nb, -1, a.shape[-1]), g.reshape(n, nb, -1, g.shape[-1]))


def _mixed_sumsq(a: jax.Array, g: jax.Array) -> jax.Array:
  """``sum_i ||A[b, i].T @ G[b, i]||^2`` for each ``b``, the cheaper way.

  Args:
    a: ``(examples, n, T, C)``.
    g: ``(examples, n, T, F)``.
  """

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
  return _up(_mixed_sumsq_scaled(a, g), 2 * top)


def _mixed_sumsq_scaled(a: jax.Array, g: jax.Array) -> jax.Array:
  t, c, f = a.shape[2], a.shape[3], g.shape[3]
  if t == 1:
    return jnp.sum(jnp.sum(a * a, axis=(2, 3)) * jnp.sum(g * g, axis=(2, 3)), axis=1)
  if gram_is_cheaper(t, c, f):  # ghost: <A A^T, G G^T>
    aa = jnp.einsum("bntc,bnsc->bnts", a, a, precision=_HIGHEST)
    gg = jnp.einsum("bntf,bnsf->bnts", g, g, precision=_HIGHEST)
    return jnp.sum(aa * gg, axis=(1, 2, 3))
  grad = jnp.einsum("bntc,bntf->bncf", a, g, precision=_HIGHEST)  # instantiated
  return jnp.sum(grad * grad, axis=(1, 2, 3))


def conv_sumsq(site: Site, kernel: jax.Array, a: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of a convolution's kernel||^2``.

  The kernel's gradient is ``A^T G`` per feature group, ``A`` the input's
  patches (one row per output position, one column per kernel tap) and ``G``
  the output gradient: the ``dot_general`` rule over positions, through the
  Gram matrices ``<A A^T, G G^T>`` when the positions are few; otherwise the
  per-example kernel gradient, formed without the patches.

  Args:
    site: A ``conv_general_dilated`` site whose kernel (operand 1) is the parameter.
    kernel: The kernel's value at the site, repeated for every example.
    a: The input, for every example (leading batch axis).
    g: The gradient with respect to the output, for every example.
  """
  eqn = site.eqn
  params = _jax.conv_parts(eqn)
  dn = params.dimension_numbers
  rhs_aval, out_aval = eqn.invars[1].aval, eqn.outvars[0].aval
  groups, positions, taps, outs = conv_dims(site)
  if not gram_is_cheaper(positions, taps, outs):  # the per-example kernel gradient costs less

    def one(k_b, a_b, g_b):
      _, vjp = jax.vjp(lambda k: _jax.bind(eqn, [a_b, k])[0], k_b)
      (grad,) = vjp(g_b.astype(out_aval.dtype))
      return grad

    return safe_sumsq(jax.vmap(one)(kernel, a, g))
  filt = [rhs_aval.shape[d] for d in dn.rhs_spec[2:]]

  def patches(a_b):  # (positions, C * K), columns channel-major
    x = jnp.transpose(a_b, dn.lhs_spec)  # N, C, spatial...
    p = jax.lax.conv_general_dilated_patches(
      x,
      filt,
      params.window_strides,
      params.padding,
      params.lhs_dilation,
      params.rhs_dilation,
      precision=_HIGHEST,
    )  # N, C * K, out spatial...
    return jnp.moveaxis(p, 1, -1).reshape(positions, -1)

  n = a.shape[0]
  pa = jax.vmap(patches)(_numerics.upcast_for_accumulation(a)).reshape(n, positions, groups, taps)
  pg = jnp.moveaxis(
    jnp.transpose(_numerics.upcast_for_accumulation(g), (0, *(1 + d for d in dn.out_spec))), 2, -1
  )
  pg = pg.reshape(n, positions, groups, outs)
  return _mixed_sumsq(jnp.swapaxes(pa, 1, 2), jnp.swapaxes(pg, 1, 2))


def _lookup_operands(site: Site, ids: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An embedding lookup's ids ``(examples, T)``, in range, and row gradients ``(examples, T, R)``.

  Rows read out of range in ``FILL_OR_DROP`` or ``PROMISE_IN_BOUNDS`` mode
  (``E[ids]``: it reads the clamped row) get a zero gradient, as in JAX's own
  transpose of the gather, whose scatter drops them.
  """
  eqn = site.eqn
  rows = eqn.invars[0].aval.shape[0]
  n = ids.shape[0]
  ids = ids.reshape(n, -1)
  g = _numerics.upcast_for_accumulation(g).reshape(n, ids.shape[1], -1)
  mode = _jax.gather_parts(eqn).mode
  if "FILL" in mode or "PROMISE" in mode:  # out-of-range rows: dropped from the gradient
    g = jnp.where(((ids >= 0) & (ids < rows))[..., None], g, 0)
  return jnp.clip(ids, 0, rows - 1), g


def gather_sumsq(site: Site, ids: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of the looked-up table||^2``, repeated rows included."""
  rows = site.eqn.invars[0].aval.shape[0]
  ids, g = _lookup_operands(site, ids, g)
  e = _exponent(g)
  return _up(_gather_sumsq_scaled(ids, _down(g, e), rows), 2 * e)


def _gather_sumsq_scaled(ids: jax.Array, g: jax.Array, rows: int) -> jax.Array:
  t = ids.shape[1]
  if lookup_gram_is_cheaper(t, rows):  # t^2 R flops against about 2 t R for the sums
    gg = jnp.einsum("btr,bsr->bts", g, g, precision=_HIGHEST)
    return jnp.sum(jnp.where(ids[:, :, None] == ids[:, None, :], gg, 0), axis=(1, 2))
  if t < rows:  # the sums of the rows read, one per distinct id: the size of g
    sums = jax.vmap(lambda i, x: _rows_by_id(i, x, t))(ids, g)
  else:  # the per-example gradient of the table: smaller than g
    sums = jax.vmap(lambda i, x: jnp.zeros((rows, x.shape[1]), x.dtype).at[i].add(x))(ids, g)
  return jnp.sum(sums * sums, axis=(1, 2))


def _rows_by_id(ids: jax.Array, g: jax.Array, t: int) -> jax.Array:
  """One example's ``sum_{s: id_s = r} g_s`` for each distinct ``r`` (``t`` rows, some zero).

  The non-zero rows of the per-example gradient of the table, without
  forming its ``rows x R`` zeros: the ids sorted, each run of equal ids one
  segment.
  """
  order = jnp.argsort(ids)
  ids = ids[order]
  run = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32), (ids[1:] != ids[:-1])]))
  return jax.ops.segment_sum(g[order], run, num_segments=t, indices_are_sorted=True)


def tied_cross(
  lookup: Site, ids: jax.Array, g_rows: jax.Array, dot: Site, pos: int, a: jax.Array, g: jax.Array
) -> jax.Array:
  """Each example's ``<grad through the lookup, grad through the dot>`` of one table.

  For a table ``E`` (``rows x R``) read by ``E[ids]`` and used by a
  ``dot_general`` that contracts its axis 1 and keeps its axis 0 (a tied
  output head, ``h @ E.T``), the dot's gradient of row ``r`` is
  ``sum_s G[s, r] a_s``, so the inner product is
  ``sum_{t,s} G[s, id_t] <g_t, a_s>``: cost ``T_lookup * T_dot`` per example.
  """
  ids, g_rows = _lookup_operands(lookup, ids, g_rows)
  a, g = _dot_operands(dot, pos, a, g)  # (b, 1, T, R) and (b, 1, T, rows)
  a, g = a[:, 0], g[:, 0]
  er, ea, eg = _exponent(g_rows), _exponent(a), _exponent(g)
  g_rows, a, g = _down(g_rows, er), _down(a, ea), _down(g, eg)
  return _up(_tied_cross_scaled(ids, g_rows, a, g), er + ea + eg)


def _tied_cross_scaled(ids: jax.Array, g_rows: jax.Array, a: jax.Array, g: jax.Array) -> jax.Array:
  m = jnp.einsum("btr,bsr->bts", g_rows, a, precision=_HIGHEST)
  picked = jnp.take_along_axis(
    g, jnp.broadcast_to(ids[:, None, :], g.shape[:2] + ids.shape[1:]), axis=2
  )  # (b, s, t): G[s, id_t]
  return jnp.sum(m * jnp.swapaxes(picked, 1, 2), axis=(1, 2))
