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
  scales and biases this is a cheap per-example reduction.

A rule applies per use when a parameter's uses read disjoint parts of it:
static slices (a Python loop over ``W[l]``), and the iterations of a
``lax.scan`` over stacked layers, whose body is walked with its ``a`` and
``g`` stacked over the iterations; the squared norms of the parts add.

The clipped sum is then book-kept: ``sum_b w_b g_{u,b}`` pulled back through
each site (one matmul for a dense layer) and through ``h``, with no second
pass over the model. Where the plan's norms cost more than a share
``_VMAP_RATIO`` of forming every per-example gradient (long sequences of
narrow layers), the caller forms per-example gradients instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _sharding

PARAM, DATA, CONST = "param", "data", "const"
# Call primitives whose body is walked when a parameter goes in (so that the
# uses inside a jitted or rematerialised layer are seen one by one; the ghost
# pass then stores that layer's activations rather than recomputing them).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2"})
_REMATS = frozenset({"checkpoint", "remat", "remat2"})
# Primitives that rearrange a parameter without changing its values: the
# gradient of the result has the norm of the parameter's gradient.
_VIEWS = frozenset(
  {
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "convert_element_type",
    "broadcast_in_dim",
    "slice",
  }
)
# Elements of per-example gradients one chunk of a group may hold at once.
_CHUNK_ELEMENTS = 1 << 24
_HIGHEST = jax.lax.Precision.HIGHEST
# The ghost pass is used when its norms cost at most this share of the flops
# of every per-example gradient (it also pays a book-keeping pass that vmap
# does not); above it, the per-example gradients are formed (method="vmap").
_VMAP_RATIO = 0.8


@dataclasses.dataclass(frozen=True)
class _Info:
  """What a value of the program depends on."""

  kind: str
  deps: frozenset[int] = frozenset()  # the parameter leaves it depends on
  view: int | None = None  # the leaf it is a rearrangement of (of a part of), if any
  axes: tuple[int, ...] | None = None  # for such a view, the leaf axis of each of its axes
  # For a view of a static slice of the leaf, ``(leaf axis, start, stop)`` of
  # each sliced axis; ``()`` for the whole leaf.
  region: tuple[tuple[int, int, int], ...] = ()


_CONST = _Info(CONST)
_DATA = _Info(DATA)


@dataclasses.dataclass(frozen=True)
class Site:
  """An equation through which the loss depends on the parameters.

  Attributes:
    eqn: The equation, or ``None`` when the loss itself depends on the
      parameters only.
    roles: For each input, ``PARAM`` (a floating-point value of the
      parameters: the site's boundary), ``DATA`` or ``CONST``.
    infos: For each ``PARAM`` input, what it depends on.
    outs: The floating-point outputs (the others carry no gradient).
    out_avals: Their per-example abstract values.
    rules: For each ``PARAM`` input, ``"dot"``, ``"gather"`` or ``"generic"``.
    stack: ``(scan id, length)`` of each ``lax.scan`` the site is in,
      outermost first: its records then carry one leading axis per scan (one
      entry per iteration).
  """

  eqn: Any
  roles: tuple[str, ...]
  infos: tuple[_Info, ...]
  outs: tuple[int, ...]
  out_avals: tuple[Any, ...]
  rules: tuple[str, ...]
  stack: tuple[tuple[int, int], ...] = ()

  @property
  def name(self) -> str:
    return "the loss" if self.eqn is None else self.eqn.primitive.name

  def param_positions(self) -> list[int]:
    return [i for i, r in enumerate(self.roles) if r == PARAM]


def _is_float(aval: Any) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.floating)


def _bind(eqn: Any, vals: Sequence[Any]) -> list[Any]:
  out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _body(eqn: Any) -> tuple[Any, list[Any]] | None:
  """The jaxpr and consts of a call primitive's body, or ``None``."""
  if eqn.primitive.name not in _CALLS:
    return None
  inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if isinstance(inner, jex.ClosedJaxpr):
    return inner.jaxpr, list(inner.consts)
  if isinstance(inner, jex.Jaxpr) and not inner.constvars:
    return inner, []
  return None


def _view_of(eqn: Any, infos: list[_Info]) -> _Info:
  """What an equation's output depends on, when its inputs depend on params only."""
  deps = frozenset().union(*(i.deps for i in infos))
  name = eqn.primitive.name
  params = [i for i in infos if i.kind == PARAM]
  if name not in _VIEWS or len(params) != 1 or params[0].view is None or len(eqn.outvars) != 1:
    return _Info(PARAM, deps)
  src, out = eqn.invars[0].aval, eqn.outvars[0].aval
  if not (_is_float(src) and _is_float(out)) or infos[0].kind != PARAM:
    return _Info(PARAM, deps)
  info = params[0]
  if name == "slice":
    return _slice_of(eqn, info, deps)
  if math.prod(src.shape) != math.prod(out.shape):
    return _Info(PARAM, deps)  # broadcast_in_dim that repeats values
  axes = info.axes
  if axes is not None and name == "transpose":
    axes = tuple(axes[p] for p in eqn.params["permutation"])
  elif axes is not None and name == "squeeze":
    gone = {d % src.ndim for d in eqn.params["dimensions"]}
    axes = tuple(a for j, a in enumerate(axes) if j not in gone)
  elif tuple(src.shape) != tuple(out.shape):
    axes = None  # still the leaf's values, but not axis by axis
  return _Info(PARAM, deps, info.view, axes, info.region)


