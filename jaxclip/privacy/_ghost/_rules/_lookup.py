"""The ``lookup`` rule: an embedding table read at ids, ``E[ids]`` or ``take(E, ids, 0)``.

Each example's gradient of the table adds up the rows' output gradients at
their ids, so its squared norm is ``sum_{s,t: id_s = id_t} <g_s, g_t>``: a
Gram product masked by equal ids where the rows read are few, otherwise the
sums of the rows read (one per distinct id), or the table's gradient where
that is smaller. A lookup at ids that do not depend on the example
(``wpe[arange(T)]``) is a site too, its ids the same for every example.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._rules import _scaling
from jaxclip.privacy._ghost._rules._base import Rule, levels
from jaxclip.privacy._ghost._types import PARAM, Site


def lookup_gram_is_cheaper(t: int, rows: int) -> bool:
  return t * t <= rows + t


def lookup_operands(site: Site, ids: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
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


def lookup_sumsq(site: Site, ids: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of the looked-up table||^2``, repeated rows included, as
  :func:`~jaxclip.privacy._ghost._rules._scaling.read` reads it."""
  return _scaling.read(lookup_parts(site, ids, g))


def lookup_parts(site: Site, ids: jax.Array, g: jax.Array) -> _scaling.Parts:
  """The :class:`~jaxclip.privacy._ghost._rules._scaling.Parts` of :func:`lookup_sumsq`."""
  rows = site.eqn.invars[0].aval.shape[0]
  ids, g = lookup_operands(site, ids, g)
  e = _scaling.exponent(g)
  return _scaling.up_parts(_lookup_parts_scaled(ids, _scaling.down(g, e), rows), 2 * e)


def _lookup_parts_scaled(ids: jax.Array, g: jax.Array, rows: int) -> _scaling.Parts:
  """Rows whose largest entry is in ``[0.5, 1)``. A row's ``||g_t||`` bounds its terms; the
  rows at one id add up (``M`` of the parts) and, in the Gram form, their dot products are off
  by ``R eps ||g_t|| ||g_s||``, their sum (``T^2`` terms) by ``T^2 eps``; the sums per id (at
  most ``n`` rows each) by ``n eps`` of their rows' norms."""
  t, eps, floor = ids.shape[1], jnp.finfo(g.dtype).eps, _scaling.floor_factor(g.dtype)
  norms = jnp.sqrt(jnp.sum(g * g, axis=2))
  if lookup_gram_is_cheaper(t, rows):  # t^2 R flops against about 2 t R for the sums
    same = ids[:, :, None] == ids[:, None, :]
    gg = jnp.where(same, jnp.einsum("btr,bsr->bts", g, g, precision=_scaling.HIGHEST), 0)
    s = jnp.sum(gg, axis=(1, 2))
    m = jnp.sum(jnp.where(same, norms[:, :, None] * norms[:, None, :], 0), axis=(1, 2))
    err = eps * (g.shape[2] * m + t * t * jnp.sum(jnp.abs(gg), axis=(1, 2)))
    return _scaling.Parts(s, err, floor * m)
  # Per id: the sum of its rows, and of their norms and of ones (how many there are).
  if t < rows:  # the sums of the rows read, one per distinct id: the size of g
    by_id = lambda x: jax.vmap(lambda i, x: _rows_by_id(i, x, t))(ids, x)
  else:  # the per-example gradient of the table: smaller than g
    by_id = lambda x: jax.vmap(lambda i, x: jnp.zeros((rows, x.shape[1]), x.dtype).at[i].add(x))(
      ids, x
    )
  s = jnp.sum(by_id(g) ** 2, axis=(1, 2))
  sums = by_id(jnp.stack([norms, jnp.ones_like(norms)], axis=2))
  m = jnp.sum(sums[..., 0] ** 2, axis=1)
  err = eps * jnp.sqrt(jnp.sum((sums[..., 1] * sums[..., 0]) ** 2, axis=1))
  return _scaling.formed_parts(s, err, m)


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


class LookupRule(Rule):
  """The ``lookup`` rule (see the module's docstring)."""

  name = "lookup"

  def matches(self, eqn: Any, roles: tuple[str, ...], pos: int) -> bool:
    return (
      eqn is not None
      and pos == 0
      and len(roles) == 2
      and roles[1] != PARAM
      and _jax.is_row_lookup(eqn)
    )

  def sumsq(self, site: Site, k: int, w: Any, a: jax.Array, g: jax.Array) -> jax.Array:
    del k, w
    return lookup_sumsq(site, a, g)

  def _dims(self, site: Site) -> tuple[int, int, int]:
    """The table's rows, their width, and the rows read."""
    table, ids = site.eqn.invars[0].aval, site.eqn.invars[1].aval
    return table.shape[0], math.prod(table.shape[1:]), math.prod(ids.shape[:-1])

  def cost(self, site: Site, k: int) -> tuple[int, int]:
    reps = levels(site, k)[0]
    rows, width, t = self._dims(site)
    grad = (rows + t) * width
    ghost = t * t * width if lookup_gram_is_cheaper(t, rows) else min(2 * t, rows + t) * width
    return ghost * reps, grad * reps

  def form(self, site: Site, k: int) -> str:
    rows, _, t = self._dims(site)
    return "lookup:gram" if lookup_gram_is_cheaper(t, rows) else "lookup"

  def work(self, site: Site, k: int) -> int:
    reps, stacked = levels(site, k)
    rows, width, t = self._dims(site)
    return reps * stacked * (t * t if lookup_gram_is_cheaper(t, rows) else min(t, rows) * width)


LOOKUP = LookupRule()
