"""What JAX's types say about where a leaf's values live across devices.

Two ways of running on many devices need two different things from jaxclip:

* Under ``jax.jit`` with sharded arrays (``NamedSharding``: FSDP, ZeRO, tensor
  parallelism), nothing: every op sees the global array, and XLA's SPMD
  partitioner turns each reduction into local partial sums followed by one
  all-reduce of a scalar. Leaves keep their shardings.
* Inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap(axis_name=)`` every
  device sees only its local values, so a norm needs ``axis_name=`` to combine
  partial sums across the named axes, and to know which leaves are *not*
  shards (a bias that every device holds in full counts once, not once per
  device). Under ``shard_map``'s default ``check_vma=True`` JAX's type of each
  leaf says which manual axes it varies over, and that is read; elsewhere the
  caller says it with ``replicated=`` or ``partition_specs=``.

This module reads those types and descriptions: the axes each leaf is summed
over (:func:`leaf_reduction_axes`) and whether leaves may be joined without
communication (:func:`layout`). :mod:`jaxclip._kernel._reduction` uses them
to combine the norm kernel's partial sums across devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jaxclip._kernel._typing import AxisName, PyTree


def axis_names(axis_name: AxisName) -> tuple[Hashable, ...]:
  """``axis_name`` as a tuple of mesh axis names (a single name or a sequence)."""
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not names or len(set(names)) != len(names):
    raise ValueError(f"axis_name must name distinct mesh axes, got {axis_name!r}.")
  return names


# ----------------------------------------------------------------------------
# What JAX knows about how a value varies across devices
# ----------------------------------------------------------------------------


def vma_checked() -> bool:
  """Whether the trace being built tracks varying manual axes (``check_vma=True``).

  ``jax.shard_map(..., check_vma=True)`` (the default) types every value with
  the manual axes it varies over; with ``check_vma=False``, and under
  ``jax.pmap`` (which runs on ``shard_map`` with checking off), every type says
  "invariant", which then means nothing.

  JAX has no public query for this. ``shard_map`` sets JAX's internal
  ``check_vma`` config state while it traces its body (``jax/_src/shard_map.py``
  enters ``config._check_vma(check_vma)``; JAX's own ``pvary`` and vma rules
  read the same state), and the public ``jax.config`` object reads that state
  by name. This is the one place jaxclip reads it; should a JAX release drop
  the name, the answer is ``False``: every leaf is taken for a shard, as under
  ``check_vma=False``.
  """
  return bool(getattr(jax.config, "check_vma", False))


def manual_axes() -> frozenset[Hashable]:
  """The mesh axes of the current abstract mesh that are manual (inside ``shard_map``)."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = jax.sharding.AxisType.Manual
  if mesh.empty:
    return frozenset()
  return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == manual)


def varying_axes(x: Any) -> frozenset[Hashable]:
  """The manual mesh axes JAX's type of ``x`` says it varies over (its vma)."""
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def as_varying(tree: PyTree, axis_name: AxisName) -> PyTree:
  """Marks the leaves of ``tree`` as varying over ``axis_name`` inside ``shard_map``.

  Under ``shard_map``'s default ``check_vma=True``, the gradient with respect
  to a value that is the same on every device (e.g. parameters passed with
  ``P()``) is summed over the devices as it is computed: right for a mean
  gradient, wrong for per-example gradients, which must stay local until each
  is clipped. Differentiating with respect to ``as_varying(params, axis)``
  keeps them local. Outside ``shard_map``/``pmap`` (e.g. under ``vmap``) the
  tree is returned unchanged.
  """
  names = axis_names(axis_name)
  if not set(names) <= manual_axes():
    return tree
  return cast_varying(tree, names)


