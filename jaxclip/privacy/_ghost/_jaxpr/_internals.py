"""What the ghost engine reads of JAX's jaxprs: every primitive and parameter name, in one place.

The engine (:mod:`jaxclip.privacy._ghost._jaxpr._walk` and the modules it serves)
walks the jaxpr of a per-example loss. It recognises some primitives by name
and reads some of their parameters; those names are JAX's internals and may
change from one release to the next. They are all here, in the tables below
and behind the accessors, so that nothing else in the engine spells one.
Where releases lay a parameter out differently, one accessor reads every
layout: :func:`scan_counts` (``lax.scan``'s ``num_consts``/``num_carry`` up to
jax 0.10, its flat tree ``ft_in`` from jax 0.11) and :func:`closed` (bodies
that are ``ClosedJaxpr`` s up to jax 0.10, ``Jaxpr`` s from jax 0.11).
``tests/test_jax_layouts.py`` reads each accessor on a known program.

A release that renames something must not give a wrong result:

* a first-order primitive the engine does not know (or whose parameters are
  not where it looks) is a *generic* operation: applied whole, its
  per-example gradient formed exactly, as by ``method="vmap"``;
* a *higher-order* primitive (one that carries a sub-jaxpr in its
  parameters) the engine does not know, or a known one whose parameters it
  cannot read, is reported by :func:`unreadable`: the engine does not know
  whether it should look inside (a renamed ``jit`` or ``scan`` would hide
  every rule of the model, and its cost), so where such a primitive touches
  the parameters or the batch the whole loss takes ``method="vmap"``, and
  :func:`jaxclip.ghost_plan` names the primitive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex

# ----------------------------------------------------------------------------
# The names
# ----------------------------------------------------------------------------

# Call primitives: their body (param ``jaxpr`` or ``call_jaxpr``) is walked
# when a parameter goes in, so that the uses inside a jitted or
# rematerialised layer are seen one by one. (``pjit``, ``core_call``,
# ``checkpoint`` and ``remat``: the names of earlier JAX releases.)
CALLS = frozenset(
  {"jit", "pjit", "call", "closed_call", "core_call", "checkpoint", "remat", "remat2"}
)
# The call primitives that rematerialise their body (``jax.checkpoint``).
REMATS = frozenset({"checkpoint", "remat", "remat2"})
# ``lax.scan``: its body is walked per iteration.
SCANS = frozenset({"scan"})
# Higher-order primitives of JAX that the engine applies whole, as it does a
# first-order one: JAX's own rules batch and differentiate them, and nothing
# inside them needs a rule of the engine's.
OPAQUE = frozenset(
  {
    "cond",
    "while",
    "custom_jvp_call",
    "custom_jvp_call_jaxpr",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
    "custom_linear_solve",
    "custom_vmap_call",
    "custom_transpose_call",
    "linear_call",
    "shard_map",
    "run_state",
    "remat_opt",
    "pallas_call",
  }
)
# Primitives that rearrange a value without changing its values.
VIEWS = frozenset(
  {
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "convert_element_type",
    "broadcast_in_dim",
    "slice",
  }
)
SLICE, TRANSPOSE, SQUEEZE = "slice", "transpose", "squeeze"
# Sums of two values: the gradient of each input is the output's.
ADDS = frozenset({"add", "add_any"})
MUL = "mul"
DOT, GATHER, CONV = "dot_general", "gather", "conv_general_dilated"

# Parameter names.
_CALL_BODY = ("jaxpr", "call_jaxpr")  # the first present is the body
_PREVENT_CSE, _POLICY = "prevent_cse", "policy"
_SCAN_KEYS = ("length", "jaxpr", "reverse", "unroll")
# How a scan says which of its inputs are consts, carries and xs. jax 0.10:
# two counts, ``num_consts`` and ``num_carry``. jax 0.11 on: ``ft_in``, a flat
# tree of three groups (consts, carries, xs) whose lengths are the counts.
_SCAN_COUNTS = ("num_consts", "num_carry")
_SCAN_FLAT_TREE = "ft_in"
_PERMUTATION, _DIMENSIONS = "permutation", "dimensions"
_SLICE_KEYS = ("start_indices", "limit_indices", "strides")
_DIMENSION_NUMBERS = "dimension_numbers"
_GATHER_KEYS = ("dimension_numbers", "slice_sizes", "mode")
_CONV_KEYS = (
  "dimension_numbers",
  "feature_group_count",
  "batch_group_count",
  "window_strides",
  "padding",
  "lhs_dilation",
  "rhs_dilation",
)


# ----------------------------------------------------------------------------
# Equations and variables
# ----------------------------------------------------------------------------


def name(eqn: Any) -> str:
  """The name of an equation's primitive."""
  return eqn.primitive.name


