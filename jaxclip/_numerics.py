"""The one norm kernel behind every jaxclip op and transform.

Everything that measures a gradient goes through this module:

* sums of squares accumulate in float32 whatever the leaf dtype (float64 for
  float64 leaves under ``jax_enable_x64``), within a leaf *and* across leaves,
  so bfloat16 trees do not lose precision and float16 trees do not overflow;
* the square root has a custom JVP whose tangent is zero at zero, so
  ``jax.grad`` through any clip is finite at an all-zero input;
* the clip factor ``max_norm / max(norm, max_norm)`` is written so that a zero
  threshold with a zero norm gives ``0``, an infinite threshold gives ``1``
  and a non-finite norm gives ``nan`` (the failure stays visible);
* scaling a half-precision leaf multiplies in float32 and casts back, so the
  product cannot overflow; under ``jit`` XLA fuses the casts into the scale,
  so no float32 copy of the leaf is materialised.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

Axes = int | Sequence[int] | None

_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype: Any) -> jnp.dtype:
  """The real dtype in which sums over a leaf of ``dtype`` are accumulated.

  float64 / complex128 leaves accumulate in float64; every other inexact
  dtype (bfloat16, float16, float32, complex64) in float32.
  """
  dtype = jnp.dtype(dtype)
  real = jnp.finfo(dtype).dtype  # complex64 -> float32, complex128 -> float64
  if real == jnp.dtype(jnp.float64):
    return real
  return jnp.dtype(jnp.float32)


def tree_accumulation_dtype(tree: Any) -> jnp.dtype:
  """The accumulation dtype shared by all leaves of ``tree`` (float32 if empty)."""
  dtypes = {accumulation_dtype(jnp.result_type(x)) for x in jax.tree.leaves(tree)}
  return jnp.dtype(jnp.float64) if jnp.dtype(jnp.float64) in dtypes else jnp.dtype(jnp.float32)


def compute_dtype(dtype: Any) -> jnp.dtype:
  """The dtype in which products with a leaf of ``dtype`` are formed.

  float32 for the half-precision dtypes (so a product cannot overflow
  float16), the leaf's own dtype otherwise.
  """
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if dtype in _HALF_DTYPES else dtype


@jax.custom_jvp
def safe_sqrt(x: jax.Array) -> jax.Array:
  """``sqrt(x)`` for ``x >= 0`` whose derivative at ``0`` is ``0``, not ``inf``."""
  return jnp.sqrt(x)


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  y = jnp.sqrt(x)
  positive = x > 0
  # The coefficient is a primal value, so the transposed (reverse-mode) rule
  # multiplies the cotangent by an exact zero where x == 0: no 0 * inf.
  coef = jnp.where(positive, 0.5 / jnp.where(positive, y, 1), 0).astype(y.dtype)
  return y, coef * dx


def _canonical_axes(ndim: int, axis: Axes) -> tuple[int, ...] | None:
  if axis is None:
    return None
  if isinstance(axis, int):
    axis = (axis,)
  out = []
  for a in axis:
    a = int(a)
    if not -ndim <= a < ndim:
      raise ValueError(f"axis {a} is out of bounds for a leaf of rank {ndim}.")
    out.append(a % ndim)
  return tuple(out)


def _reduction_input(x: jax.Array) -> jax.Array:
  """``x`` as the input of a norm reduction.

  On XLA:CPU a bfloat16 leaf that feeds both the norm reduction and the
  scale pass gets its float32 conversion materialised as a full-size buffer
  (the reduction kernel cannot absorb a convert whose operand has a second
  user). An optimization barrier gives the reduction its own operand, so the
  convert fuses into it: no float32 copy, and about 3x faster on a 4M-entry
  leaf. The barrier is an identity for values and gradients; it is applied
  only where it was measured to help.
  """
  if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
    return jax.lax.optimization_barrier(x)
  return x


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|**2`` elementwise, in ``x``'s accumulation dtype."""
  x = _reduction_input(jnp.asarray(x))
  acc = accumulation_dtype(x.dtype)
  if jnp.iscomplexobj(x):
    return jnp.square(x.real.astype(acc)) + jnp.square(x.imag.astype(acc))
  return jnp.square(x.astype(acc))


def safe_abs(x: jax.Array) -> jax.Array:
  """``|x|`` elementwise in the accumulation dtype; finite gradient at 0."""
  x = _reduction_input(jnp.asarray(x))
  if jnp.iscomplexobj(x):
    return safe_sqrt(abs_sq(x))
  return jnp.abs(x.astype(accumulation_dtype(x.dtype)))


def leaf_sumsq(x: jax.Array, axis: Axes = None, keepdims: bool = False) -> jax.Array:
  """``sum(|x|**2)`` over ``axis`` (all axes if ``None``), accumulated in float32+."""
  x = jnp.asarray(x)
  return jnp.sum(abs_sq(x), axis=_canonical_axes(x.ndim, axis), keepdims=keepdims)


