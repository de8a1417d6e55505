"""Per-example clipping of a whole batch in bounded memory (DP-SGD's clip step).

It sits above the ops and the optax-compatible transforms: each chunk of
examples is clipped by :func:`jaxclip.per_example_global_norm_clip`'s kernel,
and :mod:`jaxclip._kernel._sharding` keeps the parameters local inside
``shard_map``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics, _platform, _sharding, _validation
from jaxclip.privacy import _clip_batch, _ghost
from jaxclip.privacy import _jax_internals as _jax

PyTree = Any
AxisName = _sharding.AxisName


def _mesh_axis_size(axis_name: AxisName | None) -> int | None:
  """The number of devices along ``axis_name`` of the current mesh, if known."""
  if axis_name is None:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  names = _sharding.axis_names(axis_name)
  if mesh.empty or any(n not in mesh.axis_names for n in names):
    return None
  return math.prod(mesh.shape[n] for n in names)


def _batch_size(args: Sequence[Any], batch_argnums: tuple[int, ...]) -> int:
  sizes = {
    jnp.shape(x)[0] if jnp.ndim(x) else None
    for i in batch_argnums
    for x in jax.tree.leaves(args[i])
  }
  if len(sizes) != 1 or None in sizes:
    shapes = [jax.tree.map(jnp.shape, args[i]) for i in batch_argnums]
    raise ValueError(
      "per_example_clipped_grad needs every array of the batch arguments to "
      f"share one batch dimension on axis 0; got shapes {shapes}."
    )
  return sizes.pop()


def _check_mask(example_mask: Any, size: int) -> jax.Array | None:
  """``example_mask`` as a boolean ``(size,)`` array (or ``None``), else a clear error."""
  if example_mask is None:
    return None
  dtype = getattr(example_mask, "dtype", None)
  if dtype is None:
    example_mask = jnp.asarray(example_mask)
    dtype = example_mask.dtype
  if dtype != jnp.bool_ or jnp.shape(example_mask) != (size,):
    raise ValueError(
      "example_mask must be a boolean array of shape (batch,) = "
      f"({size},), True for a real example; got {jax.typeof(example_mask)}."
    )
  return jnp.asarray(example_mask)


def _rows(mask: jax.Array, like: jax.Array) -> jax.Array:
  """A ``(rows,)`` mask shaped to broadcast against ``like`` (``(rows,)`` or ``(rows, groups)``)."""
  return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


def _first_real_row(x: jax.Array, onehot: jax.Array) -> jax.Array:
  """Row ``argmax(onehot)`` of ``x``, as a masked sum: safe on a sharded batch axis."""
  x = jnp.asarray(x)
  work = jnp.int32 if x.dtype == jnp.bool_ else x.dtype
  picked = jnp.where(
    onehot.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(work), jnp.zeros((), work)
  )
  return jnp.sum(picked, axis=0, dtype=work).astype(x.dtype)


def _pad_rows(x: jax.Array, rows: Any) -> jax.Array:
  """``x`` with ``rows >= len(x)`` rows: zeros appended.

  With a symbolic batch (``jax.export``), where how many rows to append is not
  known when tracing, the rows appended are copies of the last one: callers
  mask them out.
  """
  n = x.shape[0]
  if n == rows:
    return x
  if _jax.is_symbolic(n) or _jax.is_symbolic(rows):
    return jnp.take(x, jnp.minimum(jnp.arange(rows), n - 1), axis=0)
  return jnp.pad(x, [(0, rows - n)] + [(0, 0)] * (x.ndim - 1))


def _stand_in(x: Any, mask: jax.Array, padded: Any) -> jax.Array:
  """``x`` padded to ``padded`` rows, every row where ``mask`` is False replaced by the first
  real example (so a loss that is non-finite on zeros or on masked rows stays finite)."""
  x = jnp.asarray(x)
  onehot = jnp.arange(x.shape[0]) == jnp.argmax(mask[: x.shape[0]])
  first = _first_real_row(x, onehot)
  x = _pad_rows(x, padded)
  return jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, first)


def _warn_shared_like_batch(args: Sequence[Any], idx: Sequence[int], size: int) -> bool:
  """Warns if a shared argument has a leading dimension of the batch size; True if it did."""
  for i, a in enumerate(args):
    if i in idx:
      continue
    if any(getattr(x, "shape", None) and x.shape[0] == size for x in jax.tree.leaves(a)):
      warnings.warn(
        f"per_example_clipped_grad: argument {i + 1} is shared (not in batch_argnums) but "
        f"has a leading dimension of the batch size {size}: if it holds one row per "
        "example, add it to batch_argnums, or it is given whole to every example. "
        "(Warned once per function.)",
        UserWarning,
        stacklevel=4,
      )
      return True
  return False


def per_example_clipped_grad(
  loss_fn: Callable[..., jax.Array],
  l2_norm_clip: jax.typing.ArrayLike,
  *,
  microbatch_size: int | None = None,
  batch_argnums: int | Sequence[int] | None = None,
  keep_batch_dim: bool = False,
  spmd_axis_name: AxisName | None = None,
  axis_name: AxisName | None = None,
  has_aux: bool = False,
  method: str = "vmap",
  return_norms: bool = False,
  group_size: int = 1,
  normalize: float | None = None,
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
  A batch that is not a multiple of ``microbatch_size`` is padded with copies
  of a real example at weight 0, so a loss that is non-finite on zeros (such
  as ``w / x``) leaves the sum finite.

  **Masks.** The returned function takes ``example_mask=``, a boolean
  ``(batch,)`` array, True for a real example: the fixed-shape batches of
  Poisson sampling (:func:`jaxclip.poisson_batch`) under ``jit``. A
  masked-out example contributes nothing to the sum (its rows are replaced
  by a copy of a real example at weight 0, so even a loss that is
  non-finite on them is harmless), is not counted in ``num_clipped`` and
  gets norm 0; this holds for both methods and every option below.

  **User-level clipping.** With ``group_size=k`` the batch is ``B / k``
  groups of ``k`` consecutive examples (one user's data, padded with masked
  rows) and the clipped unit is a group: the gradient of the sum of its
  examples' losses is clipped to ``l2_norm_clip`` as a whole,

  .. math::

    \sum_{u=1}^{B/k} G_u \cdot \min\!\Big(1, \frac{C}{\|G_u\|_2}\Big),
    \qquad G_u = \nabla_\theta \sum_{b \in u} m_b\,\ell(\theta, x_b),

  with :math:`m_b` the mask, so the sum's sensitivity to one user's data is
  ``C``. Both methods treat a group's loss as the loss of one example, so
  ghost norms apply unchanged.

  **Per-layer clipping.** ``l2_norm_clip`` may be a pytree prefix of
  ``params`` (one threshold per layer, or per group of layers: each of its
  leaves covers the parameter leaves under it). Each example's gradient
  :math:`g_b` is then clipped group by group,

  .. math::

    \sum_{b=1}^{B} \sum_{k} g_{b,k} \cdot
    \min\!\Big(1, \frac{C_k}{\|g_{b,k}\|_2}\Big),

  :math:`g_{b,k}` its part in group ``k``, so the sum's sensitivity is
  :math:`\sqrt{\sum_k C_k^2}` (what :func:`jaxclip.dp_noise` takes from the
  same pytree). ``num_clipped`` and ``norms`` then come per group, as
  pytrees like ``l2_norm_clip`` (below). Under ``method="ghost"`` each
  group's norm adds its leaves' rules, and the book-keeping weights each
  site by its own group; where one parameter input mixes leaves of two
  groups (``W1 + W2``, ``W1`` and ``W2`` clipped apart), those leaves are
  already instantiated for their norms, and the clipped sum pulls that
  input back once per group it touches (in a two-pass plan, the weighted
  backward pass runs once per group).

  **Automatic clipping.** With ``normalize=gamma`` (``None``: clip) every
  example (every group) is scaled instead of clipped,

  .. math::

    \sum_{b=1}^{B} g_b \cdot \frac{C}{\|g_b\|_2 + \gamma},

  so that its norm, :math:`C \|g_b\| / (\|g_b\| + \gamma)`, is below ``C``
  (close to it unless the gradient is small): no threshold to tune against
  the gradients' size (the learning rate absorbs ``C``), and the
  sensitivity is still ``C`` (per group, :math:`\sqrt{\sum_k C_k^2}`).
  ``gamma = 0`` is normalised SGD; a small ``gamma`` (Bu et al. use 0.01)
  keeps small gradients from being scaled up to ``C``. ``num_clipped``
  counts the examples scaled down (:math:`\|g_b\| + \gamma > C`).

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

  ==============================  ===========================================
  case                            result
  ==============================  ===========================================
  ``l2_norm_clip == 0``           zeros; every example counts as clipped
                                  (with ``normalize``: every one with
                                  :math:`\|g\| + \gamma > 0`)
  a non-finite gradient           ``nan`` in the sum (the failure is visible)
  ``normalize=0``, zero gradient  contributes zeros, factor 0 (not 0/0),
                                  not counted; so does a gradient whose
                                  float32 squared norm underflows to 0
  ``normalize=0``, tiny gradient  scaled to norm ``C``; the factor
                                  :math:`C / \|g\|` is capped at float32's
                                  largest number
  ``normalize``, infinite ``C``   refused (``ValueError``): no finite
                                  sensitivity
  ``normalize``, float16, ghost   factors above 1 meet float16 output
                                  gradients: the book-keeping is scaled by
                                  a power of two into float16's range, and
                                  back in float32
  a group with no leaves          norm 0, as a zero gradient
  ==============================  ===========================================

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
  * a convolution kernel gets the first rule over the input's patches, or its
    per-example gradient from that layer alone, whichever costs less;
  * every other parameter (layer-norm scales, biases, other weights used
    twice, anything used inside a ``custom_jvp`` or ``cond``) gets its
    per-example gradient formed exactly, for those parameters only, in
    chunks of examples; for scales and biases that is a cheap reduction.

  The rules apply per iteration of a ``lax.scan`` over stacked layers (flax
  ``nn.scan``, ``nnx.scan``, equinox) and per static slice of a stacked
  weight, the squared norms added; a weight every iteration of a scan reads
  (an RNN's cell, a block shared by every layer) gets the first rule over
  iterations x rows, and a lookup at ids that do not depend on the example
  (``wpe[jnp.arange(T)]``) the second. The clipped sum is then book-kept from the
  same ``a`` and ``g`` (one matmul per dense layer), with no second pass over
  the model; where a layer with a ghost rule is rematerialised
  (``jax.checkpoint``, flax ``nn.remat``), the norms are taken inside the
  backward pass, keeping no ``a`` and ``g``, and the clipped sum is a second,
  weighted backward pass (:attr:`jaxclip.GhostPlan.passes` is 2).
  ``"ghost"`` applies every rule it finds, whatever it costs; only where the
  loss uses a higher-order primitive the engine does not know is
  ``"vmap"``'s way taken (and named by :func:`jaxclip.ghost_plan`).

  With ``method="auto"`` each layer gets its rule or its own per-example
  gradient by the cost model of the platform the program is lowered for: on
  CPU by flops, as measured on XLA:CPU (per layer, the rules' own switch
  between the Gram form and the per-example gradient formed from ``a`` and
  ``g``; for the whole loss, ``"vmap"``'s program where the rules would cost
  more than 0.9x the flops of every per-example gradient); elsewhere by
  memory, not measured (per layer, the rule or the layer's per-example
  gradient, whichever holds fewer floats per example; ``"vmap"``'s program
  where no layer keeps a rule). Where the two models disagree both plans are staged under
  :func:`jax.lax.platform_dependent`, and the lowering keeps its platform's.
  :func:`jaxclip.ghost_plan` shows the rule of each parameter. Results equal
  ``method="vmap"`` up to float rounding; memory stays close to the
  non-private gradient's (see the benchmark in docs/privacy.md). Under bfloat16
  compute the reference is the non-private ``jax.grad``: ghost's clipped sum,
  book-kept through the model's own bfloat16 operations, matches it bit for
  bit where nothing is clipped, while ``vmap``'s float32 sum of per-example gradients
  differs from both by bfloat16 rounding.

  **Symbolic batches.** Under ``jax.export`` the batch dimension may be
  symbolic (``jax.export.symbolic_shape("b")``), for both methods, with or
  without ``microbatch_size`` (chunks of ``min(b, microbatch_size)``
  examples) and ``example_mask``; with ``group_size=k`` it must be known to
  be a multiple of ``k`` (such as ``symbolic_shape("k*u")``).

  Args:
    loss_fn: ``loss_fn(params, *args) -> scalar`` for one example (or, with
      ``keep_batch_dim=True``, for a batch of one).
    l2_norm_clip: The largest L2 norm of one example's gradient, ``>= 0``;
      or a pytree prefix of ``params`` with one such number per group of
      leaves (per-layer clipping, above). Each may be traced.
    microbatch_size: How many examples' gradients to hold at once; ``None``
      for the whole batch in one ``vmap``.
    batch_argnums: Which positional arguments of ``loss_fn`` after ``params``
      carry the batch on axis 0 of every leaf (counted as in ``loss_fn``, so
      ``1`` is the first argument after ``params``); the others are shared,
      given whole to every example. ``None`` (default): every argument after
      ``params`` is batched. A shared argument whose leading dimension equals
      the batch size gets a warning (once per function): it is often a
      batched one left out.
    keep_batch_dim: Pass each example to ``loss_fn`` with a leading axis of
      size one.
    spmd_axis_name: The mesh axis (or axes) the batch is sharded over under
      ``jit``, passed to ``jax.vmap``.
    axis_name: Inside ``shard_map``/``pmap``, the axis (or axes) to sum the
      clipped gradients and counts over.
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``, as in ``jax.grad``:
      ``aux`` (any pytree, e.g. logits or a per-example loss) is then returned
      for every example.
    method: ``"vmap"`` (per-example gradients with ``jax.vmap``),
      ``"ghost"`` (per-example norms without per-example gradients, above)
      or ``"auto"`` (per layer, whichever the platform's cost model finds
      cheaper, above).
    return_norms: Also return each example's gradient norm before clipping
      (for :func:`jaxclip.quantile_clip_norm_update`, or to monitor).
    group_size: Clip groups of this many consecutive examples as one unit
      (user-level clipping, above); ``1`` (default) clips each example. It
      must divide the batch, and ``microbatch_size`` (which counts examples)
      must be a multiple of it.
    normalize: ``None`` (default) to clip, or ``gamma >= 0`` (a number, may
      be traced) to scale each example by :math:`C / (\|g\| + \gamma)`
      (automatic clipping, above).

  Returns:
    A function ``(params, *args, example_mask=None) -> (clipped_grad_sum,
    num_clipped)``: the sum
    over the batch of the clipped per-example gradients (a pytree like
    ``params``, in its dtypes) and how many examples were scaled down. Divide
    by the batch size (after adding noise, for DP-SGD) to get a mean.

    With ``return_norms=True`` the per-example norms (float32, in the order of
    the batch; 0 where ``example_mask`` is False) come next:
    ``(clipped_grad_sum, num_clipped, norms)``. With ``group_size=k``,
    ``num_clipped`` counts groups and ``norms`` has one entry per group.

    With a pytree ``l2_norm_clip`` (per-layer clipping), ``num_clipped`` is a
    pytree like it: for each group of leaves, how many examples had that
    part of their gradient scaled down (an example may count in several
    groups); and ``norms`` is a pytree like it of ``(batch,)`` arrays, each
    example's norm over that group's leaves (the global norm is the
    root-sum-square of the groups'), ready for
    :func:`jaxclip.quantile_clip_norm_update` per group (``jax.tree.map``
    over ``l2_norm_clip``, ``norms`` and one key per group).

    An empty batch gives zeros, a count of 0 and an empty ``norms``; empty
    ``params`` give an empty sum and norms of 0.

    With ``has_aux=True`` it returns ``(clipped_grad_sum, num_clipped, aux)``
    (``aux`` last, after ``norms`` if asked for):
    each leaf of ``aux`` stacks what ``loss_fn`` returned for each example on
    a new leading axis of the batch size, in the order of the batch, whatever
    the ``microbatch_size`` (padding examples are dropped; a masked-out
    example's aux is its stand-in's). With
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
      dimension, an ``example_mask`` that is not boolean ``(batch,)``, a
      ``group_size`` that is not a positive divisor of the batch (or of a
      symbolic batch not known to be its multiple), an unknown
      ``method``, or (with ``method="ghost"``) complex
      parameters or a loss that is not a real scalar.

  Examples:
    A loss of ``(params, x, y)`` for one example: ``x`` and ``y`` both carry
    the batch (every argument after ``params`` does, by default):

    >>> import jax, jax.numpy as jnp
    >>> import jaxclip
    >>> def sq_loss(w, x, y):
    ...   return (jnp.dot(w, x) - y) ** 2
    >>> xs, ys = jnp.array([[1., 0.], [0., 1.], [1., 1.]]), jnp.array([1., -1., 0.])
    >>> grad_fn = jaxclip.per_example_clipped_grad(sq_loss, 1.0)
    >>> grad_fn(jnp.zeros(2), xs, ys)  # per-example gradients [-2, 0], [0, 2], [0, 0]
    (Array([-1.,  1.], dtype=float32), Array(2, dtype=int32))

    With a shared argument, ``batch_argnums`` names the batched ones:

    >>> scaled = lambda w, scale, x, y: scale * sq_loss(w, x, y)
    >>> grad_fn = jaxclip.per_example_clipped_grad(scaled, 1.0, batch_argnums=(2, 3))
    >>> grad_fn(jnp.zeros(2), 0.25, xs, ys)[0]
    Array([-0.5,  0.5], dtype=float32)

    Microbatches of two examples; the gradient of ``w . x`` is ``x``:

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

    ``example_mask`` drops examples (the padding of a Poisson batch), and
    ``group_size`` clips groups of examples as one unit:

    >>> mask = jnp.array([True, False, True])
    >>> grad_fn(jnp.zeros(2), xs, example_mask=mask)[2]
    Array([ 5.,  0., 10.], dtype=float32)
    >>> pairs = jnp.array([[3., 0.], [0., 4.], [1., 0.], [0., 0.]])  # users (0, 1), (2, 3)
    >>> jaxclip.per_example_clipped_grad(loss, 2.0, group_size=2, return_norms=True)(
    ...     jnp.zeros(2), pairs)
    (Array([2.2, 1.6], dtype=float32), Array(1, dtype=int32), Array([5., 1.], dtype=float32))

    A clip norm per layer: counts and norms per layer; and automatic
    clipping, each example scaled to norm ``C`` (here ``gamma = 0``):

    >>> params = {"w": jnp.zeros(2), "b": jnp.zeros(())}
    >>> affine = lambda p, x: jnp.dot(p["w"], x) + 3.0 * p["b"]  # gradients x and 3
    >>> grad_fn = jaxclip.per_example_clipped_grad(
    ...     affine, {"w": 2.0, "b": 1.0}, return_norms=True)
    >>> total, num_clipped, norms = grad_fn(params, xs)
    >>> total["w"], num_clipped  # w: as above; b: each 3 clipped to 1
    (Array([2.4, 4.2], dtype=float32), {'b': Array(3, dtype=int32), 'w': Array(2, dtype=int32)})
    >>> norms["b"]
    Array([3., 3., 3.], dtype=float32)
    >>> grad_fn = jaxclip.per_example_clipped_grad(loss, 2.0, normalize=0.0)
    >>> grad_fn(jnp.zeros(2), xs)[0]  # [1.2, 1.6] + [0, 2] + [1.2, 1.6]
    Array([2.4, 5.2], dtype=float32)

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

    Bu et al., `Scalable and Efficient Training of Large Convolutional Neural
    Networks with Differential Privacy <https://arxiv.org/abs/2205.10683>`_,
    2022 (mixed ghost clipping, per layer: ``method="auto"``)

    Bu et al., `Automatic Clipping: Differentially Private Deep Learning Made
    Easier and Stronger <https://arxiv.org/abs/2206.07136>`_, 2023
    (``normalize``)

    McMahan et al., `Learning Differentially Private Recurrent Language Models
    <https://arxiv.org/abs/1710.06963>`_, 2017 (per-layer clipping)
  """
  opts = _Options.checked(
    loss_fn,
    l2_norm_clip,
    microbatch_size=microbatch_size,
    batch_argnums=batch_argnums,
    keep_batch_dim=keep_batch_dim,
    spmd_axis_name=spmd_axis_name,
    axis_name=axis_name,
    has_aux=has_aux,
    method=method,
    return_norms=return_norms,
    group_size=group_size,
    normalize=normalize,
  )
  warned = []  # the shared-argument warning is given once per function

  def clipped_grad(params, *args, example_mask=None):
    batch = _batch_of(opts, params, args, example_mask, warned)
    call = dataclasses.replace(opts, groups=_clip_batch.clip_groups(opts.l2_norm_clip, params))
    out = _clipped_units(call, _unit_loss(opts, batch.idx), params, _grouped(opts, batch))
    if opts.group_size > 1 and opts.has_aux:  # each example's aux, in the batch's order
      size = batch.size
      out = out[:-1] + (jax.tree.map(lambda a: a.reshape((size,) + a.shape[2:]), out[-1]),)
    return out

  return clipped_grad


