"""Ghost norms, step 1: the sites of a per-example loss and what they see.

A per-example loss is traced to a jaxpr. Every value of the program is classed
as depending on the parameters only (*param*), on the batch (*data*), or on
neither (*const*). A *site* is an equation that takes a floating-point param
value and a data value, such as ``x @ W`` or ``E[ids]``: the loss depends on the
parameters through the sites alone.

Three walkers share one traversal (:class:`_Walker`):

* :class:`Analyzer` finds the sites, statically (no values);
* :class:`Forward` evaluates one example, adds a zero to each site's float
  outputs (so that the gradient with respect to those zeros is the site's
  output gradient ``g``) and records each site's data inputs ``a``; at a
  *probed* site it records nothing and the gradient with respect to its zero
  is the site's squared norm, computed from ``a`` and ``g`` in the backward
  pass (:func:`_probe`);
* :class:`ParamsPass` evaluates only what does not depend on the batch and
  records each site's param and const inputs.

Call primitives (``jit``, ``remat``) are walked into when a parameter goes in,
and a ``lax.scan`` over stacked layers is walked per iteration, its records
stacked over the iterations; a weight the scan closes over keeps its view of
the leaf, marked ``shared`` over that scan's iterations. A lookup of a param
table at ids that do not depend on the example (``wpe[jnp.arange(T)]``) is a
site with no data input (:func:`is_fixed_lookup`). Which primitives these are, and how their
parameters are read, is :mod:`jaxclip.privacy._jax_internals`'s; a
higher-order primitive it cannot read that touches the parameters or the
batch is recorded by :class:`Analyzer` (``unknown``), and the whole loss then
takes ``method="vmap"``.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _sharding
from jaxclip.privacy import _jax_internals as _jax

PARAM, DATA, CONST = "param", "data", "const"

Stack = tuple[tuple[int, int], ...]  # (scan id, length) of each enclosing scan, outermost first
Pair = tuple[Any, "_Info"]  # a value (or None where not computed) and its class


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
  # Whether it is a view of a leaf that a ``lax.scan`` closes over (one of its
  # consts): the same weight read by every iteration.
  scan_const: bool = False
  # For such a view, the levels of the enclosing scans (indices into a site's
  # ``stack``) over whose iterations it is the same value: its gradient is the
  # sum of those iterations' gradients, so a rule takes their rows together.
  shared: frozenset[int] = frozenset()


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
    rules: For each ``PARAM`` input, ``"dot"``, ``"gather"``, ``"conv"`` or
      ``"generic"``.
    stack: ``(scan id, length)`` of each ``lax.scan`` the site is in,
      outermost first: its records then carry one leading axis per scan (one
      entry per iteration).
    remat: Whether the site is inside a rematerialised call
      (``jax.checkpoint``, flax ``nn.remat``): the model asks for its
      activations to be recomputed rather than kept.
  """

  eqn: Any
  roles: tuple[str, ...]
  infos: tuple[_Info, ...]
  outs: tuple[int, ...]
  out_avals: tuple[Any, ...]
  rules: tuple[str, ...]
  stack: Stack = ()
  remat: bool = False

  @property
  def name(self) -> str:
    return "the loss" if self.eqn is None else _jax.name(self.eqn)

  def param_positions(self) -> list[int]:
    return [i for i, r in enumerate(self.roles) if r == PARAM]

  def param_avals(self) -> list[Any]:
    """The abstract values of the param inputs (per iteration inside scans)."""
    if self.eqn is None:
      return list(self.out_avals)
    return [self.eqn.invars[p].aval for p in self.param_positions()]

  def zero_avals(self, tapped: bool) -> list[Any]:
    """What :class:`Forward` adds zeros to: the param inputs if ``tapped``, else the outputs."""
    return self.param_avals() if tapped else list(self.out_avals)


def is_float(aval: Any) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.floating)


# ----------------------------------------------------------------------------
# Views: which part of which leaf a param value is
# ----------------------------------------------------------------------------


