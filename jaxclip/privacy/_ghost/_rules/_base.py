"""Ghost rules: what a rule declares, and the costs of the per-example gradient it replaces.

A rule (:class:`Rule`) turns one site's records, its data inputs ``a`` and
output gradients ``g`` for every example, into each example's squared norm
of the gradient of one of its param inputs, without that gradient. It
declares which sites it applies to (:meth:`Rule.matches`), the squared norm
(:meth:`Rule.sumsq`), what it costs in flops (:meth:`Rule.cost`) and in
floats held (:meth:`Rule.memory`, from :meth:`Rule.work`), and whether the
per-example gradient is better formed where ``a`` and ``g`` meet in the
backward pass (:meth:`Rule.accumulates`). The base class is the
per-example gradient itself: its costs are those of a site no rule covers
(:mod:`jaxclip.privacy._ghost._rules._instantiate`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip.privacy._ghost._types import DATA, Site


def levels(site: Site, k: int) -> tuple[int, int]:
  """The iterations of a boundary's scans that read their own parameter value, and those that
  read one value (its ``shared`` levels)."""
  shared = site.infos[k].shared
  own = math.prod(n for j, (_, n) in enumerate(site.stack) if j not in shared)
  return own, math.prod(n for j, (_, n) in enumerate(site.stack) if j in shared)


def size(avals: Any) -> int:
  return sum(math.prod(a.shape) for a in avals)


class Rule:
  """A way to a param input's per-example squared gradient norm; the base: none (instantiate).

  Attributes:
    name: How :func:`jaxclip.ghost_plan` names the rule.
    reads_param: Whether :meth:`sumsq` reads the site's param input (a
      convolution's kernel); the others get ``None``.
    takes_shared: Whether it takes a weight that every iteration of a scan
      reads (``Info.shared``), their rows together; otherwise such a leaf is
      instantiated.
  """

  name = "instantiate"
  reads_param = False
  takes_shared = False

  def matches(self, eqn: Any, roles: tuple[str, ...], pos: int) -> bool:
    """Whether the rule applies to input ``pos`` (a param input) of ``eqn`` (``None``: the loss).

    ``roles`` are the inputs' classes (``"param"``, ``"data"``, ``"const"``).
    """
    del eqn, roles, pos
    return False

  def sumsq(self, site: Site, k: int, w: Any, a: jax.Array, g: jax.Array) -> jax.Array:
    """Each example's squared norm of the gradient of param input ``k`` (leading batch axis).

    ``w`` is the param input's value (for :attr:`reads_param`), ``a`` the data
    input (a lookup's ids) and ``g`` the output gradient, for every example.
    Inside scans a rule sees one iteration (its :attr:`takes_shared` levels
    excepted: their axes follow the batch axis).
    """
    raise NotImplementedError(f"the {self.name!r} rule has no squared norm of its own")

  def cost(self, site: Site, k: int) -> tuple[int, int]:
    """Per example, the flops of the rule and of the per-example gradient it replaces.

    The base: an elementwise or small operation, about its outputs' size.
    """
    reps, rows = levels(site, k)
    grad = size(site.out_avals) * rows * reps
    return grad, grad

  def form(self, site: Site, k: int) -> str:
    """The rule's form at a boundary, as the cost model (``_cost_model``) names it: the rule's
    name, with ``":gram"`` where it takes the Gram form."""
    del site, k
    return self.name

  def work(self, site: Site, k: int) -> int:
    """Per example, the floats the rule's own arithmetic holds (Gram matrices, sums)."""
    del site, k
    return 0

  def memory(self, site: Site, k: int) -> tuple[int, int]:
    """Per example, the floats a boundary holds under the rule and instantiated.

    Under the rule: the site's records (its data inputs and output gradients,
    kept for the norms and the book-keeping) and the rule's :meth:`work`.
    Instantiated: the per-example gradient of its param input, taken in the
    backward pass, where that is smaller than the records (a tapped site);
    otherwise the records and the per-example gradient formed from them.
    """
    reps, rows = levels(site, k)
    stack = reps * rows
    data = [v.aval for v, r in zip(site.eqn.invars, site.roles, strict=True) if r == DATA]
    records = stack * size([*data, *site.out_avals])
    param = stack * math.prod(site.param_avals()[k].shape)
    return records + self.work(site, k), param if param <= records else records + param

  def accumulates(self, site: Site, k: int) -> bool:
    """Whether the boundary's per-example gradient is formed in the backward pass instead."""
    del site, k
    return False


def formed_in_backward(site: Site, k: int, formed: bool) -> bool:
  """Whether a boundary whose rule would form each example's gradient (``formed``) forms it
  where ``a`` and ``g`` meet in the backward pass.

  That is a site of one param input, float32 or wider, whose per-example
  gradient is smaller than its output gradients: neither ``a`` nor ``g`` is
  then kept past that step for the site (its ``a`` may still be kept by the
  model's own backward pass, so only ``g`` is counted). Inside scans, a
  weight every iteration reads gets one gradient per example (each
  iteration's term added up there), and one sliced per iteration gets one
  per iteration.
  """
  if site.eqn is None or len(site.infos) != 1 or not formed:
    return False
  if site.infos[k].shared and not site.summed:  # shared by some of its scans only
    return False
  avals = [v.aval for v in site.eqn.invars] + list(site.out_avals)
  if any(jnp.finfo(a.dtype).bits < 32 for a in avals):
    return False
  iterations = math.prod(n for _, n in site.stack)
  grad = math.prod(site.param_avals()[k].shape) * (1 if site.summed else iterations)
  return grad < iterations * size(site.out_avals)
