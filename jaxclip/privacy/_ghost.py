"""Per-example gradient norms without per-example gradients (ghost norms).

The engine behind ``per_example_clipped_grad(..., method="ghost")``. It works
on the traced jaxpr of one example's loss, so any JAX model (pure JAX, flax
linen or nnx, equinox) is handled without per-framework layer classes.

Every value of the program is classed as depending on the parameters only
(*param*), on the batch (*data*), or on neither (*const*). A *site* is an
equation that takes a floating-point param value and a data value, such as
``x @ W`` or ``E[ids]``: the loss depends on the parameters through the sites
alone, so for example ``b``

.. math::

  \\nabla_\\theta \\ell_b = \\sum_u J_{h_u}^\\top \\, \\partial_V f_u(V_u, a_{u,b})^\\top g_{u,b}

where ``V_u = h_u(theta)`` is the site's param input, ``a_{u,b}`` its data
input and ``g_{u,b}`` the gradient of the loss with respect to the site's
output. One pass gives every ``a`` and ``g``: the batch's loss is evaluated
(under ``vmap``) with a zero added to each site's output, and differentiated
with respect to those zeros only.

Then, for each example:

* a parameter whose only use is one ``dot_general`` (dense layers, einsums,
  attention projections) gets its norm from ``a`` and ``g`` alone:
  ``||A^T G||^2`` is ``<A A^T, G G^T>`` (``T^2 (C + F)`` flops per example
  for ``T`` rows of ``C`` inputs and ``F`` outputs) or, when that costs more
  than ``A^T G`` (``T C F``), ``A^T G`` formed once per example (the *mixed
  ghost norm* rule);
* a parameter whose only use is an embedding lookup (``E[ids]``,
  ``jnp.take``) gets it from the rows' gradients and the ids:
  ``sum_{t,s} [id_t = id_s] <g_t, g_s>``, repeated tokens included;
* an embedding table also used, transposed, by an output head (tied
  weights) gets both of these plus their cross term,
  ``sum_{t,s} G[s, id_t] <g_t, a_s>``;
* a convolution's kernel gets the ``dot_general`` rule over the input's
  patches (one row per output position), or its per-example gradient formed
  from the site alone, whichever costs less;
* every other parameter (layer-norm scales and biases, weights used twice
  otherwise, anything used through a ``custom_jvp`` or a ``while`` loop) has
  its per-example gradient instantiated exactly, in one per-example pass
  through its sites for all such parameters, in chunks of examples: for
  scales and biases this is a cheap per-example reduction. Where a site's
  param inputs are smaller than its ``g`` and ``a`` (a bias or a scale: one
  row against one per position), the zero goes to those inputs instead, so
  the backward pass gives their per-example gradients and no ``g`` or ``a``
  of that site is held.

A rule applies per use when a parameter's uses read disjoint parts of it:
static slices (a Python loop over ``W[l]``), and the iterations of a
``lax.scan`` over stacked layers, whose body is walked with its ``a`` and
``g`` stacked over the iterations; the squared norms of the parts add. A
weight the scan closes over (read by every iteration: an RNN's
hidden-to-hidden matrix, a block shared by every layer) gets the
``dot_general`` rule with every iteration's rows together. A lookup at ids
that do not depend on the example (``wpe[jnp.arange(T)]``) is a site of its
own and gets the lookup rule with those ids.

The clipped sum is then book-kept: ``sum_b w_b g_{u,b}`` pulled back through
each site (one matmul for a dense layer) and through ``h``, with no second
pass over the model. Book-keeping holds every site's ``a`` and ``g`` until the
norms are known; where a ghost site is rematerialised (``jax.checkpoint``,
flax ``nn.remat``: the model asks for its activations to be recomputed, not
kept), the plan takes two passes instead: each ghost site's norm is taken in
the backward pass where its ``a`` and ``g`` meet (a probe whose gradient is
the norm), and the clipped sum is the gradient of ``sum_b w_b loss_b``.
``method="ghost"`` takes every rule the analysis finds; ``method="auto"``
keeps each leaf's rule or instantiates the leaf, by the cost model of the
platform the program is lowered for
(:func:`jaxclip.privacy._ghost_rules.auto_plan`), and may take
``method="vmap"``'s program for the whole loss (:func:`plan_for`).

The engine is four modules, one per step:

* :mod:`~jaxclip.privacy._ghost_capture`: the sites, and each site's ``a``
  and ``g`` (walkers over the jaxpr);
* :mod:`~jaxclip.privacy._ghost_norms`: each rule's per-example squared
  norm, and the instantiated per-example gradients of the rest;
* :mod:`~jaxclip.privacy._ghost_rules`: which rule each leaf gets, and
  ``"auto"``'s choice between a rule and a per-example gradient;
* this module: tracing, the norms of a plan, and the book-kept clipped sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _sharding
from jaxclip.privacy import _ghost_capture, _ghost_norms, _ghost_rules
from jaxclip.privacy._ghost_capture import Captured, Inputs, analyze, input_infos
from jaxclip.privacy._ghost_rules import Plan, make_plan

__all__ = [
  "Plan",
  "Traced",
  "analyze",
  "clipped_sum",
  "input_infos",
  "leaf_rules",
  "make_plan",
  "plan_for",
  "trace",
]

METHODS = ("vmap", "ghost", "auto")


def plan_for(plan: Plan, method: str, platform: str | None) -> tuple[Plan | None, str | None]:
  """The plan ``method`` runs in a program lowered for ``platform``, or ``None`` (and why) for
  ``method="vmap"``'s program.

  ``"ghost"`` takes every rule the analyser found; ``"auto"`` chooses per
  leaf by the platform's cost model (:func:`jaxclip.privacy._ghost_rules.auto_plan`).
  Either takes ``"vmap"``'s program where the loss has a higher-order
  primitive the engine cannot read (``plan.unknown``): what it uses is not
  known.
  """
  if plan.unknown:
    return None, "falls back to method='vmap': " + "; ".join(plan.unknown)
  if method == "ghost":
    return plan, None
  return _ghost_rules.auto_plan(plan, platform)


def leaf_rules(plan: Plan, method: str, platform: str | None) -> list[tuple[str, str | None]]:
  """``(rule, reason)`` of each parameter leaf, as :func:`jaxclip.ghost_plan` reports them.

  Where ``vmap``'s program is taken, every leaf the loss uses is
  instantiated, the reason saying why (with a higher-order primitive the
  engine cannot read, every leaf: what that primitive uses is not known).
  """
  chosen, why = plan_for(plan, method, platform)
  if chosen is not None:
    return _ghost_rules.leaf_rules(chosen, plan.num_leaves)
  if plan.unknown:
    return [("instantiate", why)] * plan.num_leaves
  used = {i for s in plan.sites for info in s.infos for i in info.deps}
  return [("instantiate", why) if i in used else ("unused", None) for i in range(plan.num_leaves)]


# ----------------------------------------------------------------------------
# Tracing
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Traced:
  """One example's loss, traced for the ghost pass.

  Attributes:
    closed: The ``ClosedJaxpr`` over ``leaves + arg_leaves`` (the loss first,
      then any aux leaves).
    out_shape: What the loss returns, as shapes.
    leaves: The parameter leaves.
    params_tree: Their tree structure.
    arg_leaves: The argument leaves that are arrays (the others, shared
      non-arrays such as ``True`` or a string, are baked into ``closed``).
    batched: Which of ``arg_leaves`` carry the examples on axis 0.
    plan: From :func:`make_plan`.
  """

  closed: Any
  out_shape: Any
  leaves: list[jax.Array]
  params_tree: Any
  arg_leaves: list[Any]
  batched: list[bool]
  plan: Plan


def _is_static(x: Any) -> bool:
  """Whether a shared argument leaf is not an array (``True``, a string): passed as is."""
  return not isinstance(x, (jax.Array, np.ndarray, np.generic))


def _example_aval(x: Any, batched: bool) -> Any:
  """What the traced loss takes for an argument leaf: one example's shape.

  Inside ``shard_map`` the jaxpr must keep the axes each value varies over
  (and record the casts they need): it is then traced on the first example
  itself.
  """
  if _sharding.varying_axes(x):
    return x[0] if batched else x
  shape = x.shape[1:] if batched else x.shape
  return jax.ShapeDtypeStruct(shape, x.dtype, weak_type=jax.typeof(x).weak_type)


def trace(
  example_loss: Callable[..., Any],
  params: Any,
  args: Sequence[Any],
  batch_idx: Sequence[int],
  *,
  has_aux: bool,
) -> Traced:
  """Traces one example's loss and plans each parameter's rule.

  Args:
    example_loss: ``example_loss(params, *args)`` for one example.
    params: The parameters (a pytree of real arrays).
    args: The arguments, those at ``batch_idx`` with a leading batch axis.
    batch_idx: Positions in ``args`` of the batched arguments.
    has_aux: Whether ``example_loss`` returns ``(loss, aux)``.
  """
  leaves, params_tree = jax.tree.flatten(params)
  if any(jnp.issubdtype(jnp.result_type(x), jnp.complexfloating) for x in leaves):
    raise ValueError(
      "per_example_clipped_grad(method='ghost') takes real parameters only; "
      "use method='vmap' for complex ones."
    )
  flat, args_tree = jax.tree.flatten(list(args))
  which = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
  static = {
    j: x
    for j, (x, i) in enumerate(zip(flat, which, strict=True))
    if i not in batch_idx and _is_static(x)
  }
  arg_leaves = [jnp.asarray(x) for j, x in enumerate(flat) if j not in static]
  batched = [i in batch_idx for j, i in enumerate(which) if j not in static]

  def flat_loss(ls, xs):
    it = iter(xs)
    full = [static[j] if j in static else next(it) for j in range(len(flat))]
    return example_loss(jax.tree.unflatten(params_tree, ls), *jax.tree.unflatten(args_tree, full))

  closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(
    leaves, [_example_aval(x, b) for x, b in zip(arg_leaves, batched, strict=True)]
  )
  loss_shape = out_shape[0] if has_aux else out_shape
  if jnp.shape(loss_shape) or not jnp.issubdtype(loss_shape.dtype, jnp.floating):
    raise ValueError(
      "per_example_clipped_grad needs loss_fn to return a real scalar for one example, "
      f"got {loss_shape}."
    )
  infos = input_infos([jnp.ndim(x) for x in leaves], batched)
  sites, unknown = _ghost_capture.analysis(closed, infos)
  plan = make_plan(sites, len(leaves), unknown)
  return Traced(closed, out_shape, leaves, params_tree, arg_leaves, batched, plan)


# ----------------------------------------------------------------------------
# The clipped sum
# ----------------------------------------------------------------------------


def clipped_sum(
  traced: Traced,
  weights_fn: Callable[[jax.Array], tuple[jax.Array, Any]],
  *,
  spmd_axis_name: Any,
  leaf_groups: Sequence[int] | None = None,
  num_groups: int | None = None,
) -> tuple[list[jax.Array], jax.Array, Any, list[Any]]:
  """Per-example norms, then the weighted sum of per-example gradients.

  Rows that are not real examples are the caller's to neutralise: it
  replaces them by copies of a real example and ``weights_fn`` gives them
  weight 0, so their output gradients (finite) drop out of the book-keeping
  with no copy of ``g`` masked.

  Args:
    traced: From :func:`trace`, its batched ``arg_leaves`` holding the
      examples on axis 0.
    weights_fn: Maps the per-example norms to ``(weights, extra)``.
    spmd_axis_name: Passed to ``vmap``.
    leaf_groups: The clip group of each parameter leaf (per-layer clipping),
      or ``None`` for one group. With groups, the norms are ``(examples,
      groups)``, each example's norm over each group's leaves, and so are the
      weights: leaf ``i`` of example ``b`` is weighted by
      ``weights[b, leaf_groups[i]]`` (:func:`book_keep`).
    num_groups: How many groups (some may hold no leaf); ``None``: those
      ``leaf_groups`` names.

  Returns:
    ``(sum_b weights_b * grad_b leaves, norms, extra, aux leaves)``, the sums
    in float32 (or wider).
  """
  plan = traced.plan
  probes = {
    u: _probe_sumsq(plan.sites[u], k, rule) for u, k, rule in plan.ghost if u in plan.probed
  }
  inputs = Inputs(
    traced.closed,
    traced.leaves,
    traced.arg_leaves,
    traced.batched,
    spmd_axis_name,
    plan.tapped,
    probes,
  )
  cap = _ghost_capture.capture(inputs, plan.sites)
  norms = _numerics.safe_sqrt(plan_sumsq(plan, cap, leaf_groups, num_groups))
  weights, extra = weights_fn(norms)
  if plan.two_pass:
    grads = _two_pass(cap, weights, leaf_groups)
    grads = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in grads]
  else:
    grads = book_keep(cap, weights, leaf_groups)
  return grads, norms, extra, cap.aux


def _two_pass(cap: Captured, weights: jax.Array, leaf_groups: Sequence[int] | None) -> list[Any]:
  """The second, weighted backward pass; with clip groups, one per group (each group's leaves
  taken from the pass weighted by its weights)."""
  half = any(_is_float16(x) for x in cap.leaves)

  def weighted(w):
    w, scale = _in_range(w, half)
    return [_rescaled(x, scale) for x in cap.weighted(w)]

  if leaf_groups is None:
    return weighted(weights)
  out = [None] * len(cap.leaves)
  for k in sorted(set(leaf_groups)):
    grads = weighted(weights[:, k])
    for i, g in enumerate(leaf_groups):
      if g == k:
        out[i] = grads[i]
  return out


def _is_float16(x: Any) -> bool:
  return jnp.result_type(x) == jnp.float16


def _in_range(
  weights: jax.Array, half: bool, gs: Sequence[jax.Array] = ()
) -> tuple[jax.Array, jax.Array | None]:
  """``(weights / s, s)`` for float16 book-keeping, ``s`` a power of two (at least 1);
  ``(weights, None)`` otherwise.

  Automatic clipping's weights exceed 1 (up to ``C / gamma``): multiplied into
  float16 output gradients they could overflow float16's range (65504).
  Scaled by a power of two, the pull-back stays in range and is scaled back
  in float32 after (:func:`_rescaled`). With the output gradients ``gs``,
  ``s`` brings the largest weighted entry to at most ``2**14`` (so the other
  examples' weights keep float16's precision); without, the largest weight to
  at most 1. For clipping's weights (at most 1) and output gradients below
  ``2**14``, ``s`` is 1 and nothing changes.
  """
  if not half:
    return weights, None
  top = jnp.max(weights)
  gs = [g for g in gs if all(d != 0 for d in g.shape[1:])]
  if gs:
    peak = [jnp.max(jnp.abs(g.astype(weights.dtype)).reshape(g.shape[0], -1), axis=1) for g in gs]
    top = jnp.max(weights * jnp.max(jnp.stack(peak), axis=0)) / 2.0**14
  exponent = jnp.minimum(jnp.ceil(jnp.log2(jnp.maximum(top, 1))), 127)
  scale = jnp.exp2(exponent).astype(weights.dtype)
  return weights / scale, scale


def _rescaled(x: jax.Array, scale: jax.Array | None) -> jax.Array:
  """``x * scale`` formed in float32 (or wider), in ``x``'s dtype; ``x`` for ``None``."""
  if scale is None:
    return x
  acc = jnp.promote_types(x.dtype, jnp.float32)
  return (x.astype(acc) * scale.astype(acc)).astype(x.dtype)


