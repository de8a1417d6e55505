"""Per-example clipping of a whole batch in bounded memory (DP-SGD's clip step).

It sits above the ops and the optax-compatible transforms: each chunk of
examples is clipped by :func:`jaxclip.per_example_global_norm_clip`'s kernel,
and :mod:`jaxclip._distributed` keeps the parameters local inside
``shard_map``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip import _distributed
from jaxclip import _ghost
from jaxclip import _numerics
from jaxclip import _optax_compat
from jaxclip import _validation

PyTree = Any
AxisName = _distributed.AxisName


def _mesh_axis_size(axis_name: AxisName | None) -> int | None:
  """The number of devices along ``axis_name`` of the current mesh, if known."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  if axis_name is None or get_mesh is None:
    return None
  mesh = get_mesh()
  names = _distributed.axis_names(axis_name)
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
    has_aux: bool = False,
    method: str = "vmap",
    return_norms: bool = False,
) -> Callable[..., tuple[Any, ...]]:
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

  With ``method="ghost"`` no per-example gradient of a dense layer or an
  embedding table is formed (*ghost norms*): the function works from the
  traced jaxpr of ``loss_fn``, so any JAX model (pure JAX, flax linen or nnx,
  equinox) is handled. One backward pass gives, for every example, each
  parameterised operation's input ``a`` and output gradient ``g``; then

  * a weight used once, by one ``dot_general`` (dense layers, einsums,
    attention projections), gets its per-example norm as
    :math:`\langle A A^\top, G G^\top\rangle` over the example's ``T``
    rows, or from :math:`A^\top G` formed per example when :math:`T^2`
    exceeds the weight's size (the mixed ghost norm rule);
  * a table used once, by an embedding lookup (``E[ids]``, ``jnp.take``),
    gets :math:`\sum_{t,s} [\mathrm{id}_t = \mathrm{id}_s]\,
    \langle g_t, g_s\rangle`, repeated ids included; a table tied to the
    output head (``h @ E.T``) adds the exact cross term of its two uses;
  * every other parameter (layer-norm scales, biases, convolution kernels,
    other weights used twice, anything used inside a ``custom_jvp``,
    ``lax.scan`` or ``cond``) gets its per-example gradient
    formed exactly, for that parameter (and those it shares a use with) only,
    in chunks of examples; for scales and biases that is a cheap reduction.

  The clipped sum is then book-kept from the same ``a`` and ``g`` (one matmul
  per dense layer), with no second pass over the model. Results equal
  ``method="vmap"`` up to float rounding; memory stays close to the
  non-private gradient's (see the README's benchmark).

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
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``, as in ``jax.grad``:
      ``aux`` (any pytree, e.g. logits or a per-example loss) is then returned
      for every example.
    method: ``"vmap"`` (per-example gradients with ``jax.vmap``) or
      ``"ghost"`` (per-example norms without per-example gradients, above).
    return_norms: Also return each example's gradient norm before clipping
      (for :func:`jaxclip.quantile_clip_norm_update`, or to monitor).

  Returns:
    A function ``(params, *args) -> (clipped_grad_sum, num_clipped)``: the sum
    over the batch of the clipped per-example gradients (a pytree like
    ``params``, in its dtypes) and how many examples were scaled down. Divide
    by the batch size (after adding noise, for DP-SGD) to get a mean.

    With ``return_norms=True`` the per-example norms (float32, in the order of
    the batch) come next: ``(clipped_grad_sum, num_clipped, norms)``.

    With ``has_aux=True`` it returns ``(clipped_grad_sum, num_clipped, aux)``
    (``aux`` last, after ``norms`` if asked for):
    each leaf of ``aux`` stacks what ``loss_fn`` returned for each example on
    a new leading axis of the batch size, in the order of the batch, whatever
    the ``microbatch_size`` (padding examples are dropped). With
    ``keep_batch_dim=True`` it is stacked as returned, so an ``aux`` that keeps
    the example's batch axis of one comes out ``(batch, 1, ...)``. Under
    ``spmd_axis_name`` it is sharded over the batch as the inputs are; with
    ``axis_name`` it holds the device's own examples only (nothing is
    gathered: ``out_specs=P(axis_name)`` puts the global batch together).

  Raises:
    ValueError: for a concrete negative or NaN ``l2_norm_clip``, a
      ``microbatch_size`` below 1 or (under a mesh set with ``jax.set_mesh``)
      not a multiple of the devices of ``spmd_axis_name``, ``batch_argnums``
      naming ``params``, batch arguments without a common leading
      dimension, an unknown ``method``, or (with ``method="ghost"``) complex
      parameters or a loss that is not a real scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> loss = lambda w, x: jnp.dot(w, x)  # gradient: the example itself
    >>> xs = jnp.array([[3., 4.], [0., 1.], [6., 8.]])  # norms 5, 1, 10
    >>> grad_fn = jaxclip.per_example_clipped_grad(loss, 2.0, microbatch_size=2)
    >>> total, num_clipped = grad_fn(jnp.zeros(2), xs)
    >>> total, num_clipped  # [1.2, 1.6] + [0, 1] + [1.2, 1.6]
    (Array([2.4, 4.2], dtype=float32), Array(2, dtype=int32))

    With ``has_aux=True``, whatever ``loss_fn`` returns beside the loss comes
    back for each example, in the batch's order:

    >>> loss_aux = lambda w, x: (jnp.dot(w, x), {'x0': x[0]})
    >>> grad_fn = jaxclip.per_example_clipped_grad(
    ...     loss_aux, 2.0, microbatch_size=2, has_aux=True)
    >>> total, num_clipped, aux = grad_fn(jnp.zeros(2), xs)
    >>> aux
    {'x0': Array([3., 0., 6.], dtype=float32)}

    ``method="ghost"`` gives the same results without forming per-example
    gradients; ``return_norms=True`` adds each example's norm:

    >>> grad_fn = jaxclip.per_example_clipped_grad(
    ...     loss, 2.0, method="ghost", return_norms=True)
    >>> total, num_clipped, norms = grad_fn(jnp.zeros(2), xs)
    >>> total, norms
    (Array([2.4, 4.2], dtype=float32), Array([ 5.,  1., 10.], dtype=float32))

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016

    Goodfellow, `Efficient Per-Example Gradient Computations
    <https://arxiv.org/abs/1510.01799>`_, 2015

    Li et al., `Large Language Models Can Be Strong Differentially Private
    Learners <https://arxiv.org/abs/2110.05679>`_, 2022 (ghost clipping)

    Bu et al., `Differentially Private Optimization on Large Model at Small
    Cost <https://arxiv.org/abs/2210.00038>`_, 2023 (book-keeping, mixed
    ghost norm)
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
  if method not in ("vmap", "ghost"):
    raise ValueError(f"method must be 'vmap' or 'ghost', got {method!r}.")

  def example_loss(params, *args):
    if keep_batch_dim:
      args = [jax.tree.map(lambda x: jnp.expand_dims(x, 0), a) if i + 1 in batch_argnums
              else a for i, a in enumerate(args)]
    out = loss_fn(params, *args)
    loss = out[0] if has_aux and isinstance(out, (tuple, list)) and out else out
    if jnp.shape(loss) or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise ValueError(
          "per_example_clipped_grad needs loss_fn to return a real scalar for one example, "
          f"got {jax.typeof(loss).str_short()}.")
    return out

  example_grad = jax.grad(example_loss, has_aux=has_aux)

  def clipped_grad(params, *args):
    if max(batch_argnums) > len(args):
      raise ValueError(
          f"batch_argnums={batch_argnums} but only {len(args)} arguments follow params.")
    _validation.check_inexact_leaves(params, "per_example_clipped_grad")
    idx = [i - 1 for i in batch_argnums]
    size = _batch_size(args, idx)
    if axis_name is not None:
      params = _distributed.as_varying(params, axis_name)
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
      if method == "ghost":
        return _ghost_chunk(example_loss, params, full, idx, l2_norm_clip, mask,
                            spmd_axis_name, has_aux)
      grads, aux = vgrad(params, *full) if has_aux else (vgrad(params, *full), None)
      total, count, norms = _optax_compat._per_example_clip(
          grads, l2_norm_clip, mask=mask, accumulate=True, return_norms=True)
      return total, count, norms, aux

    if num_chunks == 1:
      total, num_clipped, norms, aux = clip_chunk([args[i] for i in idx], None)
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
        part, count, norms, aux = clip_chunk(batch_args, mask)
        return (jax.tree.map(jnp.add, carry[0], part), carry[1] + count), (norms, aux)

      # Inside shard_map the sums vary over the axes the inputs vary over; the
      # scan carry must have that type from the start.
      vary = frozenset().union(*map(_distributed.varying_axes, jax.tree.leaves((params, args))))
      if vary:
        init = _distributed.cast_varying(init, tuple(sorted(vary, key=str)))
      (total, num_clipped), (norms, aux) = jax.lax.scan(body, init, (xs, masks))
      # The inverse of to_chunks: row i of chunk j is example i * num_chunks + j.
      norms, aux = jax.tree.map(
          lambda a: jnp.swapaxes(a, 0, 1).reshape((padded,) + a.shape[2:])[:size], (norms, aux))
    total = jax.tree.map(lambda t, p: t.astype(jnp.result_type(p)), total, params)
    if axis_name is not None:
      total, num_clipped = jax.lax.psum((total, num_clipped), _distributed.axis_names(axis_name))
    out = (total, num_clipped) + ((norms,) if return_norms else ())
    return out + (aux,) if has_aux else out

  return clipped_grad


