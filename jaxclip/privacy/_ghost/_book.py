"""Ghost norms: the clipped sum, ``sum_b w_b grad_b``, from the captured sites.

Book-keeping (:func:`book_keep`) pulls ``sum_b w_b g_b`` back through each
site (one matmul for a dense layer) and then through the parameters' pass
``h``, with no second pass over the model. A plan that takes its norms in the
backward pass (rematerialised sites) runs a second, weighted backward pass
instead (:func:`two_pass`). With clip groups (per-layer clipping), each leaf
takes its own group's weights. Where the model holds bfloat16 or float16
values, the sum is formed in float32: the weighted output gradients, the
pull-back through each site and through ``h`` are evaluated in float32
(``wide``), so that nothing rounds it to half precision before the noise
(nor overflows float16's range where automatic clipping weights above 1). A
model that computes in half precision never takes the second backward pass
(:func:`jaxclip.privacy._ghost._planning._probed`).
"""

from __future__ import annotations

import functools
import math
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
  taken from the pass weighted by its weights). Float32 (or wider) models only."""
  if leaf_groups is None:
    return cap.weighted(weights)
  out = [None] * len(cap.leaves)
  for k in sorted(set(leaf_groups)):
    grads = cap.weighted(weights[:, k])
    for i, g in enumerate(leaf_groups):
      if g == k:
        out[i] = grads[i]
  return out


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
  pos = _paired(site, dvals, gs)
  if pos is None:
    return None
  if _dot.DOT.matches(site.eqn, site.roles, pos):
    return functools.partial(_dot.balanced, site)
  if _scale.SCALE.matches(site.eqn, site.roles, pos) and dvals[0].shape == gs[0].shape:
    return _scaling.balanced_entries
  lead = _by_example(site, dvals, gs)
  return None if lead is None else lambda d, g: _scaling.balanced_examples(d, g, lead)


def _paired(site: Site, dvals: Sequence[Any], gs: Sequence[Any]) -> int | None:
  """The param position of a site of one param input, one floating-point data record and one
  output gradient (what :func:`_balance` can balance), else ``None``."""
  params = site.param_positions()
  if site.eqn is None or len(params) != 1 or len(dvals) != 1 or len(gs) != 1:
    return None
  return params[0] if jnp.issubdtype(dvals[0].dtype, jnp.floating) else None


def _by_example(site: Site, dvals: Sequence[Any], gs: Sequence[Any]) -> int | None:
  """The records' leading axes (examples, then one per scan) where :func:`_balance` balances
  a site example by example (a convolution, a scale across positions), else ``None``."""
  pos = _paired(site, dvals, gs)
  if pos is None or dvals[0].shape == gs[0].shape:
    return None
  if not any(r.matches(site.eqn, site.roles, pos) for r in (_scale.SCALE, _conv.CONV)):
    return None
  return dvals[0].ndim - site.eqn.invars[1 - pos].aval.ndim


def unbounded(
  cap: Captured, weights: jax.Array, norms: jax.Array, leaf_groups: Sequence[int] | None
) -> jax.Array | None:
  """Which examples a site balanced example by example could move by more than ``2**-20`` of
  what they add (``(examples,)``, shaped to broadcast against ``norms``): the book-keeping
  drops them (weight 0). ``None`` where no site is balanced so.

  Balanced by powers of two (:func:`_scaling.balanced_examples`), such a site's records
  ``d' = d 2**-k`` and weighted output gradients ``g' = w g 2**k`` of one example have largest
  entries ``D`` and ``G``; XLA:CPU flushes a factor, product or partial sum below the normal
  range (``2**-126`` in float32), so the pull-back loses at most ``n (max(D, G) + 1)
  2**-126``, ``n`` the products (at most the sizes of ``d`` and ``g`` multiplied). Rows of one
  example farther apart than the range (``|d| ~ 2**120`` against ``|g| ~ 2**-120`` in one
  row, the other way round in another) leave ``D`` or ``G`` near ``2**120``: such a loss moved
  a bfloat16 sum by ``1.9 C`` (``tests/test_ghost_cancel.py``). It is compared with the
  example's own part of the sum, ``w ||grad||`` (at most its clip): an ordinary example is
  dropped only where that part is below ``2**-60`` or so, where dropping it moves nothing.
  """
  out = None
  for u, site in enumerate(cap.sites):
    lead = None if u in cap.tapped else _by_example(site, cap.drecs[u], cap.gs[u])
    if lead is None:
      continue
    (d,), (g,) = cap.drecs[u], cap.gs[u]
    tops = _scaling.example_tops(d, g, lead)
    md, mg = (x.reshape(d.shape[0], -1) for x in tops)  # (examples, scan iterations)
    w, part = weights, weights * norms
    if leaf_groups is not None:  # the groups of the site's param input
      groups = sorted({leaf_groups[i] for i in site.infos[0].deps})
      w, part = jnp.max(w[:, groups], axis=1), jnp.min(part[:, groups], axis=1)
    k = _scaling.halfway(md, mg)
    big = jnp.maximum(_numerics.times_pow2(md, -k), _numerics.times_pow2(mg, k) * w[:, None])
    n = math.prod(d.shape[1:]) * math.prod(g.shape[1:])  # at least the products
    lost = (jnp.max(big, axis=1) + 1) * (n * 2.0**-106)  # 2**-126 n, against 2**-20 of part
    drop = (part > 0) & ~(lost <= part)
    out = drop if out is None else out | drop
  return None if out is None else _batching.rows(out, norms)


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
