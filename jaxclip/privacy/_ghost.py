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
``g`` stacked over the iterations; the squared norms of the parts add.

The clipped sum is then book-kept: ``sum_b w_b g_{u,b}`` pulled back through
each site (one matmul for a dense layer) and through ``h``, with no second
pass over the model. Book-keeping holds every site's ``a`` and ``g`` until the
norms are known; where a ghost site is rematerialised (``jax.checkpoint``,
flax ``nn.remat``: the model asks for its activations to be recomputed, not
kept), the plan takes two passes instead: each ghost site's norm is taken in
the backward pass where its ``a`` and ``g`` meet (a probe whose gradient is
the norm), and the clipped sum is the gradient of ``sum_b w_b loss_b``.
Where the plan's norms cost more than a share ``_VMAP_RATIO`` of forming
every per-example gradient (long sequences of narrow layers), the caller
forms per-example gradients instead.

The engine is four modules, one per step:

* :mod:`~jaxclip.privacy._ghost_capture`: the sites, and each site's ``a``
  and ``g`` (walkers over the jaxpr);
* :mod:`~jaxclip.privacy._ghost_norms`: each rule's per-example squared
  norm, and the instantiated per-example gradients of the rest;
* :mod:`~jaxclip.privacy._ghost_rules`: which rule each leaf gets;
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
  "falls_back",
  "input_infos",
  "make_plan",
  "trace",
]

# The ghost pass is used when its norms cost at most this share of the flops
# of every per-example gradient (it also pays a book-keeping pass that vmap
# does not); above it, the per-example gradients are formed (method="vmap").
# Measured on XLA:CPU (benchmarks/ghost_zoo.md and ghost.md, ghost forced
# against vmap): at shares 0.79 (linen nn.scan(nn.remat) GPT, two passes) and
# 0.81 (equinox ViT) ghost took 0.73-1.01x vmap's time; at 1.0 (linen ResNet)
# 1.04-1.27x, and at 1.06 (the benchmark GPT at T=128) 1.10-1.13x.
_VMAP_RATIO = 0.9


def falls_back(plan: Plan) -> bool:
  """Whether ``method="ghost"`` forms per-example gradients as ``method="vmap"`` does.

  Where the loss has a higher-order primitive the engine cannot read
  (``plan.unknown``), or where per-example gradients cost less.
  """
  return bool(plan.unknown) or vmap_cheaper(plan)


def vmap_cheaper(plan: Plan) -> bool:
  """Whether per-example gradients (``method="vmap"``) cost less than ``plan``.

  The ghost pass also pays a book-keeping pass about as costly as the
  non-private gradient's weight gradients, which ``vmap`` does not, so it wins
  only well below ``_VMAP_RATIO``.
  """
  ghost, per_example = plan.cost
  return ghost > _VMAP_RATIO * per_example


def leaf_rules(plan: Plan, num_leaves: int) -> list[tuple[str, str | None]]:
  """``(rule, reason)`` of each parameter leaf, as :func:`jaxclip.ghost_plan` reports them.

  With a higher-order primitive the engine cannot read, every leaf is
  instantiated (as under ``method="vmap"``: what that primitive uses is not
  known), the reason naming it.
  """
  if plan.unknown:
    why = "falls back to method='vmap': " + "; ".join(plan.unknown)
    return [("instantiate", why)] * num_leaves
  if not vmap_cheaper(plan):
    return _ghost_rules.leaf_rules(plan, num_leaves)
  ghost, per_example = plan.cost
  why = (
    f"cheaper to instantiate: the ghost norms' {ghost:.3g} flops per example exceed "
    f"{_VMAP_RATIO:g}x the per-example gradients' {per_example:.3g}"
  )
  used = {i for s in plan.sites for info in s.infos for i in info.deps}
  return [("instantiate", why) if i in used else ("unused", None) for i in range(num_leaves)]


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
  norms = _numerics.safe_sqrt(plan_sumsq(plan, cap))
  weights, extra = weights_fn(norms)
  if plan.two_pass:
    grads = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in cap.weighted(weights)]
  else:
    grads = book_keep(cap, weights)
  return grads, norms, extra, cap.aux


def plan_sumsq(plan: Plan, cap: Captured) -> jax.Array:
  """Each example's squared gradient norm, by the plan's rules."""
  acc = _numerics.tree_accumulation_dtype(cap.leaves)  # as method="vmap" sums squares
  sumsq = jnp.zeros((cap.n,), acc)
  for u, k, rule in plan.ghost:
    if u in plan.probed:  # taken in the backward pass, per scan iteration
      part = cap.gs[u][0]
      sumsq = sumsq + jnp.sum(part.reshape(cap.n, -1), axis=1).astype(acc)
      continue
    sumsq = sumsq + _rule_sumsq(cap, u, k, rule).astype(acc)
  for pair in plan.tied:
    sumsq = sumsq + _tied_sumsq(cap, pair).astype(acc)
  for group in plan.groups:
    sumsq = sumsq + _ghost_norms.instantiated_sumsq(group, cap).astype(acc)
  return sumsq


def _site_rule(site: _ghost_capture.Site, k: int, rule: str) -> Callable[..., jax.Array]:
  """``(kernel, a, g) -> ||grad||^2`` of a ghost boundary, per example (leading batch axis).

  ``kernel`` (the param input) is read by the ``conv`` rule only.
  """
  if rule == "dot":
    pos = site.param_positions()[k]
    return lambda w, a, g: _ghost_norms.dot_sumsq(site, pos, a, g)
  if rule == "conv":
    return lambda w, a, g: _ghost_norms.conv_sumsq(site, w, a, g)
  return lambda w, ids, g: _ghost_norms.gather_sumsq(site, ids, g)


def _rule_sumsq(cap: Captured, u: int, k: int, rule: str) -> jax.Array:
  """A ghost boundary's squared norms, summed over its scan iterations."""
  site, a, g = cap.sites[u], cap.drecs[u][0], cap.gs[u][0]
  fn = _site_rule(site, k, rule)
  if rule == "conv":
    kernel = jnp.broadcast_to(cap.pvals[u][k], (cap.n,) + jnp.shape(cap.pvals[u][k]))
    return _ghost_norms.per_iteration(site, fn, kernel, a, g)
  return _ghost_norms.per_iteration(site, lambda a, g: fn(None, a, g), a, g)


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


def book_keep(cap: Captured, weights: jax.Array) -> list[jax.Array]:
  """``sum_b w_b grad_b``: ``sum_b w_b g_b`` pulled back through each site, then through ``h``."""
  cts = []
  for u, site in enumerate(cap.sites):  # every site has a float output
    if u in cap.tapped:  # the per-example gradients of its param inputs, weighted and summed
      pairs = zip(cap.gs[u], cap.pvals[u], strict=True)
      cts.append([_weighted_sum(g, weights, p) for g, p in pairs])
      continue
    wg = [_weighted(g, weights) for g in cap.gs[u]]
    fn = lambda pv, site=site, c=cap.cvals[u], d=cap.drecs[u]: _batched_outputs(
      site, pv, c, d, cap.n, cap.spmd_axis_name
    )
    vjp = _ghost_norms.site_vjp(site, fn, cap.pvals[u])
    cts.append(vjp(wg)[0])
  (grads,) = cap.pull(cts)
  return [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in grads]


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
