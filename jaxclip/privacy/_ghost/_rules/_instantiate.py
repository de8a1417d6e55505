"""Ghost norms: the per-example gradients of the parameters no rule covers.

Leaves no rule covers (layer-norm scales, biases, a weight used twice) are
instantiated together (:class:`~jaxclip.privacy._ghost._types.Instantiated`): each
example's gradient of their boundaries (the sites' param inputs) is
formed through those sites only, from their recorded ``a`` and ``g``, in chunks
of examples, and pulled back to the leaves. A leaf used only through views of
disjoint parts of it (a bias, a slice per scan iteration) needs no pull-back:
its squared norm is that of its uses' gradients summed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _shapes
from jaxclip.privacy._ghost._jaxpr import _sites
from jaxclip.privacy._ghost._rules._base import Rule
from jaxclip.privacy._ghost._types import Boundary, Captured, Instantiated, Site

# Elements of per-example gradients one chunk of the instantiated leaves may hold at once.
_CHUNK_ELEMENTS = 1 << 24


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


class _Layout(NamedTuple):
  """How the instantiated leaves' per-example gradients are formed.

  Attributes:
    by_site: The boundary positions at each of its sites.
    direct: Leaves used only through views of disjoint parts of them (a bias,
      a scale, a slice per scan iteration): their squared norm is that of
      their uses' gradients summed, with no pull-back to the leaf.
    pulled: The other leaves, pulled back from their boundaries.
    order: The boundaries pulled back, in the order of ``by_site``.
  """

  by_site: dict[int, list[int]]
  direct: frozenset[int]
  pulled: list[int]
  order: list[Boundary]


def _layout(sites: Sequence[Site], inst: Instantiated, tapped: frozenset[int]) -> _Layout:
  by_site: dict[int, list[int]] = {}
  for u, k in inst.bounds:
    by_site.setdefault(u, []).append(k)
  summed = frozenset(u for u in tapped if sites[u].summed)
  direct = frozenset(
    i
    for i in inst.leaves
    if disjoint_views(
      sites, i, [(u, k) for u, k in inst.bounds if i in sites[u].infos[k].deps], summed
    )
  )
  pulled = [i for i in inst.leaves if i not in direct]
  order = [(u, k) for u in by_site for k in by_site[u] if not sites[u].infos[k].deps <= direct]
  return _Layout(by_site, direct, pulled, order)


def _sq(x: jax.Array) -> jax.Array:
  """One example's ``sum |x|^2``, scaled on the way (neither flushed nor overflowed)."""
  x = _numerics.upcast_for_accumulation(x)
  e = _numerics.scale_exponent(jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), x.dtype))
  return _numerics.times_pow2(jnp.sum(_numerics.abs_sq(_numerics.times_pow2(x, -e))), 2 * e)


def instantiated_sumsq(
  inst: Instantiated, cap: Captured, leaf_groups: Sequence[int] | None = None, num_groups: int = 1
) -> jax.Array:
  """Per-example squared norms of the instantiated leaves' gradients, formed in chunks of examples.

  With ``leaf_groups`` (the clip group of each parameter leaf), ``(examples,
  num_groups)``: each leaf's squared norm goes to its clip group's column
  (a leaf used directly belongs to its boundaries, whose one dependency it
  is; a pulled-back leaf's gradient is its own).
  """
  sites = cap.sites
  lay = _layout(sites, inst, cap.tapped)
  pull = _boundary_pull(cap, lay) if lay.pulled else None

  def per_example(xs):
    ds, gg = xs
    cts, total = [], jnp.zeros((), jnp.float32)
    if leaf_groups is not None:  # one-hot columns: under an Explicit mesh, one sharding
      total = jnp.zeros((num_groups,), jnp.float32)
      column = lambda i, x: jnp.where(np.arange(num_groups) == leaf_groups[i], x, 0)
    for u, ks in lay.by_site.items():
      if u in cap.tapped:  # taken in the backward pass
        grads = [gg[u][k] for k in ks]
      else:
        grads = _site_param_grads(sites[u], ks, cap.pvals[u], cap.cvals[u], ds[u], gg[u])
      for k, ct in zip(ks, grads, strict=True):
        deps = sites[u].infos[k].deps
        if deps <= lay.direct and leaf_groups is None:
          total = total + _sq(ct)
        elif deps <= lay.direct:
          total = total + column(min(deps), _sq(ct))
        elif u in cap.tapped and sites[u].summed:  # summed over the iterations
          cts.append(spread(ct, cap.pvals[u][k]))
        else:
          cts.append(ct)
    if pull is not None:
      (grads,) = pull(cts)
      if leaf_groups is None:
        total = total + sum(_sq(x) for x in grads)
      else:
        for i, x in zip(lay.pulled, grads, strict=True):
          total = total + column(i, _sq(x))
    return total

  xs = ({u: cap.drecs[u] for u in lay.by_site}, {u: cap.gs[u] for u in lay.by_site})
  size = sum(math.prod(jnp.shape(cap.leaves[i])) for i in inst.leaves) + sum(
    math.prod(jnp.shape(cap.pvals[u][k])) for u, k in lay.order
  )
  limit = max(1, _CHUNK_ELEMENTS // max(size, 1))
  if cap.spmd_axis_name is None and _shapes.is_symbolic(cap.n):
    return _symbolic_chunks(per_example, xs, cap.n, limit)
  chunk = min(cap.n, limit)
  if cap.spmd_axis_name is not None or chunk >= cap.n:
    # One chunk: a plain vmap (lax.map would compile the per-example gradient
    # in another layout, many times slower for convolutions on XLA:CPU).
    return jax.vmap(per_example, spmd_axis_name=cap.spmd_axis_name)(xs)
  return jax.lax.map(per_example, xs, batch_size=chunk)


def spread(x: jax.Array, like: jax.Array) -> jax.Array:
  """A gradient summed over a site's scan iterations, as the gradient of ``like`` (the site's
  param input in every iteration, the same value in each): all of it on the first iteration.

  The parameters' pass pulls each iteration's gradient back to the same
  leaf, so the sum may sit on any one of them.
  """
  lead = jnp.ndim(like) - jnp.ndim(x)
  return jnp.zeros_like(like).at[(0,) * lead].set(x.astype(jnp.result_type(like)))


def _symbolic_chunks(fn: Callable[[Any], jax.Array], xs: Any, n: Any, limit: int) -> jax.Array:
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
  return out.reshape((num * chunk,) + out.shape[2:])[:n]


def _boundary_pull(cap: Captured, lay: _Layout) -> Callable[[list[Any]], Any]:
  """The pull-back of the ``lay.order`` boundaries' values to the ``lay.pulled`` leaves."""

  def boundary_values(sub):
    full = list(cap.leaves)
    for i, x in zip(lay.pulled, sub, strict=True):
      full[i] = x
    ps, _ = cap.params_pass(full)
    return [ps[u][k] for u, k in lay.order]

  return jax.vjp(boundary_values, [cap.leaves[i] for i in lay.pulled])[1]


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
