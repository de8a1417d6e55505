"""Ghost norms: the per-example gradients of the parameters no rule covers.

Leaves no rule covers (layer-norm scales, biases, a weight used twice) are
instantiated together (:class:`~jaxclip.privacy._ghost._types.Instantiated`): each
example's gradient of their boundaries (the sites' param inputs) is
formed through those sites only, from their recorded ``a`` and ``g`` (or
taken in the backward pass, a tapped site), in chunks of examples, and
pulled back to the leaves. The norms are read from these gradients, and the
clipped sum adds these same gradients, weighted (:func:`released_sums`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _shapes
from jaxclip.privacy._ghost._jaxpr import _sites
from jaxclip.privacy._ghost._rules._base import Rule
from jaxclip.privacy._ghost._types import Boundary, Captured, Instantiated, Site

# Elements of per-example gradients one chunk of the instantiated leaves may hold at once.
_CHUNK_ELEMENTS = 1 << 24


def _sq(x: jax.Array) -> jax.Array:
  """One example's ``sum |x|^2``, scaled on the way (neither flushed nor overflowed)."""
  x = _numerics.upcast_for_accumulation(x)
  e = _numerics.scale_exponent(jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), x.dtype))
  return _numerics.times_pow2(jnp.sum(_numerics.abs_sq(_numerics.times_pow2(x, -e))), 2 * e)


def disjoint_views(
  sites: Sequence[Site], leaf: int, bounds: Sequence[Boundary], summed: frozenset[int] = frozenset()
) -> bool:
  """Whether every use of the leaf is a view of its own part of it, in the same scans.

  A use shared by a scan's iterations counts as one where its site is in
  ``summed`` (its gradient summed over them in the backward pass).
  """
  infos = [sites[u].infos[k] for u, k in bounds]
  return (
    bool(infos)
    and all(
      i.view == leaf and i.deps == {leaf} and (not i.shared or u in summed)
      for i, (u, _) in zip(infos, bounds, strict=True)
    )
    and len({sites[u].stack for u, _ in bounds}) == 1
    and all(_sites.disjoint(a, b) for j, a in enumerate(infos) for b in infos[j + 1 :])
  )


def _booked(cap: Captured, inst: Instantiated) -> frozenset[int]:
  """The leaves whose uses' per-example gradients are taken in the backward pass (tapped) and
  placed in them by views of disjoint parts (a bias, a scale, a slice per scan iteration):
  their norms are those of their uses' gradients summed, and their clipped sum is those same
  gradients weighted and summed, placed by the views (exactly): by the book-keeping, or by
  :func:`released_sums` in a two-pass plan. The others' gradients are pulled back to them per
  example."""
  sites = cap.sites
  summed = frozenset(u for u in cap.tapped if sites[u].summed)
  out = set()
  for i in inst.leaves:
    bounds = [(u, k) for u, k in inst.bounds if i in sites[u].infos[k].deps]
    if all(u in cap.tapped for u, _ in bounds) and disjoint_views(sites, i, bounds, summed):
      out.add(i)
  return frozenset(out)