def _view_of(eqn: Any, infos: list[_Info]) -> _Info:
  """What an equation's output depends on, when its inputs depend on params only."""
  deps = frozenset().union(*(i.deps for i in infos))
  params = [i for i in infos if i.kind == PARAM]
  if not _jax.is_view(eqn) or len(params) != 1 or len(eqn.outvars) != 1:
    return _Info(PARAM, deps)
  src, out = eqn.invars[0].aval, eqn.outvars[0].aval
  if not (is_float(src) and is_float(out)) or infos[0].kind != PARAM:
    return _Info(PARAM, deps)
  info = params[0]
  same_values = _jax.is_slice(eqn) or math.prod(src.shape) == math.prod(out.shape)
  if info.view is None:  # still a scan's const, if it was one
    return _Info(PARAM, deps, scan_const=info.scan_const and same_values)
  if _jax.is_slice(eqn):
    return _slice_of(eqn, info, deps)
  if not same_values:  # broadcast_in_dim that repeats values
    return _Info(PARAM, deps, scan_const=info.scan_const)
  axes = info.axes
  perm, gone = _jax.transpose_permutation(eqn), _jax.squeeze_dimensions(eqn)
  if axes is not None and perm is not None:
    axes = tuple(axes[p] for p in perm)
  elif axes is not None and gone is not None:
    gone = {d % src.ndim for d in gone}
    axes = tuple(a for j, a in enumerate(axes) if j not in gone)
  elif tuple(src.shape) != tuple(out.shape):
    axes = None  # still the leaf's values, but not axis by axis
  return dataclasses.replace(info, deps=deps, axes=axes)


def _slice_of(eqn: Any, info: _Info, deps: frozenset[int]) -> _Info:
  """A static slice of a view: a view of a region of the leaf (or of nothing known)."""
  bounds = _jax.slice_bounds(eqn)
  if bounds is None:
    return _Info(PARAM, deps)
  starts, limits, strides = bounds
  if info.axes is None or (strides is not None and any(s != 1 for s in strides)):
    return _Info(PARAM, deps, scan_const=info.scan_const)
  region = dict((a, (lo, hi)) for a, lo, hi in info.region)
  shape = eqn.invars[0].aval.shape
  for j, (lo, hi) in enumerate(zip(starts, limits, strict=True)):
    if (lo, hi) != (0, shape[j]):
      base = region.get(info.axes[j], (0, None))[0]
      region[info.axes[j]] = (base + lo, base + hi)
  return dataclasses.replace(
    info, deps=deps, region=tuple(sorted((a, lo, hi) for a, (lo, hi) in region.items()))
  )


def disjoint(a: _Info, b: _Info) -> bool:
  """Whether two views of regions of one leaf share no element."""
  ra, rb = (
    dict((x, (lo, hi)) for x, lo, hi in a.region),
    dict((x, (lo, hi)) for x, lo, hi in b.region),
  )
  return any(ax in rb and (ra[ax][1] <= rb[ax][0] or rb[ax][1] <= ra[ax][0]) for ax in ra)


# ----------------------------------------------------------------------------
# Which rule a site's param input can get
# ----------------------------------------------------------------------------


def _gather_is_lookup(eqn: Any) -> bool:
  """Whether a gather takes whole rows of its operand: ``E[ids]``, ``take(E, ids, 0)``."""
  parts = _jax.gather_parts(eqn)
  if parts is None:
    return False
  dn = parts.dimension_numbers
  op, idx = eqn.invars[0].aval, eqn.invars[1].aval
  rest = tuple(op.shape[1:])
  lead = idx.ndim - 1
  return (
    idx.ndim >= 1
    and idx.shape[-1] == 1
    and tuple(dn.collapsed_slice_dims) == (0,)
    and tuple(dn.start_index_map) == (0,)
    and not tuple(dn.operand_batching_dims)
    and parts.slice_sizes == (1,) + rest
    and tuple(dn.offset_dims) == tuple(range(lead, lead + len(rest)))
  )


def _conv_is_ghostable(eqn: Any) -> bool:
  parts = _jax.conv_parts(eqn)
  return parts is not None and parts.batch_group_count == 1 and parts.dimension_numbers is not None


def _rule(eqn: Any, roles: tuple[str, ...], pos: int) -> str:
  if eqn is None:
    return "generic"
  if _jax.dot_dimension_numbers(eqn) is not None and len(roles) == 2 and roles[1 - pos] == DATA:
    return "dot"
  if pos == 0 and len(roles) == 2 and roles[1] != PARAM and _gather_is_lookup(eqn):
    return "gather"
  if pos == 1 and len(roles) == 2 and roles[0] == DATA and _conv_is_ghostable(eqn):
    return "conv"
  return "generic"


def _roles(eqn: Any, infos: Sequence[_Info]) -> tuple[str, ...]:
  if eqn is None:
    return (PARAM,)
  return tuple(
    PARAM if i.kind == PARAM and is_float(v.aval) else DATA if i.kind == DATA else CONST
    for i, v in zip(infos, eqn.invars, strict=True)
  )


