"""Ghost norms: the clipped sum, ``sum_b w_b grad_b``, from the captured sites.

Book-keeping (:func:`book_keep`) pulls ``sum_b w_b g_b`` back through each
site (one matmul for a dense layer) and then through the parameters' pass
``h``, with no second pass over the model. A plan that takes its norms in the
backward pass (rematerialised sites) runs a second, weighted backward pass
instead (:func:`two_pass`). With clip groups (per-layer clipping), each leaf
takes its own group's weights. Where the model holds bfloat16 or float16
values, the sum is formed in float32: the weighted output gradients, the
pull-back through each site and through ``h`` are evaluated in float32
(``wide``), so that nothing rounds it to half precision before the noise.
The second backward pass does so too: its forward pass takes float32 copies
of the leaves and evaluates each site in float32, its outputs rounded to
their dtypes (``wide`` in :class:`jaxclip.privacy._ghost._forward.Forward`),
so each site's sum over the batch, and the leaves' gradients, are float32.
The second backward pass's float16 output gradients with weights above 1
(automatic clipping) is scaled by a power of two into float16's range
(:func:`_in_range`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy import _batching
from jaxclip.privacy._ghost import _wide
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._jaxpr import _sites
from jaxclip.privacy._ghost._rules import _conv, _dot, _instantiate, _scale, _scaling
from jaxclip.privacy._ghost._types import Captured, Plan, Site


def kept(cap: Captured, keep: jax.Array) -> Captured:
  """``cap`` with every example not in ``keep`` selected away for the book-keeping.

  Its output gradients (and a tapped site's per-example gradients) become
  zeros, and its float data records copies of the first kept example's: a
  NaN or infinite record at weight 0 would give ``0 * nan = nan`` in the
  pull-back. (Copies of a kept row, not zeros: a site's derivative may be
  infinite at zero data.)
  """
  onehot = _batching.first_onehot(keep)

  def rows(x):
    return keep.reshape((-1,) + (1,) * (x.ndim - 1))

  def zeroed(x):
    return jnp.where(rows(x), x, jnp.zeros((), x.dtype))

  def stood_in(x):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return x
    first = jnp.sum(jnp.where(onehot.reshape(rows(x).shape), x, jnp.zeros((), x.dtype)), axis=0)
    return jnp.where(rows(x), x, first)

  gs = [[zeroed(g) for g in site_gs] for site_gs in cap.gs]
  drecs = [[stood_in(d) for d in site_d] for site_d in cap.drecs]
  return cap._replace(gs=gs, drecs=drecs)


def two_pass(cap: Captured, weights: jax.Array, leaf_groups: Sequence[int] | None) -> list[Any]:
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
  acc = _numerics.accumulation_dtype(x.dtype)
  return (x.astype(acc) * scale.astype(acc)).astype(x.dtype)


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
  wide = cap.wide()
  pulls = [_site_pullback(cap, u, wide)(weights) for u in range(len(cap.sites))]
  (grads,) = _pull(cap, wide)(pulls)
  return [_numerics.upcast_for_accumulation(x) for x in grads]


def _pull(cap: Captured, wide: bool) -> Callable[[list[Any]], Any]:
  """The pull-back of the sites' param inputs to the leaves: ``cap.pull``, or, with half
  precision (``wide``), that of the parameters' pass evaluated in float32 at float32 copies
  of the leaves (:class:`jaxclip.privacy._ghost._capture.WideParamsPass`)."""
  if not wide:
    return cap.pull
  leaves = [_wide.widened(x) for x in cap.leaves]
  return jax.vjp(cap.wide_pass, leaves, has_aux=True)[1]


def _site_pullback(cap: Captured, u: int, wide: bool = False) -> Callable[[jax.Array], list[Any]]:
  """``weights ->`` the cotangents of site ``u``'s param inputs for ``sum_b weights_b g_b``.

  With ``wide`` (a model with half precision), the weighted output gradients
  are formed in float32 and pulled back through the site evaluated in
  float32 (:func:`jaxclip.privacy._ghost._wide.wide_bind`): the sum over
  the batch is taken in float32 and returned so, as
  :func:`_pull` with ``wide`` takes it, never rounded to half precision
  before the noise. A ``dot_general``'s, a scale's or a convolution's
  records are balanced first (:func:`_balance`): no row's weighted ``g`` is
  flushed below the dtype's normal range where its ``a`` is large.
  """
  gs, pvals = cap.gs[u], cap.pvals[u]
  if wide:
    pvals = [_wide.widened(p) for p in pvals]
  if u in cap.tapped:  # the per-example gradients of its param inputs, weighted and summed
    spread = _instantiate.spread if cap.sites[u].summed else lambda x, p: x
    return lambda w: [spread(_weighted_sum(g, w, p), p) for g, p in zip(gs, pvals, strict=True)]
  site, cvals, dvals = cap.sites[u], cap.cvals[u], cap.drecs[u]
  balance = _balance(site, dvals, gs)
  if balance is not None:  # float32 or wider, as the records are where nothing is half precision
    (d,), (g,) = dvals, gs
    d, g = balance(d, g)
    dvals, gs = [d], [g]
  bind = _wide.wide_bind if wide else _jax.bind
  fn = lambda pv: _batched_outputs(site, pv, cvals, dvals, cap.n, cap.spmd_axis_name, bind)
  vjp = _instantiate.site_vjp(site, fn, pvals)
  return lambda w: vjp([_weighted(g, w, wide=wide) for g in gs])[0]


def _balance(
  site: Site, dvals: Sequence[Any], gs: Sequence[Any]
) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None:
  """How the book-keeping balances a site's data records and output gradients before it
  weights them (powers of two, exactly): a ``dot_general`` row by row
  (:func:`jaxclip.privacy._ghost._rules._dot.balanced`), a norm's scale entry by entry
  (:func:`jaxclip.privacy._ghost._rules._scaling.balanced_entries`), a convolution example by
  example (:func:`jaxclip.privacy._ghost._rules._scaling.balanced_examples`); ``None`` for any
  other site (one param input and one floating-point data input only).

  Without it, a row ``|a| ~ 2**123`` against ``|g| ~ 2**-112``, its example clipped hard, has
  its weighted ``g`` flushed to zero where another row's is not, undoing their cancellation: a
  float32 example moved the released sum by up to 4.6 C (``tests/test_ghost_cancel.py``). It
  costs two passes over each such site's records: the zoo's ghost steps took 0.96-1.10x their
  time (``nnx_llama`` and ``eqx_vit`` at B = 128: 1.05x; 28 November 2026, interleaved), the
  compiled memory unchanged but ``linen_lstm``'s at B = 16 (+0.2 MiB). A ``lax.cond`` taking it
  only for batches at risk cost more: a check's pass, and ``linen_cnn``'s step ran 9x slower on
  XLA:CPU with the pull-back inside a conditional.
  """
  params = site.param_positions()
  if site.eqn is None or len(params) != 1 or len(dvals) != 1 or len(gs) != 1:
    return None
  if not jnp.issubdtype(dvals[0].dtype, jnp.floating):
    return None
  if _dot.DOT.matches(site.eqn, site.roles, params[0]):
    return functools.partial(_dot.balanced, site)
  lead = dvals[0].ndim - site.eqn.invars[1 - params[0]].aval.ndim
  if _scale.SCALE.matches(site.eqn, site.roles, params[0]):
    if dvals[0].shape == gs[0].shape:
      return _scaling.balanced_entries
    return lambda d, g: _scaling.balanced_examples(d, g, lead)
  if _conv.CONV.matches(site.eqn, site.roles, params[0]):
    return lambda d, g: _scaling.balanced_examples(d, g, lead)
  return None


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
  wide = cap.wide()
  by_group: list[dict[int, list[Any]]] = []
  for u in range(len(sites)):
    pull, needed = _site_pullback(cap, u, wide), sorted({k for ks in groups_of[u] for k in ks})
    by_group.append({k: pull(weights[:, k]) for k in needed})

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
          like = cap.pvals[u][j]
          cts.append(jnp.zeros_like(_wide.widened(like) if wide else like))
      out.append(cts)
    return out

  grads = [None] * len(cap.leaves)
  pull = _pull(cap, wide)
  for k, taken in pull_passes([ks for per_site in groups_of for ks in per_site], leaf_groups):
    (pulled,) = pull(cotangents(k))
    for i, g in enumerate(leaf_groups):
      if g in taken:
        grads[i] = pulled[i]
  return [_numerics.upcast_for_accumulation(x) for x in grads]


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
  site: Site,
  pvals: Sequence[Any],
  cvals: Sequence[Any],
  dvals: Sequence[Any],
  n: int,
  spmd_axis_name: Any,
  bind: Any = None,
) -> list[Any]:
  """The site's outputs for every example (``dvals`` with a leading batch axis), its equation
  evaluated by ``bind`` (as :func:`jaxclip.privacy._ghost._jaxpr._sites.site_outputs`)."""
  outputs = functools.partial(_sites.site_outputs, bind=bind or _jax.bind)
  if not dvals:  # the site does not see the example: the same outputs for all
    return [jnp.broadcast_to(x, (n,) + jnp.shape(x)) for x in outputs(site, pvals, cvals, [])]
  return jax.vmap(lambda db: outputs(site, pvals, cvals, db), spmd_axis_name=spmd_axis_name)(dvals)


def _weighted_sum(g: jax.Array, weights: jax.Array, like: jax.Array) -> jax.Array:
  """``sum_b weights_b g_b`` in float32 (or wider), in ``like``'s dtype."""
  acc = _numerics.accumulation_dtype(g.dtype)
  w = weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(acc)
  # A sum, not a dot: under an Explicit mesh the batch axis may be sharded.
  return jnp.sum(w * g.astype(acc), axis=0).astype(jnp.result_type(like))


def _weighted(g: jax.Array, weights: jax.Array, wide: bool = False) -> jax.Array:
  """``weights_b g_b`` for every example, in ``g``'s dtype (in float32 or wider if ``wide``)."""
  dtype = _numerics.compute_dtype(g.dtype)
  w = weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(dtype)
  out = g.astype(dtype) * w
  return out if wide else out.astype(g.dtype)
