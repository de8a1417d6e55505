"""The ``scale`` rule: an elementwise product of a parameter and data, the parameter repeated.

A layer norm's or RMS norm's scale (``x_hat * scale``; flax linen and nnx,
equinox under ``vmap``, by hand) reaches the loss through a ``mul`` whose
param operand is a view of the leaf with size-1 axes where the data operand
has positions (``(1, d)`` against ``(T, d)``, or ``(T, 1)`` against
``(1, d)`` where flax multiplies ``rsqrt(var + eps)`` by the scale first):
``mul`` broadcasts the size-1 axes itself. (A ``broadcast_in_dim`` that
repeats the scale's values, ``jnp.broadcast_to``, is not a view of the leaf:
such a scale is instantiated, exactly.) Each example's gradient of
the scale is ``grad_j = sum_t g_tj a_tj`` over the repeated axes ``t`` (``a``
the data operand, ``g`` the output gradient), so

.. math::

  \\|\\nabla\\|^2 = \\sum_j \\Big(\\sum_t g_{tj} \\, a_{tj}\\Big)^2,

formed per example from the site's records, as book-keeping forms a
per-example gradient from ``a`` and ``g`` (Bu et al., 2023); where it is
smaller than the output gradient (float32), it is formed in the backward
pass instead (:meth:`ScaleRule.accumulates`), as the ``dot`` rule's is. A
weight every iteration of a scan reads sums their terms before squaring.
The gradient is the size of the scale, so it is formed outright (as
``jax.grad`` forms it) and only its squares are summed scaled, so that no
finite example's squares overflow (as the other rules, Li et al., 2022).

References:
  Li et al., 2022, `Large Language Models Can Be Strong Differentially
  Private Learners <https://arxiv.org/abs/2110.05679>`_; Bu et al., 2023,
  `Differentially Private Optimization on Large Model at Small Cost
  <https://arxiv.org/abs/2210.00038>`_.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._rules import _scaling
from jaxclip.privacy._ghost._rules._base import Rule, formed_in_backward, levels, size
from jaxclip.privacy._ghost._types import DATA, PARAM, Site


def summed_dims(site: Site, k: int) -> tuple[int, ...]:
  """The output axes along which param input ``k``'s elements repeat: its gradient is the
  output gradient times the data operand, summed over them (those where the operand has size
  1, or no axis: numpy's alignment, and the output not)."""
  p, out = site.param_avals()[k].shape, site.out_avals[0].shape
  p = (1,) * (len(out) - len(p)) + tuple(p)
  return tuple(d for d in range(len(out)) if p[d] == 1 and out[d] != 1)


def scale_sumsq(a: jax.Array, g: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """Each example's ``sum (sum over axes of g * a)^2`` (leading batch axis), overflow-safe.

  The per-example gradient is formed as ``jax.grad`` forms it, ``g * a``
  summed over the repeated axes, in float32 for half-precision records: its
  entries are finite wherever the gradient's are (no record is squared on
  its own, unlike a Gram product), and its squares are summed scaled: ``inf``
  beyond the dtype's range. Each entry sums signed products, which may
  cancel: it is read within its rounding's bound, the same sum of the
  products' absolute values bounding it
  (:func:`~jaxclip.privacy._ghost._rules._scaling.formed_of`), never under-read.
  """
  a, g = _numerics.upcast_for_accumulation(a), _numerics.upcast_for_accumulation(g)
  terms = math.prod(g.shape[d] for d in axes)
  products = g * a
  magnitude = jnp.sum(jnp.abs(products), axis=axes)
  return _scaling.read(_scaling.formed_of(jnp.sum(products, axis=axes), magnitude, terms))


class ScaleRule(Rule):
  """The ``scale`` rule (see the module's docstring)."""

  name = "scale"
  takes_shared = True

  def matches(self, eqn: Any, roles: tuple[str, ...], pos: int) -> bool:
    """A ``mul`` of param input ``pos`` and data, into a float output."""
    if eqn is None or not _jax.is_mul(eqn) or len(roles) != 2 or len(eqn.outvars) != 1:
      return False
    if roles[pos] != PARAM or roles[1 - pos] != DATA:
      return False
    p, out = eqn.invars[pos].aval, eqn.outvars[0].aval
    return jnp.issubdtype(out.dtype, jnp.floating) and p.ndim <= out.ndim

  def sumsq(self, site: Site, k: int, w: Any, a: jax.Array, g: jax.Array) -> jax.Array:
    """``a`` and ``g`` for every example; inside scans, the axes of the ``shared`` levels
    (a scale every iteration reads) follow the batch axis, and are summed over first."""
    del w
    shared = len(site.infos[k].shared)
    lead = 1 + shared
    a = a.reshape(a.shape[:lead] + (1,) * (g.ndim - a.ndim) + a.shape[lead:])
    axes = tuple(range(1, lead)) + tuple(lead + d for d in summed_dims(site, k))
    return scale_sumsq(a, g, axes)

  def cost(self, site: Site, k: int) -> tuple[int, int]:
    """A product and a sum per output element, as the per-example gradient it forms."""
    reps, rows = levels(site, k)
    flops = size(site.out_avals) * reps * rows
    return flops, flops

  def work(self, site: Site, k: int) -> int:
    """The per-example gradient of the repeated view, per iteration of its own."""
    out, dims = site.out_avals[0].shape, summed_dims(site, k)
    return levels(site, k)[0] * math.prod(n for d, n in enumerate(out) if d not in dims)

  def memory(self, site: Site, k: int) -> tuple[int, int]:
    """As the base rule counts it, but for the gradient formed in the backward pass: that
    gradient alone, no records."""
    ghost, instantiated = super().memory(site, k)
    return (self.work(site, k) if self.accumulates(site, k) else ghost), instantiated

  def accumulates(self, site: Site, k: int) -> bool:
    """Where the per-example gradient (float32 or wider) is smaller than the output gradient:
    it is then formed in the backward pass, as the ``dot`` rule's is."""
    return formed_in_backward(site, k, True)


SCALE = ScaleRule()