def leaf_norm(
    x: jax.Array, ord: float = 2, axis: Axes = None, keepdims: bool = False
) -> jax.Array:
  """The ``ord``-norm of ``x`` over ``axis`` (all axes if ``None``).

  Returned in the accumulation dtype of ``x``. ``ord`` must already be
  normalised by :func:`check_ord` (1, 2 or ``inf``).
  """
  x = jnp.asarray(x)
  axes = _canonical_axes(x.ndim, axis)
  if ord == 2:
    return safe_sqrt(leaf_sumsq(x, axes, keepdims))
  if ord == 1:
    return jnp.sum(safe_abs(x), axis=axes, keepdims=keepdims)
  # ord == inf. ``initial`` makes the max of an empty leaf 0, as its norm.
  return jnp.max(safe_abs(x), axis=axes, keepdims=keepdims, initial=0.0)


def tree_norm(
    tree: Any, ord: float = 2, axis_name: Any = None, replicated: Any = None
) -> jax.Array:
  """The global ``ord``-norm of every leaf of ``tree`` together.

  For ``ord=2`` this is ``sqrt(sum_leaves(sum(|x|**2)))`` with one square root
  at the end (never a norm per leaf squared back). Empty trees give ``0``.

  With ``axis_name`` (inside ``shard_map``/``pmap``/``vmap`` over a named
  axis, or a tuple of axes) the leaves are local shards: the partial sums
  (max for ``ord=inf``) are combined across the axes with a scalar ``psum``
  (``pmax``) before the root, so every device gets the same global norm.
  ``replicated`` says which leaves are the same on every device of an axis,
  so their sums are added once rather than once per device: ``None`` (every
  leaf is a shard), a pytree prefix of ``tree`` with ``True``/``False``, axis
  names or ``PartitionSpec`` leaves, or a callable ``(path, leaf) -> ...``;
  see :func:`jaxclip._distributed.leaf_reduction_axes`.
  """
  leaves = jax.tree.leaves(tree)
  acc = tree_accumulation_dtype(tree)
  if axis_name is None:
    parts = _grouped_parts(leaves, ord, acc)
  else:
    parts = [_leaf_part(x, ord).astype(acc) for x in leaves]
  if axis_name is not None:
    # Imported here: _distributed builds on this module.
    from jaxclip import _distributed

    total = _distributed.combine_across_devices(tree, parts, ord, axis_name, replicated)
  elif replicated is not None:
    raise ValueError("replicated= only has a meaning together with axis_name=.")
  elif not parts:
    total = jnp.zeros((), acc)
  elif ord == math.inf:
    total = jnp.max(jnp.stack(parts))
  else:
    total = _sum_scalars(parts)
  return safe_sqrt(total) if ord == 2 else total


# Leaves of at most this many elements are reduced in groups (see below).
_SMALL_LEAF = 1 << 16
# How many small leaves one group combines.
_GROUP = 32


def _leaf_part(x: jax.Array, ord: float) -> jax.Array:
  """One leaf's share of a tree norm: ``sum |x|**2``, ``sum |x|`` or ``max |x|``."""
  if ord == 2:
    return leaf_sumsq(x)
  if ord == 1:
    return jnp.sum(safe_abs(x))
  return leaf_norm(x, math.inf)


