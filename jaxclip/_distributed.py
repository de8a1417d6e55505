"""Clipping when gradients live on many devices.

Two ways of running on many devices need two different things from jaxclip:

* Under ``jax.jit`` with sharded arrays (``NamedSharding``: FSDP, ZeRO, tensor
  parallelism), nothing: every op sees the global array, and XLA's SPMD
  partitioner turns each reduction into local partial sums followed by one
  all-reduce of a scalar. Leaves keep their shardings.
* Inside ``jax.shard_map`` or ``jax.pmap`` every device sees only its local
  shard, so the norm needs ``axis_name=`` to combine partial sums across the
  named mesh axes, and ``replicated=`` to say which leaves are *not* shards
  (a bias that every device holds in full must be counted once, not once per
  device).

This module resolves ``replicated=`` for the norm kernel, and holds
:func:`per_example_clipped_grad`, the memory-bounded per-example clipping of
data-parallel DP-SGD.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxclip import _numerics
from jaxclip import _optax_compat
from jaxclip import _validation

PyTree = Any
AxisName = Hashable | Sequence[Hashable]


def axis_names(axis_name: AxisName) -> tuple[Hashable, ...]:
  """``axis_name`` as a tuple of mesh axis names (a single name or a sequence)."""
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not names or len(set(names)) != len(names):
    raise ValueError(f"axis_name must name distinct mesh axes, got {axis_name!r}.")
  return names


def _is_spec_leaf(x: Any) -> bool:
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


def _reduce_axes(value: Any, names: tuple[Hashable, ...], where: str) -> tuple[Hashable, ...]:
  """The axes of ``names`` over which a leaf described by ``value`` is a shard."""
  if isinstance(value, bool):
    return () if value else names
  if isinstance(value, PartitionSpec):
    sharded = _spec_axes(value)
    return tuple(n for n in names if n in sharded)
  if isinstance(value, str) or _is_spec_leaf(value):
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
      "(replicated over every axis of axis_name), False (a shard), an axis "
      "name or tuple of names it is replicated over, or its PartitionSpec."
  )


def leaf_reduction_axes(
    tree: PyTree, axis_name: AxisName, replicated: Any = None
) -> list[tuple[Hashable, ...]]:
  """For each leaf of ``tree`` (``jax.tree.leaves`` order), the axes to sum it over.

  ``replicated`` is ``None`` (every leaf is a shard over every axis), a
  callable ``(path, leaf) -> description``, or a pytree prefix of ``tree``
  whose leaves are descriptions: ``True`` / ``False``, an axis name or a tuple
  of axis names the leaf is replicated over, or the leaf's ``PartitionSpec``
  (it is a shard over the axes the spec names).
  """
  names = axis_names(axis_name)
  paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if replicated is None:
    return [names] * len(paths_leaves)
  if callable(replicated) and not isinstance(replicated, PartitionSpec):
    values = [replicated(path, leaf) for path, leaf in paths_leaves]
  else:
    descriptions, prefix = jax.tree.flatten(replicated, is_leaf=_is_spec_leaf)
    try:
      subtrees = prefix.flatten_up_to(tree)
    except ValueError as e:
      raise ValueError(
          "replicated must be a pytree prefix of the tree (with True/False, "
          "axis names or PartitionSpecs as leaves) or a callable "
          f"(path, leaf) -> bool; it does not match the tree: {e}"
      ) from None
    values = [v for v, sub in zip(descriptions, subtrees, strict=True)
              for _ in jax.tree.leaves(sub)]
  return [_reduce_axes(v, names, jax.tree_util.keystr(p) or "<root>")
          for v, (p, _) in zip(values, paths_leaves, strict=True)]


def combine_across_devices(
    tree: PyTree,
    partials: list[jax.Array],
    ord: float,
    axis_name: AxisName,
    replicated: Any = None,
) -> jax.Array:
  """Combines per-leaf partial norms of local shards into the global total.

  ``partials[i]`` is leaf ``i``'s sum of squares (``ord=2``), sum of absolute
  values (``ord=1``) or max (``ord=inf``). Sums are ``psum``-ed over the axes
  each leaf is a shard of, grouped so that leaves with the same axes share one
  scalar all-reduce; replicated leaves are added locally, once. Maxima take one
  ``pmax`` over every axis (a max is unchanged by repeats).
  """
  groups: dict[tuple[Hashable, ...], list[jax.Array]] = {}
  for axes, part in zip(leaf_reduction_axes(tree, axis_name, replicated), partials, strict=True):
    groups.setdefault(axes, []).append(part)
  if not partials:
    return jnp.zeros((), _numerics.tree_accumulation_dtype(tree))
  if ord == math.inf:
    return jax.lax.pmax(jnp.max(jnp.stack(partials)), axis_names(axis_name))
  totals = []
  for axes, parts in groups.items():
    local = _numerics._sum_scalars(parts)
    totals.append(jax.lax.psum(local, axes) if axes else local)
  return _numerics._sum_scalars(totals)


def _varying_axes(x: Any) -> frozenset:
  """The manual mesh axes JAX's type of ``x`` says it varies over (if tracked)."""
  typeof = getattr(jax, "typeof", None)
  if typeof is None:
    return frozenset()
  aval = typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return frozenset(vma or ())


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
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get_mesh() if get_mesh is not None else None
  manual = getattr(getattr(jax.sharding, "AxisType", None), "Manual", None)
  if mesh is None or manual is None or mesh.empty or any(
      n not in mesh.axis_names or mesh.axis_types[mesh.axis_names.index(n)] != manual
      for n in names):
    return tree
  return _cast_varying(tree, names)