def _float_outs(eqn: Any, aval: Any) -> tuple[int, ...]:
  """The positions of a site's floating-point outputs (``aval``: the loss's, for ``None``)."""
  avals = [aval] if eqn is None else [v.aval for v in eqn.outvars]
  return tuple(j for j, a in enumerate(avals) if is_float(a))


def _is_site(eqn: Any, infos: Sequence[_Info]) -> bool:
  """Whether an equation takes a float param value and a data value, with a float output, or
  is a lookup of fixed rows (:func:`is_fixed_lookup`)."""
  return (
    any(i.kind == PARAM and is_float(v.aval) for i, v in zip(infos, eqn.invars, strict=True))
    and any(is_float(v.aval) for v in eqn.outvars)
    and (any(i.kind == DATA for i in infos) or is_fixed_lookup(eqn, infos))
  )


def is_fixed_lookup(eqn: Any, infos: Sequence[Any]) -> bool:
  """Whether an equation looks up rows of a param table at ids that do not depend on the
  example (``wpe[jnp.arange(T)]``, ``jnp.take(wpe, jnp.arange(T), axis=0)``).

  ``infos`` are the inputs' classes (or, for a site, its ``roles``). Such a
  lookup is a site of its own (with no data input): the lookup rule then
  applies to the table, with the fixed ids, instead of the table's
  per-example gradient being formed from the rows' gradients.
  """
  kinds = [getattr(i, "kind", i) for i in infos]
  return kinds == [PARAM, CONST] and _gather_is_lookup(eqn)


class _ScanShape(NamedTuple):
  """A ``lax.scan`` whose body is walked per iteration: its parts and their classes."""

  nc: int  # consts
  nk: int  # carries
  length: int
  closed: Any  # the body's ClosedJaxpr
  body_infos: list[_Info]  # consts, carries and xs, as the body sees them
  out_infos: list[_Info]  # final carries, then ys
  reverse: bool
  unroll: Any