def _on_mesh(x: jax.Array) -> bool:
  """Whether ``x`` carries a mesh sharding (sharded arrays under ``jax.set_mesh``)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  return sharding is not None and not sharding.mesh.empty


def _grouped_parts(leaves: list[Any], ord: float, acc: jnp.dtype) -> list[jax.Array]:
  """Partial sums (maxima for ``ord=inf``) of ``leaves``, a few per tree.

  One scalar per leaf would make XLA build one fusion per leaf and then one
  chain of thousands of scalar adds, which compiles in time quadratic in the
  number of leaves (optax's clip takes minutes at 5,000 leaves). Instead,
  small leaves are flattened, their ``|x|**2`` (``|x|``) zero-padded to the
  next power of two and added (maxed) elementwise in groups of ``_GROUP``
  before a single reduction per group. Zero padding leaves every sum and
  maximum of non-negative terms unchanged; large leaves keep one reduction
  each, so no leaf is copied. Leaves that carry a mesh (sharded arrays under
  ``jax.set_mesh``) are only grouped with leaves of the same shape and
  sharding and never reshaped, so grouping adds no collective.
  """
  term = abs_sq if ord == 2 else safe_abs
  combine = jnp.maximum if ord == math.inf else jnp.add
  parts, groups = [], {}
  for x in leaves:
    x = jnp.asarray(x)
    if x.size == 0:
      continue
    if x.size > _SMALL_LEAF:
      parts.append(_leaf_part(x, ord))
      continue
    if _on_mesh(x):
      key = (x.shape, x.dtype, jax.typeof(x).sharding)
    else:
      key = (1 << (x.size - 1).bit_length(), accumulation_dtype(x.dtype))
    groups.setdefault(key, []).append(x)
  for key, group in groups.items():
    for start in range(0, len(group), _GROUP):
      total = None
      for x in group[start:start + _GROUP]:
        t = term(x)
        if isinstance(key[0], int):  # flatten and pad to the group's width
          t = t.ravel()
          t = jnp.pad(t, (0, key[0] - t.size)) if t.size < key[0] else t
        total = t if total is None else combine(total, t)
      parts.append(jnp.max(total) if ord == math.inf else jnp.sum(total))
  return [p.astype(acc) for p in parts]


def map_leaf_norms(
    fn: Callable[[jax.Array, int], jax.Array], leaves: Sequence[Any], ord: float = 2,
    axis: Axes = None,
) -> list[jax.Array]:
  """``[fn(leaf_norm(x, ord, axis, keepdims=True), x.size) for x in leaves]``, batched.

  ``fn`` maps a norm (with kept dimensions) and the leaf's size to a value
  broadcastable against the leaf, e.g. a clip factor. Small leaves of equal
  shape and dtype are stacked ``_GROUP`` at a time so that one reduction and
  one call of ``fn`` serve the whole stack, and XLA compiles a few kernels per
  group instead of several per leaf (thousands of leaves compile in seconds).
  Only small leaves are stacked (a copy of at most ``_SMALL_LEAF`` elements
  each); large and mesh-sharded leaves are reduced one by one.
  """
  out: list[Any] = [None] * len(leaves)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    x = jnp.asarray(x)
    if x.size > _SMALL_LEAF or _on_mesh(x):
      out[i] = fn(leaf_norm(x, ord, axis, keepdims=True), x.size)
    else:
      groups.setdefault((x.shape, x.dtype), []).append(i)
  for (shape, _), members in groups.items():
    axes = _canonical_axes(len(shape), axis)
    axes = tuple(range(1, len(shape) + 1)) if axes is None else tuple(a + 1 for a in axes)
    size = math.prod(shape)
    for start in range(0, len(members), _GROUP):
      chunk = members[start:start + _GROUP]
      if len(chunk) == 1:
        out[chunk[0]] = fn(leaf_norm(leaves[chunk[0]], ord, axis, keepdims=True), size)
        continue
      stacked = jnp.stack([jnp.asarray(leaves[i]) for i in chunk])
      values = fn(leaf_norm(stacked, ord, axes, keepdims=True), size)
      for j, i in enumerate(chunk):
        out[i] = values[j]
  return out


def _sum_scalars(parts: list[jax.Array]) -> jax.Array:
  return jnp.sum(jnp.stack(parts)) if len(parts) > 1 else parts[0]


def clip_scale(norm: jax.Array, max_norm: Any) -> jax.Array:
  """The factor ``max_norm / max(norm, max_norm)``, safe at every edge.

  ============================  =========
  case                          factor
  ============================  =========
  ``norm < max_norm``           ``1``
  ``norm >= max_norm > 0``      ``max_norm / norm``
  ``norm == max_norm == 0``     ``0`` (zeros stay zeros, gradient 0)
  ``max_norm == inf``           ``1``
  ``max_norm < 0`` (traced)     acts as ``0``
  ``norm`` is ``inf``/``nan``   ``nan``
  ============================  =========
  """
  norm = jnp.asarray(norm)
  max_norm = jnp.maximum(jnp.asarray(max_norm, norm.dtype), 0)
  clipping = norm >= max_norm
  # One division last: XLA then computes the factor once instead of copying
  # the selects into every leaf's kernel (which slows compiling big trees).
  numerator = jnp.where(jnp.isfinite(norm), jnp.where(clipping, max_norm, 1), jnp.nan)
  denominator = jnp.where(clipping & (norm > 0), norm, 1)
  return (numerator / denominator).astype(norm.dtype)


def apply_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``x * scale`` formed in :func:`compute_dtype`, returned in ``x.dtype``."""
  x = jnp.asarray(x)
  dtype = compute_dtype(x.dtype)
  return (x.astype(dtype) * jnp.asarray(scale).astype(dtype)).astype(x.dtype)


_ORDS = {None: 2, 1: 1, 2: 2, math.inf: math.inf, "inf": math.inf}


def check_ord(ord: Any) -> float:
  """Normalises ``ord`` to ``1``, ``2`` or ``inf`` (``None`` means 2).

  A concrete 0-d array is read as its value; a traced one (as
  ``optax.inject_hyperparams`` makes of numeric arguments) cannot choose a
  reduction and raises, asking for ``static_args=("ord",)``.
  """
  if isinstance(ord, jax.core.Tracer):
    raise ValueError(
        "ord must be a static Python value, not a traced array; with "
        "optax.inject_hyperparams pass static_args=('ord',)."
    )
  if hasattr(ord, "shape") and getattr(ord, "shape", None) == ():
    ord = ord.item()
  try:
    return _ORDS[ord]
  except (KeyError, TypeError):
    pass
  raise ValueError(
      f"Unsupported ord={ord!r}: jaxclip norms support ord=1, ord=2 and "
      "ord=inf (as torch.nn.utils.get_total_norm)."
  )