def _cast_varying(tree: PyTree, names: tuple[Hashable, ...]) -> PyTree:
  cast = getattr(jax.lax, "pcast", None)

  def one(x):
    missing = tuple(n for n in names if n not in _varying_axes(x))
    if not missing:
      return x
    if cast is not None:
      return cast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # JAX < 0.8

  return jax.tree.map(one, tree)


def _mesh_axis_size(axis_name: AxisName | None) -> int | None:
  """The number of devices along ``axis_name`` of the current mesh, if known."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  if axis_name is None or get_mesh is None:
    return None
  mesh = get_mesh()
  names = axis_names(axis_name)
  if mesh.empty or any(n not in mesh.axis_names for n in names):
    return None
  return math.prod(mesh.shape[n] for n in names)


def _batch_size(args: Sequence[Any], batch_argnums: tuple[int, ...]) -> int:
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None
           for i in batch_argnums for x in jax.tree.leaves(args[i])}
  if len(sizes) != 1 or None in sizes:
    shapes = [jax.tree.map(jnp.shape, args[i]) for i in batch_argnums]
    raise ValueError(
        "per_example_clipped_grad needs every array of the batch arguments to "
        f"share one batch dimension on axis 0; got shapes {shapes}."
    )
  return sizes.pop()


def per_example_clipped_grad(
    loss_fn: Callable[..., jax.Array],
    l2_norm_clip: jax.typing.ArrayLike,
    *,
    microbatch_size: int | None = None,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = False,
    spmd_axis_name: AxisName | None = None,
    axis_name: AxisName | None = None,
) -> Callable[..., tuple[PyTree, jax.Array]]:
  r"""Makes a function returning the sum of per-example gradients, each clipped.

  .. math::

    \sum_{b=1}^{B} \nabla_\theta \ell(\theta, x_b) \cdot
    \min\!\Big(1, \frac{C}{\|\nabla_\theta \ell(\theta, x_b)\|_2}\Big)

  the clipping step of DP-SGD, computed in chunks of ``microbatch_size``
  examples under ``jax.lax.scan``: only ``microbatch_size`` per-example
  gradients exist at once, so memory stays bounded whatever the batch size.
  Each chunk is :func:`jaxclip.per_example_global_norm_clip` of a ``vmap``-ed
  gradient; the running sum is kept in float32 for half-precision parameters.
  A batch that is not a multiple of ``microbatch_size`` is padded with
  all-zero examples whose gradients are dropped (even non-finite ones).

  On many devices:

  * under ``jax.jit`` with the batch sharded over a mesh axis (data
    parallelism), pass that axis as ``spmd_axis_name`` and a
    ``microbatch_size`` that is a multiple of its number of devices: the
    examples of each chunk stay on the device that holds them (chunk ``j``
    takes examples ``j, j + n, j + 2n, ...`` of the ``n`` chunks, so every
    device works on its own rows), and per-example gradients are never
    gathered;
  * inside ``jax.shard_map`` over the batch axis, pass it as ``axis_name``:
    each device clips its local examples and the sums (and counts) are
    ``psum``-ed, so every device returns the global sum. The parameters are
    first marked varying over the axis (``jax.lax.pcast(..., to='varying')``),
    so that JAX does not sum gradients across devices before they are
    clipped.

  ==========================  ===============================================
  case                        result
  ==========================  ===============================================
  ``l2_norm_clip == 0``       zeros; every example counts as clipped
  a non-finite gradient       ``nan`` in the sum (the failure is visible)
  ==========================  ===============================================

  Args:
    loss_fn: ``loss_fn(params, *args) -> scalar`` for one example (or, with
      ``keep_batch_dim=True``, for a batch of one).
    l2_norm_clip: The largest L2 norm of one example's gradient, ``>= 0``.
    microbatch_size: How many examples' gradients to hold at once; ``None``
      for the whole batch in one ``vmap``.
    batch_argnums: Which positional arguments of ``loss_fn`` after ``params``
      carry the batch on axis 0 of every leaf (counted as in ``loss_fn``, so
      ``1`` is the first argument after ``params``); the others are shared.
    keep_batch_dim: Pass each example to ``loss_fn`` with a leading axis of
      size one.
    spmd_axis_name: The mesh axis (or axes) the batch is sharded over under
      ``jit``, passed to ``jax.vmap``.
    axis_name: Inside ``shard_map``/``pmap``, the axis (or axes) to sum the
      clipped gradients and counts over.

  Returns:
    A function ``(params, *args) -> (clipped_grad_sum, num_clipped)``: the sum
    over the batch of the clipped per-example gradients (a pytree like
    ``params``, in its dtypes) and how many examples were scaled down. Divide
    by the batch size (after adding noise, for DP-SGD) to get a mean.

  Raises:
    ValueError: for a concrete negative or NaN ``l2_norm_clip``, a
      ``microbatch_size`` below 1 or (under a mesh set with ``jax.set_mesh``)
      not a multiple of the devices of ``spmd_axis_name``, ``batch_argnums``
      naming ``params``, or batch arguments without a common leading
      dimension.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> loss = lambda w, x: jnp.dot(w, x)  # gradient: the example itself
    >>> xs = jnp.array([[3., 4.], [0., 1.], [6., 8.]])  # norms 5, 1, 10
    >>> grad_fn = jaxclip.per_example_clipped_grad(loss, 2.0, microbatch_size=2)
    >>> total, num_clipped = grad_fn(jnp.zeros(2), xs)
    >>> total, num_clipped  # [1.2, 1.6] + [0, 1] + [1.2, 1.6]
    (Array([2.4, 4.2], dtype=float32), Array(2, dtype=int32))

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016
  """
  _validation.check_threshold(l2_norm_clip, "l2_norm_clip")
  if microbatch_size is not None and (
      isinstance(microbatch_size, bool) or int(microbatch_size) != microbatch_size
      or microbatch_size < 1):
    raise ValueError(f"microbatch_size must be a positive integer, got {microbatch_size!r}.")
  batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
  if not batch_argnums or any(i < 1 for i in batch_argnums):
    raise ValueError(
        "batch_argnums must name arguments after params (1, 2, ...), got "
        f"{batch_argnums!r}."
    )
  grad_fn = jax.grad(loss_fn)

  def example_grad(params, *args):
    if keep_batch_dim:
      args = [jax.tree.map(lambda x: jnp.expand_dims(x, 0), a) if i + 1 in batch_argnums
              else a for i, a in enumerate(args)]
    return grad_fn(params, *args)

  def clipped_grad(params, *args):
    if max(batch_argnums) > len(args):
      raise ValueError(
          f"batch_argnums={batch_argnums} but only {len(args)} arguments follow params.")
    _validation.check_inexact_leaves(params, "per_example_clipped_grad")
    idx = [i - 1 for i in batch_argnums]
    size = _batch_size(args, idx)
    if axis_name is not None:
      params = as_varying(params, axis_name)
    in_axes = (None,) + tuple(0 if i in idx else None for i in range(len(args)))
    vgrad = jax.vmap(example_grad, in_axes=in_axes, spmd_axis_name=spmd_axis_name)
    chunk = size if microbatch_size is None else min(int(microbatch_size), size)
    num_chunks = -(-size // chunk) if chunk else 1
    devices = _mesh_axis_size(spmd_axis_name)
    if num_chunks > 1 and devices and chunk % devices:
      raise ValueError(
          f"microbatch_size={microbatch_size} must be a multiple of the {devices} "
          f"devices of spmd_axis_name={spmd_axis_name!r}, so that every device "
          "takes the same number of examples of each chunk."
      )

    def clip_chunk(batch_args, mask):
      full = list(args)
      for i, a in zip(idx, batch_args, strict=True):
        full[i] = a
      grads = vgrad(params, *full)
      return _optax_compat._per_example_clip(grads, l2_norm_clip, mask=mask, accumulate=True)

    if num_chunks == 1:
      total, num_clipped = clip_chunk([args[i] for i in idx], None)
    else:
      padded = chunk * num_chunks

      def to_chunks(x):
        x = jnp.asarray(x)
        if x.shape[0] < padded:
          x = jnp.pad(x, [(0, padded - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        # Example i * num_chunks + j goes to chunk j, row i: a device holding a
        # contiguous block of the batch holds whole rows of every chunk.
        return jnp.swapaxes(x.reshape((chunk, num_chunks) + x.shape[1:]), 0, 1)

      xs = [jax.tree.map(to_chunks, args[i]) for i in idx]
      masks = to_chunks(jnp.arange(padded) < size) if padded > size else None
      # zeros_like keeps each parameter's sharding for the running sum.
      init = (jax.tree.map(
          lambda p: jnp.zeros_like(p, jnp.promote_types(jnp.result_type(p), jnp.float32)),
          params), jnp.zeros((), jax.dtypes.canonicalize_dtype(jnp.int_)))

      def body(carry, chunk_in):
        batch_args, mask = chunk_in
        part, count = clip_chunk(batch_args, mask)
        return (jax.tree.map(jnp.add, carry[0], part), carry[1] + count), None

      # Inside shard_map the sums vary over the axes the inputs vary over; the
      # scan carry must have that type from the start.
      vary = frozenset().union(*map(_varying_axes, jax.tree.leaves((params, args))))
      if vary:
        init = _cast_varying(init, tuple(sorted(vary, key=str)))
      (total, num_clipped), _ = jax.lax.scan(body, init, (xs, masks))
    total = jax.tree.map(lambda t, p: t.astype(jnp.result_type(p)), total, params)
    if axis_name is not None:
      total, num_clipped = jax.lax.psum((total, num_clipped), axis_names(axis_name))
    return total, num_clipped

  return clipped_grad