# ----------------------------------------------------------------------------
# Setup: the options, the batch arguments, the mask, the groups
# ----------------------------------------------------------------------------


def _positive_int(value: Any, name: str) -> None:
  if isinstance(value, bool) or int(value) != value or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class _Options:
  """The checked options of one :func:`per_example_clipped_grad` function."""

  loss_fn: Callable[..., Any]
  l2_norm_clip: jax.typing.ArrayLike
  microbatch_size: int | None
  batch_argnums: tuple[int, ...] | None
  keep_batch_dim: bool
  spmd_axis_name: AxisName | None
  axis_name: AxisName | None
  has_aux: bool
  method: str
  return_norms: bool
  group_size: int
  normalize: Any = None
  # Per call: the clip bound's groups of parameter leaves (_clip_batch.clip_groups).
  groups: _clip_batch.ClipGroups | None = None

  @property
  def per_group(self) -> bool:
    """Whether ``l2_norm_clip`` is a pytree: counts and norms per group of leaves."""
    return self.groups is not None and self.groups.per_group

  def group_shape(self) -> tuple[int, ...]:
    """The trailing shape of per-group counts and norms: ``(groups,)``, or ``()``."""
    return (len(self.groups.bounds),) if self.per_group else ()

  def factors(self, norms: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Each unit's (and group's) weight, 0 where masked, and the count scaled down."""
    bound = self.groups.bound(norms.dtype)
    weights, count = _clip_batch.scale_factors(norms, bound, mask, self.normalize)
    if mask is not None:
      weights = jnp.where(_rows(mask, weights), weights, 0)
    return weights, count

  @classmethod
  def checked(
    cls, loss_fn: Callable[..., Any], l2_norm_clip: jax.typing.ArrayLike, **kwargs: Any
  ) -> _Options:
    """The options, or a ``ValueError`` naming the first bad one."""
    _clip_batch.check_clip(l2_norm_clip)
    _clip_batch.check_normalize(kwargs["normalize"], l2_norm_clip)
    micro, group = kwargs["microbatch_size"], kwargs["group_size"]
    if micro is not None:
      _positive_int(micro, "microbatch_size")
    _positive_int(group, "group_size")
    kwargs["group_size"] = group = int(group)
    if micro is not None and micro % group:
      raise ValueError(
        f"microbatch_size={micro} must be a multiple of "
        f"group_size={group}: each chunk holds whole groups."
      )
    nums = kwargs["batch_argnums"]
    if nums is not None:
      nums = (nums,) if isinstance(nums, int) else tuple(nums)
      if not nums or any(i < 1 for i in nums):
        raise ValueError(
          f"batch_argnums must name arguments after params (1, 2, ...), got {nums!r}."
        )
      kwargs["batch_argnums"] = nums
    if kwargs["method"] not in _ghost.METHODS:
      raise ValueError(
        f"method must be one of {', '.join(map(repr, _ghost.METHODS))}, got {kwargs['method']!r}."
      )
    return cls(loss_fn, l2_norm_clip, **kwargs)


class _Batch(NamedTuple):
  """A call's arguments, checked.

  Attributes:
    args: The arguments after ``params``.
    idx: The positions in ``args`` of the batched ones.
    size: The number of examples.
    mask: The ``example_mask`` as a boolean ``(size,)`` array, or ``None``.
  """

  args: list[Any]
  idx: list[int]
  size: int
  mask: jax.Array | None


def _batch_of(
  opts: _Options, params: Any, args: Sequence[Any], example_mask: Any, warned: list[bool]
) -> _Batch:
  nums = opts.batch_argnums if opts.batch_argnums is not None else tuple(range(1, len(args) + 1))
  if not nums:
    raise ValueError("per_example_clipped_grad needs a batch: at least one argument after params.")
  if max(nums) > len(args):
    raise ValueError(f"batch_argnums={nums} but only {len(args)} arguments follow params.")
  _validation.check_inexact_leaves(params, "per_example_clipped_grad")
  idx = [i - 1 for i in nums]
  size = _batch_size(args, idx)
  if opts.batch_argnums is not None and not warned and _warn_shared_like_batch(args, idx, size):
    warned.append(True)
  return _Batch(list(args), idx, size, _check_mask(example_mask, size))


class _Units(NamedTuple):
  """The batch in clipping units: examples, or (``group_size > 1``) groups of examples.

  Attributes:
    args: The loss's arguments; those at ``idx`` carry the units on axis 0 (a
      group's examples on axis 1, and its real-example flags last).
    idx: The positions in ``args`` of the batched ones.
    size: The number of units.
    mask: Which units hold a real example, or ``None``.
    microbatch: The units per chunk, or ``None`` for all at once.
  """

  args: list[Any]
  idx: list[int]
  size: int
  mask: jax.Array | None
  microbatch: int | None


def _grouped(opts: _Options, batch: _Batch) -> _Units:
  """``batch`` in units of ``group_size`` consecutive examples."""
  k, size, mask = opts.group_size, batch.size, batch.mask
  if k == 1:
    return _Units(batch.args, batch.idx, size, mask, opts.microbatch_size)
  if _jax.is_symbolic(size % k):
    raise ValueError(
      f"group_size={k} must divide the batch, whose size {size} is symbolic (jax.export) "
      f"and not known to be a multiple of {k}: export it as one, such as "
      f"jax.export.symbolic_shape('{k}*u')."
    )
  if size % k:
    raise ValueError(
      f"group_size={k} must divide the batch of {size} examples "
      "(groups are consecutive examples; pad a user's data with masked rows)."
    )
  units = size // k
  real = jnp.ones((size,), jnp.bool_) if mask is None else mask
  regroup = lambda x: jnp.reshape(x, (units, k) + jnp.shape(x)[1:])
  stand_in = lambda x: _stand_in(x, real, size) if mask is not None else jnp.asarray(x)
  args = [
    jax.tree.map(lambda x: regroup(stand_in(x)), a) if i in batch.idx else a
    for i, a in enumerate(batch.args)
  ] + [regroup(real)]
  micro = None if opts.microbatch_size is None else opts.microbatch_size // k
  unit_mask = None if mask is None else jnp.any(regroup(real), axis=1)
  return _Units(args, batch.idx + [len(batch.args)], units, unit_mask, micro)


def _unit_loss(opts: _Options, idx: Sequence[int]) -> Callable[..., Any]:
  """The loss of one unit: one example, or (``group_size > 1``) one group's sum."""

  def example_loss(params, *args):
    if opts.keep_batch_dim:
      args = [
        jax.tree.map(lambda x: jnp.expand_dims(x, 0), a) if i in idx else a
        for i, a in enumerate(args)
      ]
    out = opts.loss_fn(params, *args)
    loss = out[0] if opts.has_aux and isinstance(out, (tuple, list)) and out else out
    if jnp.shape(loss) or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise ValueError(
        "per_example_clipped_grad needs loss_fn to return a real scalar for one example, "
        f"got {jax.typeof(loss).str_short()}."
      )
    return out

  if opts.group_size == 1:
    return example_loss

  def group_loss(params, *args):
    *args, real = args  # args' batched leaves hold the group's k examples
    in_axes = (None,) + tuple(0 if i in idx else None for i in range(len(args)))
    out = jax.vmap(example_loss, in_axes=in_axes)(params, *args)
    losses, aux = out if opts.has_aux else (out, None)
    loss = jnp.sum(jnp.where(real, losses, jnp.zeros((), losses.dtype)))
    return (loss, aux) if opts.has_aux else loss

  return group_loss


