"""Ghost norms: the sites of a per-example loss.

A per-example loss is traced to a jaxpr. Every value of the program is classed
as depending on the parameters only (*param*), on the batch (*data*), or on
neither (*const*) (:class:`~jaxclip.privacy._ghost._types.Info`); a param value
that rearranges a parameter leaf, or a static slice of one, keeps that *view*
of the leaf (:func:`view_of`). A *site* is an equation that takes a floating-point param
value and a data value, such as ``x @ W`` or ``E[ids]``: the loss depends on the
parameters through the sites alone. A lookup of a param table at ids that do
not depend on the example (``wpe[jnp.arange(T)]``) is a site with no data
input (:func:`is_fixed_lookup`). Which rule each param input of a site gets is
the rule registry's (:mod:`jaxclip.privacy._ghost._rules`).

Which primitives these are, and how their parameters are read, is
:mod:`jaxclip.privacy._ghost._jaxpr._internals`'s; the walkers that find the sites are in
:mod:`jaxclip.privacy._ghost._jaxpr._walk`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._types import CONST, DATA, PARAM, Info, Site


def is_float(aval: Any) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.floating)


# ----------------------------------------------------------------------------
# Views: which part of which leaf a param value is
# ----------------------------------------------------------------------------


def view_of(eqn: Any, infos: list[Info]) -> Info:
  """What an equation's output depends on, when its inputs depend on params only."""
  deps = frozenset().union(*(i.deps for i in infos))
  params = [i for i in infos if i.kind == PARAM]
  if not _jax.is_view(eqn) or len(params) != 1 or len(eqn.outvars) != 1:
    return Info(PARAM, deps)
  src, out = eqn.invars[0].aval, eqn.outvars[0].aval
  if not (is_float(src) and is_float(out)) or infos[0].kind != PARAM:
    return Info(PARAM, deps)
  info = params[0]
  same_values = _jax.is_slice(eqn) or math.prod(src.shape) == math.prod(out.shape)
  if info.view is None:  # still a scan's const, if it was one
    return Info(PARAM, deps, scan_const=info.scan_const and same_values)
  if _jax.is_slice(eqn):
    return _slice_of(eqn, info, deps)
  if not same_values:  # broadcast_in_dim that repeats values
    return Info(PARAM, deps, scan_const=info.scan_const)
  axes = info.axes
  perm, gone = _jax.transpose_permutation(eqn), _jax.squeeze_dimensions(eqn)
  if axes is not None and perm is not None:
    axes = tuple(axes[p] for p in perm)
  elif axes is not None and gone is not None:
    gone = {d % src.ndim for d in gone}
    axes = tuple(a for j, a in enumerate(axes) if j not in gone)
  elif tuple(src.shape) != tuple(out.shape):
    axes = None  # still the leaf's values, but not axis by axis
  return dataclasses.replace(info, deps=deps, axes=axes)


def _slice_of(eqn: Any, info: Info, deps: frozenset[int]) -> Info:
  """A static slice of a view: a view of a region of the leaf (or of nothing known)."""
  bounds = _jax.slice_bounds(eqn)
  if bounds is None:
    return Info(PARAM, deps)
  starts, limits, strides = bounds
  if info.axes is None or (strides is not None and any(s != 1 for s in strides)):
    return Info(PARAM, deps, scan_const=info.scan_const)
  region = dict((a, (lo, hi)) for a, lo, hi in info.region)
  shape = eqn.invars[0].aval.shape
  for j, (lo, hi) in enumerate(zip(starts, limits, strict=True)):
    if (lo, hi) != (0, shape[j]):
      base = region.get(info.axes[j], (0, None))[0]
      region[info.axes[j]] = (base + lo, base + hi)
  return dataclasses.replace(
    info, deps=deps, region=tuple(sorted((a, lo, hi) for a, (lo, hi) in region.items()))
  )


def disjoint(a: Info, b: Info) -> bool:
  """Whether two views of regions of one leaf share no element."""
  ra, rb = (
    dict((x, (lo, hi)) for x, lo, hi in a.region),
    dict((x, (lo, hi)) for x, lo, hi in b.region),
  )
  return any(ax in rb and (ra[ax][1] <= rb[ax][0] or rb[ax][1] <= ra[ax][0]) for ax in ra)


def site_roles(eqn: Any, infos: Sequence[Info]) -> tuple[str, ...]:
  if eqn is None:
    return (PARAM,)
  return tuple(
    PARAM if i.kind == PARAM and is_float(v.aval) else DATA if i.kind == DATA else CONST
    for i, v in zip(infos, eqn.invars, strict=True)
  )