def _slice_of(eqn: Any, info: _Info, deps: frozenset[int]) -> _Info:
  """A static slice of a view: a view of a region of the leaf (or of nothing known)."""
  strides = eqn.params["strides"]
  if info.axes is None or (strides is not None and any(s != 1 for s in strides)):
    return _Info(PARAM, deps)
  region = dict((a, (lo, hi)) for a, lo, hi in info.region)
  shape = eqn.invars[0].aval.shape
  for j, (lo, hi) in enumerate(
    zip(eqn.params["start_indices"], eqn.params["limit_indices"], strict=True)
  ):
    if (lo, hi) != (0, shape[j]):
      base = region.get(info.axes[j], (0, None))[0]
      region[info.axes[j]] = (base + lo, base + hi)
  return _Info(
    PARAM, deps, info.view, info.axes, tuple(sorted((a, lo, hi) for a, (lo, hi) in region.items()))
  )


def _disjoint(a: _Info, b: _Info) -> bool:
  """Whether two views of regions of one leaf share no element."""
  ra, rb = (
    dict((x, (lo, hi)) for x, lo, hi in a.region),
    dict((x, (lo, hi)) for x, lo, hi in b.region),
  )
  return any(ax in rb and (ra[ax][1] <= rb[ax][0] or rb[ax][1] <= ra[ax][0]) for ax in ra)


def _gather_is_lookup(eqn: Any) -> bool:
  """Whether a gather takes whole rows of its operand: ``E[ids]``, ``take(E, ids, 0)``."""
  dn = eqn.params["dimension_numbers"]
  op, idx = eqn.invars[0].aval, eqn.invars[1].aval
  rest = tuple(op.shape[1:])
  lead = idx.ndim - 1
  return (
    idx.ndim >= 1
    and idx.shape[-1] == 1
    and tuple(dn.collapsed_slice_dims) == (0,)
    and tuple(dn.start_index_map) == (0,)
    and not tuple(dn.operand_batching_dims)
    and tuple(eqn.params["slice_sizes"]) == (1,) + rest
    and tuple(dn.offset_dims) == tuple(range(lead, lead + len(rest)))
  )


def _rule(eqn: Any, roles: tuple[str, ...], pos: int) -> str:
  if eqn is None:
    return "generic"
  name = eqn.primitive.name
  if name == "dot_general" and len(roles) == 2 and roles[1 - pos] == DATA:
    return "dot"
  if name == "gather" and pos == 0 and roles[1] == DATA and _gather_is_lookup(eqn):
    return "gather"
  if name == "conv_general_dilated" and pos == 1 and roles[0] == DATA and _conv_is_ghostable(eqn):
    return "conv"
  return "generic"