# ----------------------------------------------------------------------------
# Chunking: microbatches under lax.scan, padded with copies of a real example
# ----------------------------------------------------------------------------


class _Chunks(NamedTuple):
  """How the units are cut into chunks: ``num`` chunks of ``size`` units (``padded`` in all).

  With a symbolic batch (``jax.export``), ``size`` and ``num`` are symbolic
  too: ``min(batch, microbatch_size)`` and as many chunks as that takes.
  """

  size: Any
  num: Any

  @property
  def padded(self) -> Any:
    return self.size * self.num

  def pads(self, units: int) -> bool:
    """Whether the chunks hold more than ``units`` rows (always, for a symbolic batch: the
    padding rows are then masked, whether there are any or not)."""
    if _jax.is_symbolic(units):
      return self.padded != units
    return self.padded > units

  def split(self, x: Any) -> jax.Array:
    """``x`` (padded to ``padded`` rows) as ``(num, size, ...)``.

    Example ``i * num + j`` goes to chunk ``j``, row ``i``: a device holding a
    contiguous block of the batch holds whole rows of every chunk.
    """
    x = _pad_rows(jnp.asarray(x), self.padded)
    return jnp.swapaxes(x.reshape((self.size, self.num) + x.shape[1:]), 0, 1)

  def join(self, a: jax.Array, size: int) -> jax.Array:
    """The inverse of :meth:`split`, the first ``size`` rows."""
    return jnp.swapaxes(a, 0, 1).reshape((self.padded,) + a.shape[2:])[:size]


