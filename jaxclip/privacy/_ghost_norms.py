"""Ghost norms, step 2: each example's squared gradient norm from a site's ``a`` and ``g``.

The rules (``dot``, ``conv``, ``lookup`` and a tied table's cross term) work
from the data inputs ``a`` and output gradients ``g`` that
:mod:`jaxclip.privacy._ghost_capture` records; :func:`instantiated_sumsq`
forms the per-example gradients of the parameters no rule covers, through
their sites only. :func:`site_cost` and :func:`site_memory` give each rule's
flops and floats held per example, and those of the per-example gradient it
replaces, from which :mod:`jaxclip.privacy._ghost_rules` picks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics
from jaxclip.privacy import _ghost_capture
from jaxclip.privacy import _jax_internals as _jax
from jaxclip.privacy._ghost_capture import Captured, Site

# Elements of per-example gradients one chunk of an instantiated group may hold at once.
_CHUNK_ELEMENTS = 1 << 24
_HIGHEST = jax.lax.Precision.HIGHEST


def per_iteration(
  site: Site, fn: Callable[..., jax.Array], *xs: jax.Array, shared: frozenset[int] = frozenset()
) -> jax.Array:
  """``fn(*xs)`` (each ``x`` with a leading batch axis), summed over the site's scan iterations.

  ``fn`` maps per-example records to a value per example; inside scans the
  records have one more axis per scan after the batch axis. The scan levels
  in ``shared`` (a weight every iteration of those scans reads) are not
  mapped over: ``fn`` gets their axes, after the batch axis, in order.
  """
  levels = range(len(site.stack))
  own = [j for j in levels if j not in shared]
  order = [0] + [1 + j for j in own] + [1 + j for j in levels if j in shared]
  xs = tuple(jnp.transpose(x, order + list(range(len(order), x.ndim))) for x in xs)
  for _ in own:
    fn = jax.vmap(fn, in_axes=1, out_axes=1)
  out = fn(*xs)
  return jnp.sum(out.reshape(out.shape[0], -1), axis=1)


def dot_dims(site: Site, pos: int) -> tuple[tuple[int, int, int, int], tuple[list[int], ...]]:
  """``(n, T, C, F)`` of :func:`_dot_operands`, and the data operand's batch, free and
  contracting dims."""
  eqn = site.eqn
  (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(eqn)
  contract, batch = (lc, lb) if pos == 1 else (rc, rb)
  d_aval = eqn.invars[1 - pos].aval
  size = lambda dims: math.prod(d_aval.shape[i] for i in dims)
  free = [i for i in range(d_aval.ndim) if i not in contract and i not in batch]
  nb, t, c = size(batch), size(free), size(contract)
  f = math.prod(eqn.invars[pos].aval.shape) // max(nb * c, 1)
  return (nb, t, c, f), (list(batch), free, list(contract))


def _dot_operands(site: Site, pos: int, a: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A ``dot_general`` site's data operand and output gradient, canonicalised.

  Returns ``A`` of shape ``(examples, n, T, C)`` and ``G`` of shape
  ``(examples, n, T, F)`` (float32) such that each example's gradient of the
  param operand is ``A[b, i].T @ G[b, i]`` for each of its ``n`` dot batch
  indices: ``T`` runs over the data operand's free dims, ``C`` over the
  contracting dims (in the data operand's order) and ``F`` over the param
  operand's free dims.

  Args:
    site: A ``dot_general`` site whose operand ``pos`` is the parameter.
    pos: 0 or 1.
    a: The other operand, for every example (leading batch axis).
    g: The gradient with respect to the output, for every example.
  """
  (nb, t, c, f), (batch, free, contract) = dot_dims(site, pos)
  n = a.shape[0]
  perm = [0] + [1 + i for i in (*batch, *free, *contract)]
  a = _numerics.upcast_for_accumulation(jnp.transpose(a, perm).reshape(n, nb, t, c))
  g = _numerics.upcast_for_accumulation(g)
  if pos == 1:  # output dims: batch, data free, param free
    return a, g.reshape(n, nb, t, f)
  return a, jnp.swapaxes(g.reshape(n, nb, f, t), 2, 3)  # batch, param free, data free


