"""An embedding table tied to an output head: the ``lookup`` and ``dot`` rules and their cross term.

A table ``E`` read by ``E[ids]`` and used, transposed, by a head ``h @ E.T``
has, per example, the gradient of the lookup plus that of the head; its
squared norm is both rules' plus twice their inner product
(:func:`tied_cross`), which costs ``T_lookup * T_dot`` per example, read
within the three terms' rounding's bound (:func:`tied_parts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxclip.privacy._ghost._rules import _scaling
from jaxclip.privacy._ghost._rules._dot import dot_dims, dot_operands
from jaxclip.privacy._ghost._rules._lookup import lookup_operands
from jaxclip.privacy._ghost._types import Site, Tied


def tied_cross(
  lookup: Site, ids: jax.Array, g_rows: jax.Array, dot: Site, pos: int, a: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Each example's ``<grad through the lookup, grad through the dot>`` of one table, and a
  bound on its rounding error.

  For a table ``E`` (``rows x R``) read by ``E[ids]`` and used by a
  ``dot_general`` that contracts its axis 1 and keeps its axis 0 (a tied
  output head, ``h @ E.T``), the dot's gradient of row ``r`` is
  ``sum_s G[s, r] a_s``, so the inner product is
  ``sum_{t,s} G[s, id_t] <g_t, a_s>``: cost ``T_lookup * T_dot`` per example.
  """
  ids, g_rows = lookup_operands(lookup, ids, g_rows)
  a, g = dot_operands(dot, pos, a, g)  # (b, 1, T, R) and (b, 1, T, rows)
  a, g = a[:, 0], g[:, 0]
  er, ea, eg = _scaling.exponent(g_rows), _scaling.exponent(a), _scaling.exponent(g)
  g_rows, a, g = _scaling.down(g_rows, er), _scaling.down(a, ea), _scaling.down(g, eg)
  cross, err = _tied_cross_scaled(ids, g_rows, a, g)
  return _scaling.up(cross, er + ea + eg), _scaling.up(err, er + ea + eg)


def _tied_cross_scaled(
  ids: jax.Array, g_rows: jax.Array, a: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """``<g_t, a_s>`` is off by ``R eps ||g_t|| ||a_s||``, the products' sum (``T_lookup T_dot``
  of them) by ``(T_lookup T_dot + 1) eps`` of their absolute values' sum; each scaled input's
  largest entry is in ``[0.5, 1)``, and a flushed product is off by ``tiny`` at most."""
  m = jnp.einsum("btr,bsr->bts", g_rows, a, precision=_scaling.HIGHEST)
  picked = jnp.take_along_axis(
    g, jnp.broadcast_to(ids[:, None, :], g.shape[:2] + ids.shape[1:]), axis=2
  )  # (b, s, t): G[s, id_t]
  terms = m * jnp.swapaxes(picked, 1, 2)
  cross = jnp.sum(terms, axis=(1, 2))
  tl, td, width = m.shape[1], m.shape[2], g_rows.shape[2]
  info = jnp.finfo(m.dtype)
  norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=2))
  outer = norm(g_rows)[:, :, None] * norm(a)[:, None, :]
  err = info.eps * jnp.sum(
    width * outer * jnp.abs(jnp.swapaxes(picked, 1, 2)) + (tl * td + 1) * jnp.abs(terms),
    axis=(1, 2),
  )
  return cross, err + tl * td * (width + 1) * info.tiny


def tied_parts(
  lookup: _scaling.Parts, head: _scaling.Parts, cross: tuple[jax.Array, jax.Array]
) -> _scaling.Parts:
  """A tied table's squared norm: its lookup's, its head's and twice their cross term
  (:func:`tied_cross`), each with its error bound, and the two additions' rounding. Where the
  two gradients cancel, the error bounds make the read an upper bound."""
  x, err = cross
  s = lookup.s + head.s + 2 * x
  eps = jnp.finfo(s.dtype).eps
  err = (
    lookup.err
    + head.err
    + 2 * err
    + 2 * eps * (jnp.abs(lookup.s) + jnp.abs(head.s) + 2 * jnp.abs(x))
  )
  return _scaling.Parts(s, err, lookup.floor + head.floor)


def tied_cross_cost(sites: Sequence[Site], pair: Tied) -> int:
  """Per example, the flops of :func:`tied_cross`."""
  (gu, _), (du, dk) = pair
  t_lookup = math.prod(sites[gu].eqn.invars[1].aval.shape[:-1])
  _, t, c, f = dot_dims(sites[du], sites[du].param_positions()[dk])[0]
  return t_lookup * t * (c + f)
