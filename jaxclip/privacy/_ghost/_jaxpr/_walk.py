"""Ghost norms: walking a per-example loss's jaxpr, and finding its sites.

:class:`Walker` walks a jaxpr equation by equation, classing each value
(:mod:`jaxclip.privacy._ghost._jaxpr._sites`); its subclasses say what a site does.
:class:`Analyzer` finds the sites statically (no values); the walkers that
evaluate an example are in :mod:`jaxclip.privacy._ghost._forward` and
:mod:`jaxclip.privacy._ghost._capture`.

Call primitives (``jit``, ``remat``) are walked into when a parameter goes in,
and a ``lax.scan`` over stacked layers is walked per iteration, its records
stacked over the iterations; a weight the scan closes over keeps its view of
the leaf, marked ``shared`` over that scan's iterations. A higher-order
primitive the engine cannot read that touches the parameters or the batch is
recorded by :class:`Analyzer` (``unknown``), and the whole loss then takes
``method="vmap"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._jaxpr import _sites
from jaxclip.privacy._ghost._types import (
  CONST_INFO,
  DATA,
  DATA_INFO,
  PARAM,
  Info,
  Pair,
  Site,
  Stack,
)


class _ScanShape(NamedTuple):
  """A ``lax.scan`` whose body is walked per iteration: its parts and their classes."""

  nc: int  # consts
  nk: int  # carries
  length: int
  closed: Any  # the body's ClosedJaxpr
  body_infos: list[Info]  # consts, carries and xs, as the body sees them
  out_infos: list[Info]  # final carries, then ys
  reverse: bool
  unroll: Any


def _scan_shape(eqn: Any, infos: Sequence[Info], depth: int) -> _ScanShape | None:
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
  k_infos = [DATA_INFO if i.kind == DATA else CONST_INFO for i in infos[nc : nc + nk]]
  for _ in range(nk + 1):  # a carry becomes data once an iteration makes it so
    probe = Analyzer().walk(
      closed.jaxpr, closed.consts, [(None, i) for i in c_infos + k_infos + x_infos]
    )
    if any(i.kind == PARAM for _, i in probe[:nk]):
      return None
    new = [
      DATA_INFO if DATA in (a.kind, b.kind) else CONST_INFO
      for a, (_, b) in zip(k_infos, probe[:nk], strict=True)
    ]
    if new == k_infos:
      break
    k_infos = new
  ys_infos = [Info(PARAM, i.deps) if i.kind == PARAM else i for _, i in probe[nk:]]
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


class Walker:
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

  def computes(self, info: Info) -> bool:
    """Whether a value of this class is evaluated (outside sites)."""
    return True

  def computed(self, vals: Sequence[Any], infos: Sequence[Info]) -> list[Any]:
    """``vals``, with ``None`` for each value of a class that is not evaluated."""
    return [x if self.computes(i) else None for x, i in zip(vals, infos, strict=True)]

  def site(self, eqn: Any, vals: list[Any], infos: list[Info], aval: Any = None) -> list[Any]:
    """Records site ``eqn`` (``None``: the loss) and returns its outputs."""
    raise NotImplementedError

  def call(self, eqn: Any, body: tuple[Any, list[Any]], ins: list[Pair]) -> list[Pair]:
    """Walks the body of a call primitive that a parameter goes into."""
    return self.walk(body[0], body[1], ins)

  def walk(self, jaxpr: Any, consts: Sequence[Any], ins: Sequence[Pair]) -> list[Pair]:
    env: dict[Any, Pair] = {}

    def read(v):
      return (_jax.literal_value(v), CONST_INFO) if _jax.is_literal(v) else env[v]

    def write(v, x):
      if not _jax.is_dropped(v):
        env[v] = x

    for v, c in zip(jaxpr.constvars, consts, strict=True):
      write(v, (c, CONST_INFO))
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
    if _sites.is_site(eqn, infos):
      return [(x, DATA_INFO) for x in self.site(eqn, vals, infos)]
    if DATA in kinds:
      info = DATA_INFO
    elif PARAM in kinds:
      info = _sites.view_of(eqn, infos)
    else:
      info = CONST_INFO
    res = self.bind(eqn, vals, info) if self.computes(info) else [None] * len(eqn.outvars)
    return [(x, info) for x in res]

  def bind(self, eqn: Any, vals: list[Any], info: Info | None = None) -> list[Any]:
    """Evaluates an equation that is not a site (its primitive applied to ``vals``); ``info``
    is its outputs' class."""
    del info
    return _jax.bind(eqn, vals)

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
    zs, fixed = self.site_zeros(u0, u1)
    scans = [self.scans]

    def step(carry, x):
      xv, zv = x
      if fixed:  # zeros closed over: their gradient is summed over the iterations
        zv = [zs[j] if j in fixed else z for j, z in enumerate(zv)]
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
      (vals[nc + nk :], zs if not fixed else [() if j in fixed else z for j, z in enumerate(zs)]),
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

  def site_zeros(self, u0: int, u1: int) -> tuple[list[Any] | None, frozenset[int]]:
    """The zeros added to sites ``u0`` to ``u1`` (``None``: none added), and the positions among
    them of those that are the same for every iteration of the scan being entered."""
    return None, frozenset()

  def child(self, zs: Any, *, base: int, stack: Stack, scans: int) -> Walker:
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