def dot_sumsq(site: Site, pos: int, a: jax.Array, g: jax.Array, shared: int = 0) -> jax.Array:
  """Each example's ``||grad of the dot_general's param operand||^2``.

  Args as :func:`_dot_operands`, but for ``shared``: the number of scan axes
  (after the batch axis of ``a`` and ``g``) over whose iterations the
  parameter is the same value. Its gradient is then the sum over those
  iterations, ``[A_1; A_2; ...]^T [G_1; G_2; ...]``: one ``dot_general`` whose
  rows are every iteration's rows.
  """
  operands = lambda a, g: _dot_operands(site, pos, a, g)
  for _ in range(shared):
    operands = jax.vmap(operands, in_axes=1, out_axes=2)
  a, g = operands(a, g)  # (examples, n, iterations..., T, C or F)
  n, nb = a.shape[0], a.shape[1]
  return _mixed_sumsq(a.reshape(n, nb, -1, a.shape[-1]), g.reshape(n, nb, -1, g.shape[-1]))


def gram_is_cheaper(t: int, c: int, f: int) -> bool:
  """Whether ``<A A^T, G G^T>`` (``t^2 (c + f)`` flops) costs less than ``A^T G`` (``t c f``)."""
  return t * (c + f) <= c * f


def _mixed_sumsq(a: jax.Array, g: jax.Array) -> jax.Array:
  """``sum_i ||A[b, i].T @ G[b, i]||^2`` for each ``b``, the cheaper way.

  Args:
    a: ``(examples, n, T, C)``.
    g: ``(examples, n, T, F)``.
  """
  t, c, f = a.shape[2], a.shape[3], g.shape[3]
  if t == 1:
    return jnp.sum(jnp.sum(a * a, axis=(2, 3)) * jnp.sum(g * g, axis=(2, 3)), axis=1)
  if gram_is_cheaper(t, c, f):  # ghost: <A A^T, G G^T>
    aa = jnp.einsum("bntc,bnsc->bnts", a, a, precision=_HIGHEST)
    gg = jnp.einsum("bntf,bnsf->bnts", g, g, precision=_HIGHEST)
    return jnp.sum(aa * gg, axis=(1, 2, 3))
  grad = jnp.einsum("bntc,bntf->bncf", a, g, precision=_HIGHEST)  # instantiated
  return jnp.sum(grad * grad, axis=(1, 2, 3))


def conv_dims(site: Site) -> tuple[int, int, int, int]:
  """A convolution's feature groups, output positions, taps and outputs per group."""
  eqn = site.eqn
  parts = _jax.conv_parts(eqn)
  dn, groups = parts.dimension_numbers, parts.feature_group_count
  rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
  positions = math.prod(out.shape[d] for d in (dn.out_spec[0], *dn.out_spec[2:]))
  taps = math.prod(rhs.shape[d] for d in dn.rhs_spec[1:])  # per group: C / groups * K
  return groups, positions, taps, rhs.shape[dn.rhs_spec[0]] // groups


