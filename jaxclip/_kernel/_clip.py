"""The clip ops' arithmetic, with no argument checked.

:mod:`jaxclip.ops` checks its arguments on every call and then computes here;
the transforms check their hyperparameters once, when built, and call these
on every update, so nothing is checked twice.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._kernel import _numerics, _shapes, _validation


def value_clip(
  tree: Any,
  clip_value_min: Any,
  clip_value_max: Any,
  *,
  fn_name: str = "clip_by_value",
  modulus: bool = False,
) -> Any:
  """Every entry clipped to ``[clip_value_min, clip_value_max]`` (see ``ops.clip_by_value``).

  Raises ``ValueError`` for a bound that does not broadcast to a leaf's
  shape (a property of the leaves, known only here). A complex leaf has no
  order: with ``modulus`` (a symmetric clip, ``min == -max``) each entry's
  modulus is bounded by ``clip_value_max`` and its phase kept, else it
  raises ``TypeError`` naming the leaf.
  """
  # The bounds are cast once per dtype and broadcast once per shape: a leaf
  # then traces two ops, which counts at thousands of leaves.
  cast: dict[Any, tuple[jax.Array, jax.Array]] = {}
  broadcast: dict[tuple[Any, ...], tuple[jax.Array, jax.Array]] = {}

  def bounds_for(x):
    key = (x.shape, x.dtype)
    if key not in broadcast:
      if x.dtype not in cast:
        cast[x.dtype] = (
          _bound_for(x.dtype, clip_value_min, up=True),
          _bound_for(x.dtype, clip_value_max, up=False),
        )
      for b in cast[x.dtype]:
        try:
          fits = jnp.broadcast_shapes(x.shape, b.shape) == x.shape
        except ValueError:
          fits = False
        if not fits:
          return None, b.shape
      broadcast[key] = tuple(jnp.broadcast_to(b, x.shape) for b in cast[x.dtype])
    return broadcast[key], None

  def clip_leaf(path, x):
    x = _numerics.as_array(x)
    if jnp.iscomplexobj(x):
      if not modulus:
        raise TypeError(
          f"{fn_name}: the leaf at {jax.tree_util.keystr(path) or '<root>'} is complex, and "
          "complex numbers have no order to clip between two bounds; jaxclip.clip(max_delta) "
          "bounds each entry's modulus (keeping its phase), the norm clips bound the leaf's norm."
        )
      return _modulus_clip(x, clip_value_max)
    pair, bad_shape = bounds_for(x)
    if pair is None:
      raise ValueError(
        f"clip_by_value: a bound of shape {bad_shape} does not broadcast to "
        f"the leaf at {jax.tree_util.keystr(path) or '<root>'} of shape "
        f"{x.shape}."
      )
    lo, hi = pair
    return jax.lax.min(jax.lax.max(x, lo), hi)

  return jax.tree_util.tree_map_with_path(clip_leaf, tree)


def _modulus_clip(z: jax.Array, bound: Any) -> jax.Array:
  """``z`` with each entry's modulus held to ``bound`` (its phase kept); below it, ``z`` itself."""
  magnitude = jnp.abs(z)  # XLA's complex abs does not overflow where the squares would
  bound = jnp.broadcast_to(jnp.asarray(bound).astype(magnitude.dtype), z.shape)
  over = magnitude > bound
  factor = jnp.where(over, bound / jnp.where(over, magnitude, 1), 1)
  return jnp.where(over, z * factor.astype(z.dtype), z)


def _bound_for(dtype, bound, up: bool) -> jax.Array:
  """``bound`` cast to ``dtype``; for integer dtypes rounded (``up`` for a lower
  bound, down for an upper one) and saturated to the dtype's range.

  A concrete bound is rounded in float64 on the host, so a bound such as
  ``-1e-80`` (which float32 would turn into ``-0.0``) still rounds to ``-1``.
  """
  if not jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(bound).astype(dtype)
  info = jnp.iinfo(dtype)
  concrete = _validation.concrete_value(bound)
  if concrete is not None:
    if not np.issubdtype(concrete.dtype, np.integer):
      concrete = (np.ceil if up else np.floor)(concrete.astype(np.float64))
    return jnp.asarray(np.clip(concrete, info.min, info.max).astype(dtype))
  bound = jnp.asarray(bound)
  if jnp.issubdtype(bound.dtype, jnp.integer):
    b_info = jnp.iinfo(bound.dtype)
    lo, hi = max(info.min, b_info.min), min(info.max, b_info.max)
  else:
    bound = jnp.ceil(bound) if up else jnp.floor(bound)
    lo, hi = float(info.min), float(info.max)
  return jnp.clip(bound, lo, hi).astype(dtype)


def norm_clip(tree: Any, clip_norm: Any, axes: Any = None, arg: str = "clip_norm") -> Any:
  """Each leaf held to L2 norm ``clip_norm`` over ``axes`` (see ``ops.clip_by_norm``)."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  shape = jnp.shape(clip_norm)
  for path, x in paths:
    if _shapes.constant_size(x) is None:  # symbolic (jax.export): checked when run
      continue
    kept = _numerics.kept_shape(jnp.shape(x), axes)
    try:
      fits = jnp.broadcast_shapes(kept, shape) == kept
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(
        f"clip_by_norm: {arg} of shape {shape} does not broadcast against the norm of the "
        f"leaf at {jax.tree_util.keystr(path) or '<root>'} (shape {kept}: the leaf's shape "
        f"{jnp.shape(x)} with axes={axes!r} reduced to 1)."
      )
  leaves = [x for _, x in paths]
  return treedef.unflatten(
    _numerics.scale_by_leaf_norms(_norm_scale, leaves, 2, axes, operands=(clip_norm,))
  )


def average_norm_clip(tree: Any, clip_norm: Any) -> Any:
  """Each leaf held to ``clip_norm`` times its size (see ``ops.clip_by_average_norm``)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten(
    _numerics.scale_by_leaf_norms(_average_norm_scale, leaves, 2, operands=(clip_norm,))
  )


def _norm_scale(norm, size, clip_norm):
  del size
  return _numerics.clip_scale(norm, clip_norm)


def _average_norm_scale(norm, size, clip_norm):
  return _numerics.clip_scale(norm, jnp.asarray(clip_norm, norm.dtype) * size)


def global_norm_clip(tree: Any, clip_norm: Any, norm: jax.Array) -> Any:
  """Every leaf times ``clip_norm / max(norm, clip_norm)``, ``norm`` the tree's global norm."""
  scale = _numerics.clip_scale(norm, clip_norm)
  return jax.tree.map(lambda x: _numerics.apply_scale(x, scale), tree)


def read_norm(use_norm: Any, tree: Any) -> jax.Array:
  """A given global norm in the accumulation dtype of ``tree``, never below its own.

  A bfloat16 norm would otherwise make a bfloat16 factor for float32
  leaves; an integer norm is read as a float.
  """
  norm = jnp.asarray(use_norm)
  acc = _numerics.tree_accumulation_dtype(tree)
  if jnp.issubdtype(norm.dtype, jnp.floating):
    acc = jnp.promote_types(acc, _numerics.accumulation_dtype(norm.dtype))
  return norm.astype(acc)
