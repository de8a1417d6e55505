"""Ghost norms: each site's ``a`` and ``g`` for every example, and its param inputs.

:class:`jaxclip.privacy._ghost._forward.Forward` evaluates one example, adding
a zero at each site and recording its data inputs ``a``; :class:`ParamsPass`
evaluates only what does not depend on the batch and records each site's
param and const inputs. :func:`capture` runs both over a batch.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _sharding
from jaxclip.privacy._ghost._forward import Forward
from jaxclip.privacy._ghost._jaxpr import _sites
from jaxclip.privacy._ghost._jaxpr._walk import Walker, input_infos
from jaxclip.privacy._ghost._types import (
  CONST,
  DATA,
  PARAM,
  Captured,
  Info,
  Pair,
  Site,
  Stack,
)
from jaxclip.privacy._ghost._wide import wide_bind, widened


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
  no rounding to half precision on the way (:mod:`jaxclip.privacy._ghost._book`).
  """

  def bind(self, eqn: Any, vals: list[Any], info: Info | None = None) -> list[Any]:
    del info
    return wide_bind(eqn, vals)

  def site(self, eqn: Any, vals: list[Any], infos: list[Info], aval: Any = None) -> list[Any]:
    return super().site(eqn, [widened(v) for v in vals], infos, aval)

  def scan(self, eqn: Any, shape: Any, ins: list[Pair]) -> list[Pair]:
    return super().scan(eqn, shape, [(widened(x), i) for x, i in ins])


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
      (see :class:`~jaxclip.privacy._ghost._forward.Forward`).
    borrowed: ``{site: site}``: the sites that take another's output
      gradient, the same value (:func:`jaxclip.privacy._ghost._jaxpr._sites.borrowed`).
    accumulated: As in :class:`~jaxclip.privacy._ghost._forward.Forward`.
    early: As in :class:`~jaxclip.privacy._ghost._forward.Forward`.
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

  def losses(leaves, zs):
    def one(zs_b, data_b):
      walker = Forward(
        zs_b, sites, inputs.tapped, inputs.probed, inputs.accumulated, early=inputs.early
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
    if u in inputs.early:  # a tied head's own term's parts (_sumsq.probe_tied_head)
      avals = [*avals, jax.ShapeDtypeStruct((3,), acc)]
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
  loss, vjp, (aux, drecs) = jax.vjp(losses, inputs.leaves, zs, has_aux=True)
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
    # Under the value's own mesh: jit of Explicit-sharded arrays needs no mesh set.
    with jax.sharding.use_abstract_mesh(sharding.mesh):
      return jnp.zeros(shape, dtype, out_sharding=jax.P(spec[0], *[None] * (len(shape) - 1)))
  return jnp.zeros(shape, dtype)
