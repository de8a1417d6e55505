"""The ``conv`` rule: a convolution whose kernel is a parameter and whose input is data.

The kernel's gradient is ``A^T G`` per feature group, ``A`` the input's
patches (one row per output position, one column per kernel tap) and ``G``
the output gradient: the ``dot`` rule over positions, through the Gram
matrices when the positions are few, otherwise the per-example kernel
gradient (Bu et al., 2023; formed tap by tap in the backward pass where that
is cheaper: :mod:`jaxclip.privacy._ghost._rules._conv_taps`).

References:
  Bu et al., 2023, `Differentially Private Optimization on Large Model at
  Small Cost <https://arxiv.org/abs/2210.00038>`_.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy._ghost import _wide
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._rules import _scaling
from jaxclip.privacy._ghost._rules._base import Rule, formed_in_backward, levels
from jaxclip.privacy._ghost._rules._scaling import gram_is_cheaper
from jaxclip.privacy._ghost._types import DATA, Site


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
  per-example kernel gradient, formed without the patches (in float32), its
  squares read within its rounding's bound
  (:func:`~jaxclip.privacy._ghost._rules._scaling.formed_parts`).

  Args:
    site: A ``conv_general_dilated`` site whose kernel (operand 1) is the parameter.
    kernel: The kernel's value at the site, repeated for every example.
    a: The input, for every example (leading batch axis).
    g: The gradient with respect to the output, for every example.
  """
  eqn = site.eqn
  params = _jax.conv_parts(eqn)
  dn = params.dimension_numbers
  rhs_aval = eqn.invars[1].aval
  groups, positions, taps, outs = conv_dims(site)
  if not gram_is_cheaper(positions, taps, outs):  # the per-example kernel gradient costs less

    def one(k_b, a_b, g_b):  # in float32 (or wider), as the rules sum
      _, vjp = jax.vjp(lambda k: _wide.wide_bind(eqn, [a_b, k])[0], _wide.widened(k_b))
      (grad,) = vjp(_wide.widened(g_b))
      return grad

    # Each entry sums a product per output position, each input entry is in at most
    # `window` of the patches, so the terms in absolute value are at most sqrt(window)
    # ||a|| ||g|| (_scaling.formed_parts), from the records as they are.
    window = math.prod(rhs_aval.shape[d] for d in dn.rhs_spec[2:])
    (qa, ka), (qg, kg) = _scaling.frobenius(a), _scaling.frobenius(g)
    k, m = ka + kg, window * qa * qg
    s = _numerics.times_pow2(_scaling.safe_sumsq(jax.vmap(one)(kernel, a, g)), -2 * k)
    e = positions * jnp.finfo(s.dtype).eps * jnp.sqrt(m)
    return _scaling.read(_scaling.up_parts(_scaling.formed_parts(s, e, m), 2 * k))

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
      precision=_scaling.HIGHEST,
    )  # N, C * K, out spatial...
    return jnp.moveaxis(p, 1, -1).reshape(positions, -1)

  n = a.shape[0]
  pa = jax.vmap(patches)(_numerics.upcast_for_accumulation(a)).reshape(n, positions, groups, taps)
  pg = jnp.moveaxis(
    jnp.transpose(_numerics.upcast_for_accumulation(g), (0, *(1 + d for d in dn.out_spec))), 2, -1
  )
  pg = pg.reshape(n, positions, groups, outs)
  return _scaling.mixed_sumsq(jnp.swapaxes(pa, 1, 2), jnp.swapaxes(pg, 1, 2))


class ConvRule(Rule):
  """The ``conv`` rule (see the module's docstring)."""

  name = "conv"
  reads_param = True

  def matches(self, eqn: Any, roles: tuple[str, ...], pos: int) -> bool:
    parts = None if eqn is None else _jax.conv_parts(eqn)
    return (
      pos == 1
      and len(roles) == 2
      and roles[0] == DATA
      and parts is not None
      and parts.batch_group_count == 1
      and parts.dimension_numbers is not None
    )

  def sumsq(self, site: Site, k: int, w: Any, a: jax.Array, g: jax.Array) -> jax.Array:
    del k
    return conv_sumsq(site, w, a, g)

  def cost(self, site: Site, k: int) -> tuple[int, int]:
    reps = levels(site, k)[0]
    groups, positions, taps, outs = conv_dims(site)
    grad = groups * positions * taps * outs
    cheap = gram_is_cheaper(positions, taps, outs)
    ghost = groups * positions * positions * (taps + outs) if cheap else grad
    return ghost * reps, grad * reps

  def form(self, site: Site, k: int) -> str:
    _, positions, taps, outs = conv_dims(site)
    return "conv:gram" if gram_is_cheaper(positions, taps, outs) else "conv"

  def work(self, site: Site, k: int) -> int:
    reps, rows = levels(site, k)
    groups, positions, taps, outs = conv_dims(site)
    cheap = gram_is_cheaper(positions, taps, outs)
    return reps * rows * groups * (2 * positions * positions if cheap else taps * outs)

  def accumulates(self, site: Site, k: int) -> bool:
    _, positions, taps, outs = conv_dims(site)
    return formed_in_backward(site, k, not gram_is_cheaper(positions, taps, outs))


CONV = ConvRule()