class Analyzer(Walker):
  """Finds the sites (``self.sites``), from the classes of the values alone."""

  in_remat = False  # whether the walk is inside a rematerialised call

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    # Why the engine cannot read each higher-order equation it does not know
    # that touches the parameters or the batch, once each, in order.
    self.unknown: list[str] = []

  def computes(self, info: Info) -> bool:
    return False

  def walk(self, jaxpr: Any, consts: Sequence[Any], ins: Sequence[Pair]) -> list[Pair]:
    first = len(self.sites)
    outs = super().walk(jaxpr, consts, ins)
    _sites.join_outputs(jaxpr, self.sites, first)
    return outs

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

  def site(self, eqn: Any, vals: list[Any], infos: list[Info], aval: Any = None) -> list[Any]:
    roles = _sites.site_roles(eqn, infos)
    avals = [aval] if eqn is None else [v.aval for v in eqn.outvars]
    outs = _sites.float_outs(eqn, aval)
    self.sites.append(
      Site(
        eqn,
        roles,
        tuple(i for i, r in zip(infos, roles, strict=True) if r == PARAM),
        outs,
        tuple(avals[j] for j in outs),
        (),  # the planner's (jaxclip.privacy._ghost._rules.rules_of)
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


def input_infos(ndims: Sequence[int], batched: Sequence[bool]) -> list[Info]:
  """The classes of the loss's inputs: the parameter leaves, then the arguments."""
  return [Info(PARAM, frozenset({i}), i, tuple(range(ndim))) for i, ndim in enumerate(ndims)] + [
    DATA_INFO if b else CONST_INFO for b in batched
  ]


def analysis(closed: Any, in_infos: Sequence[Info]) -> tuple[list[Site], tuple[str, ...]]:
  """The sites of a traced per-example loss, and why the engine cannot read each higher-order
  equation it does not know that touches the parameters or the batch (if any: the loss then
  takes ``method="vmap"``)."""
  walker = Analyzer()
  walker.run(closed, [(None, i) for i in in_infos])
  return walker.sites, tuple(walker.unknown)


def dtypes(jaxpr: Any) -> set[Any]:
  """The dtype of every array of a ``Jaxpr`` or ``ClosedJaxpr``: its inputs, outputs and each
  equation's, those of its sub-jaxprs included."""
  j = getattr(jaxpr, "jaxpr", jaxpr)
  own = [*j.invars, *j.constvars, *j.outvars, *(v for e in j.eqns for v in (*e.invars, *e.outvars))]
  subs = [sub for e in j.eqns for sub in _jax.sub_jaxprs(e)]
  return {getattr(v.aval, "dtype", None) for v in own}.union(*map(dtypes, subs)) - {None}