class _Walker:
  """Walks a jaxpr, classifying its values and treating the sites by ``mode``.

  * ``"analyze"``: no values, only the static classification (``sites``);
  * ``"forward"``: evaluates everything, adds ``zs[u]`` to the float outputs
    of site ``u`` and records its data inputs (``records``);
  * ``"params"``: evaluates only what does not depend on the batch and
    records the param and const inputs of every site (``records``).
  """

  def __init__(
    self,
    mode: str,
    zs: Sequence[Sequence[Any]] | None = None,
    sites: Sequence[Site] = (),
    *,
    base: int = 0,
    stack: tuple[tuple[int, int], ...] = (),
    scans: int = 0,
  ):
    self.mode = mode
    self.zs = zs  # indexed from ``base``
    self.sites: list[Site] = list(sites)  # analyze: found; otherwise: from the analysis
    self.records: list[Any] = []  # the records of sites base, base + 1, ...
    self.base = base
    self.stack = stack  # the scans being walked, outermost first
    self.scans = scans  # the scans entered so far (their ids)

  def site(self, eqn: Any, vals: list[Any], infos: list[_Info], aval: Any = None) -> list[Any]:
    index = len(self.records)
    if eqn is None:
      roles = (PARAM,)
      avals = [aval]
    else:
      roles = tuple(
        PARAM if i.kind == PARAM and _is_float(v.aval) else DATA if i.kind == DATA else CONST
        for i, v in zip(infos, eqn.invars, strict=True)
      )
      avals = [v.aval for v in eqn.outvars]
    outs = tuple(j for j, a in enumerate(avals) if _is_float(a))
    if self.mode == "analyze":
      self.sites.append(
        Site(
          eqn,
          roles,
          tuple(i for i, r in zip(infos, roles, strict=True) if r == PARAM),
          outs,
          tuple(avals[j] for j in outs),
          tuple(_rule(eqn, roles, p) for p, r in enumerate(roles) if r == PARAM),
          self.stack,
        )
      )
      self.records.append(None)
      return [None] * len(avals)
    if self.mode == "params":
      self.records.append(
        (
          [v for v, r in zip(vals, roles, strict=True) if r == PARAM],
          [v for v, r in zip(vals, roles, strict=True) if r == CONST],
        )
      )
      return [None] * len(avals)
    self.records.append([v for v, r in zip(vals, roles, strict=True) if r == DATA])
    out = list(vals) if eqn is None else _bind(eqn, vals)
    if self.zs is not None:
      for j, z in zip(outs, self.zs[index], strict=True):
        out[j] = out[j] + z
    return out

  def walk(
    self, jaxpr: Any, consts: Sequence[Any], ins: Sequence[tuple[Any, _Info]]
  ) -> list[tuple[Any, _Info]]:
    env: dict[Any, tuple[Any, _Info]] = {}

    def read(v):
      return (v.val, _CONST) if isinstance(v, jex.Literal) else env[v]

    def write(v, x):
      if not isinstance(v, jex.DropVar):
        env[v] = x

    for v, c in zip(jaxpr.constvars, consts, strict=True):
      write(v, (c, _CONST))
    for v, x in zip(jaxpr.invars, ins, strict=True):
      write(v, x)
    for eqn in jaxpr.eqns:
      ins_e = [read(v) for v in eqn.invars]
      vals = [x for x, _ in ins_e]
      infos = [i for _, i in ins_e]
      kinds = {i.kind for i in infos}
      body = _body(eqn) if PARAM in kinds else None
      scanned = self.scan(eqn, ins_e) if eqn.primitive.name == "scan" and PARAM in kinds else None
      if scanned is not None:
        outs = scanned
      elif body is not None and self.mode == "forward" and eqn.primitive.name in _REMATS:
        outs = self.remat(eqn, body, ins_e)
      elif body is not None:
        outs = self.walk(body[0], body[1], ins_e)
      elif (
        DATA in kinds
        and any(
          i.kind == PARAM and _is_float(v.aval) for i, v in zip(infos, eqn.invars, strict=True)
        )
        and any(_is_float(v.aval) for v in eqn.outvars)
      ):
        outs = [(x, _DATA) for x in self.site(eqn, vals, infos)]
      else:
        if DATA in kinds:
          info = _DATA
        elif PARAM in kinds:
          info = _view_of(eqn, infos)
        else:
          info = _CONST
        skip = self.mode == "analyze" or (self.mode == "params" and info.kind == DATA)
        res = [None] * len(eqn.outvars) if skip else _bind(eqn, vals)
        outs = [(x, info) for x in res]
      for v, x in zip(eqn.outvars, outs, strict=True):
        write(v, x)
    return [read(v) for v in jaxpr.outvars]

  def scan(self, eqn: Any, ins: list[tuple[Any, _Info]]) -> list[tuple[Any, _Info]] | None:
    """Walks a ``lax.scan``'s body once per iteration, or ``None`` to treat it as one site.

    Parameters stacked over the scan (its ``xs``) are sliced per iteration:
    each iteration uses its own slice, so a rule applied per iteration, its
    squared norms summed, is exact. Parameters it closes over (``consts``)
    are used by every iteration and lose their view of the leaf (they are
    instantiated). A carry that depends on the parameters alone is not
    handled: the whole scan is then one site.
    """
    p = eqn.params
    nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
    closed = p["jaxpr"]
    infos = [i for _, i in ins]
    if any(i.kind == PARAM for i in infos[nc : nc + nk]):
      return None
    c_infos = [_Info(PARAM, i.deps) if i.kind == PARAM else i for i in infos[:nc]]
    x_infos = [
      _Info(PARAM, i.deps, i.view, None if i.axes is None else i.axes[1:], i.region)
      if i.kind == PARAM
      else i
      for i in infos[nc + nk :]
    ]
    k_infos = [_DATA if i.kind == DATA else _CONST for i in infos[nc : nc + nk]]
    for _ in range(nk + 1):  # a carry becomes data once an iteration makes it so
      probe = _Walker("analyze").walk(
        closed.jaxpr, closed.consts, [(None, i) for i in c_infos + k_infos + x_infos]
      )
      if any(i.kind == PARAM for _, i in probe[:nk]):
        return None
      new = [
        _DATA if DATA in (a.kind, b.kind) else _CONST
        for a, (_, b) in zip(k_infos, probe[:nk], strict=True)
      ]
      if new == k_infos:
        break
      k_infos = new
    ys_infos = [_Info(PARAM, i.deps) if i.kind == PARAM else i for _, i in probe[nk:]]
    scan_id, self.scans = self.scans, self.scans + 1
    stack = self.stack + ((scan_id, length),)
    body_infos = c_infos + k_infos + x_infos
    if self.mode == "analyze":
      saved, self.stack = self.stack, stack
      self.walk(closed.jaxpr, closed.consts, [(None, i) for i in body_infos])
      self.stack = saved
      return [(None, i) for i in k_infos + ys_infos]
    u0 = self.base + len(self.records)
    u1 = u0
    while u1 < len(self.sites) and self.sites[u1].stack[: len(stack)] == stack:
      u1 += 1
    vals = [x for x, _ in ins]
    skip = self.mode == "params"  # data values are not computed in this mode
    consts = vals[:nc]
    carry = [
      None if skip and i.kind == DATA else x
      for x, i in zip(vals[nc : nc + nk], k_infos, strict=True)
    ]
    xs = [
      None if skip and i.kind == DATA else x for x, i in zip(vals[nc + nk :], x_infos, strict=True)
    ]
    zs = None if self.zs is None else list(self.zs[u0 - self.base : u1 - self.base])
    scans = [self.scans]

    def step(carry, x):
      xv, zv = x
      sub = _Walker(self.mode, zv, self.sites, base=u0, stack=stack, scans=self.scans)
      outs = sub.walk(
        closed.jaxpr,
        closed.consts,
        list(zip(consts + list(carry) + list(xv), body_infos, strict=True)),
      )
      assert len(sub.records) == u1 - u0, (len(sub.records), u1 - u0)
      scans[0] = sub.scans
      outs = [
        None if skip and i.kind == DATA else x
        for (x, _), i in zip(outs, k_infos + ys_infos, strict=True)
      ]
      return outs[:nk], (outs[nk:], sub.records)

    carry, (ys, records) = jax.lax.scan(
      step, carry, (xs, zs), length=length, reverse=p["reverse"], unroll=p["unroll"]
    )
    self.scans = scans[0]
    self.records.extend(records)
    return list(zip(list(carry) + list(ys), k_infos + ys_infos, strict=True))

  def remat(
    self, eqn: Any, body: tuple[Any, list[Any]], ins: list[tuple[Any, _Info]]
  ) -> list[tuple[Any, _Info]]:
    """Walks a rematerialised layer's body under ``jax.checkpoint`` with the layer's policy.

    Only what the sites record (their data inputs) and the layer's outputs
    are kept for the backward pass; the rest is recomputed, as the model asks.
    """
    probe = _Walker("analyze", stack=self.stack)
    probe.walk(body[0], body[1], [(None, i) for _, i in ins])
    count = len(probe.sites)
    u0 = len(self.records)
    zs = list(self.zs[u0 : u0 + count])
    infos, found = [i for _, i in ins], {}

    def inner(vals, zs):
      sub = _Walker(
        "forward", zs, self.sites, base=self.base + u0, stack=self.stack, scans=self.scans
      )
      outs = sub.walk(body[0], body[1], list(zip(vals, infos, strict=True)))
      found.update(infos=[i for _, i in outs], scans=sub.scans)
      return [x for x, _ in outs], sub.records

    outs, records = jax.checkpoint(
      inner, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy")
    )([x for x, _ in ins], zs)
    self.scans = found["scans"]
    self.records.extend(records)
    return list(zip(outs, found["infos"], strict=True))

  def run(self, closed: Any, ins: Sequence[tuple[Any, _Info]]) -> list[Any]:
    outs = self.walk(closed.jaxpr, closed.consts, ins)
    loss, info = outs[0]
    if info.kind == PARAM:  # the loss does not depend on the example
      loss = self.site(None, [loss], [info], closed.jaxpr.outvars[0].aval)[0]
    return [loss] + [x for x, _ in outs[1:]]