def _scan_shape(eqn: Any, infos: Sequence[_Info], depth: int) -> _ScanShape | None:
  """How a scan's body is walked, or ``None`` to treat the whole scan as one site.

  Parameters stacked over the scan (its ``xs``) are sliced per iteration:
  each iteration uses its own slice, so a rule applied per iteration, its
  squared norms summed, is exact. Parameters it closes over (``consts``) are
  used by every iteration (an RNN's hidden-to-hidden matrix, a block shared
  by every layer): they keep their view of the leaf, marked ``shared`` at
  this scan's level ``depth`` (its index in the body's sites' ``stack``), so
  that a rule takes every iteration's rows together. A carry that depends on
  the parameters alone is not handled.
  """
  parts = _jax.scan_parts(eqn)
  if parts is None:
    return None
  nc, nk, closed = parts.num_consts, parts.num_carry, parts.body
  if any(i.kind == PARAM for i in infos[nc : nc + nk]):
    return None
  c_infos = [
    dataclasses.replace(
      i,
      scan_const=i.scan_const or i.view is not None,
      shared=i.shared | {depth} if i.view is not None else frozenset(),
    )
    if i.kind == PARAM
    else i
    for i in infos[:nc]
  ]
  x_infos = [
    dataclasses.replace(i, axes=None if i.axes is None else i.axes[1:]) if i.kind == PARAM else i
    for i in infos[nc + nk :]
  ]
  k_infos = [_DATA if i.kind == DATA else _CONST for i in infos[nc : nc + nk]]
  for _ in range(nk + 1):  # a carry becomes data once an iteration makes it so
    probe = Analyzer().walk(
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
  return _ScanShape(
    nc,
    nk,
    parts.length,
    closed,
    c_infos + k_infos + x_infos,
    k_infos + ys_infos,
    parts.reverse,
    parts.unroll,
  )


# ----------------------------------------------------------------------------
# The walkers
# ----------------------------------------------------------------------------


class _Walker:
  """Walks a jaxpr, classifying its values; subclasses say what a site does.

  Args:
    sites: The sites found by :class:`Analyzer` (empty for the analyzer itself).
    base: The index in ``sites`` of this walker's first site.
    stack: The scans being walked, outermost first.
    scans: How many scans were entered so far (the next scan's id).
  """

  def __init__(
    self, sites: Sequence[Site] = (), *, base: int = 0, stack: Stack = (), scans: int = 0
  ):
    self.sites: list[Site] = list(sites)
    self.records: list[Any] = []  # the records of sites base, base + 1, ...
    self.base = base
    self.stack = stack
    self.scans = scans

  def computes(self, info: _Info) -> bool:
    """Whether a value of this class is evaluated (outside sites)."""
    return True

  def computed(self, vals: Sequence[Any], infos: Sequence[_Info]) -> list[Any]:
    """``vals``, with ``None`` for each value of a class that is not evaluated."""
    return [x if self.computes(i) else None for x, i in zip(vals, infos, strict=True)]

  def site(self, eqn: Any, vals: list[Any], infos: list[_Info], aval: Any = None) -> list[Any]:
    """Records site ``eqn`` (``None``: the loss) and returns its outputs."""
    raise NotImplementedError

  def call(self, eqn: Any, body: tuple[Any, list[Any]], ins: list[Pair]) -> list[Pair]:
    """Walks the body of a call primitive that a parameter goes into."""
    return self.walk(body[0], body[1], ins)

  def walk(self, jaxpr: Any, consts: Sequence[Any], ins: Sequence[Pair]) -> list[Pair]:
    env: dict[Any, Pair] = {}

    def read(v):
      return (_jax.literal_value(v), _CONST) if _jax.is_literal(v) else env[v]

    def write(v, x):
      if not _jax.is_dropped(v):
        env[v] = x

    for v, c in zip(jaxpr.constvars, consts, strict=True):
      write(v, (c, _CONST))
    for v, x in zip(jaxpr.invars, ins, strict=True):
      write(v, x)
    for eqn in jaxpr.eqns:
      outs = self.equation(eqn, [read(v) for v in eqn.invars])
      for v, x in zip(eqn.outvars, outs, strict=True):
        write(v, x)
    return [read(v) for v in jaxpr.outvars]

  def equation(self, eqn: Any, ins: list[Pair]) -> list[Pair]:
    vals = [x for x, _ in ins]
    infos = [i for _, i in ins]
    kinds = {i.kind for i in infos}
    why = _jax.unreadable(eqn)
    if why is not None and (kinds & {PARAM, DATA} or _jax.captures_tracer(eqn)):
      self.unreadable(eqn, why)
    if PARAM in kinds and _jax.is_scan(eqn):
      shape = _scan_shape(eqn, infos, len(self.stack))
      if shape is not None:
        return self.scan(eqn, shape, ins)
    body = _jax.call_body(eqn) if PARAM in kinds else None
    if body is not None:
      return self.call(eqn, body, ins)
    if _is_site(eqn, infos):
      return [(x, _DATA) for x in self.site(eqn, vals, infos)]
    if DATA in kinds:
      info = _DATA
    elif PARAM in kinds:
      info = _view_of(eqn, infos)
    else:
      info = _CONST
    res = _jax.bind(eqn, vals) if self.computes(info) else [None] * len(eqn.outvars)
    return [(x, info) for x in res]

  def scan(self, eqn: Any, shape: _ScanShape, ins: list[Pair]) -> list[Pair]:
    """Walks a scan's body once per iteration under ``lax.scan``, stacking the records."""
    scan_id, self.scans = self.scans, self.scans + 1
    stack = self.stack + ((scan_id, shape.length),)
    u0 = self.base + len(self.records)
    u1 = u0
    while u1 < len(self.sites) and self.sites[u1].stack[: len(stack)] == stack:
      u1 += 1
    nc, nk = shape.nc, shape.nk
    vals = self.computed([x for x, _ in ins], shape.body_infos)
    zs = self.site_zeros(u0, u1)
    scans = [self.scans]

    def step(carry, x):
      xv, zv = x
      sub = self.child(zv, base=u0, stack=stack, scans=self.scans)
      outs = sub.walk(
        shape.closed.jaxpr,
        shape.closed.consts,
        list(zip(vals[:nc] + list(carry) + list(xv), shape.body_infos, strict=True)),
      )
      assert len(sub.records) == u1 - u0, (len(sub.records), u1 - u0)
      scans[0] = sub.scans
      outs = self.computed([x for x, _ in outs], shape.out_infos)
      # One stacked output per value: sites that read the same value (the
      # gates of an LSTM cell read one input) record it once.
      leaves, tree = jax.tree.flatten(sub.records)
      first: dict[int, int] = {}
      index = [first.setdefault(id(v), len(first)) for v in leaves]
      unique = list({id(v): v for v in leaves}.values())
      layout[:] = [tree, index]
      return outs[:nk], (outs[nk:], unique)

    layout: list[Any] = []
    carry, (ys, unique) = jax.lax.scan(
      step,
      vals[nc : nc + nk],
      (vals[nc + nk :], zs),
      length=shape.length,
      reverse=shape.reverse,
      unroll=shape.unroll,
    )
    self.scans = scans[0]
    tree, index = layout
    self.records.extend(jax.tree.unflatten(tree, [unique[i] for i in index]))
    return list(zip(list(carry) + list(ys), shape.out_infos, strict=True))

  def unreadable(self, eqn: Any, why: str) -> None:
    """Notes a higher-order equation the engine cannot read, which touches the parameters or
    the batch (``why``: in a few words)."""

  def site_zeros(self, u0: int, u1: int) -> list[Any] | None:
    """The zeros added to the outputs of sites ``u0`` to ``u1`` (``None``: none added)."""
    return None

  def child(self, zs: Any, *, base: int, stack: Stack, scans: int) -> _Walker:
    """A walker of the same kind for a scan's body."""
    raise NotImplementedError

  def run(self, closed: Any, ins: Sequence[Pair]) -> list[Any]:
    """Walks a per-example loss: its outputs (the loss first), the loss made a site if it
    depends on the parameters only."""
    outs = self.walk(closed.jaxpr, closed.consts, ins)
    loss, info = outs[0]
    if info.kind == PARAM:  # the loss does not depend on the example
      loss = self.site(None, [loss], [info], closed.jaxpr.outvars[0].aval)[0]
    return [loss] + [x for x, _ in outs[1:]]


class Analyzer(_Walker):
  """Finds the sites (``self.sites``), from the classes of the values alone."""

  in_remat = False  # whether the walk is inside a rematerialised call

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    # Why the engine cannot read each higher-order equation it does not know
    # that touches the parameters or the batch, once each, in order.
    self.unknown: list[str] = []

  def computes(self, info: _Info) -> bool:
    return False

  def unreadable(self, eqn: Any, why: str) -> None:
    if why not in self.unknown:
      self.unknown.append(why)

  def call(self, eqn: Any, body: tuple[Any, list[Any]], ins: list[Pair]) -> list[Pair]:
    saved = self.in_remat
    self.in_remat = saved or _jax.is_remat(eqn)
    try:
      return super().call(eqn, body, ins)
    finally:
      self.in_remat = saved

  def site(self, eqn: Any, vals: list[Any], infos: list[_Info], aval: Any = None) -> list[Any]:
    roles = _roles(eqn, infos)
    avals = [aval] if eqn is None else [v.aval for v in eqn.outvars]
    outs = _float_outs(eqn, aval)
    self.sites.append(
      Site(
        eqn,
        roles,
        tuple(i for i, r in zip(infos, roles, strict=True) if r == PARAM),
        outs,
        tuple(avals[j] for j in outs),
        tuple(_rule(eqn, roles, p) for p, r in enumerate(roles) if r == PARAM),
        self.stack,
        self.in_remat,
      )
    )
    self.records.append(None)
    return [None] * len(avals)

  def scan(self, eqn: Any, shape: _ScanShape, ins: list[Pair]) -> list[Pair]:
    """Walks the body once, its sites marked as inside this scan."""
    scan_id, self.scans = self.scans, self.scans + 1
    saved, self.stack = self.stack, self.stack + ((scan_id, shape.length),)
    self.walk(shape.closed.jaxpr, shape.closed.consts, [(None, i) for i in shape.body_infos])
    self.stack = saved
    return [(None, i) for i in shape.out_infos]


class Forward(_Walker):
  """Evaluates one example, adding zeros at each site and recording its data inputs.

  The zeros ``zs[u]`` go to the float outputs of site ``u`` (the gradient with
  respect to them is the site's output gradient ``g``), or, for a site in
  ``tapped``, to its param inputs (the gradient is then the example's
  gradient of those inputs, and nothing is recorded). A site in ``probed``
  gets one scalar zero, whose gradient is the site's squared norm (see
  :func:`_probe`), and records nothing.

  Args:
    zs: For each site from ``base`` on, the zeros added to it.
    sites: The sites, from :class:`Analyzer`.
    tapped: The sites whose param inputs get the zeros.
    probed: For each probed site, ``fn(pvals, dvals, gs)``: one example's
      squared norm from the site's param and data inputs and its output
      gradients (of one scan iteration).
  """

  def __init__(
    self,
    zs: Sequence[Sequence[Any]],
    sites: Sequence[Site],
    tapped: frozenset[int] = frozenset(),
    probed: Mapping[int, Callable[..., Any]] | None = None,
    **kwargs: Any,
  ):
    super().__init__(sites, **kwargs)
    self.zs = zs
    self.tapped = tapped
    self.probed = probed or {}

  def site(self, eqn: Any, vals: list[Any], infos: list[_Info], aval: Any = None) -> list[Any]:
    index = len(self.records)
    roles = _roles(eqn, infos)
    if eqn is not None and self.base + index in self.probed:
      self.records.append([])
      out = _jax.bind(eqn, vals)
      floats = _float_outs(eqn, aval)
      (z,) = self.zs[index]
      probed = _probe(
        self.probed[self.base + index],
        [out[j] for j in floats],
        [v for v, r in zip(vals, roles, strict=True) if r == PARAM],
        [v for v, r in zip(vals, roles, strict=True) if r == DATA],
        z,
      )
      for j, x in zip(floats, probed, strict=True):
        out[j] = x
      return out
    if eqn is not None and self.base + index in self.tapped:
      self.records.append([])
      zs = iter(self.zs[index])
      vals = [v + next(zs) if r == PARAM else v for v, r in zip(vals, roles, strict=True)]
      return _jax.bind(eqn, vals)
    self.records.append([v for v, r in zip(vals, roles, strict=True) if r == DATA])
    out = list(vals) if eqn is None else _jax.bind(eqn, vals)
    for j, z in zip(_float_outs(eqn, aval), self.zs[index], strict=True):
      out[j] = out[j] + z
    return out

  def site_zeros(self, u0: int, u1: int) -> list[Any]:
    return list(self.zs[u0 - self.base : u1 - self.base])

  def child(self, zs: Any, *, base: int, stack: Stack, scans: int) -> Forward:
    return Forward(zs, self.sites, self.tapped, self.probed, base=base, stack=stack, scans=scans)

  def call(self, eqn: Any, body: tuple[Any, list[Any]], ins: list[Pair]) -> list[Pair]:
    if _jax.is_remat(eqn):
      return self.remat(eqn, body, ins)
    return super().call(eqn, body, ins)

  def remat(self, eqn: Any, body: tuple[Any, list[Any]], ins: list[Pair]) -> list[Pair]:
    """Walks a rematerialised layer's body under ``jax.checkpoint`` with the layer's policy.

    Only what the sites record (their data inputs) and the layer's outputs
    are kept for the backward pass; the rest is recomputed, as the model asks.
    """
    probe = Analyzer(stack=self.stack)
    probe.walk(body[0], body[1], [(None, i) for _, i in ins])
    u0 = len(self.records)
    zs = list(self.zs[u0 : u0 + len(probe.sites)])
    infos, found = [i for _, i in ins], {}

    def inner(vals, zs):
      sub = self.child(zs, base=self.base + u0, stack=self.stack, scans=self.scans)
      outs = sub.walk(body[0], body[1], list(zip(vals, infos, strict=True)))
      found.update(infos=[i for _, i in outs], scans=sub.scans)
      return [x for x, _ in outs], sub.records

    outs, records = jax.checkpoint(inner, **_jax.remat_options(eqn))([x for x, _ in ins], zs)
    self.scans = found["scans"]
    self.records.extend(records)
    return list(zip(outs, found["infos"], strict=True))


def _probe(
  fn: Callable[..., Any], outs: list[Any], pvals: list[Any], dvals: list[Any], z: Any
) -> list[Any]:
  """``outs``, unchanged; the gradient with respect to ``z`` is ``fn(pvals, dvals, gs)``.

  ``gs`` are the gradients with respect to ``outs``, which pass through
  unchanged: the backward pass computes the site's squared norm where its
  ``a`` and ``g`` meet, and nothing of the site outlives that step (inside a
  rematerialised layer, ``a`` is recomputed there as the model asks). Inside
  a ``lax.scan`` the gradient with respect to a per-iteration ``z`` is that
  iteration's norm.
  """

  dtype = z.dtype

  @jax.custom_vjp
  def identity(outs, pvals, dvals, z):
    return outs

  def fwd(outs, pvals, dvals, z):
    return outs, (pvals, dvals)

  def bwd(res, gs):
    pvals, dvals = res
    return gs, None, None, fn(pvals, dvals, gs).astype(dtype)

  identity.defvjp(fwd, bwd)
  return identity(outs, pvals, dvals, z)


class ParamsPass(_Walker):
  """Evaluates what does not depend on the batch; records each site's ``(param inputs,
  const inputs)``."""

  def computes(self, info: _Info) -> bool:
    return info.kind != DATA

  def site(self, eqn: Any, vals: list[Any], infos: list[_Info], aval: Any = None) -> list[Any]:
    roles = _roles(eqn, infos)
    self.records.append(
      (
        [v for v, r in zip(vals, roles, strict=True) if r == PARAM],
        [v for v, r in zip(vals, roles, strict=True) if r == CONST],
      )
    )
    return [None] * (1 if eqn is None else len(eqn.outvars))

  def child(self, zs: Any, *, base: int, stack: Stack, scans: int) -> ParamsPass:
    return ParamsPass(self.sites, base=base, stack=stack, scans=scans)


def input_infos(ndims: Sequence[int], batched: Sequence[bool]) -> list[_Info]:
  """The classes of the loss's inputs: the parameter leaves, then the arguments."""
  return [_Info(PARAM, frozenset({i}), i, tuple(range(ndim))) for i, ndim in enumerate(ndims)] + [
    _DATA if b else _CONST for b in batched
  ]


def analyze(closed: Any, in_infos: Sequence[_Info]) -> list[Site]:
  """The sites of a traced per-example loss."""
  return analysis(closed, in_infos)[0]


def analysis(closed: Any, in_infos: Sequence[_Info]) -> tuple[list[Site], tuple[str, ...]]:
  """The sites of a traced per-example loss, and why the engine cannot read each higher-order
  equation it does not know that touches the parameters or the batch (if any: the loss then
  takes ``method="vmap"``)."""
  walker = Analyzer()
  walker.run(closed, [(None, i) for i in in_infos])
  return walker.sites, tuple(walker.unknown)


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
    out = _jax.bind(site.eqn, [next(its[r]) for r in site.roles])
    return [out[j] for j in site.outs]

  for _ in site.stack:
    once = jax.vmap(once)
  return once(pvals, cvals, dvals)


# ----------------------------------------------------------------------------
# Capturing a batch
# ----------------------------------------------------------------------------


class Inputs(NamedTuple):
  """The inputs of a traced per-example loss.

  Attributes:
    closed: The ``ClosedJaxpr`` of one example's loss over ``leaves +
      arg_leaves`` (the loss first, then any aux leaves).
    leaves: The parameter leaves.
    arg_leaves: The argument leaves; those flagged in ``batched`` carry the
      examples on axis 0.
    batched: Which argument leaves are batched.
    spmd_axis_name: Passed to ``vmap``.
    tapped: The sites whose per-example param-input gradients are taken in
      the backward pass instead of their output gradients.
    probed: The sites whose squared norms are taken in the backward pass
      (see :class:`Forward`).
  """

  closed: Any
  leaves: list[jax.Array]
  arg_leaves: list[Any]
  batched: Sequence[bool]
  spmd_axis_name: Any
  tapped: frozenset[int] = frozenset()
  probed: Mapping[int, Callable[..., Any]] = types.MappingProxyType({})

  def infos(self) -> list[_Info]:
    return input_infos([jnp.ndim(x) for x in self.leaves], self.batched)

  def data(self) -> list[Any]:
    return [x for x, b in zip(self.arg_leaves, self.batched, strict=True) if b]


class Captured(NamedTuple):
  """What one backward pass and one pass over the parameters give for a batch.

  Attributes:
    sites: The sites, in order.
    leaves: The parameter leaves.
    n: The number of examples.
    drecs: Per site, its data inputs for every example (leading batch axis,
      then one axis per enclosing scan).
    gs: Per site, the gradient of each example's loss with respect to each
      float output (same leading axes); for a site in ``tapped``, with
      respect to each param input instead; for a probed site, its squared
      norms (one per example and scan iteration).
    pvals: Per site, its param inputs (one axis per enclosing scan).
    cvals: Per site, its const inputs.
    params_pass: ``leaves -> (pvals, cvals)``.
    pull: The pull-back of ``pvals`` to the leaves (``jax.vjp`` of
      ``params_pass``).
    aux: The aux leaves the loss returns for every example.
    spmd_axis_name: Passed to ``vmap``.
    tapped: As in :class:`Inputs`.
    weighted: With probed sites, ``weights -> sum_b weights_b grad_b`` (the
      parameters' gradients, in their dtypes): the second backward pass.
  """

  sites: tuple[Site, ...]
  leaves: list[jax.Array]
  n: int
  drecs: list[Any]
  gs: list[Any]
  pvals: list[Any]
  cvals: list[Any]
  params_pass: Any
  pull: Any
  aux: list[Any]
  spmd_axis_name: Any
  tapped: frozenset[int] = frozenset()
  weighted: Callable[[jax.Array], list[Any]] | None = None


def capture(inputs: Inputs, sites: Sequence[Site]) -> Captured:
  """Every site's ``a`` and ``g`` for every example, and its param and const inputs."""
  drecs, gs, aux, weighted = _site_gradients(inputs, sites)
  params_pass = _params_pass(inputs, sites)
  pvals, pull, cvals = jax.vjp(params_pass, inputs.leaves, has_aux=True)
  n = inputs.data()[0].shape[0]
  return Captured(
    sites=tuple(sites),
    leaves=inputs.leaves,
    n=n,
    drecs=drecs,
    gs=gs,
    pvals=pvals,
    cvals=cvals,
    params_pass=params_pass,
    pull=pull,
    aux=aux,
    spmd_axis_name=inputs.spmd_axis_name,
    tapped=inputs.tapped,
    weighted=weighted,
  )


def _site_gradients(
  inputs: Inputs, sites: Sequence[Site]
) -> tuple[list, list, list, Callable[[jax.Array], list[Any]] | None]:
  """Each site's data inputs and output gradients, for every example, the aux leaves and,
  with probed sites, the weighted gradient.

  The batch's loss is evaluated (under ``vmap``) with a zero added to each
  site's output, and differentiated with respect to those zeros only. With
  probed sites (two passes), it is differentiated with respect to the
  parameters too, and the backward pass is run twice from the one forward
  pass: once for the zeros (the norms; the parameters' gradients are dropped
  unused), once more with the examples' weights for the parameters (the
  returned ``weights -> sum_b weights_b grad_b``; the norms are dropped).
  """
  in_infos = inputs.infos()
  data = inputs.data()
  n = data[0].shape[0]

  def merge(data_b):
    it = iter(data_b)
    return [next(it) if b else x for x, b in zip(inputs.arg_leaves, inputs.batched, strict=True)]

  def losses(leaves, zs):
    def one(zs_b, data_b):
      walker = Forward(zs_b, sites, inputs.tapped, inputs.probed)
      ins = list(zip(list(leaves) + merge(data_b), in_infos, strict=True))
      outs = walker.run(inputs.closed, ins)
      return outs[0], (outs[1:], walker.records)

    return jax.vmap(one, spmd_axis_name=inputs.spmd_axis_name)(zs, data)

  acc = _numerics.tree_accumulation_dtype(inputs.leaves)
  zs = [
    tuple(
      _batch_zeros((n,) + tuple(length for _, length in s.stack) + a.shape, a.dtype, data[0])
      for a in (
        [jax.ShapeDtypeStruct((), acc)] if u in inputs.probed else s.zero_avals(u in inputs.tapped)
      )
    )
    for u, s in enumerate(sites)
  ]
  # Inside shard_map the zeros must vary as the examples do: the gradient with
  # respect to a value that is the same on every device is summed over them.
  vary = frozenset().union(*map(_sharding.varying_axes, inputs.leaves + inputs.arg_leaves))
  if vary:
    zs = _sharding.cast_varying(zs, tuple(sorted(vary, key=str)))
  if not inputs.probed:  # the zeros only
    loss, vjp, (aux, drecs) = jax.vjp(lambda zs: losses(inputs.leaves, zs), zs, has_aux=True)
    return drecs, vjp(jnp.ones_like(loss))[0], aux, None
  loss, vjp, (aux, drecs) = jax.vjp(losses, inputs.leaves, zs, has_aux=True)
  gs = vjp(jnp.ones_like(loss))[1]
  return drecs, gs, aux, lambda weights: vjp(weights.astype(loss.dtype))[0]


def _params_pass(inputs: Inputs, sites: Sequence[Site]) -> Any:
  """``leaves -> (pvals, cvals)``: each site's param and const inputs."""
  in_infos = inputs.infos()
  shared = [None if b else x for x, b in zip(inputs.arg_leaves, inputs.batched, strict=True)]

  def params_pass(ls):
    walker = ParamsPass(sites)
    walker.run(inputs.closed, list(zip(list(ls) + shared, in_infos, strict=True)))
    return [p for p, _ in walker.records], [c for _, c in walker.records]

  return params_pass


def _batch_zeros(shape: tuple[int, ...], dtype: Any, like: jax.Array) -> jax.Array:
  """Zeros with a batch axis sharded as ``like``'s (under an Explicit mesh)."""
  sharding = jax.typeof(like).sharding
  spec = sharding.spec
  if spec and spec[0] is not None and not sharding.mesh.empty:
    return jnp.zeros(shape, dtype, out_sharding=jax.P(spec[0], *[None] * (len(shape) - 1)))
  return jnp.zeros(shape, dtype)
