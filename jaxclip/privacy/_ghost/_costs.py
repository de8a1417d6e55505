"""Ghost norms: what each rule costs, against the per-example gradient it replaces.

:func:`site_cost` and :func:`site_memory` give a boundary's flops and floats
held per example under its ghost rule and instantiated, from which
:mod:`jaxclip.privacy._ghost._planning` picks; :func:`accumulates` says where a
boundary's per-example gradient is formed in the backward pass instead. The
rules' shapes (:func:`dot_dims`, :func:`conv_dims`) and the choice between a
Gram product and the gradient itself (:func:`gram_is_cheaper`) are the
formulas' too (:mod:`jaxclip.privacy._ghost._rules._norms`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._types import Site


def gram_is_cheaper(t: int, c: int, f: int) -> bool:
  """Whether ``<A A^T, G G^T>`` (``t^2 (c + f)`` flops) costs less than ``A^T G`` (``t c f``)."""
  return t * (c + f) <= c * f


def lookup_gram_is_cheaper(t: int, rows: int) -> bool:
  return t * t <= rows + t


def dot_dims(site: Site, pos: int) -> tuple[tuple[int, int, int, int], tuple[list[int], ...]]:
  """``(n, T, C, F)`` of :func:`jaxclip.privacy._ghost._rules._norms._dot_operands`, and the data
  operand's batch, free and contracting dims."""
  eqn = site.eqn
  (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(eqn)
  contract, batch = (lc, lb) if pos == 1 else (rc, rb)
  d_aval = eqn.invars[1 - pos].aval
  size = lambda dims: math.prod(d_aval.shape[i] for i in dims)
  free = [i for i in range(d_aval.ndim) if i not in contract and i not in batch]
  nb, t, c = size(batch), size(free), size(contract)
  f = math.prod(eqn.invars[pos].aval.shape) // max(nb * c, 1)
  return (nb, t, c, f), (list(batch), free, list(contract))


def conv_dims(site: Site) -> tuple[int, int, int, int]:
  """A convolution's feature groups, output positions, taps and outputs per group."""
  eqn = site.eqn
  parts = _jax.conv_parts(eqn)
  dn, groups = parts.dimension_numbers, parts.feature_group_count
  rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
  positions = math.prod(out.shape[d] for d in (dn.out_spec[0], *dn.out_spec[2:]))
  taps = math.prod(rhs.shape[d] for d in dn.rhs_spec[1:])  # per group: C / groups * K
  return groups, positions, taps, rhs.shape[dn.rhs_spec[0]] // groups


def _levels(site: Site, k: int) -> tuple[int, int]:
  """The iterations of a boundary's scans that read their own parameter value, and those that
  read one value (its ``shared`` levels)."""
  shared = site.infos[k].shared
  own = math.prod(n for j, (_, n) in enumerate(site.stack) if j not in shared)
  return own, math.prod(n for j, (_, n) in enumerate(site.stack) if j in shared)


def accumulates(site: Site, k: int) -> bool:
  """Whether a boundary's per-example gradient is formed in the backward pass.

  That is a ``dot`` or ``conv`` boundary of float32 or wider whose rule would
  form each example's gradient anyway (the Gram form costing more flops),
  where that gradient is smaller than the site's output gradients: it is
  then formed where ``a`` and ``g`` meet
  (:class:`jaxclip.privacy._ghost._capture.Forward`), and neither is kept
  past that step for the site (its ``a`` may still be kept by the model's
  own backward pass, so only ``g`` is counted). Inside scans, a weight every
  iteration reads gets one gradient per example (each iteration's term
  added up there), and one sliced per iteration gets one per iteration.
  """
  rule = site.rules[k]
  if site.eqn is None or rule not in ("dot", "conv") or len(site.infos) != 1:
    return False
  if site.infos[k].shared and not site.summed:  # shared by some of its scans only
    return False
  avals = [v.aval for v in site.eqn.invars] + list(site.out_avals)
  if any(jnp.finfo(a.dtype).bits < 32 for a in avals):
    return False
  if rule == "dot":
    (_, t, c, f), rows = dot_dims(site, site.param_positions()[k])[0], _levels(site, k)[1]
    formed = not gram_is_cheaper(t * rows, c, f)
  else:
    _, positions, taps, outs = conv_dims(site)
    formed = not gram_is_cheaper(positions, taps, outs)
  iterations = math.prod(n for _, n in site.stack)
  grad = math.prod(site.param_avals()[k].shape) * (1 if site.summed else iterations)
  return formed and grad < iterations * sum(math.prod(a.shape) for a in site.out_avals)


def site_cost(site: Site, k: int, rule: str) -> tuple[int, int]:
  """Per example, the flops of a boundary's ghost rule and of its per-example gradient."""
  reps, rows = _levels(site, k)
  if rule == "dot":  # the rows of every iteration that reads the same weight, together
    nb, t, c, f = dot_dims(site, site.param_positions()[k])[0]
    t *= rows
    grad = nb * t * c * f
    ghost = nb * t * t * (c + f) if gram_is_cheaper(t, c, f) else grad
  elif rule == "gather":
    rows, width = site.eqn.invars[0].aval.shape[0], math.prod(site.eqn.invars[0].aval.shape[1:])
    t = math.prod(site.eqn.invars[1].aval.shape[:-1])
    grad = (rows + t) * width
    ghost = t * t * width if lookup_gram_is_cheaper(t, rows) else min(2 * t, rows + t) * width
  elif rule == "conv":
    groups, positions, taps, outs = conv_dims(site)
    grad = groups * positions * taps * outs
    ghost = (
      groups * positions * positions * (taps + outs)
      if gram_is_cheaper(positions, taps, outs)
      else grad
    )
  else:  # an elementwise or small operation: about its outputs' size
    grad = ghost = sum(math.prod(a.shape) for a in site.out_avals) * rows
  return ghost * reps, grad * reps


def site_memory(site: Site, k: int, rule: str) -> tuple[int, int]:
  """Per example, the floats a boundary holds under its ghost rule and instantiated.

  Under the rule: the site's records (its data inputs and output gradients,
  kept for the norms and the book-keeping) and the rule's own work (the two
  Gram matrices, or the per-example gradient where that costs fewer flops).
  Instantiated: the per-example gradient of its param input, taken in the
  backward pass, where that is smaller than the records (a tapped site);
  otherwise the records and the per-example gradient formed from them.
  """
  reps, rows = _levels(site, k)
  stack = reps * rows
  data = [v.aval for v, r in zip(site.eqn.invars, site.roles, strict=True) if r == "data"]
  records = stack * sum(math.prod(a.shape) for a in [*data, *site.out_avals])
  param = stack * math.prod(site.param_avals()[k].shape)
  if rule == "dot":
    nb, t, c, f = dot_dims(site, site.param_positions()[k])[0]
    t *= rows
    work = reps * nb * (2 * t * t if gram_is_cheaper(t, c, f) else c * f)
  elif rule == "conv":
    groups, positions, taps, outs = conv_dims(site)
    cheap = gram_is_cheaper(positions, taps, outs)
    work = stack * groups * (2 * positions * positions if cheap else taps * outs)
  elif rule == "gather":
    rows_, width = site.eqn.invars[0].aval.shape[0], math.prod(site.eqn.invars[0].aval.shape[1:])
    t = math.prod(site.eqn.invars[1].aval.shape[:-1])
    work = stack * (t * t if lookup_gram_is_cheaper(t, rows_) else min(t, rows_) * width)
  else:
    work = 0
  return records + work, param if param <= records else records + param


def tied_cross_cost(sites: Sequence[Site], pair: tuple[tuple[int, int], tuple[int, int]]) -> int:
  (gu, _), (du, dk) = pair
  t_lookup = math.prod(sites[gu].eqn.invars[1].aval.shape[:-1])
  _, t, c, f = dot_dims(sites[du], sites[du].param_positions()[dk])[0]
  return t_lookup * t * (c + f)