def conv_sumsq(site: Site, kernel: jax.Array, a: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of a convolution's kernel||^2``.

  The kernel's gradient is ``A^T G`` per feature group, ``A`` the input's
  patches (one row per output position, one column per kernel tap) and ``G``
  the output gradient: the ``dot_general`` rule over positions, through the
  Gram matrices ``<A A^T, G G^T>`` when the positions are few; otherwise the
  per-example kernel gradient, formed without the patches.

  Args:
    site: A ``conv_general_dilated`` site whose kernel (operand 1) is the parameter.
    kernel: The kernel's value at the site, repeated for every example.
    a: The input, for every example (leading batch axis).
    g: The gradient with respect to the output, for every example.
  """
  eqn = site.eqn
  params = _jax.conv_parts(eqn)
  dn = params.dimension_numbers
  rhs_aval, out_aval = eqn.invars[1].aval, eqn.outvars[0].aval
  groups, positions, taps, outs = conv_dims(site)
  if not gram_is_cheaper(positions, taps, outs):  # the per-example kernel gradient costs less

    def one(k_b, a_b, g_b):
      _, vjp = jax.vjp(lambda k: _jax.bind(eqn, [a_b, k])[0], k_b)
      (grad,) = vjp(g_b.astype(out_aval.dtype))
      return jnp.sum(_numerics.abs_sq(_numerics.upcast_for_accumulation(grad)))

    return jax.vmap(one)(kernel, a, g)
  filt = [rhs_aval.shape[d] for d in dn.rhs_spec[2:]]

  def patches(a_b):  # (positions, C * K), columns channel-major
    x = jnp.transpose(a_b, dn.lhs_spec)  # N, C, spatial...
    p = jax.lax.conv_general_dilated_patches(
      x,
      filt,
      params.window_strides,
      params.padding,
      params.lhs_dilation,
      params.rhs_dilation,
      precision=_HIGHEST,
    )  # N, C * K, out spatial...
    return jnp.moveaxis(p, 1, -1).reshape(positions, -1)

  n = a.shape[0]
  pa = jax.vmap(patches)(_numerics.upcast_for_accumulation(a)).reshape(n, positions, groups, taps)
  pg = jnp.moveaxis(
    jnp.transpose(_numerics.upcast_for_accumulation(g), (0, *(1 + d for d in dn.out_spec))), 2, -1
  )
  pg = pg.reshape(n, positions, groups, outs)
  return _mixed_sumsq(jnp.swapaxes(pa, 1, 2), jnp.swapaxes(pg, 1, 2))


def _lookup_operands(site: Site, ids: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An embedding lookup's ids ``(examples, T)``, in range, and row gradients ``(examples, T, R)``.

  Rows read out of range in ``FILL_OR_DROP`` or ``PROMISE_IN_BOUNDS`` mode
  (``E[ids]``: it reads the clamped row) get a zero gradient, as in JAX's own
  transpose of the gather, whose scatter drops them.
  """
  eqn = site.eqn
  rows = eqn.invars[0].aval.shape[0]
  n = ids.shape[0]
  ids = ids.reshape(n, -1)
  g = _numerics.upcast_for_accumulation(g).reshape(n, ids.shape[1], -1)
  mode = _jax.gather_parts(eqn).mode
  if "FILL" in mode or "PROMISE" in mode:  # out-of-range rows: dropped from the gradient
    g = jnp.where(((ids >= 0) & (ids < rows))[..., None], g, 0)
  return jnp.clip(ids, 0, rows - 1), g


def lookup_gram_is_cheaper(t: int, rows: int) -> bool:
  return t * t <= rows + t


def gather_sumsq(site: Site, ids: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of the looked-up table||^2``, repeated rows included."""
  rows = site.eqn.invars[0].aval.shape[0]
  ids, g = _lookup_operands(site, ids, g)
  t = ids.shape[1]
  if lookup_gram_is_cheaper(t, rows):  # t^2 R flops against about 2 t R for the sums
    gg = jnp.einsum("btr,bsr->bts", g, g, precision=_HIGHEST)
    return jnp.sum(jnp.where(ids[:, :, None] == ids[:, None, :], gg, 0), axis=(1, 2))
  if t < rows:  # the sums of the rows read, one per distinct id: the size of g
    sums = jax.vmap(lambda i, x: _rows_by_id(i, x, t))(ids, g)
  else:  # the per-example gradient of the table: smaller than g
    sums = jax.vmap(lambda i, x: jnp.zeros((rows, x.shape[1]), x.dtype).at[i].add(x))(ids, g)
  return jnp.sum(sums * sums, axis=(1, 2))


def _rows_by_id(ids: jax.Array, g: jax.Array, t: int) -> jax.Array:
  """One example's ``sum_{s: id_s = r} g_s`` for each distinct ``r`` (``t`` rows, some zero).

  The non-zero rows of the per-example gradient of the table, without
  forming its ``rows x R`` zeros: the ids sorted, each run of equal ids one
  segment.
  """
  order = jnp.argsort(ids)
  ids = ids[order]
  run = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32), (ids[1:] != ids[:-1])]))
  return jax.ops.segment_sum(g[order], run, num_segments=t, indices_are_sorted=True)


def tied_cross(
  lookup: Site, ids: jax.Array, g_rows: jax.Array, dot: Site, pos: int, a: jax.Array, g: jax.Array
) -> jax.Array:
  """Each example's ``<grad through the lookup, grad through the dot>`` of one table.

  For a table ``E`` (``rows x R``) read by ``E[ids]`` and used by a
  ``dot_general`` that contracts its axis 1 and keeps its axis 0 (a tied
  output head, ``h @ E.T``), the dot's gradient of row ``r`` is
  ``sum_s G[s, r] a_s``, so the inner product is
  ``sum_{t,s} G[s, id_t] <g_t, a_s>``: cost ``T_lookup * T_dot`` per example.
  """
  ids, g_rows = _lookup_operands(lookup, ids, g_rows)
  a, g = _dot_operands(dot, pos, a, g)  # (b, 1, T, R) and (b, 1, T, rows)
  a, g = a[:, 0], g[:, 0]
  m = jnp.einsum("btr,bsr->bts", g_rows, a, precision=_HIGHEST)
  picked = jnp.take_along_axis(
    g, jnp.broadcast_to(ids[:, None, :], g.shape[:2] + ids.shape[1:]), axis=2
  )  # (b, s, t): G[s, id_t]
  return jnp.sum(m * jnp.swapaxes(picked, 1, 2), axis=(1, 2))


def _levels(site: Site, k: int) -> tuple[int, int]:
  """The iterations of a boundary's scans that read their own parameter value, and those that
  read one value (its ``shared`` levels)."""
  shared = site.infos[k].shared
  own = math.prod(n for j, (_, n) in enumerate(site.stack) if j not in shared)
  return own, math.prod(n for j, (_, n) in enumerate(site.stack) if j in shared)


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


# ----------------------------------------------------------------------------
# Parameters no rule covers: their per-example gradients, through their sites only
# ----------------------------------------------------------------------------

Boundary = tuple[int, int]  # (site, position among the site's param inputs)


class Group(NamedTuple):
  """Leaves whose per-example gradients are instantiated together, and their boundaries."""

  leaves: tuple[int, ...]
  bounds: tuple[Boundary, ...]


def disjoint_views(sites: Sequence[Site], leaf: int, bounds: Sequence[Boundary]) -> bool:
  """Whether every use of the leaf is a view of its own part of it, in the same scans."""
  infos = [sites[u].infos[k] for u, k in bounds]
  return (
    bool(infos)
    and all(i.view == leaf and i.deps == {leaf} and not i.shared for i in infos)
    and len({sites[u].stack for u, _ in bounds}) == 1
    and all(_ghost_capture.disjoint(a, b) for j, a in enumerate(infos) for b in infos[j + 1 :])
  )


class _Layout(NamedTuple):
  """How an instantiated group's per-example gradients are formed.

  Attributes:
    by_site: The group's boundary positions at each of its sites.
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


def _layout(sites: Sequence[Site], group: Group) -> _Layout:
  by_site: dict[int, list[int]] = {}
  for u, k in group.bounds:
    by_site.setdefault(u, []).append(k)
  direct = frozenset(
    i
    for i in group.leaves
    if disjoint_views(sites, i, [(u, k) for u, k in group.bounds if i in sites[u].infos[k].deps])
  )
  pulled = [i for i in group.leaves if i not in direct]
  order = [(u, k) for u in by_site for k in by_site[u] if not sites[u].infos[k].deps <= direct]
  return _Layout(by_site, direct, pulled, order)


def _sq(x: jax.Array) -> jax.Array:
  return jnp.sum(_numerics.abs_sq(_numerics.upcast_for_accumulation(x)))


def instantiated_sumsq(
  group: Group, cap: Captured, leaf_groups: Sequence[int] | None = None, num_groups: int = 1
) -> jax.Array:
  """Per-example squared norms of a group's gradients, instantiated in chunks of examples.

  With ``leaf_groups`` (the clip group of each parameter leaf), ``(examples,
  num_groups)``: each leaf's squared norm goes to its clip group's column
  (a leaf used directly belongs to its boundaries, whose one dependency it
  is; a pulled-back leaf's gradient is its own).
  """
  sites = cap.sites
  lay = _layout(sites, group)
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
  size = sum(math.prod(jnp.shape(cap.leaves[i])) for i in group.leaves) + sum(
    math.prod(jnp.shape(cap.pvals[u][k])) for u, k in lay.order
  )
  limit = max(1, _CHUNK_ELEMENTS // max(size, 1))
  if cap.spmd_axis_name is None and _jax.is_symbolic(cap.n):
    return _symbolic_chunks(per_example, xs, cap.n, limit)
  chunk = min(cap.n, limit)
  if cap.spmd_axis_name is not None or chunk >= cap.n:
    # One chunk: a plain vmap (lax.map would compile the per-example gradient
    # in another layout, many times slower for convolutions on XLA:CPU).
    return jax.vmap(per_example, spmd_axis_name=cap.spmd_axis_name)(xs)
  return jax.lax.map(per_example, xs, batch_size=chunk)


def _symbolic_chunks(fn: Callable[[Any], jax.Array], xs: Any, n: Any, limit: int) -> jax.Array:
  """``vmap(fn)(xs)`` for a symbolic number of examples ``n``, at most ``limit`` at once.

  Under ``jax.export`` with a symbolic batch the number of chunks is not
  known when tracing: the examples are cut into ``min(n, limit)``-row chunks
  (the last one filled up with copies of example ``n - 1``, dropped after),
  mapped one after the other.
  """
  chunk = _jax.min_dim(n, limit)
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
    return _ghost_capture.site_outputs(site, pv, cvals, d)

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