def _chunks(opts: _Options, units: _Units) -> _Chunks:
  micro = units.microbatch
  size = units.size if micro is None else _jax.min_dim(units.size, int(micro))
  if _jax.is_symbolic(units.size):  # a symbolic batch has at least one example
    num = -(-units.size // size)
    several = micro is not None  # chunks of microbatch_size, unless the batch is smaller
    size_devices = int(micro) if several else None
  else:
    num = -(-units.size // size) if size else 1
    several, size_devices = num > 1, size
  devices = _mesh_axis_size(opts.spmd_axis_name)
  if several and devices and size_devices % devices:
    raise ValueError(
      f"microbatch_size={opts.microbatch_size} must be a multiple of the {devices} "
      f"devices of spmd_axis_name={opts.spmd_axis_name!r}, so that every device "
      "takes the same number of examples of each chunk."
    )
  return _Chunks(size, num)


def _clipped_units(
  opts: _Options, loss: Callable[..., Any], params: Any, units: _Units
) -> tuple[Any, ...]:
  """The clipped sum over the units, chunk by chunk, with the outputs asked for."""
  if opts.axis_name is not None:
    params = _sharding.as_varying(params, opts.axis_name)
  chunks = _chunks(opts, units)
  # Padding and masked-out rows become copies of the first real example, at
  # weight 0: a loss that is non-finite on zeros (or on the masked rows) is
  # then evaluated on real data only, so no NaN reaches the sum, under
  # either method.
  mask = units.mask
  if mask is not None or chunks.pads(units.size):
    full_mask = jnp.arange(chunks.padded) < units.size
    if mask is not None:
      full_mask = full_mask & _pad_rows(mask, chunks.padded)
    batch = [
      jax.tree.map(lambda x: _stand_in(x, full_mask, chunks.padded), units.args[i])
      for i in units.idx
    ]
  else:
    full_mask, batch = None, [units.args[i] for i in units.idx]

  def clip_chunk(batch_args, mask):
    full = list(units.args)
    for i, a in zip(units.idx, batch_args, strict=True):
      full[i] = a
    return _clip_chunk(opts, loss, params, full, units.idx, mask)

  if units.size == 0:
    out = _empty_batch(opts, loss, params, units)
  elif isinstance(chunks.num, int) and chunks.num == 1:
    out = clip_chunk(batch, full_mask)
  else:
    out = _scan_chunks(clip_chunk, chunks, params, units, batch, full_mask, opts.group_shape())
  return _finish(opts, params, units.mask, *out)


def _empty_batch(
  opts: _Options, loss: Callable[..., Any], params: Any, units: _Units
) -> tuple[Any, jax.Array, jax.Array, Any]:
  """Zeros, a count of 0, no norms and an empty aux: what both methods give for no examples."""
  example = [
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)), a)
    if i in units.idx
    else a
    for i, a in enumerate(units.args)
  ]
  shapes = jax.eval_shape(loss, params, *example)
  total = jax.tree.map(jnp.zeros_like, params)
  num_clipped = jnp.zeros(opts.group_shape(), jax.dtypes.canonicalize_dtype(jnp.int_))
  norms = jnp.zeros((0,) + opts.group_shape(), _numerics.tree_accumulation_dtype(params))
  aux = (
    jax.tree.map(lambda s: jnp.zeros((0,) + s.shape, s.dtype), shapes[1]) if opts.has_aux else None
  )
  return total, num_clipped, norms, aux