def plan_sumsq(
  plan: Plan,
  cap: Captured,
  leaf_groups: Sequence[int] | None = None,
  num_groups: int | None = None,
) -> jax.Array:
  """Each example's squared gradient norm, by the plan's rules.

  With ``leaf_groups`` (the clip group of each leaf), ``(examples, groups)``:
  each example's squared norm over each group's leaves. A ghost rule's or a
  tied table's term belongs to its one leaf's group; the instantiated leaves
  are summed per group (:func:`jaxclip.privacy._ghost_norms.instantiated_sumsq`).
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
    parts[g] = parts[g] + _rule_sumsq(cap, u, k, rule).astype(acc)
  for pair in plan.tied:
    (gu, gk), _ = pair
    g = group(plan.sites[gu].infos[gk].view)
    parts[g] = parts[g] + _tied_sumsq(cap, pair).astype(acc)
  for inst in plan.groups:
    if leaf_groups is None:
      parts[0] = parts[0] + _ghost_norms.instantiated_sumsq(inst, cap).astype(acc)
      continue
    per_group = _ghost_norms.instantiated_sumsq(inst, cap, leaf_groups, num).astype(acc)
    parts = [p + per_group[:, j] for j, p in enumerate(parts)]
  if leaf_groups is None:
    return parts[0]
  # A group no term reached: zeros sharded as the others (under an Explicit mesh).
  reached = [p for p, z in zip(parts, zeros, strict=True) if p is not z]
  return jnp.stack(
    [
      jnp.zeros_like(reached[0]) if p is z and reached else p
      for p, z in zip(parts, zeros, strict=True)
    ],
    axis=1,
  )


def _site_rule(site: _ghost_capture.Site, k: int, rule: str) -> Callable[..., jax.Array]:
  """``(kernel, a, g) -> ||grad||^2`` of a ghost boundary, per example (leading batch axis).

  ``kernel`` (the param input) is read by the ``conv`` rule only.
  """
  if rule == "dot":
    pos, shared = site.param_positions()[k], len(site.infos[k].shared)
    return lambda w, a, g: _ghost_norms.dot_sumsq(site, pos, a, g, shared)
  if rule == "conv":
    return lambda w, a, g: _ghost_norms.conv_sumsq(site, w, a, g)
  return lambda w, ids, g: _ghost_norms.gather_sumsq(site, ids, g)


def _rule_sumsq(cap: Captured, u: int, k: int, rule: str) -> jax.Array:
  """A ghost boundary's squared norms, summed over its scan iterations.

  A lookup of fixed rows (``wpe[jnp.arange(T)]``) records no data: its ids are
  its const input, the same for every example.
  """
  site, g = cap.sites[u], cap.gs[u][0]
  a = cap.drecs[u][0] if cap.drecs[u] else _repeat(cap.cvals[u][0], cap.n)
  fn = _site_rule(site, k, rule)
  if rule == "conv":
    kernel = _repeat(cap.pvals[u][k], cap.n)
    return _ghost_norms.per_iteration(site, fn, kernel, a, g)
  shared = site.infos[k].shared
  return _ghost_norms.per_iteration(site, lambda a, g: fn(None, a, g), a, g, shared=shared)


def _repeat(x: jax.Array, n: int) -> jax.Array:
  return jnp.broadcast_to(x, (n,) + jnp.shape(x))


def _probe_sumsq(site: _ghost_capture.Site, k: int, rule: str) -> Callable[..., jax.Array]:
  """``(pvals, dvals, gs) -> ||grad||^2`` of a ghost site, for one example and one iteration.

  The rules take a leading batch axis; inside the backward pass (under the
  batch's ``vmap``) the site's values are one example's.
  """
  fn, one = _site_rule(site, k, rule), lambda x: x[None]
  return lambda pv, dv, gs: fn(one(pv[k]), one(dv[0]), one(gs[0]))[0]


def _tied_sumsq(cap: Captured, pair: _ghost_rules.Tied) -> jax.Array:
  """A tied table's squared norms: its lookup's, its head's and twice their cross term."""
  (gu, _), (du, dk) = pair
  lookup, head = cap.sites[gu], cap.sites[du]
  pos = head.param_positions()[dk]
  ids, rows, a, g = cap.drecs[gu][0], cap.gs[gu][0], cap.drecs[du][0], cap.gs[du][0]
  return (
    _ghost_norms.gather_sumsq(lookup, ids, rows)
    + _ghost_norms.dot_sumsq(head, pos, a, g)
    + 2 * _ghost_norms.tied_cross(lookup, ids, rows, head, pos, a, g)
  )


def book_keep(
  cap: Captured, weights: jax.Array, leaf_groups: Sequence[int] | None = None
) -> list[jax.Array]:
  """``sum_b w_b grad_b``: ``sum_b w_b g_b`` pulled back through each site, then through ``h``.

  With ``leaf_groups`` (per-layer clipping) ``weights`` is ``(examples,
  groups)`` and leaf ``i`` takes ``weights[:, leaf_groups[i]]``
  (:func:`_book_keep_groups`).
  """
  if leaf_groups is not None:
    return _book_keep_groups(cap, weights, leaf_groups)
  cts = []
  for u, site in enumerate(cap.sites):  # every site has a float output
    if u in cap.tapped:  # the per-example gradients of its param inputs, weighted and summed
      pairs = zip(cap.gs[u], cap.pvals[u], strict=True)
      cts.append([_weighted_sum(g, weights, p) for g, p in pairs])
      continue
    ws, scale = _in_range(weights, any(_is_float16(g) for g in cap.gs[u]), cap.gs[u])
    wg = [_weighted(g, ws) for g in cap.gs[u]]
    fn = lambda pv, site=site, c=cap.cvals[u], d=cap.drecs[u]: _batched_outputs(
      site, pv, c, d, cap.n, cap.spmd_axis_name
    )
    vjp = _ghost_norms.site_vjp(site, fn, cap.pvals[u])
    cts.append([_rescaled(x, scale) for x in vjp(wg)[0]])
  (grads,) = cap.pull(cts)
  return [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in grads]


def mixed_boundaries(plan: Plan, leaf_groups: Sequence[int]) -> list[tuple[int, int]]:
  """The boundaries ``(site, position)`` whose param input depends on leaves of several clip
  groups (such as ``W1 + W2`` with ``W1`` and ``W2`` in different groups).

  Book-keeping cannot weight such an input once per group: its cotangent is
  pulled back to the leaves once per group, weighted by that group's weights,
  each group keeping its own leaves' share (:func:`_book_keep_groups`). The
  leaves themselves are always instantiated (they meet at a value), so their
  per-group norms are exact.
  """
  return [
    (u, k)
    for u, s in enumerate(plan.sites)
    for k, info in enumerate(s.infos)
    if len({leaf_groups[i] for i in info.deps}) > 1
  ]


def _book_keep_groups(
  cap: Captured, weights: jax.Array, leaf_groups: Sequence[int]
) -> list[jax.Array]:
  """:func:`book_keep` with a weight per example and clip group.

  Each site's output gradients are weighted once per group among its param
  inputs' leaves and pulled back through the site, each param input keeping
  the cotangent of its own group. One pull-back to the leaves serves every
  group that no param input mixes with another (its leaves receive
  cotangents only from inputs of their own group); each group that one does
  gets a pull-back of its own (:func:`pull_passes`).
  """
  sites = cap.sites
  groups_of = [
    [sorted({leaf_groups[i] for i in info.deps}) for info in site.infos] for site in sites
  ]
  # per site: {group: cotangents of every param input weighted by that group}
  by_group: list[dict[int, list[Any]]] = []
  for u, site in enumerate(sites):
    needed = sorted({k for ks in groups_of[u] for k in ks})
    if u in cap.tapped:
      by_group.append(
        {
          k: [
            _weighted_sum(g, weights[:, k], p) for g, p in zip(cap.gs[u], cap.pvals[u], strict=True)
          ]
          for k in needed
        }
      )
      continue
    fn = lambda pv, site=site, c=cap.cvals[u], d=cap.drecs[u]: _batched_outputs(
      site, pv, c, d, cap.n, cap.spmd_axis_name
    )
    vjp = _ghost_norms.site_vjp(site, fn, cap.pvals[u])
    half = any(_is_float16(g) for g in cap.gs[u])

    def pulled(w, vjp=vjp, gs=cap.gs[u], half=half):
      w, scale = _in_range(w, half, gs)
      return [_rescaled(x, scale) for x in vjp([_weighted(g, w) for g in gs])[0]]

    by_group.append({k: pulled(weights[:, k]) for k in needed})

  def cotangents(k):
    """Each param input's cotangent in the pull-back of group ``k`` (``None``: each input of
    one group weighted by it; zeros for an input that mixes groups)."""
    out = []
    for u in range(len(sites)):
      cts = []
      for j, ks in enumerate(groups_of[u]):
        own = k if k is not None else (ks[0] if len(ks) == 1 else None)
        if own is not None and own in ks:
          cts.append(by_group[u][own][j])
        else:
          cts.append(jnp.zeros_like(cap.pvals[u][j]))
      out.append(cts)
    return out

  grads = [None] * len(cap.leaves)
  for k, taken in pull_passes([ks for per_site in groups_of for ks in per_site], leaf_groups):
    (pulled,) = cap.pull(cotangents(k))
    for i, g in enumerate(leaf_groups):
      if g in taken:
        grads[i] = pulled[i]
  return [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in grads]


def pull_passes(
  input_groups: Sequence[Sequence[int]], leaf_groups: Sequence[int]
) -> list[tuple[int | None, frozenset[int]]]:
  """The pull-backs of a per-group book-keeping: ``(group, groups whose leaves it gives)``.

  ``input_groups`` holds the clip groups of each param input's leaves. A
  group none of whose leaves meets another group's at an input is served by
  one shared pull-back (``None``: each input weighted by its own group);
  each group that does meet another gets a pull-back of its own, every input
  touching it weighted by its weights.
  """
  mixed = frozenset(k for ks in input_groups if len(ks) > 1 for k in ks)
  rest = frozenset(leaf_groups) - mixed
  return ([(None, rest)] if rest else []) + [(k, frozenset({k})) for k in sorted(mixed)]


def _batched_outputs(
  site: _ghost_capture.Site,
  pvals: Sequence[Any],
  cvals: Sequence[Any],
  dvals: Sequence[Any],
  n: int,
  spmd_axis_name: Any,
) -> list[Any]:
  """The site's outputs for every example (``dvals`` with a leading batch axis)."""
  outputs = _ghost_capture.site_outputs
  if not dvals:  # the site does not see the example: the same outputs for all
    return [jnp.broadcast_to(x, (n,) + jnp.shape(x)) for x in outputs(site, pvals, cvals, [])]
  return jax.vmap(lambda db: outputs(site, pvals, cvals, db), spmd_axis_name=spmd_axis_name)(dvals)


def _weighted_sum(g: jax.Array, weights: jax.Array, like: jax.Array) -> jax.Array:
  """``sum_b weights_b g_b`` in float32 (or wider), in ``like``'s dtype."""
  acc = jnp.promote_types(g.dtype, jnp.float32)
  w = weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(acc)
  # A sum, not a dot: under an Explicit mesh the batch axis may be sharded.
  return jnp.sum(w * g.astype(acc), axis=0).astype(jnp.result_type(like))


def _weighted(g: jax.Array, weights: jax.Array) -> jax.Array:
  dtype = _numerics.compute_dtype(g.dtype)
  w = weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(dtype)
  return (g.astype(dtype) * w).astype(g.dtype)
