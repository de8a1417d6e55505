"""Ghost norms: the rule each parameter leaf gets.

Leaves that meet at a site (a value that depends on two of them) form one
unit. A unit of one leaf whose uses each have a ghost rule and read disjoint
parts of it (one use, static slices, the iterations of a scan) gets those
rules, its squared norm the sum of theirs (a weight every iteration of a
scan reads: the ``dot`` rule over all their rows); an embedding table also
used, transposed, by an output head gets both rules and their cross term;
every other leaf is instantiated, all of them in one per-example pass. That
is :func:`make_plan`, the plan of ``method="ghost"``. :func:`auto_plan`
turns it into ``method="auto"``'s, per leaf and per platform.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxclip.privacy._ghost import _cost_model, _rules, _types
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._jaxpr import _sites, _walk
from jaxclip.privacy._ghost._rules import _tied
from jaxclip.privacy._ghost._rules._base import levels
from jaxclip.privacy._ghost._rules._dot import DOT
from jaxclip.privacy._ghost._rules._instantiate import INSTANTIATE
from jaxclip.privacy._ghost._rules._lookup import LOOKUP
from jaxclip.privacy._ghost._types import DATA, Boundary, Ghost, Instantiated, Plan, Site, Tied


def make_plan(
  sites: Sequence[Site],
  num_leaves: int,
  unknown: Sequence[str] = (),
  instantiate: Mapping[int, str] | None = None,
  half: bool = False,
) -> Plan:
  """Groups the leaves by shared uses and picks each group's rule.

  Args:
    sites: From :func:`jaxclip.privacy._ghost._jaxpr._walk.analysis`.
    num_leaves: The number of parameter leaves.
    unknown: From the same: the higher-order equations the engine cannot read.
    instantiate: Leaves to instantiate although they have a ghost rule, each with the
      reason (:func:`auto_plan`).
    half: Whether the loss computes in half precision (:func:`computes_in_half`, :func:`_probed`).
  """
  instantiate = dict(instantiate or {})
  sites = [dataclasses.replace(s, rules=_rules.rules_of(s)) for s in sites]
  boundaries = [Boundary(u, k) for u, s in enumerate(sites) if s.outs for k in range(len(s.infos))]
  ghost, tied, inst = [], [], []
  for leaves, bounds in _units(sites, boundaries, num_leaves):
    if len(leaves) == 1 and leaves[0] in instantiate:
      inst.append(Instantiated(leaves, tuple(bounds)))
      continue
    if len(leaves) == 1 and _disjoint_uses(sites, leaves[0], bounds):
      ghost.extend(Ghost(u, k, sites[u].rules[k]) for u, k in bounds)
      continue
    pair = _tied_pair(sites, leaves[0], bounds) if len(leaves) == 1 else None
    if pair is not None:
      tied.append(pair)
      continue
    inst.append(Instantiated(leaves, tuple(bounds)))
  cost = (_ghost_cost(sites, ghost, tied, inst), _per_example_cost(sites, boundaries))
  merged = _merged(inst)
  return Plan(
    tuple(sites),
    tuple(ghost),
    tuple(tied),
    merged,
    cost,
    _tapped(sites, merged),
    _probed(sites, ghost, half),
    tuple(unknown),
    num_leaves,
    tuple(sorted(instantiate.items())),
    half=half,
  )


def computes_in_half(closed: Any) -> bool:
  """Whether a loss's jaxpr holds a bfloat16 or float16 value (``half`` of :func:`make_plan`)."""
  return bool(_walk.dtypes(closed) & set(_types.HALF))


def _probed(sites: Sequence[Site], ghost: Sequence[Ghost], half: bool) -> frozenset[int]:
  """The ghost sites probed in the backward pass: all, if one is rematerialised (not ``half``).

  Book-keeping the clipped sum in one pass holds every ghost site's ``a`` and
  ``g`` until the norms are known: under ``jax.checkpoint`` (flax
  ``nn.remat``), where the gradient itself keeps only each layer's inputs,
  that is several times the gradient's memory. A model that asks for its
  activations to be recomputed gets two passes instead: the norms, taken
  where each site's ``a`` and ``g`` meet in the backward pass, then the
  gradient of the weighted sum of the losses.

  Not where the loss computes a bfloat16 or float16 value (``half``): the second pass
  weights each example's output gradients inside the model's backward pass, which rounds
  them to its dtype beyond what the norm bounds where rows cancel (up to ``2.2 C``
  measured, ``tests/test_ghost_cancel.py``); one pass book-keeps the sum in float32.
  """
  if half or not any(sites[u].remat for u, _, _ in ghost):
    return frozenset()
  # A weight shared by a scan's iterations needs them all at once, and a
  # lookup of fixed rows has no data input to probe: both keep their records.
  return frozenset(
    u for u, k, _ in ghost if not sites[u].infos[k].shared and DATA in sites[u].roles
  )