def _scan_chunks(
  clip_chunk: Callable[..., Any],
  chunks: _Chunks,
  params: Any,
  units: _Units,
  batch: list[Any],
  full_mask: jax.Array | None,
  count_shape: tuple[int, ...] = (),
) -> tuple[Any, jax.Array, jax.Array, Any]:
  """The chunks one after the other under ``lax.scan``, their sums in float32 (or wider)."""
  xs = [jax.tree.map(chunks.split, b) for b in batch]
  masks = chunks.split(full_mask) if full_mask is not None else None
  # zeros_like keeps each parameter's sharding for the running sum.
  init = (
    jax.tree.map(
      lambda p: jnp.zeros_like(p, jnp.promote_types(jnp.result_type(p), jnp.float32)), params
    ),
    jnp.zeros(count_shape, jax.dtypes.canonicalize_dtype(jnp.int_)),
  )

  def body(carry, chunk_in):
    batch_args, mask = chunk_in
    part, count, norms, aux = clip_chunk(batch_args, mask)
    return (jax.tree.map(jnp.add, carry[0], part), carry[1] + count), (norms, aux)

  # Inside shard_map the sums vary over the axes the inputs vary over; the
  # scan carry must have that type from the start.
  vary = frozenset().union(*map(_sharding.varying_axes, jax.tree.leaves((params, units.args))))
  if vary:
    init = _sharding.cast_varying(init, tuple(sorted(vary, key=str)))
  (total, num_clipped), (norms, aux) = jax.lax.scan(body, init, (xs, masks))
  norms, aux = jax.tree.map(lambda a: chunks.join(a, units.size), (norms, aux))
  return total, num_clipped, norms, aux


