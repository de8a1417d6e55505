"""Per-example gradient norms without per-example gradients (ghost norms).

The engine behind ``per_example_clipped_grad(..., method="ghost")``. It works
on the traced jaxpr of one example's loss, so any JAX model (pure JAX, flax
linen or nnx, equinox) is handled without per-framework layer classes.

Every value of the program is classed as depending on the parameters only
(*param*), on the batch (*data*), or on neither (*const*). A *site* is an
equation that takes a floating-point param value and a data value, such as
``x @ W`` or ``E[ids]``: the loss depends on the parameters through the sites
alone, so for example ``b``

.. math::

  \\nabla_\\theta \\ell_b = \\sum_u J_{h_u}^\\top \\, \\partial_V f_u(V_u, a_{u,b})^\\top g_{u,b}

where ``V_u = h_u(theta)`` is the site's param input, ``a_{u,b}`` its data
input and ``g_{u,b}`` the gradient of the loss with respect to the site's
output. One pass gives every ``a`` and ``g``: the batch's loss is evaluated
(under ``vmap``) with a zero added to each site's output, and differentiated
with respect to those zeros only.

Then, for each example:

* a parameter whose only use is one ``dot_general`` (dense layers, einsums,
  attention projections) gets its norm from ``a`` and ``g`` alone:
  ``||A^T G||^2`` is ``<A A^T, G G^T>`` (cost ``T^2`` per example for ``T``
  rows) or, when ``T^2`` exceeds the weight's size, ``A^T G`` formed once
  per example (the *mixed ghost norm* rule);
* a parameter whose only use is an embedding lookup (``E[ids]``,
  ``jnp.take``) gets it from the rows' gradients and the ids:
  ``sum_{t,s} [id_t = id_s] <g_t, g_s>``, repeated tokens included;
* an embedding table also used, transposed, by an output head (tied
  weights) gets both of these plus their cross term,
  ``sum_{t,s} G[s, id_t] <g_t, a_s>``;
* every other parameter (layer-norm scales and biases, convolutions, weights
  used twice otherwise, anything used through a ``custom_jvp`` or a loop) is
  grouped with the parameters it shares a use with, and its per-example
  gradient is instantiated exactly, for that group only, in chunks of
  examples: for scales and biases this is a cheap per-example reduction.

The clipped sum is then book-kept: ``sum_b w_b g_{u,b}`` pulled back through
each site (one matmul for a dense layer) and through ``h``, with no second
pass over the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaxclip import _distributed
from jaxclip import _numerics

PARAM, DATA, CONST = "param", "data", "const"
# Call primitives whose body is walked when a parameter goes in (so that the
# uses inside a jitted or rematerialised layer are seen one by one; the ghost
# pass then stores that layer's activations rather than recomputing them).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2"})
# Primitives that rearrange a parameter without changing its values: the
# gradient of the result has the norm of the parameter's gradient.
_VIEWS = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p",
                    "convert_element_type", "broadcast_in_dim"})
# Elements of per-example gradients one chunk of a group may hold at once.
_CHUNK_ELEMENTS = 1 << 24
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class _Info:
  """What a value of the program depends on."""

  kind: str
  deps: frozenset[int] = frozenset()  # the parameter leaves it depends on
  view: int | None = None  # the leaf it is a rearrangement of, if any
  axes: tuple[int, ...] | None = None  # for such a view, the leaf axis of each of its axes


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
    rules: For each ``PARAM`` input, ``"dot"``, ``"gather"`` or ``"generic"``.
  """

  eqn: Any
  roles: tuple[str, ...]
  infos: tuple[_Info, ...]
  outs: tuple[int, ...]
  out_avals: tuple[Any, ...]
  rules: tuple[str, ...]

  @property
  def name(self) -> str:
    return "the loss" if self.eqn is None else self.eqn.primitive.name

  def param_positions(self) -> list[int]:
    return [i for i, r in enumerate(self.roles) if r == PARAM]


def _is_float(aval: Any) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.floating)


