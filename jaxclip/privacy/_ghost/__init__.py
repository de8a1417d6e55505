"""The ghost engine: per-example gradient norms without per-example gradients.

The engine behind ``per_example_clipped_grad(..., method="ghost")`` and
``"auto"``. It works on the traced jaxpr of one example's loss, so any JAX
model (pure JAX, flax linen or nnx, equinox) is handled without per-framework
layer classes; ``docs/privacy.md`` gives the rules and what they cost.

A *site* is an equation that takes a floating-point value of the parameters
and a value of the batch, such as ``x @ W`` or ``E[ids]``: the loss depends on
the parameters through the sites alone, so for example ``b``

.. math::

  \\nabla_\\theta \\ell_b = \\sum_u J_{h_u}^\\top \\, \\partial_V f_u(V_u, a_{u,b})^\\top g_{u,b}

where ``V_u = h_u(theta)`` is the site's param input, ``a_{u,b}`` its data
input and ``g_{u,b}`` the gradient of the loss with respect to the site's
output. One backward pass gives every ``a`` and ``g``. A parameter used by one
``dot_general``, one embedding lookup (tied to an output head or not) or one
convolution gets its per-example norm from ``a`` and ``g`` alone; every other
parameter has its per-example gradient formed exactly, through its sites
only. The clipped sum is then book-kept from the same ``a`` and ``g``, or, where
a ghost site is rematerialised (float32 models), by a second, weighted pass.

The only way in for the rest of :mod:`jaxclip.privacy`:
``per_example_clipped_grad(method="ghost" | "auto")`` (:func:`trace`,
:func:`plan_for`, :func:`clipped_sum`) and :func:`jaxclip.ghost_plan`'s
report (:func:`leaf_rules`, :func:`leaf_costs`, :func:`report_passes`).
The tests reach further in; nothing else does.

The layout, one step per module:

* ``_types``: the records the steps share (a value's class, a site, a
  boundary, a group of instantiated leaves, what the capture gives); it
  imports none of the steps;
* ``_jaxpr/``: reading the jaxpr, the one place that knows JAX's internals
  (``_internals``: primitive and parameter names, each layout behind one
  accessor), walking it (``_walk``) and finding its sites (``_sites``);
* ``_rules/``: the rule registry (``__init__``) and one file per rule, each
  declaring how it matches a site, its squared norm, its cost, its memory
  and whether it accumulates in the backward pass; ``_instantiate`` is the
  base rule (the per-example gradient, formed through the sites);
* ``_planning``: which rule each leaf gets, and ``"auto"``'s choice between
  a rule and a per-example gradient, by each rule's flops and floats and
  ``_cost_model`` (the platform's weighing);
* ``_forward`` and ``_capture``: one example's evaluation with a zero added
  at each site, each site's ``a`` and ``g`` over a batch, half precision
  evaluated in float32 (``_wide``);
* ``_sumsq``: each example's squared norm by a plan; ``_book``: the clipped
  sum; this module: tracing, and running a plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _sharding
from jaxclip.privacy import _batching
from jaxclip.privacy._clip_factors import Clip, scale_factors
from jaxclip.privacy._ghost import _book, _capture, _planning, _rules
from jaxclip.privacy._ghost._book import mixed_boundaries, pull_passes
from jaxclip.privacy._ghost._capture import Inputs
from jaxclip.privacy._ghost._jaxpr import _sites, _walk
from jaxclip.privacy._ghost._jaxpr._walk import input_infos
from jaxclip.privacy._ghost._planning import leaf_costs, make_plan
from jaxclip.privacy._ghost._rules import _instantiate
from jaxclip.privacy._ghost._sumsq import early_heads, plan_terms, probe_sumsq, probe_tied_head
from jaxclip.privacy._ghost._types import Captured, Plan

__all__ = [
  "METHODS",
  "Traced",
  "clipped_sum",
  "leaf_costs",
  "leaf_rules",
  "plan_for",
  "report_passes",
  "trace",
]

METHODS = ("vmap", "ghost", "auto")


def plan_for(plan: Plan, method: str, platform: str | None) -> tuple[Plan | None, str | None]:
  """The plan ``method`` runs in a program lowered for ``platform``, or ``None`` (and why) for
  ``method="vmap"``'s program.

  ``"ghost"`` takes every rule the analyser found; ``"auto"`` chooses per
  leaf by the platform's cost model (:func:`jaxclip.privacy._ghost._planning.auto_plan`);
  ``"vmap"`` (``"auto"``'s measured pick) none. Each takes ``"vmap"``'s program where the
  loss has a higher-order primitive the engine cannot read (``plan.unknown``).
  """
  if plan.unknown:
    return None, "falls back to method='vmap': " + "; ".join(plan.unknown)
  if method == "vmap":
    return None, "runs as method='vmap'"
  if method == "ghost":
    return plan, None
  return _planning.auto_plan(plan, platform)


def leaf_rules(plan: Plan, method: str, platform: str | None) -> list[tuple[str, str | None]]:
  """``(rule, reason)`` of each parameter leaf, as :func:`jaxclip.ghost_plan` reports them.

  Where ``vmap``'s program is taken, every leaf the loss uses is
  instantiated, the reason saying why (with a higher-order primitive the
  engine cannot read, every leaf: what that primitive uses is not known).
  """
  chosen, why = plan_for(plan, method, platform)
  if chosen is not None:
    return _planning.reported_rules(chosen, plan.num_leaves)
  if plan.unknown:
    return [("instantiate", why)] * plan.num_leaves
  used = {i for s in plan.sites for info in s.infos for i in info.deps}
  return [("instantiate", why) if i in used else ("unused", None) for i in range(plan.num_leaves)]


def report_passes(
  plan: Plan | None, leaf_groups: Sequence[int] | None
) -> tuple[int, int, dict[int, str]]:
  """What :func:`jaxclip.ghost_plan` reports of a plan beside each leaf's rule.

  Args:
    plan: The plan that runs (:func:`plan_for`), or ``None`` for ``vmap``'s program.
    leaf_groups: The clip group of each leaf with per-layer clip norms, else ``None``.

  Returns:
    ``(passes, sum_passes, notes)``: the backward passes of the norms (2 where
    the clipped sum is a second pass), the pull-backs of the clipped sum with
    clip groups, and, for each leaf whose input to a site mixes clip groups,
    a note saying so (its cotangent is pulled back once per group).
  """
  if plan is None:
    return 1, 1, {}
  passes = 2 if plan.two_pass else 1
  if leaf_groups is None:
    return passes, 1, {}
  notes = {}
  for u, k in mixed_boundaries(plan, leaf_groups):
    for i in plan.sites[u].infos[k].deps:
      notes[i] = f"its input to `{plan.sites[u].name}` mixes clip groups: pulled back per group"
  if plan.two_pass:
    return passes, len(set(leaf_groups)), notes
  inputs = [{leaf_groups[i] for i in info.deps} for s in plan.sites for info in s.infos]
  return passes, len(pull_passes(inputs, leaf_groups)), notes


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
  _batching.check_loss(loss_shape, shown=str(loss_shape))
  infos = input_infos([jnp.ndim(x) for x in leaves], batched)
  sites, unknown = _walk.analysis(closed, infos)
  plan = make_plan(sites, len(leaves), unknown, half=_planning.computes_in_half(closed))
  return Traced(closed, out_shape, leaves, params_tree, arg_leaves, batched, plan)


# ----------------------------------------------------------------------------
# The clipped sum
# ----------------------------------------------------------------------------


def clipped_sum(
  traced: Traced,
  plan: Plan,
  clip: Clip,
  mask: jax.Array | None,
  *,
  spmd_axis_name: Any,
) -> tuple[list[jax.Array], jax.Array, tuple[jax.Array, jax.Array], list[Any]]:
  """Per-example norms by ``plan``, each example's weight by ``clip``, then the weighted sum
  of per-example gradients.

  Rows that are not real examples are the caller's to neutralise: it replaces them by
  copies of a real example and gives them ``mask`` False, so that they get weight 0. So
  does an example whose norm is not finite, or which the book-keeping cannot bound
  (:func:`jaxclip.privacy._ghost._book.unbounded`, counted as non-finite); every example
  at weight 0 (in every group) is then *selected* away, not multiplied by 0 (``0 * nan``
  is ``nan``): its output gradients and data records are replaced before the book-keeping
  (:func:`jaxclip.privacy._ghost._book.book_keep`), or a second backward pass runs on a
  batch where such rows are copies of a kept example.

  Args:
    traced: From :func:`trace`, its batched ``arg_leaves`` holding the examples on axis 0.
    plan: The plan to run: ``traced.plan``, or :func:`plan_for`'s choice.
    clip: The call's clip (:class:`jaxclip.privacy._clip_factors.Clip`). With
      groups (per-layer clipping, ``clip.of_leaf``), the norms are
      ``(examples, groups)``, each example's norm over each group's leaves,
      and so are the weights: leaf ``i`` of example ``b`` is weighted by
      ``weights[b, clip.of_leaf[i]]`` (:func:`jaxclip.privacy._ghost._book.book_keep`).
    mask: Which rows are real examples (boolean ``(examples,)``), or ``None`` for all.
    spmd_axis_name: Passed to ``vmap``.

  Returns:
    ``(sum_b weights_b * grad_b leaves, norms, (num_clipped, num_nonfinite), aux leaves)``,
    the sums in float32 (or wider), half precision widened as it enters.
  """
  traced = dataclasses.replace(traced, plan=plan)
  leaf_groups = clip.of_leaf
  cap = _capture.capture(inputs_for(traced, spmd_axis_name), plan.sites)
  sumsq, formed = plan_terms(plan, cap, leaf_groups, clip.num_groups)
  norms = _numerics.safe_sqrt(sumsq)
  floor = None
  if clip.normalize is not None:
    # Each scaled part of a ghost norm is exact or, below the normal range, flushed: the
    # squared norm is under-read by at most tiny per part. Dividing by at least
    # sqrt(parts * tiny / eps) keeps C / norm from lifting such an example past C.
    info = jnp.finfo(_numerics.tree_accumulation_dtype(traced.leaves))
    parts = 2 * (len(plan.sites) + len(traced.leaves)) + 1
    floor = math.sqrt(parts * float(info.tiny) / float(info.eps))
  masked = lambda w: w if mask is None else jnp.where(_batching.rows(mask, w), w, 0)
  weights, counts = scale_factors(norms, clip, mask, floor)
  weights = masked(weights)
  drop = None if plan.two_pass else _book.unbounded(cap, weights, norms, leaf_groups)
  if drop is not None:  # an example the book-keeping cannot bound is dropped, as non-finite
    weights, counts = scale_factors(jnp.where(drop, jnp.inf, norms), clip, mask, floor)
    weights = masked(weights)
  keep = weights != 0
  keep = jnp.any(keep, axis=1) if keep.ndim > 1 else keep
  sums = _instantiate.released_sums(cap, plan.instantiated, formed, weights, keep, leaf_groups)
  if plan.two_pass:  # float32 (or wider) as the second pass forms it
    grads = _two_pass_kept(traced, spmd_axis_name, cap, weights, keep, leaf_groups)
  else:
    grads = _book.book_keep(_book.kept(cap, keep), weights, leaf_groups)
  grads = [sums.get(i, x) for i, x in enumerate(grads)]
  # With no example kept, a stand-in row may hold anything: nothing is released of any.
  any_kept = jnp.any(keep)
  grads = [jnp.where(any_kept, x, jnp.zeros((), x.dtype)) for x in grads]
  return grads, norms, counts, cap.aux


def _two_pass_kept(
  traced: Traced,
  spmd_axis_name: Any,
  cap: Captured,
  weights: jax.Array,
  keep: jax.Array,
  leaf_groups: Sequence[int] | None,
) -> list[Any]:
  """The second, weighted backward pass, with every example not kept selected away.

  The pass of the capture is used when every example is kept; otherwise (a
  NaN example, say: its weight 0 times its NaN is NaN) the batch is run again
  with the rows not kept replaced by the first kept example.
  """

  def as_captured():
    return _book.two_pass(cap, weights, leaf_groups)

  def rerun():
    onehot = _batching.first_onehot(keep)
    clean = [
      jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, _batching.first_real_row(x, onehot))
      if b
      else x
      for x, b in zip(traced.arg_leaves, traced.batched, strict=True)
    ]
    again = _capture.capture(
      inputs_for(dataclasses.replace(traced, arg_leaves=clean), spmd_axis_name), traced.plan.sites
    )
    return _book.two_pass(again, weights, leaf_groups)

  # Two conds, not one: a cond's operands are live until it returns, so one
  # cond over both branches would hold the capture's residuals (the first
  # pass's) through the rerun's own. The first cond is their last use.
  every = jnp.all(keep)
  first = jax.lax.cond(every, as_captured, lambda: _placeholders(jax.eval_shape(as_captured)))
  return jax.lax.cond(every, lambda: first, rerun)


def _placeholders(avals: Sequence[Any]) -> list[Any]:
  """Values of the types of ``avals`` (and their manual axes' variance), never read."""
  return [
    _sharding.cast_varying(jnp.zeros(a.shape, a.dtype), tuple(_sharding.varying_axes(a)))
    for a in avals
  ]


def inputs_for(traced: Traced, spmd_axis_name: Any) -> Inputs:
  """What :func:`jaxclip.privacy._ghost._capture.capture` takes to run ``traced``'s plan.

  Besides the plan's tapped and probed sites: the ghost boundaries whose
  per-example gradients are formed in the backward pass
  (:meth:`jaxclip.privacy._ghost._rules._base.Rule.accumulates`), and the sites that
  take another's output gradient (:func:`jaxclip.privacy._ghost._jaxpr._sites.borrowed`).
  """
  plan = traced.plan
  probes = {u: probe_sumsq(plan.sites[u], k, rule) for u, k, rule in plan.ghost if u in plan.probed}
  accumulated = frozenset(
    u
    for u, k, rule in plan.ghost
    if u not in plan.probed and _rules.get(rule).accumulates(plan.sites[u], k)
  )
  own = [u for u in range(len(plan.sites)) if u not in plan.tapped | plan.probed | accumulated]
  return Inputs(
    traced.closed,
    traced.leaves,
    traced.arg_leaves,
    traced.batched,
    spmd_axis_name,
    plan.tapped,
    probes,
    _sites.borrowed(plan.sites, own),
    accumulated,
    {du: probe_tied_head(plan.sites[du], dk) for du, dk in early_heads(plan)},
  )