def _finish(
  opts: _Options,
  params: Any,
  mask: jax.Array | None,
  total: Any,
  num_clipped: jax.Array,
  norms: jax.Array,
  aux: Any,
) -> tuple[Any, ...]:
  """Masked norms, sums in the parameters' dtypes and summed over devices, as returned."""
  if mask is not None:
    norms = jnp.where(_rows(mask, norms), norms, jnp.zeros((), norms.dtype))
    # With no real example the stand-in is a masked row itself: drop it whatever it gave.
    any_real = jnp.any(mask)
    total = jax.tree.map(lambda t: jnp.where(any_real, t, jnp.zeros((), t.dtype)), total)
  total = jax.tree.map(lambda t, p: t.astype(jnp.result_type(p)), total, params)
  if opts.axis_name is not None:
    total, num_clipped = jax.lax.psum((total, num_clipped), _sharding.axis_names(opts.axis_name))
  num_clipped, norms = opts.groups.unflatten(num_clipped, 0), opts.groups.unflatten(norms, 1)
  out = (total, num_clipped) + ((norms,) if opts.return_norms else ())
  return out + (aux,) if opts.has_aux else out


# ----------------------------------------------------------------------------
# The two methods, on one chunk
# ----------------------------------------------------------------------------


def _clip_chunk(
  opts: _Options,
  loss: Callable[..., Any],
  params: Any,
  args: list[Any],
  idx: Sequence[int],
  mask: jax.Array | None,
) -> tuple[Any, jax.Array, jax.Array, Any]:
  """One chunk's clipped sum (float32 or wider), count, norms and aux.

  Under ``"ghost"`` and ``"auto"`` the plan is chosen when tracing, for each
  platform the program may be lowered for: ``"auto"``'s cost model differs
  between CPU and the others, so where its plans differ both are staged under
  :func:`jaxclip._kernel._platform.on_cpu` and the lowering keeps one.
  """
  if opts.method == "vmap":
    return _vmap_chunk(opts, loss, params, args, idx, mask)
  traced = _ghost.trace(loss, params, args, idx, has_aux=opts.has_aux)
  cpu = _ghost.plan_for(traced.plan, opts.method, "cpu")[0]
  other = _ghost.plan_for(traced.plan, opts.method, None)[0]

  def run(plan):
    if plan is None:  # method="vmap"'s program
      out = _vmap_chunk(opts, loss, params, args, idx, mask)
    else:
      out = _ghost_chunk(opts, dataclasses.replace(traced, plan=plan), mask)
    acc = lambda t, p: t.astype(jnp.promote_types(jnp.result_type(p), jnp.float32))
    return (jax.tree.map(acc, out[0], params), *out[1:])

  if cpu == other:
    return run(cpu)
  return _platform.on_cpu(lambda: run(cpu), lambda: run(other))