def _tapped(sites: Sequence[Site], inst: Sequence[Instantiated]) -> frozenset[int]:
  """The sites whose per-example param-input gradients are taken in the backward pass.

  Those are the sites where each param input is instantiated and where these
  gradients are smaller than what the site would record (its output gradients
  and data inputs): a bias or a scale, one row instead of one per position.
  Half-precision inputs are not tapped, so that the clipped sum stays that of
  the model's own operations, as ``jax.grad`` sums it.
  """
  instantiated = {b for one in inst for b in one.bounds}

  def size(avals):
    return sum(math.prod(a.shape) for a in avals)

  out = set()
  for u, s in enumerate(sites):
    if s.eqn is None or not s.outs or any((u, k) not in instantiated for k in range(len(s.infos))):
      continue
    if any(jnp.finfo(a.dtype).bits < 32 for a in s.param_avals()):
      continue
    data = [v.aval for v, r in zip(s.eqn.invars, s.roles, strict=True) if r == DATA]
    if size(s.param_avals()) <= size(s.out_avals) + size(data):
      out.add(u)
  return frozenset(out)


def _units(
  sites: Sequence[Site], boundaries: Sequence[Boundary], num_leaves: int
) -> list[tuple[tuple[int, ...], list[Boundary]]]:
  """The leaves joined by the values that depend on several of them, with their boundaries."""
  parent = list(range(num_leaves))

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for u, k in boundaries:
    deps = sorted(sites[u].infos[k].deps)
    for j in deps[1:]:
      parent[find(j)] = find(deps[0])
  members: dict[int, list[int]] = {}
  for i in range(num_leaves):
    members.setdefault(find(i), []).append(i)
  owned: dict[int, list[Boundary]] = {}
  for u, k in boundaries:
    deps = sites[u].infos[k].deps
    if deps:
      owned.setdefault(find(min(deps)), []).append((u, k))
  return [(tuple(members[root]), bounds) for root, bounds in owned.items()]


def _ghost_cost(
  sites: Sequence[Site], ghost: Sequence[Ghost], tied: Sequence[Tied], inst: Sequence[Instantiated]
) -> int:
  """Per example, the flops of the plan's norms."""
  cost = sum(_rules.get(rule).cost(sites[u], k)[0] for u, k, rule in ghost)
  for pair in tied:
    (gu, gk), (du, dk) = pair
    cost += (
      LOOKUP.cost(sites[gu], gk)[0]
      + DOT.cost(sites[du], dk)[0]
      + _tied.tied_cross_cost(sites, pair)
    )
  return cost + sum(INSTANTIATE.cost(sites[u], k)[1] for one in inst for u, k in one.bounds)


def _per_example_cost(sites: Sequence[Site], boundaries: Sequence[Boundary]) -> int:
  """Per example, the flops of forming every per-example gradient."""
  return sum(_rules.get(sites[u].rules[k]).cost(sites[u], k)[1] for u, k in boundaries)


def _disjoint_uses(sites: Sequence[Site], leaf: int, bounds: Sequence[Boundary]) -> bool:
  """Whether each use of the leaf has a ghost rule and reads its own part of the leaf.

  The leaf's gradient is then the sum of the uses' gradients, each on its own
  elements, so its squared norm is the sum of theirs: one use, or static
  disjoint slices (a Python loop over ``W[l]``), in the same scans.
  """
  infos = [sites[u].infos[k] for u, k in bounds]
  if any(
    i.view != leaf
    or sites[u].rules[k] == INSTANTIATE.name
    or (i.shared and not _rules.get(sites[u].rules[k]).takes_shared)
    for i, (u, k) in zip(infos, bounds, strict=True)
  ):
    return False
  if len({sites[u].stack for u, _ in bounds}) != 1:
    return False
  return all(_sites.disjoint(a, b) for j, a in enumerate(infos) for b in infos[j + 1 :])