def _ghost_chunk(example_loss, params, args, idx, l2_norm_clip, mask, spmd_axis_name, has_aux):
  """One chunk of ``method="ghost"``: the clipped sum, count, norms and aux."""
  leaves, params_tree = jax.tree.flatten(params)
  arg_leaves, batched = [], []
  for i, a in enumerate(args):
    for x in jax.tree.leaves(a):
      arg_leaves.append(jnp.asarray(x))
      batched.append(i in idx)
  args_tree = jax.tree.structure(list(args))
  if any(jnp.issubdtype(jnp.result_type(x), jnp.complexfloating) for x in leaves):
    raise ValueError("per_example_clipped_grad(method='ghost') takes real parameters only; "
                     "use method='vmap' for complex ones.")

  def flat_loss(ls, xs):
    return example_loss(jax.tree.unflatten(params_tree, ls),
                        *jax.tree.unflatten(args_tree, xs))

  def example(x, batched):
    # Inside shard_map the jaxpr must keep the axes each value varies over (and
    # record the casts they need): it is traced on the first example itself.
    if _distributed.varying_axes(x):
      return x[0] if batched else x
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(x.shape[1:] if batched else x.shape, x.dtype,
                                weak_type=aval.weak_type)

  closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(
      leaves, [example(x, b) for x, b in zip(arg_leaves, batched)])
  loss_shape = out_shape[0] if has_aux else out_shape
  if jnp.shape(loss_shape) or not jnp.issubdtype(loss_shape.dtype, jnp.floating):
    raise ValueError(
        "per_example_clipped_grad needs loss_fn to return a real scalar for one example, "
        f"got {loss_shape}.")
  infos = _ghost.input_infos([jnp.ndim(x) for x in leaves], batched)
  plan = _ghost.make_plan(_ghost.analyze(closed, infos), len(leaves))
  bound = jnp.asarray(l2_norm_clip, _numerics.tree_accumulation_dtype(leaves))

  def weights_fn(norms):
    multipliers, count = _optax_compat.clip_multipliers(norms, bound, mask)
    return (multipliers if mask is None else jnp.where(mask, multipliers, 0)), count

  grads, norms, count, aux_leaves = _ghost.clipped_sum(
      closed, plan, leaves, arg_leaves, batched, weights_fn, mask=mask,
      spmd_axis_name=spmd_axis_name)
  aux = jax.tree.unflatten(jax.tree.structure(out_shape[1]), aux_leaves) if has_aux else None
  return jax.tree.unflatten(params_tree, grads), count, norms, aux