def cast_varying(tree: PyTree, names: tuple[Hashable, ...]) -> PyTree:
  """Each leaf of ``tree`` cast (a no-op on values) to vary over ``names`` too."""

  def one(x):
    missing = tuple(n for n in names if n not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(one, tree)


# ----------------------------------------------------------------------------
# Which leaves are shards over which axes
# ----------------------------------------------------------------------------


def _is_description(x: Any) -> bool:
  if isinstance(x, (bool, str, PartitionSpec)):
    return True
  return isinstance(x, tuple) and bool(x) and all(isinstance(a, str) for a in x)


def _spec_axes(spec: PartitionSpec) -> set[Hashable]:
  """The mesh axes a ``PartitionSpec`` shards over."""
  out = set()
  for entry in spec:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      continue
    out.update(entry if isinstance(entry, tuple) else (entry,))
  return out


def _shard_axes(value: Any, names: tuple[Hashable, ...], where: str) -> tuple[Hashable, ...]:
  """The axes of ``names`` a leaf is a shard over, from its ``replicated=`` ``value``."""
  if isinstance(value, PartitionSpec):
    raise TypeError(
      f"replicated: the leaf at {where} is described by {value!r}, a PartitionSpec "
      "(where a leaf is sharded); pass PartitionSpecs as partition_specs=, and "
      "keep replicated= for True/False or the axis names a leaf is replicated over."
    )
  if isinstance(value, bool):
    return () if value else names
  if _is_description(value):
    same = (value,) if isinstance(value, str) else value
    unknown = [a for a in same if a not in names]
    if unknown:
      raise ValueError(
        f"replicated: the leaf at {where} is marked replicated over {unknown}, "
        f"which is not among axis_name={names}."
      )
    return tuple(n for n in names if n not in same)
  raise TypeError(
    f"replicated: the leaf at {where} is described by {value!r}; use True "
    "(replicated over every axis of axis_name), False (a shard), or an axis "
    "name or tuple of names it is replicated over."
  )


def _per_leaf(
  prefix: Any, tree: PyTree, is_leaf: Callable[[Any], bool], arg: str, expected: str
) -> list[Any]:
  """The leaf of the pytree prefix ``prefix`` that covers each leaf of ``tree``."""
  values, treedef = jax.tree.flatten(prefix, is_leaf=is_leaf)
  try:
    subtrees = treedef.flatten_up_to(tree)
  except ValueError as e:
    raise ValueError(
      f"{arg} must be a pytree prefix of the tree (with {expected} as leaves); "
      f"it does not match the tree: {e}"
    ) from None
  return [v for v, sub in zip(values, subtrees, strict=True) for _ in jax.tree.leaves(sub)]


def leaf_reduction_axes(
  tree: PyTree, axis_name: AxisName, replicated: Any = None, partition_specs: Any = None
) -> list[tuple[Hashable, ...]]:
  """For each leaf of ``tree`` (``jax.tree.leaves`` order), the axes to sum it over.

  Args:
    tree: The local values on this device.
    axis_name: The axis name (or tuple of names) the sums are combined over.
    replicated: ``None``, a callable ``(path, leaf) -> description``, or a
      pytree prefix of ``tree`` whose leaves are descriptions: ``True``
      (replicated over every axis of ``axis_name``: summed over none),
      ``False`` (a shard: summed over all), or an axis name or tuple of names
      the leaf is replicated over (summed over the others).
    partition_specs: ``None`` or a pytree prefix of ``tree`` of
      ``PartitionSpec`` leaves, as ``shard_map``'s ``in_specs``: a leaf is
      summed over the axes of ``axis_name`` its spec names.

  With neither, a leaf is summed over each axis of ``axis_name`` that is a
  manual axis its type varies over, when the trace checks types
  (``shard_map``'s ``check_vma=True``; see :func:`vma_checked`), and over
  every other axis (``check_vma=False``, ``pmap``, ``vmap``): then every
  leaf is taken for a shard.

  Returns:
    One tuple of axis names (in ``axis_name``'s order) per leaf.

  Raises:
    ValueError: if both ``replicated`` and ``partition_specs`` are given, if
      either does not match ``tree``, or a description names an axis outside
      ``axis_name``.
    TypeError: if ``replicated`` holds a ``PartitionSpec`` or another value
      that is no description, or ``partition_specs`` holds a non-spec leaf.
  """
  names = axis_names(axis_name)
  paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if replicated is not None and partition_specs is not None:
    raise ValueError(
      "Pass either replicated= (where leaves are replicated) or partition_specs= "
      "(where they are sharded), not both."
    )
  if partition_specs is not None:
    if isinstance(partition_specs, PartitionSpec):
      specs = [partition_specs] * len(paths_leaves)
    else:
      specs = _per_leaf(
        partition_specs,
        tree,
        lambda x: isinstance(x, PartitionSpec),
        "partition_specs",
        "PartitionSpecs",
      )
    out = []
    for spec, (path, _) in zip(specs, paths_leaves, strict=True):
      if not isinstance(spec, PartitionSpec):
        raise TypeError(
          f"partition_specs: the leaf at {jax.tree_util.keystr(path) or '<root>'} is "
          f"described by {spec!r}; partition_specs= takes PartitionSpecs only."
        )
      sharded = _spec_axes(spec)
      out.append(tuple(n for n in names if n in sharded))
    return out
  if replicated is None:
    if not vma_checked():
      return [names] * len(paths_leaves)
    manual = manual_axes()
    out = []
    for _, leaf in paths_leaves:
      vma = varying_axes(leaf)
      out.append(tuple(n for n in names if n in vma or n not in manual))
    return out
  if callable(replicated) and not isinstance(replicated, PartitionSpec):
    values = [replicated(path, leaf) for path, leaf in paths_leaves]
  else:
    values = _per_leaf(replicated, tree, _is_description, "replicated", "True/False or axis names")
  return [
    _shard_axes(v, names, jax.tree_util.keystr(p) or "<root>")
    for v, (p, _) in zip(values, paths_leaves, strict=True)
  ]


def typed_devices(x: Any) -> int:
  """How many devices the mesh of JAX's type of ``x`` lays it out over, its manual axes
  (inside ``shard_map``) left out: under ``jit`` of arrays sharded over several devices, with
  no mesh set, the tracers' types name the arrays' mesh (1 where the type names none)."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  if mesh is None or mesh.empty:
    return 1
  return math.prod(size for size, _ in _unmanual(mesh))


def _unmanual(mesh: Any) -> list[tuple[int, Any]]:
  """``(size, type)`` of each axis of ``mesh`` that is not manual (not inside ``shard_map``)."""
  manual = jax.sharding.AxisType.Manual
  return [
    (mesh.shape[n], t) for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != manual
  ]


# The layout key of a leaf whose values are all on the device that computes
# with them: it may be reshaped and concatenated with any other such leaf.
LOCAL = "local"


def layout(x: jax.Array) -> Any:
  """What JAX's type of ``x`` says about its layout across devices.

  Returns :data:`LOCAL` where reshaping ``x`` or joining it with other local
  leaves adds no communication: a program of one device, or values inside
  ``shard_map`` whose mesh axes are all manual. Returns ``x``'s sharding
  where it is known and laid out over several devices (an Explicit mesh under
  ``jax.set_mesh``): only leaves of the identical sharding and shape may be
  combined, elementwise. Returns ``None`` where the layout is chosen later by
  XLA's partitioner (an Auto mesh, a legacy ``Mesh``, shardings given to
  ``jit`` on a process with several devices): such a leaf is reduced on its
  own, since combining it with a leaf of another layout would make XLA move
  data between devices.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return LOCAL if jax.device_count() == 1 else None
  spread = [t for size, t in _unmanual(mesh) if size > 1]
  if not spread:
    return LOCAL
  if (
    sharding is not None
    and not sharding.mesh.empty
    and all(t == jax.sharding.AxisType.Explicit for t in spread)
  ):
    return sharding
  return None