def float_outs(eqn: Any, aval: Any) -> tuple[int, ...]:
  """The positions of a site's floating-point outputs (``aval``: the loss's, for ``None``)."""
  avals = [aval] if eqn is None else [v.aval for v in eqn.outvars]
  return tuple(j for j, a in enumerate(avals) if is_float(a))


def is_site(eqn: Any, infos: Sequence[Info]) -> bool:
  """Whether an equation takes a float param value and a data value, with a float output, or
  is a lookup of fixed rows (:func:`is_fixed_lookup`)."""
  return (
    any(i.kind == PARAM and is_float(v.aval) for i, v in zip(infos, eqn.invars, strict=True))
    and any(is_float(v.aval) for v in eqn.outvars)
    and (any(i.kind == DATA for i in infos) or is_fixed_lookup(eqn, infos))
  )


def is_fixed_lookup(eqn: Any, infos: Sequence[Any]) -> bool:
  """Whether an equation looks up rows of a param table at ids that do not depend on the
  example (``wpe[jnp.arange(T)]``, ``jnp.take(wpe, jnp.arange(T), axis=0)``).

  ``infos`` are the inputs' classes (or, for a site, its ``roles``). Such a
  lookup is a site of its own (with no data input): the lookup rule then
  applies to the table, with the fixed ids, instead of the table's
  per-example gradient being formed from the rows' gradients.
  """
  kinds = [getattr(i, "kind", i) for i in infos]
  return kinds == [PARAM, CONST] and _jax.is_row_lookup(eqn)


def join_outputs(jaxpr: Any, sites: list[Site], first: int) -> None:
  """Marks the sites ``first`` on, of equations of ``jaxpr``, whose outputs meet through sums.

  A site's output used once, by a sum of two values of its shape and dtype
  (``dense_i(x) + dense_h(h)`` in an LSTM's gate, a bias added after), has
  the sum's output gradient; so has each output along a chain of such sums.
  Sites whose outputs reach the same value that way have one output gradient:
  each gets ``joins``, the first of them (see :func:`borrowed`).
  """
  uses: dict[Any, int] = {}
  for v in [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars):
    if not _jax.is_literal(v):
      uses[v] = uses.get(v, 0) + 1
  into: dict[Any, Any] = {}  # a value -> the output of the sum it goes into
  for e in jaxpr.eqns:
    out = e.outvars[0]
    if _jax.is_add(e) and all(
      not _jax.is_literal(v) and (v.aval.shape, v.aval.dtype) == (out.aval.shape, out.aval.dtype)
      for v in e.invars
    ):
      into.update((v, out) for v in e.invars)

  def end(v):
    while uses.get(v) == 1 and v in into:
      v = into[v]
    return v

  mine = {id(e) for e in jaxpr.eqns}
  meet: dict[Any, list[int]] = {}
  for u in range(first, len(sites)):
    eqn = sites[u].eqn
    if eqn is not None and id(eqn) in mine and len(eqn.outvars) == 1 and sites[u].outs == (0,):
      meet.setdefault(end(eqn.outvars[0]), []).append(u)
  for us in meet.values():
    for u in us if len(us) > 1 else ():
      sites[u] = dataclasses.replace(sites[u], joins=us[0])


def borrowed(sites: Sequence[Site], own: Sequence[int]) -> dict[int, int]:
  """``{site: site whose output gradient it takes}``, among the sites ``own`` that need their
  output gradients (neither tapped nor probed): the first of each :func:`join_outputs` group
  gets a zero added to its output; the others get none and take its gradient."""
  first: dict[int, int] = {}
  out = {}
  for u in sorted(own):
    j = sites[u].joins
    if j is not None:
      if j in first:
        out[u] = first[j]
      else:
        first[j] = u
  return out


def site_outputs(
  site: Site,
  pvals: Sequence[Any],
  cvals: Sequence[Any],
  dvals: Sequence[Any],
  bind: Any = _jax.bind,
) -> list[Any]:
  """The floating-point outputs of ``site`` for the given inputs (of one example).

  Inside scans, every input and output has one leading axis per scan.
  ``bind(eqn, vals)`` evaluates the site's equation (another one evaluates it
  in float32: :func:`jaxclip.privacy._ghost._wide.wide_bind`).
  """

  def once(pvals, cvals, dvals):
    if site.eqn is None:
      return list(pvals)
    its = {PARAM: iter(pvals), CONST: iter(cvals), DATA: iter(dvals)}
    out = bind(site.eqn, [next(its[r]) for r in site.roles])
    return [out[j] for j in site.outs]

  for _ in site.stack:
    once = jax.vmap(once)
  return once(pvals, cvals, dvals)
