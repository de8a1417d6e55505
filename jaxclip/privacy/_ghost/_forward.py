"""Ghost norms: one example's evaluation, with a zero added at each site.

:class:`Forward` evaluates one example, adds a zero to each site's float
outputs (so that the gradient with respect to those zeros is the site's output
gradient ``g``) and records each site's data inputs ``a``; at a *tapped* site
the zeros go to its param inputs instead; at a *probed* site it records
nothing and the gradient with respect to its zero is the site's squared norm,
computed from ``a`` and ``g`` in the backward pass (:func:`_probe`).
:func:`jaxclip.privacy._ghost._capture.capture` runs it over a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._jaxpr import _sites
from jaxclip.privacy._ghost._jaxpr._walk import Analyzer, Walker
from jaxclip.privacy._ghost._rules import _conv_taps
from jaxclip.privacy._ghost._types import DATA, PARAM, Info, Pair, Site, Stack


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
  gradient (``borrowed`` in :class:`jaxclip.privacy._ghost._capture.Inputs`)
  and gets no zero.

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
      (:meth:`jaxclip.privacy._ghost._rules._base.Rule.accumulates`). Where the input is
      the same value in every iteration of the site's scans, the zero is
      closed over by them, and the gradient is summed over the iterations.
  """

  def __init__(
    self,
    zs: Sequence[Sequence[Any]],
    sites: Sequence[Site],
    tapped: frozenset[int] = frozenset(),
    probed: Mapping[int, Callable[..., Any]] | None = None,
    accumulated: frozenset[int] = frozenset(),
    early: Mapping[int, Callable[..., Any]] | None = None,
    **kwargs: Any,
  ):
    super().__init__(sites, **kwargs)
    self.zs = zs
    self.tapped = tapped
    self.probed = probed or {}
    self.accumulated = accumulated
    self.early = early or {}

  def site(self, eqn: Any, vals: list[Any], infos: list[Info], aval: Any = None) -> list[Any]:
    index = len(self.records)
    roles = _sites.site_roles(eqn, infos)
    u = self.base + index
    fn = self.probed.get(u) or (_param_gradient(eqn, roles) if u in self.accumulated else None)
    if eqn is not None and fn is not None:
      self.records.append([])
      out = _jax.bind(eqn, vals)
      floats = _sites.float_outs(eqn, aval)
      (z,) = self.zs[index]
      probed = _probe(
        fn,
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
      vals = [
        v + next(zs).astype(v.dtype) if r == PARAM else v for v, r in zip(vals, roles, strict=True)
      ]
      return _jax.bind(eqn, vals)
    self.records.append([v for v, r in zip(vals, roles, strict=True) if r == DATA])
    if eqn is None:  # the loss, which depends on the parameters alone
      out = list(vals)
    else:
      out = _jax.bind(eqn, vals)
    zs, early = list(self.zs[index]), self.early.get(u) if eqn is not None else None
    z_early = zs.pop() if early is not None else None
    if zs:  # none where the site takes another's output gradient (``borrowed``)
      floats = _sites.float_outs(eqn, aval)
      for j, z in zip(floats, zs, strict=True):
        out[j] = out[j] + z
      if early is not None:
        pvals = [v for v, r in zip(vals, roles, strict=True) if r == PARAM]
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
  (:mod:`jaxclip.privacy._ghost._rules._conv_taps`); otherwise, as at any other site, by
  ``jax.vjp`` of the site's primitive.
  """
  parts = _jax.conv_parts(eqn)
  if parts is not None and list(roles) == [DATA, PARAM] and _conv_taps.patches_fit(eqn, parts):
    return lambda pvals, dvals, gs: _conv_taps.kernel_gradient(parts, pvals[0], dvals[0], gs[0])

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