def instantiated_grads(
  inst: Instantiated, cap: Captured, leaf_groups: Sequence[int] | None = None, num_groups: int = 1
) -> tuple[jax.Array, list[int], list[jax.Array]]:
  """Per-example squared norms of the instantiated leaves' gradients, and those gradients.

  Each example's gradient of the instantiated leaves is formed (in chunks
  of examples) and its squared norm read from it; the clipped sum releases
  these very gradients, weighted (:func:`released_sums`), so an example adds
  at most its clip to it whatever rounding formed them. (Released otherwise,
  pulled back from the batch's weighted output gradients, an example whose
  rows cancel could be read as their small formed rest while the sum's own
  rounding of its large rows moved it by far more than the clip.) A leaf the
  book-keeping already releases so (:func:`_booked`) keeps its uses'
  gradients, with no pull-back to it.

  With ``leaf_groups`` (the clip group of each parameter leaf), the norms
  are ``(examples, num_groups)``: each leaf's squared norm goes to its clip
  group's column.

  Returns:
    ``(sumsq, leaves, grads)``: the squared norms, and the leaves whose
    per-example gradients (leading batch axis) ``grads`` holds, in order.
  """
  sites = cap.sites
  booked = _booked(cap, inst)
  pulled = [i for i in inst.leaves if i not in booked]
  by_site: dict[int, list[int]] = {}
  for u, k in inst.bounds:
    by_site.setdefault(u, []).append(k)
  order = [(u, k) for u, ks in by_site.items() for k in ks if not sites[u].infos[k].deps <= booked]
  pull = _boundary_pull(cap, pulled, order) if pulled else None

  def per_example(xs):
    ds, gg = xs
    cts, total = [], jnp.zeros((), jnp.float32)
    if leaf_groups is not None:  # one-hot columns: under an Explicit mesh, one sharding
      total = jnp.zeros((num_groups,), jnp.float32)
    column = lambda i, x: (
      x if leaf_groups is None else jnp.where(np.arange(num_groups) == leaf_groups[i], x, 0)
    )
    for u, ks in by_site.items():
      if u in cap.tapped:  # taken in the backward pass
        grads = [gg[u][k] for k in ks]
      else:
        grads = _site_param_grads(sites[u], ks, cap.pvals[u], cap.cvals[u], ds[u], gg[u])
      for k, ct in zip(ks, grads, strict=True):
        deps = sites[u].infos[k].deps
        if deps <= booked:
          total = total + column(min(deps), _sq(ct))
        elif u in cap.tapped and sites[u].summed:  # summed over the iterations
          cts.append(spread(ct, cap.pvals[u][k]))
        else:
          cts.append(ct)
    if pull is None:
      return total, []
    (grads,) = pull(cts)
    for i, x in zip(pulled, grads, strict=True):
      total = total + column(i, _sq(x))
    return total, grads

  xs = ({u: cap.drecs[u] for u in by_site}, {u: cap.gs[u] for u in by_site})
  size = sum(math.prod(jnp.shape(cap.leaves[i])) for i in pulled) + sum(
    math.prod(jnp.shape(cap.pvals[u][k])) for u, k in order
  )
  limit = max(1, _CHUNK_ELEMENTS // max(size, 1))
  if cap.spmd_axis_name is None and _shapes.is_symbolic(cap.n):
    sumsq, grads = _symbolic_chunks(per_example, xs, cap.n, limit)
  elif cap.spmd_axis_name is not None or min(cap.n, limit) >= cap.n:
    # One chunk: a plain vmap (lax.map would compile the per-example gradient
    # in another layout, many times slower for convolutions on XLA:CPU).
    sumsq, grads = jax.vmap(per_example, spmd_axis_name=cap.spmd_axis_name)(xs)
  else:
    sumsq, grads = jax.lax.map(per_example, xs, batch_size=min(cap.n, limit))
  return sumsq, pulled, grads


def released_sums(
  cap: Captured,
  insts: Sequence[Instantiated],
  formed: dict[int, jax.Array],
  weights: jax.Array,
  keep: jax.Array,
  leaf_groups: Sequence[int] | None,
) -> dict[int, jax.Array]:
  """The clipped sum of each instantiated leaf in ``formed`` (its per-example gradients,
  :func:`instantiated_grads`): the very gradients its norms were read from, weighted by its
  clip group's ``weights`` (:func:`released`); in a two-pass plan, also of each leaf
  :func:`_booked` (its uses' tapped gradients weighted and summed, then placed by its views).
  """
  column = lambda i: weights if leaf_groups is None else weights[:, leaf_groups[i]]
  out = {i: released(x, column(i), keep) for i, x in formed.items()}
  for inst in insts if cap.weighted is not None else ():
    leaves = sorted(_booked(cap, inst))
    if not leaves:
      continue
    order = [(u, k) for u, k in inst.bounds if cap.sites[u].infos[k].deps <= set(leaves)]
    cts = []
    for u, k in order:
      ct = released(cap.gs[u][k], column(min(cap.sites[u].infos[k].deps)), keep)
      cts.append(spread(ct, cap.pvals[u][k]) if cap.sites[u].summed else ct)
    (sums,) = _boundary_pull(cap, leaves, order)(cts)
    out.update(zip(leaves, sums, strict=True))
  return out


def released(grads: jax.Array, weights: jax.Array, keep: jax.Array) -> jax.Array:
  """``sum_b weights_b grads_b`` over the kept examples, in float32 (or wider): an example not
  kept is selected away (its gradient may be NaN, and ``0 * nan`` is NaN)."""
  acc = _numerics.accumulation_dtype(grads.dtype)
  rows = lambda x: x.reshape((-1,) + (1,) * (grads.ndim - 1))
  terms = rows(weights.astype(acc)) * grads.astype(acc)
  # A sum, not a dot: under an Explicit mesh the batch axis may be sharded.
  return jnp.sum(jnp.where(rows(keep), terms, jnp.zeros((), acc)), axis=0)


def spread(x: jax.Array, like: jax.Array) -> jax.Array:
  """A gradient summed over a site's scan iterations, as the gradient of ``like`` (the site's
  param input in every iteration, the same value in each): all of it on the first iteration.

  The parameters' pass pulls each iteration's gradient back to the same
  leaf, so the sum may sit on any one of them.
  """
  lead = jnp.ndim(like) - jnp.ndim(x)
  return jnp.zeros_like(like).at[(0,) * lead].set(x.astype(jnp.result_type(like)))


def _symbolic_chunks(fn: Callable[[Any], Any], xs: Any, n: Any, limit: int) -> Any:
  """``vmap(fn)(xs)`` for a symbolic number of examples ``n``, at most ``limit`` at once.

  Under ``jax.export`` with a symbolic batch the number of chunks is not
  known when tracing: the examples are cut into ``min(n, limit)``-row chunks
  (the last one filled up with copies of example ``n - 1``, dropped after),
  mapped one after the other.
  """
  chunk = _shapes.min_dim(n, limit)
  num = -(-n // chunk)
  rows = jnp.minimum(jnp.arange(num * chunk), n - 1)
  split = lambda x: jnp.take(x, rows, axis=0).reshape((num, chunk) + x.shape[1:])
  out = jax.lax.map(jax.vmap(fn), jax.tree.map(split, xs))
  return jax.tree.map(lambda x: x.reshape((num * chunk,) + x.shape[2:])[:n], out)


def _boundary_pull(
  cap: Captured, leaves: Sequence[int], order: Sequence[Boundary]
) -> Callable[[list[Any]], Any]:
  """The pull-back of the ``order`` boundaries' values to the ``leaves``."""

  def boundary_values(sub):
    full = list(cap.leaves)
    for i, x in zip(leaves, sub, strict=True):
      full[i] = x
    ps, _ = cap.params_pass(full)
    return [ps[u][k] for u, k in order]

  return jax.vjp(boundary_values, [cap.leaves[i] for i in leaves])[1]


def _site_param_grads(
  site: Site, ks: Sequence[int], pvals: Sequence[Any], cvals: Sequence[Any], d: Any, g: Any
) -> list[Any]:
  """One example's gradients of the site's param inputs ``ks``, given its ``a`` and ``g``."""

  def fn(sub):
    pv = list(pvals)
    for k, x in zip(ks, sub, strict=True):
      pv[k] = x
    return _sites.site_outputs(site, pv, cvals, d)

  vjp = site_vjp(site, fn, [pvals[k] for k in ks])
  return vjp(list(g))[0]


def site_vjp(site: Site, fn: Callable[[Any], Any], primals: Any) -> Callable[[Any], Any]:
  """``jax.vjp(fn, primals)[1]``, with errors naming the site's primitive."""

  def named(call, *args):
    try:
      return call(*args)
    except Exception as exc:  # re-raised with the primitive's name
      raise ValueError(
        "per_example_clipped_grad(method='ghost') cannot differentiate the loss with respect "
        f"to the parameters through `{site.name}`: {exc}"
      ) from exc

  vjp = named(lambda: jax.vjp(fn, primals)[1])
  return lambda cts: named(vjp, cts)


class InstantiateRule(Rule):
  """The base rule: the per-example gradient, formed through the sites (this module)."""


INSTANTIATE = InstantiateRule()