def site_outputs(
  site: Site, pvals: Sequence[Any], cvals: Sequence[Any], dvals: Sequence[Any]
) -> list[Any]:
  """The floating-point outputs of ``site`` for the given inputs (of one example).

  Inside scans, every input and output has one leading axis per scan.
  """

  def once(pvals, cvals, dvals):
    if site.eqn is None:
      return list(pvals)
    its = {PARAM: iter(pvals), CONST: iter(cvals), DATA: iter(dvals)}
    out = _bind(site.eqn, [next(its[r]) for r in site.roles])
    return [out[j] for j in site.outs]

  for _ in site.stack:
    once = jax.vmap(once)
  return once(pvals, cvals, dvals)


def per_iteration(site: Site, fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
  """``fn(*xs)`` (each ``x`` with a leading batch axis), summed over the site's scan iterations.

  ``fn`` maps per-example records to a value per example; inside scans the
  records have one more axis per scan after the batch axis.
  """
  for _ in site.stack:
    fn = jax.vmap(fn, in_axes=1, out_axes=1)
  out = fn(*xs)
  return jnp.sum(out.reshape(out.shape[0], -1), axis=1)


def _dot_dims(site: Site, pos: int) -> tuple[tuple[int, int, int, int], tuple[list[int], ...]]:
  """``(n, T, C, F)`` of :func:`_dot_operands`, and the data operand's batch, free and
  contracting dims."""
  eqn = site.eqn
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
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
  (nb, t, c, f), (batch, free, contract) = _dot_dims(site, pos)
  n = a.shape[0]
  perm = [0] + [1 + i for i in (*batch, *free, *contract)]
  a = _numerics.upcast_for_accumulation(jnp.transpose(a, perm).reshape(n, nb, t, c))
  g = _numerics.upcast_for_accumulation(g)
  if pos == 1:  # output dims: batch, data free, param free
    return a, g.reshape(n, nb, t, f)
  return a, jnp.swapaxes(g.reshape(n, nb, f, t), 2, 3)  # batch, param free, data free


def dot_sumsq(site: Site, pos: int, a: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of the dot_general's param operand||^2``.

  Args as :func:`_dot_operands`.
  """
  return _mixed_sumsq(*_dot_operands(site, pos, a, g))


def _gram_is_cheaper(t: int, c: int, f: int) -> bool:
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
  if _gram_is_cheaper(t, c, f):  # ghost: <A A^T, G G^T>
    aa = jnp.einsum("bntc,bnsc->bnts", a, a, precision=_HIGHEST)
    gg = jnp.einsum("bntf,bnsf->bnts", g, g, precision=_HIGHEST)
    return jnp.sum(aa * gg, axis=(1, 2, 3))
  grad = jnp.einsum("bntc,bntf->bncf", a, g, precision=_HIGHEST)  # instantiated
  return jnp.sum(grad * grad, axis=(1, 2, 3))


def _conv_is_ghostable(eqn: Any) -> bool:
  return eqn.params["batch_group_count"] == 1 and eqn.params["dimension_numbers"] is not None


def _conv_dims(site: Site) -> tuple[int, int, int, int]:
  """A convolution's feature groups, output positions, taps and outputs per group."""
  eqn = site.eqn
  dn = eqn.params["dimension_numbers"]
  groups = eqn.params["feature_group_count"]
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
  params = eqn.params
  dn = params["dimension_numbers"]
  rhs_aval, out_aval = eqn.invars[1].aval, eqn.outvars[0].aval
  groups, positions, taps, outs = _conv_dims(site)
  if not _gram_is_cheaper(positions, taps, outs):  # the per-example kernel gradient costs less

    def one(k_b, a_b, g_b):
      _, vjp = jax.vjp(lambda k: _bind(eqn, [a_b, k])[0], k_b)
      (grad,) = vjp(g_b.astype(out_aval.dtype))
      return jnp.sum(_numerics.abs_sq(_numerics.upcast_for_accumulation(grad)))

    return jax.vmap(one)(kernel, a, g)
  filt = [rhs_aval.shape[d] for d in dn.rhs_spec[2:]]

  def patches(a_b):  # (positions, C * K), columns channel-major
    x = jnp.transpose(a_b, dn.lhs_spec)  # N, C, spatial...
    p = jax.lax.conv_general_dilated_patches(
      x,
      filt,
      params["window_strides"],
      params["padding"],
      params["lhs_dilation"],
      params["rhs_dilation"],
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
  mode = getattr(eqn.params["mode"], "name", str(eqn.params["mode"]))
  if "FILL" in mode or "PROMISE" in mode:  # out-of-range rows: dropped from the gradient
    g = jnp.where(((ids >= 0) & (ids < rows))[..., None], g, 0)
  return jnp.clip(ids, 0, rows - 1), g


def _lookup_gram_is_cheaper(t: int, rows: int) -> bool:
  return t * t <= rows + t


def gather_sumsq(site: Site, ids: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of the looked-up table||^2``, repeated rows included."""
  rows = site.eqn.invars[0].aval.shape[0]
  ids, g = _lookup_operands(site, ids, g)
  t = ids.shape[1]
  if _lookup_gram_is_cheaper(t, rows):  # t^2 R flops against (rows + t) R for the table
    gg = jnp.einsum("btr,bsr->bts", g, g, precision=_HIGHEST)
    return jnp.sum(jnp.where(ids[:, :, None] == ids[:, None, :], gg, 0), axis=(1, 2))
  table = jax.vmap(lambda i, x: jnp.zeros((rows, x.shape[1]), x.dtype).at[i].add(x))(ids, g)
  return jnp.sum(table * table, axis=(1, 2))


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


def _tied_pair(
  sites: Sequence[Site], leaf: int, bounds: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int], tuple[int, int]] | None:
  """``(lookup, dot)`` boundaries if a 2-D leaf is an embedding table tied to a head."""
  if len(bounds) != 2 or any(sites[u].stack for u, _ in bounds):
    return None
  by_rule = {sites[u].rules[k]: (u, k) for u, k in bounds}
  if set(by_rule) != {"gather", "dot"}:
    return None
  (gu, gk), (du, dk) = by_rule["gather"], by_rule["dot"]
  g_info, d_info = sites[gu].infos[gk], sites[du].infos[dk]
  if g_info.view != leaf or d_info.view != leaf or g_info.axes != (0, 1) or d_info.axes is None:
    return None
  if g_info.region or d_info.region:
    return None
  eqn = sites[du].eqn
  pos = sites[du].param_positions()[dk]
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  contract, batch = (rc, rb) if pos == 1 else (lc, lb)
  if batch or len(contract) != 1 or d_info.axes[contract[0]] != 1:
    return None
  return (gu, gk), (du, dk)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How each parameter leaf's per-example norm is computed.

  Attributes:
    sites: The sites of the program, in order.
    ghost: ``(site, position, rule)`` for leaves handled by a ghost rule.
    tied: ``((site, position), (site, position))`` of the lookup and the
      ``dot_general`` of each embedding table tied to an output head: both
      rules, plus their cross term.
    groups: Lists of ``(leaves, boundaries)`` whose per-example gradients are
      instantiated; a boundary is ``(site, position among its params)``.
  """

  sites: tuple[Site, ...]
  ghost: tuple[tuple[int, int, str], ...]
  tied: tuple[tuple[tuple[int, int], tuple[int, int]], ...]
  groups: tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]
  cost: tuple[int, int] = (0, 0)

  @property
  def vmap_cheaper(self) -> bool:
    """Whether per-example gradients (``method="vmap"``) cost less than this plan.

    ``cost`` is the work per example of this plan's norms and that of forming
    every per-example gradient; the ghost pass also pays a book-keeping pass
    about as costly as the non-private gradient's weight gradients, which
    ``vmap`` does not, so it wins only well below ``_VMAP_RATIO``.
    """
    ghost, per_example = self.cost
    return ghost > _VMAP_RATIO * per_example


def make_plan(sites: Sequence[Site], num_leaves: int) -> Plan:
  """Groups the leaves by shared uses and picks each group's rule."""
  boundaries = [(u, k) for u, s in enumerate(sites) if s.outs for k in range(len(s.infos))]
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
  owned: dict[int, list[tuple[int, int]]] = {}
  for u, k in boundaries:
    deps = sites[u].infos[k].deps
    if deps:
      owned.setdefault(find(min(deps)), []).append((u, k))
  ghost, tied, groups = [], [], []
  for root, bounds in owned.items():
    leaves = tuple(members[root])
    if len(leaves) == 1 and _disjoint_uses(sites, leaves[0], bounds):
      ghost.extend((u, k, sites[u].rules[k]) for u, k in bounds)
      continue
    pair = _tied_pair(sites, leaves[0], bounds) if len(leaves) == 1 else None
    if pair is not None:
      tied.append(pair)
      continue
    groups.append((leaves, tuple(bounds)))
  ghost_cost = sum(_site_cost(sites[u], k, rule)[0] for u, k, rule in ghost)
  for pair in tied:
    (gu, gk), (du, dk) = pair
    ghost_cost += (
      _site_cost(sites[gu], gk, "gather")[0]
      + _site_cost(sites[du], dk, "dot")[0]
      + _tied_cross_cost(sites, pair)
    )
  ghost_cost += sum(
    _site_cost(sites[u], k, "generic")[1] for _, bounds in groups for u, k in bounds
  )
  per_example = sum(_site_cost(sites[u], k, sites[u].rules[k])[1] for u, k in boundaries)
  return Plan(
    tuple(sites), tuple(ghost), tuple(tied), _merge_groups(groups), (ghost_cost, per_example)
  )


def _site_cost(site: Site, k: int, rule: str) -> tuple[int, int]:
  """Per example, the flops of a boundary's ghost rule and of its per-example gradient."""
  reps = math.prod(length for _, length in site.stack)
  if rule == "dot":
    nb, t, c, f = _dot_dims(site, site.param_positions()[k])[0]
    grad = nb * t * c * f
    ghost = nb * t * t * (c + f) if _gram_is_cheaper(t, c, f) else grad
  elif rule == "gather":
    rows, width = site.eqn.invars[0].aval.shape[0], math.prod(site.eqn.invars[0].aval.shape[1:])
    t = math.prod(site.eqn.invars[1].aval.shape[:-1])
    grad = (rows + t) * width
    ghost = t * t * width if _lookup_gram_is_cheaper(t, rows) else grad
  elif rule == "conv":
    groups, positions, taps, outs = _conv_dims(site)
    grad = groups * positions * taps * outs
    ghost = (
      groups * positions * positions * (taps + outs)
      if _gram_is_cheaper(positions, taps, outs)
      else grad
    )
  else:  # an elementwise or small operation: about its outputs' size
    grad = ghost = sum(math.prod(a.shape) for a in site.out_avals)
  return ghost * reps, grad * reps


def _tied_cross_cost(sites: Sequence[Site], pair: tuple[tuple[int, int], tuple[int, int]]) -> int:
  (gu, _), (du, dk) = pair
  t_lookup = math.prod(sites[gu].eqn.invars[1].aval.shape[:-1])
  _, t, c, f = _dot_dims(sites[du], sites[du].param_positions()[dk])[0]
  return t_lookup * t * (c + f)


def _disjoint_uses(sites: Sequence[Site], leaf: int, bounds: Sequence[tuple[int, int]]) -> bool:
  """Whether each use of the leaf has a ghost rule and reads its own part of the leaf.

  The leaf's gradient is then the sum of the uses' gradients, each on its own
  elements, so its squared norm is the sum of theirs: one use, or static
  disjoint slices (a Python loop over ``W[l]``), in the same scans.
  """
  infos = [sites[u].infos[k] for u, k in bounds]
  if any(
    i.view != leaf or sites[u].rules[k] == "generic"
    for i, (u, k) in zip(infos, bounds, strict=True)
  ):
    return False
  if len({sites[u].stack for u, _ in bounds}) != 1:
    return False
  return all(_disjoint(a, b) for j, a in enumerate(infos) for b in infos[j + 1 :])


def _disjoint_views(sites: Sequence[Site], leaf: int, bounds: Sequence[tuple[int, int]]) -> bool:
  """Whether every use of the leaf is a view of its own part of it, in the same scans."""
  infos = [sites[u].infos[k] for u, k in bounds]
  return (
    bool(infos)
    and all(i.view == leaf and i.deps == {leaf} for i in infos)
    and len({sites[u].stack for u, _ in bounds}) == 1
    and all(_disjoint(a, b) for j, a in enumerate(infos) for b in infos[j + 1 :])
  )


def _merge_groups(
  groups: list[tuple[tuple[int, ...], tuple[tuple[int, int], ...]]],
) -> tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]:
  """The instantiated groups as one: a single per-example pass, through each site once."""
  if not groups:
    return ()
  leaves = sorted(i for ls, _ in groups for i in ls)
  bounds = sorted(b for _, bs in groups for b in bs)
  return ((tuple(leaves), tuple(bounds)),)


_RULE_NAMES = {"dot": "dot", "gather": "lookup", "conv": "conv"}


def leaf_rules(plan: Plan, num_leaves: int) -> list[tuple[str, str | None]]:
  """``(rule, reason)`` of each parameter leaf, as :func:`jaxclip.ghost_plan` reports them."""
  out: list[tuple[str, str | None]] = [("unused", None)] * num_leaves
  if plan.vmap_cheaper:
    ghost, per_example = plan.cost
    why = (
      f"cheaper to instantiate: the ghost norms' {ghost:.3g} flops per example exceed "
      f"{_VMAP_RATIO:g}x the per-example gradients' {per_example:.3g}"
    )
    used = {i for s in plan.sites for info in s.infos for i in info.deps}
    return [("instantiate", why) if i in used else ("unused", None) for i in range(num_leaves)]
  for u, k, rule in plan.ghost:
    out[plan.sites[u].infos[k].view] = (_RULE_NAMES[rule], None)
  for (gu, gk), _ in plan.tied:
    out[plan.sites[gu].infos[gk].view] = ("tied", None)
  for leaves, bounds in plan.groups:
    for i in leaves:
      out[i] = ("instantiate", _fallback_reason(plan.sites, i, leaves, bounds))
  return out


def _fallback_reason(
  sites: Sequence[Site], leaf: int, leaves: Sequence[int], bounds: Sequence[tuple[int, int]]
) -> str:
  """Why a leaf's per-example gradient is instantiated, in a few words."""
  mine = [(u, k) for u, k in bounds if leaf in sites[u].infos[k].deps]
  if len(mine) > 1:
    return "used twice" if len(mine) == 2 else f"used {len(mine)} times"
  ((u, k),) = mine
  site, info = sites[u], sites[u].infos[k]
  if len(info.deps) > 1:
    return f"combined with another parameter before `{site.name}`"
  if info.view != leaf:
    return f"transformed before `{site.name}`"
  if site.eqn is None:
    return "the loss depends on it without the example"
  return f"used by `{site.name}`, not a dot/lookup/conv"


def input_infos(ndims: Sequence[int], batched: Sequence[bool]) -> list[_Info]:
  """The classes of the loss's inputs: the parameter leaves, then the arguments."""
  return [_Info(PARAM, frozenset({i}), i, tuple(range(ndim))) for i, ndim in enumerate(ndims)] + [
    _DATA if b else _CONST for b in batched
  ]


def analyze(closed: Any, in_infos: Sequence[_Info]) -> list[Site]:
  """The sites of a traced per-example loss."""
  walker = _Walker("analyze")
  walker.run(closed, [(None, i) for i in in_infos])
  return walker.sites


def _is_static(x: Any) -> bool:
  """Whether a shared argument leaf is not an array (``True``, a string): passed as is."""
  return not isinstance(x, (jax.Array, np.ndarray, np.generic))


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

  def example(x, batched):
    # Inside shard_map the jaxpr must keep the axes each value varies over (and
    # record the casts they need): it is traced on the first example itself.
    if _sharding.varying_axes(x):
      return x[0] if batched else x
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(
      x.shape[1:] if batched else x.shape, x.dtype, weak_type=aval.weak_type
    )

  closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(
    leaves, [example(x, b) for x, b in zip(arg_leaves, batched, strict=True)]
  )
  loss_shape = out_shape[0] if has_aux else out_shape
  if jnp.shape(loss_shape) or not jnp.issubdtype(loss_shape.dtype, jnp.floating):
    raise ValueError(
      "per_example_clipped_grad needs loss_fn to return a real scalar for one example, "
      f"got {loss_shape}."
    )
  infos = input_infos([jnp.ndim(x) for x in leaves], batched)
  plan = make_plan(analyze(closed, infos), len(leaves))
  return Traced(closed, out_shape, leaves, params_tree, arg_leaves, batched, plan)


def clipped_sum(
  closed: Any,
  plan: Plan,
  leaves: list[jax.Array],
  arg_leaves: list[Any],
  batched: Sequence[bool],
  weights_fn: Callable[[jax.Array], tuple[jax.Array, Any]],
  *,
  mask: jax.Array | None,
  spmd_axis_name: Any,
) -> tuple[list[jax.Array], jax.Array, Any, list[Any]]:
  """Per-example norms, then the weighted sum of per-example gradients.

  Args:
    closed: The ``ClosedJaxpr`` of one example's loss over ``leaves +
      arg_leaves`` (the loss first, then any aux leaves).
    plan: From :func:`make_plan`.
    leaves: The parameter leaves.
    arg_leaves: The argument leaves; those flagged in ``batched`` carry the
      examples on axis 0.
    batched: Which argument leaves are batched.
    weights_fn: Maps the per-example norms to ``(weights, extra)``.
    mask: Which examples are real, or ``None``. Not read here: the caller
      replaces the other rows by copies of a real example and ``weights_fn``
      gives them weight 0, so their output gradients (finite) drop out of the
      book-keeping with no copy of ``g`` masked.
    spmd_axis_name: Passed to ``vmap``.

  Returns:
    ``(sum_b weights_b * grad_b leaves, norms, extra, aux leaves)``, the sums
    in float32 (or wider).
  """
  sites = plan.sites
  in_infos = input_infos([jnp.ndim(x) for x in leaves], batched)
  data = [x for x, b in zip(arg_leaves, batched, strict=True) if b]
  n = data[0].shape[0]

  def merge(data_b):
    it = iter(data_b)
    return [next(it) if b else x for x, b in zip(arg_leaves, batched, strict=True)]

  def one(zs_b, data_b):
    walker = _Walker("forward", zs_b, sites)
    outs = walker.run(closed, list(zip(leaves + merge(data_b), in_infos, strict=True)))
    return outs[0], (outs[1:], walker.records)

  def total(zs):
    loss, rest = jax.vmap(one, spmd_axis_name=spmd_axis_name)(zs, data)
    return jnp.sum(loss), rest

  zs = [
    tuple(
      _batch_zeros((n,) + tuple(length for _, length in s.stack) + a.shape, a.dtype, data[0])
      for a in s.out_avals
    )
    for s in sites
  ]
  # Inside shard_map the zeros must vary as the examples do: the gradient with
  # respect to a value that is the same on every device is summed over them.
  vary = frozenset().union(*map(_sharding.varying_axes, leaves + arg_leaves))
  if vary:
    zs = _sharding.cast_varying(zs, tuple(sorted(vary, key=str)))
  gs, (aux, drecs) = jax.grad(total, has_aux=True)(zs)

  def params_pass(ls):
    walker = _Walker("params", None, sites)
    walker.run(
      closed,
      list(
        zip(
          list(ls) + [None if b else x for x, b in zip(arg_leaves, batched, strict=True)],
          in_infos,
          strict=True,
        )
      ),
    )
    return [p for p, _ in walker.records], [c for _, c in walker.records]

  pvals, pull, cvals = jax.vjp(params_pass, leaves, has_aux=True)

  acc = _numerics.tree_accumulation_dtype(leaves)  # as method="vmap" sums squares
  sumsq = jnp.zeros((n,), acc)
  for u, k, rule in plan.ghost:
    site = sites[u]
    if rule == "dot":
      pos = site.param_positions()[k]
      part = per_iteration(
        site, lambda a, g, site=site, pos=pos: dot_sumsq(site, pos, a, g), drecs[u][0], gs[u][0]
      )
    elif rule == "conv":
      part = per_iteration(
        site,
        lambda k, a, g, site=site: conv_sumsq(site, k, a, g),
        _broadcast_batch(pvals[u][k], n),
        drecs[u][0],
        gs[u][0],
      )
    else:
      part = per_iteration(
        site, lambda i, g, site=site: gather_sumsq(site, i, g), drecs[u][0], gs[u][0]
      )
    sumsq = sumsq + part.astype(acc)
  for (gu, _), (du, dk) in plan.tied:
    pos = sites[du].param_positions()[dk]
    ids, rows, a, g = drecs[gu][0], gs[gu][0], drecs[du][0], gs[du][0]
    part = (
      gather_sumsq(sites[gu], ids, rows)
      + dot_sumsq(sites[du], pos, a, g)
      + 2 * tied_cross(sites[gu], ids, rows, sites[du], pos, a, g)
    )
    sumsq = sumsq + part.astype(acc)
  for group in plan.groups:
    sumsq = sumsq + _group_sumsq(
      group, sites, leaves, params_pass, pvals, cvals, drecs, gs, spmd_axis_name
    ).astype(acc)
  norms = _numerics.safe_sqrt(sumsq)
  weights, extra = weights_fn(norms)

  # Book-keeping: sum_b w_b g_b pulled back through each site, then through h.
  cts = []
  for u, site in enumerate(sites):  # every site has a float output
    wg = [_weighted(g, weights) for g in gs[u]]
    fn = lambda pv, site=site, c=cvals[u], d=drecs[u]: _batched_outputs(
      site, pv, c, d, n, spmd_axis_name
    )
    vjp = _site_vjp(site, fn, pvals[u])
    cts.append(vjp(wg)[0])
  (grads,) = pull(cts)
  grads = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in grads]
  return grads, norms, extra, aux


def _broadcast_batch(x: jax.Array, n: int) -> jax.Array:
  """A site's param value repeated over a batch axis (after which its scan axes come)."""
  return jnp.broadcast_to(x, (n,) + jnp.shape(x))


def _batched_outputs(
  site: Site,
  pvals: Sequence[Any],
  cvals: Sequence[Any],
  dvals: Sequence[Any],
  n: int,
  spmd_axis_name: Any,
) -> list[Any]:
  """The site's outputs for every example (``dvals`` with a leading batch axis)."""
  if not dvals:  # the site does not see the example: the same outputs for all
    return [jnp.broadcast_to(x, (n,) + jnp.shape(x)) for x in site_outputs(site, pvals, cvals, [])]
  return jax.vmap(lambda db: site_outputs(site, pvals, cvals, db), spmd_axis_name=spmd_axis_name)(
    dvals
  )


def _site_vjp(site: Site, fn: Callable[[Any], Any], primals: Any) -> Callable[[Any], Any]:
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


def _batch_zeros(shape: tuple[int, ...], dtype: Any, like: jax.Array) -> jax.Array:
  """Zeros with a batch axis sharded as ``like``'s (under an Explicit mesh)."""
  sharding = getattr(jax.typeof(like), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec and spec[0] is not None and not sharding.mesh.empty:
    return jnp.zeros(shape, dtype, out_sharding=jax.P(spec[0], *[None] * (len(shape) - 1)))
  return jnp.zeros(shape, dtype)


def _weighted(g: jax.Array, weights: jax.Array) -> jax.Array:
  dtype = _numerics.compute_dtype(g.dtype)
  w = weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(dtype)
  return (g.astype(dtype) * w).astype(g.dtype)


def _group_sumsq(group, sites, leaves, params_pass, pvals, cvals, drecs, gs, spmd_axis_name):
  """Per-example squared norms of a group's gradients, instantiated in chunks."""
  members, bounds = group
  by_site: dict[int, list[int]] = {}
  for u, k in bounds:
    by_site.setdefault(u, []).append(k)
  # A leaf whose uses are views of disjoint parts of it (a bias, a scale, a
  # slice per scan iteration) has the squared norm of its uses' gradients
  # summed: no pull-back to the leaf is needed.
  direct = {
    i
    for i in members
    if _disjoint_views(sites, i, [(u, k) for u, k in bounds if i in sites[u].infos[k].deps])
  }
  pulled = [i for i in members if i not in direct]
  order = [(u, k) for u in by_site for k in by_site[u] if not sites[u].infos[k].deps <= direct]

  def boundary_values(sub):
    full = list(leaves)
    for i, x in zip(pulled, sub, strict=True):
      full[i] = x
    ps, _ = params_pass(full)
    return [ps[u][k] for u, k in order]

  pull = jax.vjp(boundary_values, [leaves[i] for i in pulled])[1] if pulled else None

  def per_example(xs):
    ds, gg = xs
    cts, total = [], jnp.zeros((), jnp.float32)
    for u, ks in by_site.items():
      site = sites[u]

      def fn(sub, site=site, u=u, ks=ks, d=ds[u]):
        pv = list(pvals[u])
        for k, x in zip(ks, sub, strict=True):
          pv[k] = x
        return site_outputs(site, pv, cvals[u], d)

      vjp = _site_vjp(site, fn, [pvals[u][k] for k in ks])
      for k, ct in zip(ks, vjp(list(gg[u]))[0], strict=True):
        if sites[u].infos[k].deps <= direct:
          total = total + jnp.sum(_numerics.abs_sq(_numerics.upcast_for_accumulation(ct)))
        else:
          cts.append(ct)
    if pull is not None:
      (grads,) = pull(cts)
      total = total + sum(
        jnp.sum(_numerics.abs_sq(_numerics.upcast_for_accumulation(x))) for x in grads
      )
    return total

  ds = {u: drecs[u] for u in by_site}
  gg = {u: gs[u] for u in by_site}
  n = next(iter(gg.values()))[0].shape[0]
  size = sum(math.prod(jnp.shape(leaves[i])) for i in members) + sum(
    math.prod(jnp.shape(pvals[u][k])) for u, k in order
  )
  chunk = max(1, min(n, _CHUNK_ELEMENTS // max(size, 1)))
  if spmd_axis_name is not None or chunk >= n:
    # One chunk: a plain vmap (lax.map would compile the per-example gradient
    # in another layout, many times slower for convolutions on XLA:CPU).
    return jax.vmap(per_example, spmd_axis_name=spmd_axis_name)((ds, gg))
  return jax.lax.map(per_example, (ds, gg), batch_size=chunk)
