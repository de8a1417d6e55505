"""Ghost norms: the records the engine's stages share.

The classes of a value (:class:`Info`), the sites (:class:`Site`), the
boundaries and leaves a plan names (:class:`Boundary`, :class:`Instantiated`,
:class:`Ghost`, :class:`Tied`) and what the capture gives (:class:`Captured`).
The stages (:mod:`~jaxclip.privacy._ghost._jaxpr._sites` and
:mod:`~jaxclip.privacy._ghost._jaxpr._walk` find the sites,
:mod:`~jaxclip.privacy._ghost._planning` plans, :mod:`~jaxclip.privacy._ghost._forward`,
:mod:`~jaxclip.privacy._ghost._capture`, :mod:`~jaxclip.privacy._ghost._rules._instantiate`
and :mod:`~jaxclip.privacy._ghost._book` execute) import these; this module
imports none of them, so planning does not import execution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PARAM, DATA, CONST = "param", "data", "const"

Stack = tuple[tuple[int, int], ...]  # (scan id, length) of each enclosing scan, outermost first
Pair = tuple[Any, "Info"]  # a value (or None where not computed) and its class


@dataclasses.dataclass(frozen=True)
class Info:
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


CONST_INFO = Info(CONST)
DATA_INFO = Info(DATA)


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
    rules: For each ``PARAM`` input, the name of the rule it can get
      (:func:`jaxclip.privacy._ghost._rules.rules_of`: ``"dot"``,
      ``"lookup"``, ``"conv"``, ... or ``"instantiate"``); set by the
      planner, empty as the walk finds the site.
    stack: ``(scan id, length)`` of each ``lax.scan`` the site is in,
      outermost first: its records then carry one leading axis per scan (one
      entry per iteration).
    remat: Whether the site is inside a rematerialised call
      (``jax.checkpoint``, flax ``nn.remat``): the model asks for its
      activations to be recomputed rather than kept.
    joins: The first of the sites whose outputs meet this one's through sums
      alone (:func:`join_outputs`), or ``None``: their output gradients are
      the same value.
  """

  eqn: Any
  roles: tuple[str, ...]
  infos: tuple[Info, ...]
  outs: tuple[int, ...]
  out_avals: tuple[Any, ...]
  rules: tuple[str, ...]
  stack: Stack = ()
  remat: bool = False
  joins: int | None = None

  @property
  def name(self) -> str:
    """The name of the equation's primitive (as ``_internals.name`` reads it), or "the loss"."""
    return "the loss" if self.eqn is None else self.eqn.primitive.name

  def param_positions(self) -> list[int]:
    return [i for i, r in enumerate(self.roles) if r == PARAM]

  def param_avals(self) -> list[Any]:
    """The abstract values of the param inputs (per iteration inside scans)."""
    if self.eqn is None:
      return list(self.out_avals)
    return [self.eqn.invars[p].aval for p in self.param_positions()]

  def zero_avals(self, tapped: bool) -> list[Any]:
    """What :class:`~jaxclip.privacy._ghost._forward.Forward` adds zeros to: the param inputs
    if ``tapped``, else the outputs."""
    return self.param_avals() if tapped else list(self.out_avals)

  @property
  def summed(self) -> bool:
    """Whether every param input is the same value in every iteration of the site's scans.

    Tapped (see :class:`jaxclip.privacy._ghost._forward.Forward`), such a site
    gets one zero closed over by the scans, and the gradient with respect to
    it is the sum of the iterations' (one bias row per example, not one per
    iteration).
    """
    every = frozenset(range(len(self.stack)))
    return bool(self.stack) and self.eqn is not None and all(i.shared == every for i in self.infos)


class Boundary(NamedTuple):
  """A param input of a site: the boundary a leaf's gradient passes through."""

  site: int
  pos: int  # the position among the site's param inputs


class Instantiated(NamedTuple):
  """Leaves whose per-example gradients are instantiated together, and their boundaries."""

  leaves: tuple[int, ...]
  bounds: tuple[Boundary, ...]


class Ghost(NamedTuple):
  """A param input whose per-example squared norm a rule gives."""

  site: int
  pos: int  # the position among the site's param inputs
  rule: str


class Tied(NamedTuple):
  """The two boundaries of a table used tied: a lookup of its rows and a dot with it."""

  lookup: Boundary
  dot: Boundary


HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_half(x: Any) -> bool:
  """Whether ``x`` (a value or abstract value) is bfloat16 or float16 (``False`` for a key)."""
  if x is None:
    return False
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.extended):
    return False
  return jnp.result_type(x if dtype is None else dtype) in HALF


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
      respect to each param input instead (summed over the scan iterations,
      with no axis for them, where the site is ``summed``); for a probed
      site, its squared norms (one per example and scan iteration).
    pvals: Per site, its param inputs (one axis per enclosing scan).
    cvals: Per site, its const inputs.
    params_pass: ``leaves -> (pvals, cvals)``.
    pull: The pull-back of ``pvals`` to the leaves (``jax.vjp`` of
      ``params_pass``).
    aux: The aux leaves the loss returns for every example.
    spmd_axis_name: Passed to ``vmap``.
    tapped: As in :class:`~jaxclip.privacy._ghost._capture.Inputs`, with the
      accumulated sites (their ``gs`` are their param inputs' gradients too).
    accumulated: As in :class:`~jaxclip.privacy._ghost._capture.Inputs`.
    weighted: With probed sites, ``weights -> sum_b weights_b grad_b`` (the
      parameters' gradients, in their dtypes, in float32 where the model has
      half precision: see ``wide`` in
      :class:`~jaxclip.privacy._ghost._forward.Forward`): the second backward pass.
    wide_pass: ``params_pass`` evaluated in float32 where the model has half
      precision (:class:`~jaxclip.privacy._ghost._capture.WideParamsPass`), for float32 leaves.
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
  accumulated: frozenset[int] = frozenset()
  wide_pass: Any = None

  def wide(self) -> bool:
    """Whether any leaf or site value is bfloat16 or float16: the book-keeping then sums in
    float32 (:mod:`jaxclip.privacy._ghost._book`)."""
    values = [self.leaves, self.pvals, self.cvals, self.gs, self.drecs]
    return any(is_half(x) for x in jax.tree.leaves(values))


@dataclasses.dataclass(frozen=True)
class Plan:
  """How each parameter leaf's per-example norm is computed.

  Attributes:
    sites: The sites of the program, in order.
    ghost: ``(site, position, rule)`` for leaves handled by a ghost rule.
    tied: ``((site, position), (site, position))`` of the lookup and the
      ``dot_general`` of each embedding table tied to an output head: both
      rules, plus their cross term.
    instantiated: The :class:`Instantiated` leaves whose
      per-example gradients are instantiated (at most one: a single
      per-example pass through each of their sites).
    cost: Per example, the flops of this plan's norms and those of forming
      every per-example gradient.
    tapped: The sites whose per-example param-input gradients are taken in
      the backward pass instead of their output gradients and data inputs
      (:func:`jaxclip.privacy._ghost._planning._tapped`).
    probed: The ghost sites whose squared norms are taken in the backward
      pass, their ``a`` and ``g`` kept no longer than that step; the
      clipped sum is then a second, weighted backward pass instead of
      book-kept (:func:`jaxclip.privacy._ghost._planning._probed`). Empty for the one-pass plan.
    unknown: Why the engine cannot read each higher-order equation it does
      not know that touches the parameters or the batch
      (:func:`jaxclip.privacy._ghost._jaxpr._internals.unreadable`); if any, the whole
      loss takes ``method="vmap"`` whatever the rules.
    num_leaves: The number of parameter leaves.
    chosen: ``(leaf, reason)`` of each leaf that has a ghost rule but is
      instantiated by choice (``method="auto"``, :func:`auto_plan`).
    notes: ``(leaf, reason)`` of each leaf that keeps its ghost rule under
      ``method="auto"``: the costs that kept it.
    half: Whether the loss computes a bfloat16 or float16 value anywhere: a
      rematerialised model then keeps one pass (``probed`` empty).
  """

  sites: tuple[Site, ...]
  ghost: tuple[Ghost, ...]
  tied: tuple[Tied, ...]
  instantiated: tuple[Instantiated, ...]
  cost: tuple[int, int] = (0, 0)
  tapped: frozenset[int] = frozenset()
  probed: frozenset[int] = frozenset()
  unknown: tuple[str, ...] = ()
  num_leaves: int = 0
  chosen: tuple[tuple[int, str], ...] = ()
  notes: tuple[tuple[int, str], ...] = dataclasses.field(default=(), compare=False)
  half: bool = False

  @property
  def two_pass(self) -> bool:
    """Whether the clipped sum is a second backward pass (see ``probed``)."""
    return bool(self.probed)

  @property
  def held_in_half(self) -> bool:
    """Whether a rematerialised ghost site keeps its records for one pass because the loss
    computes in half precision (:func:`jaxclip.privacy._ghost._planning._probed`)."""
    return self.half and any(self.sites[u].remat for u, _, _ in self.ghost)