def _bind(eqn: Any, vals: Sequence[Any]) -> list[Any]:
  out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _body(eqn: Any) -> tuple[Any, list[Any]] | None:
  """The jaxpr and consts of a call primitive's body, or ``None``."""
  if eqn.primitive.name not in _CALLS:
    return None
  inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if isinstance(inner, jex.ClosedJaxpr):
    return inner.jaxpr, list(inner.consts)
  if isinstance(inner, jex.Jaxpr) and not inner.constvars:
    return inner, []
  return None


def _view_of(eqn: Any, infos: list[_Info]) -> _Info:
  """What an equation's output depends on, when its inputs depend on params only."""
  deps = frozenset().union(*(i.deps for i in infos))
  name = eqn.primitive.name
  params = [i for i in infos if i.kind == PARAM]
  if name not in _VIEWS or len(params) != 1 or params[0].view is None or len(eqn.outvars) != 1:
    return _Info(PARAM, deps)
  src, out = eqn.invars[0].aval, eqn.outvars[0].aval
  if not (_is_float(src) and _is_float(out)) or infos[0].kind != PARAM:
    return _Info(PARAM, deps)
  if math.prod(src.shape) != math.prod(out.shape):
    return _Info(PARAM, deps)  # broadcast_in_dim that repeats values
  axes = params[0].axes
  if axes is not None and name == "transpose":
    axes = tuple(axes[p] for p in eqn.params["permutation"])
  elif tuple(src.shape) != tuple(out.shape):
    axes = None  # still the leaf's values, but not axis by axis
  return _Info(PARAM, deps, params[0].view, axes)


def _gather_is_lookup(eqn: Any) -> bool:
  """Whether a gather takes whole rows of its operand: ``E[ids]``, ``take(E, ids, 0)``."""
  dn = eqn.params["dimension_numbers"]
  op, idx = eqn.invars[0].aval, eqn.invars[1].aval
  rest = tuple(op.shape[1:])
  lead = idx.ndim - 1
  return (idx.ndim >= 1 and idx.shape[-1] == 1 and tuple(dn.collapsed_slice_dims) == (0,)
          and tuple(dn.start_index_map) == (0,) and not tuple(dn.operand_batching_dims)
          and tuple(eqn.params["slice_sizes"]) == (1,) + rest
          and tuple(dn.offset_dims) == tuple(range(lead, lead + len(rest))))


def _rule(eqn: Any, roles: tuple[str, ...], pos: int) -> str:
  if eqn is None:
    return "generic"
  name = eqn.primitive.name
  if name == "dot_general" and len(roles) == 2 and roles[1 - pos] == DATA:
    return "dot"
  if name == "gather" and pos == 0 and roles[1] == DATA and _gather_is_lookup(eqn):
    return "gather"
  return "generic"