def _vmap_chunk(
  opts: _Options,
  loss: Callable[..., Any],
  params: Any,
  args: list[Any],
  idx: Sequence[int],
  mask: jax.Array | None,
) -> tuple[Any, jax.Array, jax.Array, Any]:
  """``method="vmap"``: per-example gradients under ``vmap``, clipped and summed."""
  in_axes = (None,) + tuple(0 if i in idx else None for i in range(len(args)))
  vgrad = jax.vmap(
    jax.grad(loss, has_aux=opts.has_aux), in_axes=in_axes, spmd_axis_name=opts.spmd_axis_name
  )
  grads, aux = vgrad(params, *args) if opts.has_aux else (vgrad(params, *args), None)
  bound = opts.groups if opts.per_group else opts.l2_norm_clip
  total, count, norms = _clip_batch._per_example_clip(
    grads, bound, mask=mask, accumulate=True, return_norms=True, normalize=opts.normalize
  )
  if not jax.tree.leaves(grads):  # no parameters: every norm is 0, as under ghost
    n = jax.tree.leaves([args[i] for i in idx])[0].shape[0]
    norms = jnp.zeros((n,) + opts.group_shape(), _numerics.tree_accumulation_dtype(params))
    count = opts.factors(norms, mask)[1]
  return total, count, norms, aux


def _ghost_chunk(
  opts: _Options, traced: _ghost.Traced, mask: jax.Array | None
) -> tuple[Any, jax.Array, jax.Array, Any]:
  """The clipped sum from ghost norms and book-keeping, by ``traced.plan``."""
  grads, norms, count, aux_leaves = _ghost.clipped_sum(
    traced,
    lambda norms: opts.factors(norms, mask),
    spmd_axis_name=opts.spmd_axis_name,
    leaf_groups=opts.groups.of_leaf,
    num_groups=len(opts.groups.bounds),
  )
  aux = None
  if opts.has_aux:
    aux = jax.tree.unflatten(jax.tree.structure(traced.out_shape[1]), aux_leaves)
  return jax.tree.unflatten(traced.params_tree, grads), count, norms, aux
