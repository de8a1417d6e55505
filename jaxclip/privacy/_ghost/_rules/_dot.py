"""The ``dot`` rule: a ``dot_general`` whose one operand is a parameter and the other data.

Each example's gradient of the param operand is ``A^T G`` per dot batch
index (``A`` the data operand's rows, ``G`` the output gradient's), so its
squared norm is ``<A A^T, G G^T>``: the Gram form costs ``T^2 (C + F)``
flops against ``T C F`` for the gradient, and the cheaper one is taken
(Li et al., 2022, "ghost clipping"; Bu et al., 2023, mixed ghost clipping).
A weight every iteration of a scan reads gets every iteration's rows together.

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
from jaxclip.privacy._ghost._rules._base import Rule, formed_in_backward, levels
from jaxclip.privacy._ghost._rules._scaling import gram_is_cheaper
from jaxclip.privacy._ghost._types import DATA, Site


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


def dot_operands(site: Site, pos: int, a: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
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
  """Each example's ``||grad of the dot_general's param operand||^2``, as
  :func:`~jaxclip.privacy._ghost._rules._scaling.read` reads it.

  Args as :func:`_dot_operands`, but for ``shared``: the number of scan axes
  (after the batch axis of ``a`` and ``g``) over whose iterations the
  parameter is the same value. Its gradient is then the sum over those
  iterations, ``[A_1; A_2; ...]^T [G_1; G_2; ...]``: one ``dot_general`` whose
  rows are every iteration's rows.
  """
  return _scaling.read(dot_parts(site, pos, a, g, shared))


def dot_parts(site: Site, pos: int, a: jax.Array, g: jax.Array, shared: int = 0) -> _scaling.Parts:
  """The :class:`~jaxclip.privacy._ghost._rules._scaling.Parts` of :func:`dot_sumsq`."""
  operands = lambda a, g: dot_operands(site, pos, a, g)
  for _ in range(shared):
    operands = jax.vmap(operands, in_axes=1, out_axes=2)
  a, g = operands(a, g)  # (examples, n, iterations..., T, C or F)
  n, nb = a.shape[0], a.shape[1]
  return _scaling.mixed_parts(a.reshape(n, nb, -1, a.shape[-1]), g.reshape(n, nb, -1, g.shape[-1]))


def _row_dims(site: Site, g: jax.Array) -> tuple[int, list[int], list[int], range]:
  """``(lead, rows, contract, param_free)``: the records' leading axes (examples, then one per
  scan), the data operand's batch and free dims (its rows, in the output's order) and its
  contracting dims, and the output's param-free dims."""
  pos = site.param_positions()[0]
  _, (batch, free, contract) = dot_dims(site, pos)
  lead = g.ndim - len(site.eqn.outvars[0].aval.shape)
  out_nd, nb, nf = g.ndim - lead, len(batch), len(free)
  param_free = range(nb + nf, out_nd) if pos == 1 else range(nb, out_nd - nf)
  return lead, batch + free, contract, param_free


def balanced(site: Site, d: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(d 2**-k, g 2**k)`` for a ``dot_general`` site's data records and output gradients
  (every example, leading axes), ``k`` one exponent per row (:func:`_scaling.halfway` of the
  row's largest entries): the pull-back of the site's one param input is unchanged in exact
  arithmetic (powers of two, exactly), and no row's ``g``, weighted by its example's clip
  weight, is flushed below the normal range where its ``a`` is large
  (:func:`jaxclip.privacy._ghost._book._balance`). Nothing is flushed or overflows that was
  not: both lie between the two exponents. Float32 (or wider) values, half precision widened.
  """
  lead, rows, contract, param_free = _row_dims(site, g)
  d = _numerics.upcast_for_accumulation(d)
  g = _numerics.upcast_for_accumulation(g)
  at = lambda axes: tuple(lead + i for i in axes)
  md, mg = _scaling.largest(d, at(contract)), _scaling.largest(g, at(param_free))
  rest = [i for i in range(d.ndim - lead) if i not in contract]  # the rows' dims, d's order
  perm = [*range(lead), *(lead + rest.index(i) for i in rows)]  # as the output orders them
  md = jnp.expand_dims(jnp.transpose(jnp.squeeze(md, at(contract)), perm), at(param_free))
  k = _scaling.halfway(md, mg)  # g's layout, param-free dims of size 1
  back = jnp.transpose(jnp.squeeze(k, at(param_free)), [perm.index(i) for i in range(len(perm))])
  return _numerics.times_pow2(d, -jnp.expand_dims(back, at(contract))), _numerics.times_pow2(g, k)


class DotRule(Rule):
  """The ``dot`` rule (see the module's docstring)."""

  name = "dot"
  takes_shared = True

  def matches(self, eqn: Any, roles: tuple[str, ...], pos: int) -> bool:
    return (
      eqn is not None
      and _jax.dot_dimension_numbers(eqn) is not None
      and len(roles) == 2
      and roles[1 - pos] == DATA
    )

  def sumsq(self, site: Site, k: int, w: Any, a: jax.Array, g: jax.Array) -> jax.Array:
    del w
    return dot_sumsq(site, site.param_positions()[k], a, g, len(site.infos[k].shared))

  def _dims(self, site: Site, k: int) -> tuple[int, int, int, int, int]:
    """``(reps, n, T, C, F)``: ``T`` counts the rows of every iteration that reads the weight."""
    reps, rows = levels(site, k)
    nb, t, c, f = dot_dims(site, site.param_positions()[k])[0]
    return reps, nb, t * rows, c, f

  def cost(self, site: Site, k: int) -> tuple[int, int]:
    reps, nb, t, c, f = self._dims(site, k)
    grad = nb * t * c * f
    ghost = nb * t * t * (c + f) if gram_is_cheaper(t, c, f) else grad
    return ghost * reps, grad * reps

  def form(self, site: Site, k: int) -> str:
    _, _, t, c, f = self._dims(site, k)
    return "dot:gram" if gram_is_cheaper(t, c, f) else "dot"

  def work(self, site: Site, k: int) -> int:
    reps, nb, t, c, f = self._dims(site, k)
    return reps * nb * (2 * t * t if gram_is_cheaper(t, c, f) else c * f)

  def accumulates(self, site: Site, k: int) -> bool:
    _, _, t, c, f = self._dims(site, k)
    return formed_in_backward(site, k, not gram_is_cheaper(t, c, f))


DOT = DotRule()