def bind(eqn: Any, vals: Sequence[Any]) -> list[Any]:
  """Applies an equation's primitive to ``vals``; always a list of outputs."""
  out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def is_literal(v: Any) -> bool:
  """Whether an equation's input is a literal (its value is ``v.val``)."""
  return isinstance(v, jex.Literal)


def literal_value(v: Any) -> Any:
  return v.val


def is_dropped(v: Any) -> bool:
  """Whether an equation's output is dropped (``_``)."""
  return isinstance(v, jex.DropVar)


def _is_jaxpr(x: Any) -> bool:
  return isinstance(x, (jex.Jaxpr, jex.ClosedJaxpr))


def sub_jaxprs(eqn: Any) -> list[Any]:
  """The ``Jaxpr``/``ClosedJaxpr`` values among an equation's parameters (or tuples of them)."""
  out = []
  for value in eqn.params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    out.extend(x for x in items if _is_jaxpr(x))
  return out


def captures_tracer(eqn: Any) -> bool:
  """Whether a sub-jaxpr of the equation holds a traced value as a constant.

  Such a value (a parameter closed over by a primitive that did not make it
  an input) is not among the equation's inputs: the engine cannot see that
  the equation depends on it.
  """
  return any(
    isinstance(c, jax.core.Tracer)
    for j in sub_jaxprs(eqn)
    if isinstance(j, jex.ClosedJaxpr)
    for c in j.consts
  )


def closed(body: Any) -> Any | None:
  """A sub-jaxpr as a ``ClosedJaxpr``; ``None`` if it is neither closed nor free of constants.

  Up to jax 0.10 the bodies of ``jit``, ``scan`` and the custom derivatives are
  ``ClosedJaxpr`` s; from jax 0.11 they are ``Jaxpr`` s, their constants
  hoisted among the equation's inputs.
  """
  if isinstance(body, jex.ClosedJaxpr):
    return body
  if isinstance(body, jex.Jaxpr) and not body.constvars:
    return jex.ClosedJaxpr(body, [])
  return None


def _params(eqn: Any, keys: Sequence[str]) -> tuple[Any, ...] | None:
  """The parameters ``keys`` of an equation, or ``None`` if one is missing."""
  if any(k not in eqn.params for k in keys):
    return None
  return tuple(eqn.params[k] for k in keys)


# ----------------------------------------------------------------------------
# Higher-order primitives
# ----------------------------------------------------------------------------


def call_body(eqn: Any) -> tuple[Any, list[Any]] | None:
  """The jaxpr and consts of a call primitive's body; ``None`` for any other equation."""
  if name(eqn) not in CALLS:
    return None
  body = closed(next((eqn.params[k] for k in _CALL_BODY if k in eqn.params), None))
  return None if body is None else (body.jaxpr, list(body.consts))


def is_remat(eqn: Any) -> bool:
  """Whether an equation is a rematerialised call (``jax.checkpoint``, flax ``nn.remat``)."""
  return name(eqn) in REMATS


def remat_options(eqn: Any) -> dict[str, Any]:
  """The keyword arguments of ``jax.checkpoint`` that rematerialise as the equation does."""
  return {
    "prevent_cse": eqn.params.get(_PREVENT_CSE, True),
    "policy": eqn.params.get(_POLICY),
  }


def is_scan(eqn: Any) -> bool:
  return name(eqn) in SCANS


class ScanParts(NamedTuple):
  """A ``lax.scan`` equation: its inputs are ``consts + carries + xs``."""

  num_consts: int
  num_carry: int
  length: int
  body: Any  # a ClosedJaxpr over consts + carries + xs, returning carries + ys
  reverse: bool
  unroll: Any


def scan_counts(eqn: Any) -> tuple[int, int] | None:
  """How many of a ``lax.scan``'s inputs are consts and carries (the rest are xs).

  Read from ``num_consts``/``num_carry`` (jax 0.10) or from the lengths of the
  three groups of ``ft_in`` (jax 0.11 on); ``None`` for any other equation, or
  where neither layout is there or the groups do not add up to the inputs.
  """
  if not is_scan(eqn):
    return None
  counts = _params(eqn, _SCAN_COUNTS)
  if counts is None and _SCAN_FLAT_TREE in eqn.params:
    try:
      counts = tuple(len(group) for group in eqn.params[_SCAN_FLAT_TREE].unpack())
    except (AttributeError, TypeError):
      return None
    if len(counts) != 3 or sum(counts) != len(eqn.invars):
      return None
  if counts is None or not all(isinstance(n, int) and n >= 0 for n in counts[:2]):
    return None
  return counts[0], counts[1]


def scan_parts(eqn: Any) -> ScanParts | None:
  """The parts of a ``lax.scan`` equation; ``None`` for any other (or an unreadable one)."""
  counts = scan_counts(eqn)
  values = _params(eqn, _SCAN_KEYS)
  if counts is None or values is None:
    return None
  length, body, reverse, unroll = values
  body = closed(body)
  if body is None or len(body.jaxpr.invars) != len(eqn.invars):
    return None
  return ScanParts(*counts, length, body, reverse, unroll)