class _Walker:
  """Walks a jaxpr, classifying its values and treating the sites by ``mode``.

  * ``"analyze"``: no values, only the static classification (``sites``);
  * ``"forward"``: evaluates everything, adds ``zs[u]`` to the float outputs
    of site ``u`` and records its data inputs (``records``);
  * ``"params"``: evaluates only what does not depend on the batch and
    records the param and const inputs of every site (``records``).
  """

  def __init__(self, mode: str, zs: Sequence[Sequence[Any]] | None = None):
    self.mode = mode
    self.zs = zs
    self.sites: list[Site] = []
    self.records: list[Any] = []

  def site(self, eqn: Any, vals: list[Any], infos: list[_Info], aval: Any = None) -> list[Any]:
    index = len(self.records)
    if eqn is None:
      roles = (PARAM,)
      avals = [aval]
    else:
      roles = tuple(PARAM if i.kind == PARAM and _is_float(v.aval) else
                    DATA if i.kind == DATA else CONST for i, v in zip(infos, eqn.invars))
      avals = [v.aval for v in eqn.outvars]
    outs = tuple(j for j, a in enumerate(avals) if _is_float(a))
    if self.mode == "analyze":
      self.sites.append(Site(
          eqn, roles, tuple(i for i, r in zip(infos, roles) if r == PARAM), outs,
          tuple(avals[j] for j in outs),
          tuple(_rule(eqn, roles, p) for p, r in enumerate(roles) if r == PARAM)))
      self.records.append(None)
      return [None] * len(avals)
    if self.mode == "params":
      self.records.append((
          [v for v, r in zip(vals, roles) if r == PARAM],
          [v for v, r in zip(vals, roles) if r == CONST]))
      return [None] * len(avals)
    self.records.append([v for v, r in zip(vals, roles) if r == DATA])
    out = list(vals) if eqn is None else _bind(eqn, vals)
    if self.zs is not None:
      for j, z in zip(outs, self.zs[index]):
        out[j] = out[j] + z
    return out

  def walk(self, jaxpr: Any, consts: Sequence[Any], ins: Sequence[tuple[Any, _Info]]
           ) -> list[tuple[Any, _Info]]:
    env: dict[Any, tuple[Any, _Info]] = {}

    def read(v):
      return (v.val, _CONST) if isinstance(v, jex.Literal) else env[v]

    def write(v, x):
      if not isinstance(v, jex.DropVar):
        env[v] = x

    for v, c in zip(jaxpr.constvars, consts):
      write(v, (c, _CONST))
    for v, x in zip(jaxpr.invars, ins):
      write(v, x)
    for eqn in jaxpr.eqns:
      ins_e = [read(v) for v in eqn.invars]
      vals = [x for x, _ in ins_e]
      infos = [i for _, i in ins_e]
      kinds = {i.kind for i in infos}
      body = _body(eqn) if PARAM in kinds else None
      if body is not None:
        outs = self.walk(body[0], body[1], ins_e)
      elif DATA in kinds and any(i.kind == PARAM and _is_float(v.aval)
                                 for i, v in zip(infos, eqn.invars)) and any(
                                     _is_float(v.aval) for v in eqn.outvars):
        outs = [(x, _DATA) for x in self.site(eqn, vals, infos)]
      else:
        if DATA in kinds:
          info = _DATA
        elif PARAM in kinds:
          info = _view_of(eqn, infos)
        else:
          info = _CONST
        skip = self.mode == "analyze" or (self.mode == "params" and info.kind == DATA)
        res = [None] * len(eqn.outvars) if skip else _bind(eqn, vals)
        outs = [(x, info) for x in res]
      for v, x in zip(eqn.outvars, outs):
        write(v, x)
    return [read(v) for v in jaxpr.outvars]

  def run(self, closed: Any, ins: Sequence[tuple[Any, _Info]]) -> list[Any]:
    outs = self.walk(closed.jaxpr, closed.consts, ins)
    loss, info = outs[0]
    if info.kind == PARAM:  # the loss does not depend on the example
      loss = self.site(None, [loss], [info], closed.jaxpr.outvars[0].aval)[0]
    return [loss] + [x for x, _ in outs[1:]]


def site_outputs(site: Site, pvals: Sequence[Any], cvals: Sequence[Any], dvals: Sequence[Any]
                 ) -> list[Any]:
  """The floating-point outputs of ``site`` for the given inputs."""
  if site.eqn is None:
    return list(pvals)
  its = {PARAM: iter(pvals), CONST: iter(cvals), DATA: iter(dvals)}
  out = _bind(site.eqn, [next(its[r]) for r in site.roles])
  return [out[j] for j in site.outs]


def _f32(x: jax.Array) -> jax.Array:
  return x.astype(_numerics.accumulation_dtype(x.dtype))


