"""Ghost norms: each site's ``a`` and ``g`` for every example, and its param inputs.

:class:`Forward` evaluates one example, adds a zero to each site's float
outputs (so that the gradient with respect to those zeros is the site's output
gradient ``g``) and records each site's data inputs ``a``; at a *probed* site
it records nothing and the gradient with respect to its zero is the site's
squared norm, computed from ``a`` and ``g`` in the backward pass
(:func:`_probe`). :class:`ParamsPass` evaluates only what does not depend on
the batch and records each site's param and const inputs. :func:`capture`
runs both over a batch.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _sharding
from jaxclip.privacy import _ghost_conv
from jaxclip.privacy import _ghost_sites as _sites
from jaxclip.privacy import _jax_internals as _jax
from jaxclip.privacy._ghost_types import (
  CONST,
  DATA,
  HALF,
  PARAM,
  Captured,
  Info,
  Pair,
  Site,
  Stack,
  is_half,
)
from jaxclip.privacy._ghost_walk import Analyzer, Walker, input_infos


class Forward(Walker):
  """Evaluates one example, adding zeros at each site and recording its data inputs.

  The zeros ``zs[u]`` go to the float outputs of site ``u`` (the gradient with
  respect to them is the site's output gradient ``g``), or, for a site in
  ``tapped``, to its param inputs (the gradient is then the example's
  gradient of those inputs, and nothing is recorded; summed over the scan
  iterations, the zeros closed over by the scans, where those inputs are
  the same value in every iteration). A site in ``probed`` gets one scalar
  zero, whose gradient is the site's squared norm (see :func:`_probe`), and
  records nothing. A site whose ``zs[u]`` is empty takes another's output
  gradient (``borrowed`` in :class:`Inputs`) and gets no zero.

  Args:
    zs: For each site from ``base`` on, the zeros added to it.
    sites: The sites, from :class:`Analyzer`.
    tapped: The sites whose param inputs get the zeros.
    probed: For each probed site, ``fn(pvals, dvals, gs)``: one example's
      squared norm from the site's param and data inputs and its output
      gradients (of one scan iteration).
    early: For some recorded sites, ``fn(pvals, dvals, gs)`` as in ``probed``:
      one more scalar zero (the last of ``zs[u]``), whose gradient is that
      site's squared norm, taken in the backward pass *before* its output
      gradient flows on (``lax.optimization_barrier``), so that XLA need not
      hold that gradient through the rest of the backward pass for the
      norm (a tied head's own term in a two-pass plan, whose output gradient
      is as large as its logits).
    accumulated: Sites of one param input whose zero goes to that input:
      the gradient with respect to it, the example's gradient of that
      input, is formed in the backward pass from the site's data input and
      output gradient (:func:`_probe`), with nothing recorded
      (:func:`jaxclip.privacy._ghost_norms.accumulates`). Where the input is
      the same value in every iteration of the site's scans, the zero is
      closed over by them, and the gradient is summed over the iterations.
    wide: Whether the parameters' values come in float32 copies of
      half-precision leaves (the two-pass plan's forward pass, whose second
      backward pass gives the clipped sum): what depends on the parameters
      alone is then evaluated in float32 (:func:`wide_bind`), and each site
      in float32 with its outputs rounded to their dtypes, so that the model's
      values are those of its own dtypes while the parameters' gradients,
      summed over the batch at each site, are float32 (:func:`_narrowed`).
  """

  def __init__(
    self,
    zs: Sequence[Sequence[Any]],
    sites: Sequence[Site],
    tapped: frozenset[int] = frozenset(),
    probed: Mapping[int, Callable[..., Any]] | None = None,
    accumulated: frozenset[int] = frozenset(),
    wide: bool = False,
    early: Mapping[int, Callable[..., Any]] | None = None,
    **kwargs: Any,
  ):
    super().__init__(sites, **kwargs)
    self.zs = zs
    self.tapped = tapped
    self.probed = probed or {}
    self.accumulated = accumulated
    self.wide = wide
    self.early = early or {}

  def bind(self, eqn: Any, vals: list[Any], info: Info | None = None) -> list[Any]:
    if not self.wide:
      return _jax.bind(eqn, vals)
    if info is not None and info.kind == PARAM:
      return wide_bind(eqn, vals)
    return _jax.bind(eqn, _narrowed(vals, eqn.invars))

  def bind_site(self, eqn: Any, vals: list[Any]) -> list[Any]:
    """A site's outputs: with ``wide``, evaluated in float32 and rounded to their dtypes."""
    if not self.wide:
      return _jax.bind(eqn, vals)
    return _narrowed(wide_bind(eqn, vals), eqn.outvars)

  def run(self, closed: Any, ins: Sequence[Pair]) -> list[Any]:
    outs = super().run(closed, ins)
    return _narrowed(outs, closed.jaxpr.outvars) if self.wide else outs

  def site(self, eqn: Any, vals: list[Any], infos: list[Info], aval: Any = None) -> list[Any]:
    index = len(self.records)
    roles = _sites.site_roles(eqn, infos)
    u = self.base + index
    fn = self.probed.get(u) or (_param_gradient(eqn, roles) if u in self.accumulated else None)
    if eqn is not None and fn is not None:
      self.records.append([])
      out = self.bind_site(eqn, vals)
      floats = _sites.float_outs(eqn, aval)
      (z,) = self.zs[index]
      narrow = _narrowed(vals, eqn.invars) if self.wide else vals
      probed = _probe(
        fn,
        [out[j] for j in floats],
        [v for v, r in zip(narrow, roles, strict=True) if r == PARAM],
        [v for v, r in zip(vals, roles, strict=True) if r == DATA],
        z,
      )
      for j, x in zip(floats, probed, strict=True):
        out[j] = x
      return out
    if eqn is not None and self.base + index in self.tapped:
      self.records.append([])
      zs = iter(self.zs[index])
      vals = [
        v + next(zs).astype(v.dtype) if r == PARAM else v for v, r in zip(vals, roles, strict=True)
      ]
      return self.bind_site(eqn, vals)
    self.records.append([v for v, r in zip(vals, roles, strict=True) if r == DATA])
    if eqn is None:  # the loss, which depends on the parameters alone
      out = [vals[0].astype(aval.dtype)] if self.wide else list(vals)
    else:
      out = self.bind_site(eqn, vals)
    zs, early = list(self.zs[index]), self.early.get(u) if eqn is not None else None
    z_early = zs.pop() if early is not None else None
    if zs:  # none where the site takes another's output gradient (``borrowed``)
      floats = _sites.float_outs(eqn, aval)
      for j, z in zip(floats, zs, strict=True):
        out[j] = out[j] + z
      if early is not None:
        narrow = _narrowed(vals, eqn.invars) if self.wide else vals
        pvals = [v for v, r in zip(narrow, roles, strict=True) if r == PARAM]
        dvals = [v for v, r in zip(vals, roles, strict=True) if r == DATA]
        taken = _probe(early, [out[j] for j in floats], pvals, dvals, z_early, barrier=True)
        for j, x in zip(floats, taken, strict=True):
          out[j] = x
    return out

  def site_zeros(self, u0: int, u1: int) -> tuple[list[Any], frozenset[int]]:
    into = self.tapped | self.accumulated  # zeros added to param inputs
    fixed = (u for u in range(u0, u1) if u in into and self.sites[u].summed)
    return list(self.zs[u0 - self.base : u1 - self.base]), frozenset(u - u0 for u in fixed)

  def child(self, zs: Any, *, base: int, stack: Stack, scans: int) -> Forward:
    return Forward(
      zs,
      self.sites,
      self.tapped,
      self.probed,
      self.accumulated,
      self.wide,
      self.early,
      base=base,
      stack=stack,
      scans=scans,
    )

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


def _param_gradient(eqn: Any, roles: Sequence[str]) -> Callable[..., Any]:
  """``(pvals, dvals, gs) ->`` one example's gradient of a site's one param input (of one
  scan iteration), for :func:`_probe`.

  A convolution's kernel gradient is taken one kernel tap at a time where its
  input's patches would be no larger than its input and output together
  (:mod:`jaxclip.privacy._ghost_conv`); otherwise, as at any other site, by
  ``jax.vjp`` of the site's primitive.
  """
  parts = _jax.conv_parts(eqn)
  if parts is not None and list(roles) == [DATA, PARAM] and _ghost_conv.patches_fit(eqn, parts):
    return lambda pvals, dvals, gs: _ghost_conv.kernel_gradient(parts, pvals[0], dvals[0], gs[0])

  def fn(pvals, dvals, gs):
    def outputs(p):
      ds = iter(dvals)
      return _jax.bind(eqn, [p if r == PARAM else next(ds) for r in roles])[0]

    return jax.vjp(outputs, pvals[0])[1](gs[0])[0]

  return fn


def _probe(
  fn: Callable[..., Any],
  outs: list[Any],
  pvals: list[Any],
  dvals: list[Any],
  z: Any,
  barrier: bool = False,
) -> list[Any]:
  """``outs``, unchanged; the gradient with respect to ``z`` is ``fn(pvals, dvals, gs)``.

  ``gs`` are the gradients with respect to ``outs``, which pass through
  unchanged: the backward pass computes the site's squared norm (or, for an
  accumulated site, its param input's gradient) where its ``a`` and ``g``
  meet, and nothing of the site outlives that step (inside a rematerialised
  layer, ``a`` is recomputed there as the model asks). Inside a ``lax.scan``
  the gradient with respect to a per-iteration ``z`` is that iteration's
  value; with respect to a ``z`` the scan closes over, their sum. With
  ``barrier``, ``gs`` pass on only with the norm taken
  (``lax.optimization_barrier``): the rest of the backward pass waits for
  it, and XLA's scheduler cannot hold ``gs`` past that point for it.
  """

  dtype = z.dtype

  @jax.custom_vjp
  def identity(outs, pvals, dvals, z):
    return outs

  def fwd(outs, pvals, dvals, z):
    return outs, (pvals, dvals)

  def bwd(res, gs):
    pvals, dvals = res
    norm = fn(pvals, dvals, gs).astype(dtype)
    if barrier:
      gs, norm = jax.lax.optimization_barrier((gs, norm))
    return gs, None, None, norm

  identity.defvjp(fwd, bwd)
  return identity(outs, pvals, dvals, z)


class ParamsPass(Walker):
  """Evaluates what does not depend on the batch; records each site's ``(param inputs,
  const inputs)``."""

  def computes(self, info: Info) -> bool:
    return info.kind != DATA

  def site(self, eqn: Any, vals: list[Any], infos: list[Info], aval: Any = None) -> list[Any]:
    roles = _sites.site_roles(eqn, infos)
    self.records.append(
      (
        [v for v, r in zip(vals, roles, strict=True) if r == PARAM],
        [v for v, r in zip(vals, roles, strict=True) if r == CONST],
      )
    )
    return [None] * (1 if eqn is None else len(eqn.outvars))

  def child(self, zs: Any, *, base: int, stack: Stack, scans: int) -> ParamsPass:
    return type(self)(self.sites, base=base, stack=stack, scans=scans)


class WideParamsPass(ParamsPass):
  """:class:`ParamsPass` evaluated in float32 (or wider) where the model has half precision.

  Every bfloat16 or float16 value is widened to float32 (exactly), and each
  equation is evaluated on the widened values, a half-precision dtype among
  its parameters (a cast's target, a dot's ``preferred_element_type``) taken
  as float32. Given float32 copies of the leaves, its pull-back
  (``jax.vjp``) carries the book-keeping's float32 sums to the leaves with
  no rounding to half precision on the way (:mod:`jaxclip.privacy._ghost_book`).
  """

  def bind(self, eqn: Any, vals: list[Any], info: Info | None = None) -> list[Any]:
    del info
    return wide_bind(eqn, vals)

  def site(self, eqn: Any, vals: list[Any], infos: list[Info], aval: Any = None) -> list[Any]:
    return super().site(eqn, [widened(v) for v in vals], infos, aval)

  def scan(self, eqn: Any, shape: Any, ins: list[Pair]) -> list[Pair]:
    return super().scan(eqn, shape, [(widened(x), i) for x, i in ins])


def widened(x: Any) -> Any:
  """``x`` in float32 if it is bfloat16 or float16 (exact), else ``x``."""
  return x.astype(jnp.float32) if is_half(x) else x


def _narrowed(vals: Sequence[Any], avars: Sequence[Any]) -> list[Any]:
  """Each value in its variable's half-precision dtype where it was widened (:func:`widened`);
  the others as they are."""
  return [
    x.astype(v.aval.dtype) if x is not None and is_half(v.aval) and x.dtype != v.aval.dtype else x
    for x, v in zip(vals, avars, strict=True)
  ]


class _Wide(NamedTuple):
  primitive: Any
  params: dict[str, Any]


def wide_bind(eqn: Any, vals: Sequence[Any]) -> list[Any]:
  """An equation evaluated on its inputs widened (:func:`widened`), a half-precision dtype
  among its parameters taken as float32; an equation that holds a jaxpr is evaluated in its
  own dtypes, its outputs widened."""
  if _jax.sub_jaxprs(eqn):
    narrow = [
      x.astype(v.aval.dtype) if is_half(v.aval) and x is not None else x
      for x, v in zip(vals, eqn.invars, strict=True)
    ]
    return [widened(x) for x in _jax.bind(eqn, narrow)]
  params = {
    k: jnp.dtype(jnp.float32) if isinstance(v, np.dtype) and v in HALF else v
    for k, v in eqn.params.items()
  }
  return _jax.bind(_Wide(eqn.primitive, params), [widened(x) for x in vals])


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
    borrowed: ``{site: site}``: the sites that take another's output
      gradient, the same value (:func:`jaxclip.privacy._ghost_sites.borrowed`).
    accumulated: As in :class:`Forward`.
    early: As in :class:`Forward`.
  """

  closed: Any
  leaves: list[jax.Array]
  arg_leaves: list[Any]
  batched: Sequence[bool]
  spmd_axis_name: Any
  tapped: frozenset[int] = frozenset()
  probed: Mapping[int, Callable[..., Any]] = types.MappingProxyType({})
  borrowed: Mapping[int, int] = types.MappingProxyType({})
  accumulated: frozenset[int] = frozenset()
  early: Mapping[int, Callable[..., Any]] = types.MappingProxyType({})

  def infos(self) -> list[Info]:
    return input_infos([jnp.ndim(x) for x in self.leaves], self.batched)

  def data(self) -> list[Any]:
    return [x for x, b in zip(self.arg_leaves, self.batched, strict=True) if b]


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
    tapped=inputs.tapped | inputs.accumulated,
    weighted=weighted,
    accumulated=inputs.accumulated,
    wide_pass=_params_pass(inputs, sites, WideParamsPass),
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

  # Two passes with half precision: the forward pass takes float32 copies of the leaves (see
  # ``wide`` in :class:`Forward`), so the second backward pass sums in float32.
  wide = bool(inputs.probed) and _has_half(inputs.leaves, sites)

  def losses(leaves, zs):
    def one(zs_b, data_b):
      walker = Forward(
        zs_b, sites, inputs.tapped, inputs.probed, inputs.accumulated, wide, early=inputs.early
      )
      ins = list(zip(list(leaves) + merge(data_b), in_infos, strict=True))
      outs = walker.run(inputs.closed, ins)
      return outs[0], (outs[1:], walker.records)

    return jax.vmap(one, spmd_axis_name=inputs.spmd_axis_name)(zs, data)

  acc = _numerics.tree_accumulation_dtype(inputs.leaves)

  def zeros(u, s):
    if u in inputs.borrowed:
      return ()
    tapped = u in inputs.tapped or u in inputs.accumulated
    stack = () if tapped and s.summed else tuple(length for _, length in s.stack)
    avals = [jax.ShapeDtypeStruct((), acc)] if u in inputs.probed else s.zero_avals(tapped)
    if u in inputs.early:
      avals = [*avals, jax.ShapeDtypeStruct((), acc)]
    return tuple(_batch_zeros((n, *stack, *a.shape), a.dtype, data[0]) for a in avals)

  zs = [zeros(u, s) for u, s in enumerate(sites)]
  # Inside shard_map the zeros must vary as the examples do: the gradient with
  # respect to a value that is the same on every device is summed over them.
  vary = frozenset().union(*map(_sharding.varying_axes, inputs.leaves + inputs.arg_leaves))
  if vary:
    zs = _sharding.cast_varying(zs, tuple(sorted(vary, key=str)))
  lend = lambda gs: [gs[inputs.borrowed.get(u, u)] for u in range(len(gs))]
  if not inputs.probed:  # the zeros only
    loss, vjp, (aux, drecs) = jax.vjp(lambda zs: losses(inputs.leaves, zs), zs, has_aux=True)
    return drecs, lend(vjp(jnp.ones_like(loss))[0]), aux, None
  leaves = [widened(x) for x in inputs.leaves] if wide else inputs.leaves
  loss, vjp, (aux, drecs) = jax.vjp(losses, leaves, zs, has_aux=True)
  gs = lend(vjp(jnp.ones_like(loss))[1])
  return drecs, gs, aux, lambda weights: vjp(_rounded_down(weights, loss.dtype))[0]


def _rounded_down(weights: jax.Array, dtype: Any) -> jax.Array:
  """``weights`` in ``dtype``, each rounded toward zero where ``dtype`` is narrower: a clip
  weight rounded up to half precision would let its example exceed its clip."""
  out = weights.astype(dtype)
  if jnp.finfo(dtype).bits >= jnp.finfo(weights.dtype).bits:
    return out
  above = jnp.abs(out.astype(weights.dtype)) > jnp.abs(weights)
  return jnp.where(above, jnp.nextafter(out, jnp.zeros((), dtype)), out)


def _has_half(leaves: Sequence[Any], sites: Sequence[Site]) -> bool:
  """Whether a leaf, or a site's input or output, is bfloat16 or float16."""
  avals = [v.aval for s in sites if s.eqn is not None for v in (*s.eqn.invars, *s.eqn.outvars)]
  return any(is_half(x) for x in [*leaves, *avals, *(a for s in sites for a in s.out_avals)])


def _params_pass(inputs: Inputs, sites: Sequence[Site], kind: type = ParamsPass) -> Any:
  """``leaves -> (pvals, cvals)``: each site's param and const inputs (``kind``: the walker,
  :class:`WideParamsPass` for float32 values)."""
  in_infos = inputs.infos()
  shared = [None if b else x for x, b in zip(inputs.arg_leaves, inputs.batched, strict=True)]

  def params_pass(ls):
    walker = kind(sites)
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