def _tied_pair(sites: Sequence[Site], leaf: int, bounds: Sequence[Boundary]) -> Tied | None:
  """``(lookup, dot)`` boundaries if a 2-D leaf is an embedding table tied to a head."""
  if len(bounds) != 2 or any(sites[u].stack for u, _ in bounds):
    return None
  by_rule = {sites[u].rules[k]: Boundary(u, k) for u, k in bounds}
  if set(by_rule) != {LOOKUP.name, DOT.name}:
    return None
  (gu, gk), (du, dk) = by_rule[LOOKUP.name], by_rule[DOT.name]
  if DATA not in sites[gu].roles:  # fixed rows (wpe[arange(T)]): no cross term
    return None
  g_info, d_info = sites[gu].infos[gk], sites[du].infos[dk]
  if g_info.view != leaf or d_info.view != leaf or g_info.axes != (0, 1) or d_info.axes is None:
    return None
  if g_info.region or d_info.region:
    return None
  eqn = sites[du].eqn
  pos = sites[du].param_positions()[dk]
  (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(eqn)
  contract, batch = (rc, rb) if pos == 1 else (lc, lb)
  if batch or len(contract) != 1 or d_info.axes[contract[0]] != 1:
    return None
  return Tied(lookup=by_rule[LOOKUP.name], dot=by_rule[DOT.name])


def _merged(inst: Sequence[Instantiated]) -> tuple[Instantiated, ...]:
  """The instantiated units as one: a single per-example pass, through each site once."""
  if not inst:
    return ()
  leaves = sorted(i for ls, _ in inst for i in ls)
  bounds = sorted(b for _, bs in inst for b in bs)
  return (Instantiated(tuple(leaves), tuple(bounds)),)


class LeafCost(NamedTuple):
  """Per example, what a leaf with a ghost rule costs under it and instantiated."""

  rule: str  # as ghost_plan names it
  forms: tuple[tuple[str, int], ...]  # (form, flops) of its norms (the cost model's keys)
  grads: tuple[tuple[str, int], ...]  # (rule, flops) of forming its per-example gradient
  calls: int  # evaluations of its sites (once per iteration inside scans)
  floats: int  # held under the rule (site_memory)
  grad_floats: int  # held instantiated
  size: int  # floats written forming its per-example gradient (per iteration of a shared weight)

  @property
  def flops(self) -> int:
    return sum(f for _, f in self.forms)

  @property
  def grad_flops(self) -> int:
    return sum(f for _, f in self.grads)


def _boundary_cost(site: Site, k: int, rule: str) -> LeafCost:
  r = _rules.get(rule)
  (flops, grad), (mem, grad_mem) = r.cost(site, k), r.memory(site, k)
  calls = math.prod(n for _, n in site.stack)
  size = math.prod(levels(site, k)) * math.prod(site.param_avals()[k].shape)
  return LeafCost(rule, ((r.form(site, k), flops),), ((rule, grad),), calls, mem, grad_mem, size)


def _joined(rule: str, parts: Sequence[LeafCost]) -> LeafCost:
  forms, grads = (tuple(x for p in parts for x in getattr(p, f)) for f in ("forms", "grads"))
  return LeafCost(
    rule, forms, grads, *(sum(getattr(p, f) for p in parts) for f in LeafCost._fields[3:])
  )


def leaf_costs(plan: Plan) -> dict[int, LeafCost]:
  """The cost of each leaf the plan gives a ghost rule (a tied table: both rules and the cross
  term, in the ``dot`` rule's Gram form)."""
  parts: dict[int, list[LeafCost]] = {}
  for u, k, rule in plan.ghost:
    parts.setdefault(plan.sites[u].infos[k].view, []).append(_boundary_cost(plan.sites[u], k, rule))
  for pair in plan.tied:
    (gu, gk), (du, dk) = pair
    cross = LeafCost(
      "", ((DOT.name + ":gram", _tied.tied_cross_cost(plan.sites, pair)),), (), 0, 0, 0, 0
    )
    look, head = (
      _boundary_cost(plan.sites[gu], gk, LOOKUP.name),
      _boundary_cost(plan.sites[du], dk, DOT.name),
    )
    parts[plan.sites[gu].infos[gk].view] = [_joined("tied", [look, head, cross])]
  return {leaf: _joined(ps[0].rule, ps) for leaf, ps in parts.items()}


def auto_plan(plan: Plan, platform: str | None) -> tuple[Plan | None, str | None]:
  """The plan ``method="auto"`` takes in a program lowered for ``platform``.

  By the platform's cost model
  (:func:`jaxclip.privacy._ghost._cost_model.ghost_cost_model`):

  * on CPU, by flops: per layer, the rules' own switch between the Gram form
    and the layer's per-example gradient formed from its ``a`` and ``g``
    (whichever costs fewer flops). A layer is not instantiated through its
    own sites there: that makes the forward pass's weight per-example, which
    XLA:CPU runs slower (``benchmarks/results/ghost_zoo.md``);
  * elsewhere, memory first: each leaf with a ghost rule keeps it, or is
    instantiated (its per-example gradient formed through its own sites)
    where that holds fewer floats per example.

  On CPU, where the rules would cost more than ``GHOST_FLOPS_SHARE_CPU`` of
  the flops of every per-example gradient, and elsewhere, where no leaf keeps
  a rule, the whole loss takes ``method="vmap"``'s program: per-example
  gradients with nothing held for book-keeping. The constant is set from
  ``benchmarks/results/ghost_zoo.md``.

  Returns:
    ``(plan, None)``, or ``(None, reason)`` for ``method="vmap"``'s program.
    The plan's ``notes`` say why each leaf keeps its rule.
  """
  where = f"auto on {platform or 'a platform other than CPU'}"
  costs = leaf_costs(plan)
  if _cost_model.ghost_cost_model(platform) == "flops":
    ghost, per_example = plan.cost
    share = _cost_model.GHOST_FLOPS_SHARE_CPU
    totals = (
      f"the norms' {ghost:.3g} flops per example against {share:g}x the per-example "
      f"gradients' {per_example:.3g}"
    )
    if ghost > share * per_example:
      return None, f"{where}: {totals} exceed it: the loss runs as method='vmap'"
    notes = tuple(
      (
        leaf,
        f"{where}: its {c.rule} rule costs {c.flops:,} flops per example, its per-example "
        f"gradient {c.grad_flops:,} ({totals}: every rule kept)",
      )
      for leaf, c in sorted(costs.items())
    )
    return dataclasses.replace(plan, notes=notes), None
  chosen = {
    leaf: (
      f"{where}: its {c.rule} rule holds {c.floats:,} floats per example, its per-example "
      f"gradient {c.grad_floats:,} (memory first: costs not measured there)"
    )
    for leaf, c in costs.items()
    if c.floats > c.grad_floats
  }
  if len(chosen) == len(costs):
    return None, (
      f"{where}: no layer keeps a ghost rule (each is cheaper instantiated): "
      "the loss runs as method='vmap'"
    )
  notes = tuple(
    (
      leaf,
      f"{where}: its {c.rule} rule holds {c.floats:,} floats per example, its per-example "
      f"gradient {c.grad_floats:,} (memory first: costs not measured there)",
    )
    for leaf, c in sorted(costs.items())
    if leaf not in chosen
  )
  kept = make_plan(plan.sites, plan.num_leaves, plan.unknown, chosen, plan.half) if chosen else plan
  return dataclasses.replace(kept, notes=notes), None


def reported_rules(plan: Plan, num_leaves: int) -> list[tuple[str, str | None]]:
  """``(rule, reason)`` of each parameter leaf, as :func:`jaxclip.ghost_plan` reports them."""
  out: list[tuple[str, str | None]] = [("unused", None)] * num_leaves
  notes = dict(plan.notes)
  for u, k, rule in plan.ghost:
    leaf = plan.sites[u].infos[k].view
    out[leaf] = (rule, notes.get(leaf))
  for (gu, gk), _ in plan.tied:
    leaf = plan.sites[gu].infos[gk].view
    out[leaf] = ("tied", notes.get(leaf))
  chosen = dict(plan.chosen)
  for leaves, bounds in plan.instantiated:
    for i in leaves:
      out[i] = ("instantiate", chosen.get(i) or _fallback_reason(plan.sites, i, bounds))
  return out


def _fallback_reason(sites: Sequence[Site], leaf: int, bounds: Sequence[Boundary]) -> str:
  """Why a leaf's per-example gradient is instantiated, in a few words."""
  mine = [(u, k) for u, k in bounds if leaf in sites[u].infos[k].deps]
  if len(mine) > 1:
    return "used twice" if len(mine) == 2 else f"used {len(mine)} times"
  ((u, k),) = mine
  site, info = sites[u], sites[u].infos[k]
  if len(info.deps) > 1:
    return f"combined with another parameter before `{site.name}`"
  if info.scan_const and (info.view != leaf or site.rules[k] != INSTANTIATE.name):
    return (
      f"a `lax.scan` constant: the same weight is read by `{site.name}` in every iteration "
      "(closed over, not sliced from xs), and only the dot rule takes iterations together"
    )
  if info.view != leaf:
    return f"transformed before `{site.name}`"
  if site.eqn is None:
    return "the loss depends on it without the example"
  return f"used by `{site.name}`, not a {'/'.join(rule.name for rule in _rules.RULES)}"