def unreadable(eqn: Any) -> str | None:
  """Why the engine cannot read a higher-order equation, or ``None`` if it can.

  A higher-order primitive it does not know, or a call or scan whose
  parameters are not where it reads them. A first-order primitive is never
  unreadable: applied whole, it is a generic operation.
  """
  prim = name(eqn)
  if prim in CALLS:
    if call_body(eqn) is None:
      return f"the ghost engine cannot read the body of `{prim}` (its parameters have changed)"
    return None
  if prim in SCANS:
    if scan_parts(eqn) is None:
      return f"the ghost engine cannot read the parameters of `{prim}` (they have changed)"
    return None
  if prim in OPAQUE or not sub_jaxprs(eqn):
    return None
  return f"`{prim}` is a higher-order primitive the ghost engine does not know"


# ----------------------------------------------------------------------------
# Views
# ----------------------------------------------------------------------------


def is_view(eqn: Any) -> bool:
  """Whether an equation rearranges its first input without changing its values."""
  return name(eqn) in VIEWS


def transpose_permutation(eqn: Any) -> tuple[int, ...] | None:
  """A ``transpose``'s permutation; ``None`` for any other equation."""
  if name(eqn) != TRANSPOSE or _PERMUTATION not in eqn.params:
    return None
  return tuple(eqn.params[_PERMUTATION])


def squeeze_dimensions(eqn: Any) -> tuple[int, ...] | None:
  """The axes a ``squeeze`` removes; ``None`` for any other equation."""
  if name(eqn) != SQUEEZE or _DIMENSIONS not in eqn.params:
    return None
  return tuple(eqn.params[_DIMENSIONS])


def is_add(eqn: Any) -> bool:
  """Whether an equation is the sum of its two inputs."""
  return name(eqn) in ADDS and len(eqn.invars) == 2


def is_mul(eqn: Any) -> bool:
  return name(eqn) == MUL


def is_slice(eqn: Any) -> bool:
  return name(eqn) == SLICE


def slice_bounds(eqn: Any) -> tuple[Sequence[int], Sequence[int], Sequence[int] | None] | None:
  """A static ``slice``'s ``(start_indices, limit_indices, strides)``; ``None`` for any other."""
  if not is_slice(eqn):
    return None
  return _params(eqn, _SLICE_KEYS)


# ----------------------------------------------------------------------------
# The operations with a ghost rule
# ----------------------------------------------------------------------------


def dot_dimension_numbers(eqn: Any) -> Any | None:
  """A ``dot_general``'s ``((lhs contracting, rhs contracting), (lhs batch, rhs batch))``;
  ``None`` for any other equation."""
  if name(eqn) != DOT:
    return None
  return eqn.params.get(_DIMENSION_NUMBERS)


class GatherParts(NamedTuple):
  dimension_numbers: Any  # a GatherDimensionNumbers
  slice_sizes: tuple[int, ...]
  mode: str  # the GatherScatterMode's name


def gather_parts(eqn: Any) -> GatherParts | None:
  """A ``gather``'s parameters; ``None`` for any other equation."""
  values = _params(eqn, _GATHER_KEYS) if name(eqn) == GATHER else None
  if values is None:
    return None
  dn, sizes, mode = values
  return GatherParts(dn, tuple(sizes), getattr(mode, "name", str(mode)))


def is_row_lookup(eqn: Any) -> bool:
  """Whether a ``gather`` takes whole rows of its operand: ``E[ids]``, ``take(E, ids, 0)``."""
  parts = gather_parts(eqn)
  if parts is None:
    return False
  dn = parts.dimension_numbers
  op, idx = eqn.invars[0].aval, eqn.invars[1].aval
  rest = tuple(op.shape[1:])
  lead = idx.ndim - 1
  return (
    idx.ndim >= 1
    and idx.shape[-1] == 1
    and tuple(dn.collapsed_slice_dims) == (0,)
    and tuple(dn.start_index_map) == (0,)
    and not tuple(dn.operand_batching_dims)
    and parts.slice_sizes == (1,) + rest
    and tuple(dn.offset_dims) == tuple(range(lead, lead + len(rest)))
  )


class ConvParts(NamedTuple):
  dimension_numbers: Any  # a ConvDimensionNumbers, or None
  feature_group_count: int
  batch_group_count: int
  window_strides: Sequence[int]
  padding: Any
  lhs_dilation: Sequence[int]
  rhs_dilation: Sequence[int]


def conv_parts(eqn: Any) -> ConvParts | None:
  """A ``conv_general_dilated``'s parameters; ``None`` for any other equation."""
  values = _params(eqn, _CONV_KEYS) if name(eqn) == CONV else None
  return None if values is None else ConvParts(*values)