def _dot_operands(site: Site, pos: int, a: jax.Array, g: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
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
  eqn = site.eqn
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  contract, batch = (lc, lb) if pos == 1 else (rc, rb)
  d_aval = eqn.invars[1 - pos].aval
  size = lambda dims: math.prod(d_aval.shape[i] for i in dims)
  free = [i for i in range(d_aval.ndim) if i not in contract and i not in batch]
  nb, t, c = size(batch), size(free), size(contract)
  f = math.prod(eqn.invars[pos].aval.shape) // max(nb * c, 1)
  n = a.shape[0]
  perm = [0] + [1 + i for i in (*batch, *free, *contract)]
  a = _f32(jnp.transpose(a, perm).reshape(n, nb, t, c))
  g = _f32(g)
  if pos == 1:  # output dims: batch, data free, param free
    return a, g.reshape(n, nb, t, f)
  return a, jnp.swapaxes(g.reshape(n, nb, f, t), 2, 3)  # batch, param free, data free


def dot_sumsq(site: Site, pos: int, a: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of the dot_general's param operand||^2``.

  Args as :func:`_dot_operands`.
  """
  a, g = _dot_operands(site, pos, a, g)
  t, c, f = a.shape[2], a.shape[3], g.shape[3]
  if t == 1:
    return jnp.sum(jnp.sum(a * a, axis=(2, 3)) * jnp.sum(g * g, axis=(2, 3)), axis=1)
  if t * t <= c * f:  # ghost: <A A^T, G G^T>
    aa = jnp.einsum("bntc,bnsc->bnts", a, a, precision=_HIGHEST)
    gg = jnp.einsum("bntf,bnsf->bnts", g, g, precision=_HIGHEST)
    return jnp.sum(aa * gg, axis=(1, 2, 3))
  grad = jnp.einsum("bntc,bntf->bncf", a, g, precision=_HIGHEST)  # instantiated
  return jnp.sum(grad * grad, axis=(1, 2, 3))


def _lookup_operands(site: Site, ids: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An embedding lookup's ids ``(examples, T)``, in range, and row gradients ``(examples, T, R)``.

  Rows read out of range in ``FILL_OR_DROP`` mode get a zero gradient, as in
  JAX's own transpose of the gather.
  """
  eqn = site.eqn
  rows = eqn.invars[0].aval.shape[0]
  n = ids.shape[0]
  ids = ids.reshape(n, -1)
  g = _f32(g).reshape(n, ids.shape[1], -1)
  mode = getattr(eqn.params["mode"], "name", str(eqn.params["mode"]))
  if "FILL" in mode:  # out-of-range rows read the fill value: no gradient
    g = jnp.where(((ids >= 0) & (ids < rows))[..., None], g, 0)
  return jnp.clip(ids, 0, rows - 1), g


def gather_sumsq(site: Site, ids: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``||grad of the looked-up table||^2``, repeated rows included."""
  rows = site.eqn.invars[0].aval.shape[0]
  ids, g = _lookup_operands(site, ids, g)
  t = ids.shape[1]
  if t * t <= rows * g.shape[2]:
    gg = jnp.einsum("btr,bsr->bts", g, g, precision=_HIGHEST)
    return jnp.sum(jnp.where(ids[:, :, None] == ids[:, None, :], gg, 0), axis=(1, 2))
  table = jax.vmap(lambda i, x: jnp.zeros((rows, x.shape[1]), x.dtype).at[i].add(x))(ids, g)
  return jnp.sum(table * table, axis=(1, 2))


def tied_cross(lookup: Site, ids: jax.Array, g_rows: jax.Array, dot: Site, pos: int,
               a: jax.Array, g: jax.Array) -> jax.Array:
  """Each example's ``<grad through the lookup, grad through the dot>`` of one table.

  For a table ``E`` (``rows x R``) read by ``E[ids]`` and used by a
  ``dot_general`` that contracts its axis 1 and keeps its axis 0 (a tied
  output head, ``h @ E.T``), the dot's gradient of row ``r`` is
  ``sum_s G[s, r] a_s``, so the inner product is
  ``sum_{t,s} G[s, id_t] <g_t, a_s>``: cost ``T_lookup * T_dot`` per example.
  """
  ids, g_rows = _lookup_operands(lookup, ids, g_rows)
  a, g = _dot_operands(dot, pos, a, g)  # (b, 1, T, R) and (b, 1, T, rows)
  a, g = a[:, 0], g[:, 0]
  m = jnp.einsum("btr,bsr->bts", g_rows, a, precision=_HIGHEST)
  picked = jnp.take_along_axis(g, jnp.broadcast_to(ids[:, None, :], g.shape[:2] + ids.shape[1:]),
                               axis=2)  # (b, s, t): G[s, id_t]
  return jnp.sum(m * jnp.swapaxes(picked, 1, 2), axis=(1, 2))


def _tied_pair(sites: Sequence[Site], leaf: int, bounds: Sequence[tuple[int, int]]
               ) -> tuple[tuple[int, int], tuple[int, int]] | None:
  """``(lookup, dot)`` boundaries if a 2-D leaf is an embedding table tied to a head."""
  if len(bounds) != 2:
    return None
  by_rule = {sites[u].rules[k]: (u, k) for u, k in bounds}
  if set(by_rule) != {"gather", "dot"}:
    return None
  (gu, gk), (du, dk) = by_rule["gather"], by_rule["dot"]
  g_info, d_info = sites[gu].infos[gk], sites[du].infos[dk]
  if g_info.view != leaf or d_info.view != leaf or g_info.axes != (0, 1) or d_info.axes is None:
    return None
  eqn = sites[du].eqn
  pos = sites[du].param_positions()[dk]
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  contract, batch = (rc, rb) if pos == 1 else (lc, lb)
  if batch or len(contract) != 1 or d_info.axes[contract[0]] != 1:
    return None
  return (gu, gk), (du, dk)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How each parameter leaf's per-example norm is computed.

  Attributes:
    sites: The sites of the program, in order.
    ghost: ``(site, position, rule)`` for leaves handled by a ghost rule.
    tied: ``((site, position), (site, position))`` of the lookup and the
      ``dot_general`` of each embedding table tied to an output head: both
      rules, plus their cross term.
    groups: Lists of ``(leaves, boundaries)`` whose per-example gradients are
      instantiated; a boundary is ``(site, position among its params)``.
  """

  sites: tuple[Site, ...]
  ghost: tuple[tuple[int, int, str], ...]
  tied: tuple[tuple[tuple[int, int], tuple[int, int]], ...]
  groups: tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]


def make_plan(sites: Sequence[Site], num_leaves: int) -> Plan:
  """Groups the leaves by shared uses and picks each group's rule."""
  boundaries = [(u, k) for u, s in enumerate(sites) if s.outs for k in range(len(s.infos))]
  parent = list(range(num_leaves))

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for u, k in boundaries:
    deps = sorted(sites[u].infos[k].deps)
    for j in deps[1:]:
      parent[find(j)] = find(deps[0])
  members: dict[int, list[int]] = {}
  for i in range(num_leaves):
    members.setdefault(find(i), []).append(i)
  owned: dict[int, list[tuple[int, int]]] = {}
  for u, k in boundaries:
    deps = sites[u].infos[k].deps
    if deps:
      owned.setdefault(find(min(deps)), []).append((u, k))
  ghost, tied, groups = [], [], []
  for root, bounds in owned.items():
    leaves = tuple(members[root])
    if len(leaves) == 1 and len(bounds) == 1:
      u, k = bounds[0]
      if sites[u].infos[k].view == leaves[0] and sites[u].rules[k] != "generic":
        ghost.append((u, k, sites[u].rules[k]))
        continue
    pair = _tied_pair(sites, leaves[0], bounds) if len(leaves) == 1 else None
    if pair is not None:
      tied.append(pair)
      continue
    groups.append((leaves, tuple(bounds)))
  return Plan(tuple(sites), tuple(ghost), tuple(tied), tuple(groups))


def input_infos(ndims: Sequence[int], batched: Sequence[bool]) -> list[_Info]:
  """The classes of the loss's inputs: the parameter leaves, then the arguments."""
  return ([_Info(PARAM, frozenset({i}), i, tuple(range(ndim))) for i, ndim in enumerate(ndims)]
          + [_DATA if b else _CONST for b in batched])


def analyze(closed: Any, in_infos: Sequence[_Info]) -> list[Site]:
  """The sites of a traced per-example loss."""
  walker = _Walker("analyze")
  walker.run(closed, [(None, i) for i in in_infos])
  return walker.sites


def clipped_sum(
    closed: Any,
    plan: Plan,
    leaves: list[jax.Array],
    arg_leaves: list[Any],
    batched: Sequence[bool],
    weights_fn: Callable[[jax.Array], tuple[jax.Array, Any]],
    *,
    mask: jax.Array | None,
    spmd_axis_name: Any,
) -> tuple[list[jax.Array], jax.Array, Any, list[Any]]:
  """Per-example norms, then the weighted sum of per-example gradients.

  Args:
    closed: The ``ClosedJaxpr`` of one example's loss over ``leaves +
      arg_leaves`` (the loss first, then any aux leaves).
    plan: From :func:`make_plan`.
    leaves: The parameter leaves.
    arg_leaves: The argument leaves; those flagged in ``batched`` carry the
      examples on axis 0.
    batched: Which argument leaves are batched.
    weights_fn: Maps the per-example norms to ``(weights, extra)``.
    mask: Which examples are real, or ``None``. Not read here: the caller
      replaces the other rows by copies of a real example and ``weights_fn``
      gives them weight 0, so their output gradients (finite) drop out of the
      book-keeping with no copy of ``g`` masked.
    spmd_axis_name: Passed to ``vmap``.

  Returns:
    ``(sum_b weights_b * grad_b leaves, norms, extra, aux leaves)``, the sums
    in float32 (or wider).
  """
  sites = plan.sites
  in_infos = input_infos([jnp.ndim(x) for x in leaves], batched)
  data = [x for x, b in zip(arg_leaves, batched) if b]
  n = data[0].shape[0]

  def merge(data_b):
    it = iter(data_b)
    return [next(it) if b else x for x, b in zip(arg_leaves, batched)]

  def one(zs_b, data_b):
    walker = _Walker("forward", zs_b)
    outs = walker.run(closed, list(zip(leaves + merge(data_b), in_infos)))
    return outs[0], (outs[1:], walker.records)

  def total(zs):
    loss, rest = jax.vmap(one, spmd_axis_name=spmd_axis_name)(zs, data)
    return jnp.sum(loss), rest

  zs = [tuple(_batch_zeros((n,) + a.shape, a.dtype, data[0]) for a in s.out_avals)
        for s in sites]
  # Inside shard_map the zeros must vary as the examples do: the gradient with
  # respect to a value that is the same on every device is summed over them.
  vary = frozenset().union(*map(_distributed.varying_axes, leaves + arg_leaves))
  if vary:
    zs = _distributed.cast_varying(zs, tuple(sorted(vary, key=str)))
  gs, (aux, drecs) = jax.grad(total, has_aux=True)(zs)

  def params_pass(ls):
    walker = _Walker("params")
    walker.run(closed, list(zip(list(ls) + [None if b else x for x, b in zip(arg_leaves, batched)],
                                in_infos)))
    return [p for p, _ in walker.records], [c for _, c in walker.records]

  pvals, pull, cvals = jax.vjp(params_pass, leaves, has_aux=True)

  acc = _numerics.tree_accumulation_dtype(leaves)  # as method="vmap" sums squares
  sumsq = jnp.zeros((n,), acc)
  for u, k, rule in plan.ghost:
    site = sites[u]
    if rule == "dot":
      part = dot_sumsq(site, site.param_positions()[k], drecs[u][0], gs[u][0])
    else:
      part = gather_sumsq(site, drecs[u][0], gs[u][0])
    sumsq = sumsq + part.astype(acc)
  for (gu, _), (du, dk) in plan.tied:
    pos = sites[du].param_positions()[dk]
    ids, rows, a, g = drecs[gu][0], gs[gu][0], drecs[du][0], gs[du][0]
    part = (gather_sumsq(sites[gu], ids, rows) + dot_sumsq(sites[du], pos, a, g)
            + 2 * tied_cross(sites[gu], ids, rows, sites[du], pos, a, g))
    sumsq = sumsq + part.astype(acc)
  for group in plan.groups:
    sumsq = sumsq + _group_sumsq(group, sites, leaves, params_pass, pvals, cvals, drecs, gs,
                                 spmd_axis_name).astype(acc)
  norms = _numerics.safe_sqrt(sumsq)
  weights, extra = weights_fn(norms)

  # Book-keeping: sum_b w_b g_b pulled back through each site, then through h.
  cts = []
  for u, site in enumerate(sites):  # every site has a float output
    wg = [_weighted(g, weights) for g in gs[u]]
    fn = lambda pv, site=site, c=cvals[u], d=drecs[u]: jax.vmap(
        lambda db: site_outputs(site, pv, c, db), spmd_axis_name=spmd_axis_name)(d)
    vjp = _site_vjp(site, fn, pvals[u])
    cts.append(vjp(wg)[0])
  (grads,) = pull(cts)
  grads = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in grads]
  return grads, norms, extra, aux


def _site_vjp(site: Site, fn: Callable[[Any], Any], primals: Any) -> Callable[[Any], Any]:
  """``jax.vjp(fn, primals)[1]``, with errors naming the site's primitive."""

  def named(call, *args):
    try:
      return call(*args)
    except Exception as exc:  # re-raised with the primitive's name
      raise ValueError(
          "per_example_clipped_grad(method='ghost') cannot differentiate the loss with respect "
          f"to the parameters through `{site.name}`: {exc}") from exc

  vjp = named(lambda: jax.vjp(fn, primals)[1])
  return lambda cts: named(vjp, cts)


def _batch_zeros(shape: tuple[int, ...], dtype: Any, like: jax.Array) -> jax.Array:
  """Zeros with a batch axis sharded as ``like``'s (under an Explicit mesh)."""
  sharding = getattr(jax.typeof(like), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec and spec[0] is not None and not sharding.mesh.empty:
    return jnp.zeros(shape, dtype, out_sharding=jax.P(spec[0], *[None] * (len(shape) - 1)))
  return jnp.zeros(shape, dtype)


def _weighted(g: jax.Array, weights: jax.Array) -> jax.Array:
  dtype = _numerics.compute_dtype(g.dtype)
  w = weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(dtype)
  return (g.astype(dtype) * w).astype(g.dtype)


def _group_sumsq(group, sites, leaves, params_pass, pvals, cvals, drecs, gs, spmd_axis_name):
  """Per-example squared norms of a group's gradients, instantiated in chunks."""
  members, bounds = group
  by_site: dict[int, list[int]] = {}
  for u, k in bounds:
    by_site.setdefault(u, []).append(k)
  order = [(u, k) for u in by_site for k in by_site[u]]

  def boundary_values(sub):
    full = list(leaves)
    for i, x in zip(members, sub):
      full[i] = x
    ps, _ = params_pass(full)
    return [ps[u][k] for u, k in order]

  _, pull = jax.vjp(boundary_values, [leaves[i] for i in members])

  def per_example(xs):
    ds, gg = xs
    cts = []
    for u, ks in by_site.items():
      site = sites[u]

      def fn(sub, site=site, u=u, ks=ks, d=ds[u]):
        pv = list(pvals[u])
        for k, x in zip(ks, sub):
          pv[k] = x
        return site_outputs(site, pv, cvals[u], d)

      vjp = _site_vjp(site, fn, [pvals[u][k] for k in ks])
      cts.extend(vjp(list(gg[u]))[0])
    (grads,) = pull(cts)
    return sum(jnp.sum(_numerics.abs_sq(_f32(x))) for x in grads)

  ds = {u: drecs[u] for u in by_site}
  gg = {u: gs[u] for u in by_site}
  if spmd_axis_name is not None:
    return jax.vmap(per_example, spmd_axis_name=spmd_axis_name)((ds, gg))
  n = next(iter(gg.values()))[0].shape[0]
  size = sum(math.prod(jnp.shape(leaves[i])) for i in members) + sum(
      math.prod(jnp.shape(pvals[u][k])) for u, k in order)
  chunk = max(1, min(n, _CHUNK_ELEMENTS // max(size, 1)))
  return jax.lax.map(per_example, (ds, gg), batch_size=chunk)
