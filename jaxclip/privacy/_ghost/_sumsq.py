"""Ghost norms: each example's squared gradient norm, by a plan's rules.

:func:`plan_terms` adds up, per example (and per clip group), the terms of a
plan: each ghost boundary's rule (:mod:`jaxclip.privacy._ghost._rules`) from
its captured ``a`` and ``g``, or the term taken in the backward pass (a
probed site, :func:`probe_sumsq`; an accumulated one, its per-example
gradient), each tied table's terms and the instantiated leaves'
(:mod:`jaxclip.privacy._ghost._rules._instantiate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy._ghost import _rules
from jaxclip.privacy._ghost._rules import _instantiate, _lookup, _scaling, _tied
from jaxclip.privacy._ghost._rules._dot import dot_parts
from jaxclip.privacy._ghost._types import Captured, Plan, Site, Tied


def early_heads(plan: Plan) -> list[tuple[int, int]]:
  """The tied heads whose own term is taken in the backward pass (``early`` of
  :class:`jaxclip.privacy._ghost._forward.Forward`).

  In a two-pass plan a head's output gradient, as large as its logits, is
  needed for the norms only: taken at the head, its own term frees it before
  the rest of the backward pass. Its cross term with the lookup needs only
  its rows at the lookup's ids. Not in a scan (a term per iteration is not
  the norm of a weight the iterations share).
  """
  if not plan.two_pass:
    return []
  return [(du, dk) for _, (du, dk) in plan.tied if not plan.sites[du].stack]


def plan_terms(
  plan: Plan,
  cap: Captured,
  leaf_groups: Sequence[int] | None = None,
  num_groups: int | None = None,
) -> tuple[jax.Array, dict[int, jax.Array]]:
  """Each example's squared gradient norm, by the plan's rules, and the instantiated leaves'
  per-example gradients (``{leaf: gradients}``: the clipped sum releases them weighted).

  With ``leaf_groups`` (the clip group of each leaf), ``(examples, groups)``:
  each example's squared norm over each group's leaves. A ghost rule's or a
  tied table's term belongs to its one leaf's group; the instantiated leaves
  are summed per group (:func:`jaxclip.privacy._ghost._rules._instantiate.instantiated_grads`).
  """
  acc = _numerics.tree_accumulation_dtype(cap.leaves)  # as method="vmap" sums squares
  num = 1 if leaf_groups is None else num_groups or max(leaf_groups, default=-1) + 1
  zeros = [jnp.zeros((cap.n,), acc) for _ in range(num)]
  parts = list(zeros)
  group = lambda leaf: 0 if leaf_groups is None else leaf_groups[leaf]
  for u, k, rule in plan.ghost:
    g = group(plan.sites[u].infos[k].view)
    if u in plan.probed:  # taken in the backward pass, per scan iteration
      part = cap.gs[u][0]
      parts[g] = parts[g] + jnp.sum(part.reshape(cap.n, -1), axis=1).astype(acc)
      continue
    if u in cap.accumulated:  # the per-example gradient, formed in the backward pass
      parts[g] = parts[g] + _scaling.safe_sumsq(cap.gs[u][k]).astype(acc)
      continue
    parts[g] = parts[g] + _rule_sumsq(cap, u, k, rule).astype(acc)
  early = {du for du, _ in early_heads(plan)}
  for pair in plan.tied:
    (gu, gk), _ = pair
    g = group(plan.sites[gu].infos[gk].view)
    parts[g] = parts[g] + _tied_sumsq(cap, pair, early).astype(acc)
  formed: dict[int, jax.Array] = {}
  for inst in plan.instantiated:
    sq, leaves, grads = _instantiate.instantiated_grads(inst, cap, leaf_groups, num)
    formed.update(zip(leaves, grads, strict=True))
    if leaf_groups is None:
      parts[0] = parts[0] + sq.astype(acc)
    else:
      parts = [p + sq[:, j].astype(acc) for j, p in enumerate(parts)]
  if leaf_groups is None:
    return parts[0], formed
  # A group no term reached: zeros sharded as the others (under an Explicit mesh).
  reached = [p for p, z in zip(parts, zeros, strict=True) if p is not z]
  stacked = jnp.stack(
    [
      jnp.zeros_like(reached[0]) if p is z and reached else p
      for p, z in zip(parts, zeros, strict=True)
    ],
    axis=1,
  )
  return stacked, formed


def _rule_sumsq(cap: Captured, u: int, k: int, rule: str) -> jax.Array:
  """A ghost boundary's squared norms, summed over its scan iterations.

  A lookup of fixed rows (``wpe[jnp.arange(T)]``) records no data: its ids are
  its const input, the same for every example.
  """
  site, g, r = cap.sites[u], cap.gs[u][0], _rules.get(rule)
  a = cap.drecs[u][0] if cap.drecs[u] else _repeat(cap.cvals[u][0], cap.n)
  if r.reads_param:
    kernel = _repeat(cap.pvals[u][k], cap.n)
    return _scaling.per_iteration(site, lambda w, a, g: r.sumsq(site, k, w, a, g), kernel, a, g)
  shared = site.infos[k].shared
  return _scaling.per_iteration(
    site, lambda a, g: r.sumsq(site, k, None, a, g), a, g, shared=shared
  )


def _repeat(x: jax.Array, n: int) -> jax.Array:
  return jnp.broadcast_to(x, (n,) + jnp.shape(x))


def probe_sumsq(site: Site, k: int, rule: str) -> Callable[..., jax.Array]:
  """``(pvals, dvals, gs) -> ||grad||^2`` of a ghost site, for one example and one iteration.

  The rules take a leading batch axis; inside the backward pass (under the
  batch's ``vmap``) the site's values are one example's.
  """
  r, one = _rules.get(rule), lambda x: x[None]
  return lambda pv, dv, gs: r.sumsq(site, k, one(pv[k]), one(dv[0]), one(gs[0]))[0]


def probe_tied_head(site: Site, k: int) -> Callable[..., jax.Array]:
  """``(pvals, dvals, gs) ->`` a tied head's own term's parts (stacked: the value, its error
  bound and its floor; :class:`~jaxclip.privacy._ghost._rules._scaling.Parts`), for one
  example, taken in the backward pass (:func:`early_heads`): the table's read needs them."""
  pos, one = site.param_positions()[k], lambda x: x[None]
  return lambda pv, dv, gs: jnp.stack(dot_parts(site, pos, one(dv[0]), one(gs[0])))[:, 0]


def _tied_sumsq(
  cap: Captured, pair: Tied, early: frozenset[int] | set[int] = frozenset()
) -> jax.Array:
  """A tied table's squared norms: its lookup's, its head's and twice their cross term, read
  within their rounding's bound (:func:`jaxclip.privacy._ghost._rules._tied.tied_parts`).

  A head in ``early`` took its own term's parts in the backward pass (its last zero's
  gradient, :func:`probe_tied_head`).
  """
  (gu, _), (du, dk) = pair
  lookup, head = cap.sites[gu], cap.sites[du]
  pos = head.param_positions()[dk]
  ids, rows, a, g = cap.drecs[gu][0], cap.gs[gu][0], cap.drecs[du][0], cap.gs[du][0]
  if du in early:
    own = _scaling.Parts(*jnp.moveaxis(cap.gs[du][-1], -1, 0))
  else:
    own = dot_parts(head, pos, a, g)
  cross = _tied.tied_cross(lookup, ids, rows, head, pos, a, g)
  return _scaling.read(_tied.tied_parts(_lookup.lookup_parts(lookup, ids, rows), own, cross))
