"""Per-example clipping of a whole batch in bounded memory (DP-SGD's clip step).

It sits above the ops and the optax-compatible transforms: its options are
checked once (:mod:`jaxclip.privacy._clip_options`), each call's batch is cut
into units (:mod:`jaxclip.privacy._batching`) and chunks
(:mod:`jaxclip.privacy._chunking`) and summed chunk by chunk
(:mod:`jaxclip.privacy._clip_chunks`, where :mod:`jaxclip._kernel._sharding`
keeps the parameters local inside ``shard_map``). Here each chunk is clipped by
:func:`jaxclip.per_example_global_norm_clip`'s kernel (``method="vmap"``) or by
ghost norms (:mod:`jaxclip.privacy._ghost`); under ``method="auto"``, by the
one :mod:`jaxclip.privacy._measured` timed fastest.

Each call's clip is one value, a :class:`jaxclip.privacy._clip_factors.Clip`
(the bounds in the norms' dtype, the group of each leaf, ``normalize``), made
once from ``l2_norm_clip`` and the parameters and passed down to either
method, which takes each example's factor from it
(:func:`jaxclip.privacy._clip_factors.scale_factors`). Each method forms its
sum in float32 (or wider) where it forms the terms, once; nothing above casts
it again.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxclip._kernel import _numerics, _platform
from jaxclip._kernel._typing import AxisName
from jaxclip.privacy import (
  _batching,
  _clip_batch,
  _clip_chunks,
  _clip_options,
  _ghost,
  _measured,
)
from jaxclip.privacy._clip_factors import Clip


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
  return_num_nonfinite: bool = False,
  measure: bool = True,
) -> Callable[..., tuple[Any, ...]]:
  r"""Makes a function returning the sum of per-example gradients, each clipped.

  .. math::

    \sum_{b=1}^{B} \nabla_\theta \ell(\theta, x_b) \cdot
    \min\!\Big(1, \frac{C}{\|\nabla_\theta \ell(\theta, x_b)\|_2}\Big)

  the clipping step of DP-SGD, computed in chunks of ``microbatch_size``
  examples under ``jax.lax.scan``, so memory stays bounded whatever the batch
  size; the running sum is kept (and returned) in float32 for half-precision
  parameters.
  ``method="vmap"`` forms each chunk's per-example gradients with ``vmap``;
  ``method="ghost"`` gets the same results from each layer's inputs and
  output gradients without forming them (*ghost norms*), for any JAX model;
  ``method="auto"`` chooses per layer by the cost model of the platform the
  program is lowered for, then, on the platform this process runs on, times
  that plan against ghost's and vmap's programs when it is traced and runs
  the fastest. The same function clips groups of examples as one
  unit (``group_size``), clips per layer (a pytree ``l2_norm_clip``: the
  sensitivity is then :math:`\sqrt{\sum_k C_k^2}`), or scales every example
  by :math:`C / (\|g_b\|_2 + \gamma)` instead (``normalize=gamma``). The
  guide to masks, groups, per-layer and automatic clipping, devices, ghost
  norms and their cost is ``docs/privacy.md``.

  **Bounded sensitivity, whatever an example holds.** Each example (each
  group of ``group_size``) moves the sum by at most its clip (in total at
  most :math:`S`): an example whose gradient norm is not finite (a NaN or
  infinite gradient, one whose norm overflows, or a NaN loss such as an
  out-of-vocabulary id in ``flax.linen.Embed``) contributes exactly zero to
  the sum, under every method: its gradient (or, for ghost norms, its
  output gradients and inputs) is selected away, since ``0 * nan`` is
  ``nan``. It is counted as clipped, and in ``num_nonfinite``
  (``return_num_nonfinite=True``). ``tests/test_dp_adversarial.py`` checks
  this invariant over modes, methods, dtypes and adversarial examples, as
  an attacker measures it: the change of the released sum in float64.

  Padding (a batch that is not a multiple of ``microbatch_size``) and
  masked-out examples are replaced by a copy of a real example at weight 0:
  they contribute nothing, are not counted and get norm 0, and a loss that is
  non-finite on them cannot reach the sum.

  ==============================  ===========================================
  case                            result
  ==============================  ===========================================
  ``l2_norm_clip == 0``           zeros; every example counts as clipped
                                  (with ``normalize``: every one with
                                  :math:`\|g\| + \gamma > 0`)
  a non-finite gradient or norm   contributes zeros; counted as clipped
                                  and in ``num_nonfinite``
  huge finite gradient            clipped to ``C`` under ``vmap`` (its norm
                                  is computed scaled); under ghost norms, a
                                  squared norm past float32's range (a norm
                                  above ~1.8e19) counts as non-finite
  ``normalize=0``, zero gradient  contributes zeros, factor 0 (not 0/0),
                                  not counted
  ``normalize=0``, tiny gradient  scaled to norm ``C`` (``vmap`` measures
                                  its norm scaled, never flushed); ghost
                                  norms divide by at least
                                  :math:`\sqrt{\text{parts} \cdot
                                  \text{tiny} / \text{eps}}` (~1e-15 in
                                  float32), so a norm under-read below the
                                  normal range cannot pass ``C``
  ``normalize``, infinite ``C``   refused (``ValueError``): no finite
                                  sensitivity
  a group with no leaves          norm 0, as a zero gradient
  ==============================  ===========================================

  Args:
    loss_fn: ``loss_fn(params, *args) -> scalar`` for one example (or, with
      ``keep_batch_dim=True``, for a batch of one).
    l2_norm_clip: The largest L2 norm of one example's gradient, ``>= 0``;
      or a pytree prefix of ``params`` with one such number per group of
      leaves (per-layer clipping). Each may be traced.
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
      ``jit``, passed to ``jax.vmap``; ``microbatch_size`` must then be a
      multiple of its number of devices. Per-example gradients are never
      gathered.
    axis_name: Inside ``shard_map``/``pmap``, the axis (or axes) to sum the
      clipped gradients and counts over.
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``, as in ``jax.grad``:
      ``aux`` (any pytree, e.g. logits or a per-example loss) is then returned
      for every example.
    method: ``"vmap"`` (per-example gradients with ``jax.vmap``),
      ``"ghost"`` (per-example norms without per-example gradients) or
      ``"auto"`` (per layer, whichever the platform's cost model finds
      cheaper; then, in the program for the platform this process runs on,
      whichever of that plan, ghost's rules and vmap's program ran fastest
      when timed on stand-in inputs of the call's shapes, once, at the first trace:
      ``docs/privacy.md``). Where the ghost engine cannot read
      the loss (a higher-order primitive it does not know), either runs
      ``"vmap"``'s program and warns; :func:`jaxclip.ghost_plan` says why.
    return_norms: Also return each example's gradient norm before clipping
      (for :func:`jaxclip.quantile_clip_norm_update`, or to monitor).
    group_size: Clip groups of this many consecutive examples as one unit
      (user-level clipping); ``1`` (default) clips each example. It must
      divide the batch, and ``microbatch_size`` (which counts examples) must
      be a multiple of it.
    normalize: ``None`` (default) to clip, or ``gamma >= 0`` (a number, may
      be traced) to scale each example by :math:`C / (\|g\| + \gamma)`
      (automatic clipping).
    return_num_nonfinite: Also return how many examples (groups) contributed zero: a non-finite
      gradient norm (ghost norms: or records too far apart to bound, ``docs/privacy.md``).
    measure: Under ``"auto"``, time the candidates at the first trace;
      ``False``: the cost model's plan, nothing else compiled or timed (one
      compile, the same plan in every run and on every machine of a platform).

  Returns:
    A function ``(params, *args, example_mask=None) -> (clipped_grad_sum,
    num_clipped)``: the sum over the batch of the clipped per-example
    gradients (a pytree like ``params``; in float32 for bfloat16 and float16
    leaves, so that the noise is added before any rounding to the
    parameters' dtype: :func:`jaxclip.dp_noise` casts after adding it; in the
    parameters' dtypes otherwise) and how many examples were scaled down.
    ``example_mask`` is a boolean ``(batch,)`` array, True for a real example.
    Divide by the batch size (after adding noise, for DP-SGD) to get a mean.

    With ``return_num_nonfinite=True`` the number of non-finite examples
    (an int scalar) comes next: ``(clipped_grad_sum, num_clipped,
    num_nonfinite, ...)``. Neither count, nor the norms or ``aux``, is
    private: release them only through a DP mechanism.

    With ``return_norms=True`` the per-example norms (float32, in the order of
    the batch; 0 where ``example_mask`` is False) come next:
    ``(clipped_grad_sum, num_clipped, norms)``. With ``group_size=k``,
    ``num_clipped`` counts groups and ``norms`` has one entry per group. With
    a pytree ``l2_norm_clip``, ``num_clipped`` and ``norms`` are pytrees like
    it, one count and one ``(batch,)`` array per group of leaves.

    With ``has_aux=True``, ``aux`` comes last: each of its leaves stacks what
    ``loss_fn`` returned for each example on a new leading axis, in the order
    of the batch (a masked-out example's aux is its stand-in's).

    An empty batch gives zeros, a count of 0 and an empty ``norms``; empty
    ``params`` give an empty sum and norms of 0.

    Under ``method="auto"`` the function's ``measured`` attribute holds the
    record (``platform``, ``pick``, ``why``) of its first trace, whose pick
    every later trace runs (any batch size: neighbouring batches must run one
    program): the candidates' median times and the one that runs, or
    why none was timed (``measure=False``, a loss closing over a value
    traced outside, a mesh axis, symbolic shapes, a typed PRNG key), where
    the cost model decides.

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
    TypeError: for a non-int ``microbatch_size`` or ``group_size``, or a
      non-bool ``measure``.

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

    Ghost norms in microbatches of two, with each example's norm; the gradient
    of ``w . x`` is ``x``, and ``example_mask`` drops an example:

    >>> loss = lambda w, x: jnp.dot(w, x)
    >>> xs = jnp.array([[3., 4.], [0., 1.], [6., 8.]])  # norms 5, 1, 10
    >>> grad_fn = jaxclip.per_example_clipped_grad(
    ...     loss, 2.0, microbatch_size=2, method="ghost", return_norms=True)
    >>> total, num_clipped, norms = grad_fn(jnp.zeros(2), xs)
    >>> total, num_clipped  # [1.2, 1.6] + [0, 1] + [1.2, 1.6]
    (Array([2.4, 4.2], dtype=float32), Array(2, dtype=int32))
    >>> norms
    Array([ 5.,  1., 10.], dtype=float32)
    >>> grad_fn(jnp.zeros(2), xs, example_mask=jnp.array([True, False, True]))[2]
    Array([ 5.,  0., 10.], dtype=float32)

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
  opts = _clip_options.Options.checked(
    loss_fn,
    l2_norm_clip,
    _ghost.METHODS,
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
    return_num_nonfinite=return_num_nonfinite,
    measure=measure,
  )
  return clipped_grad_of(opts)


def clipped_grad_of(
  opts: _clip_options.Options, warned: list[bool] | None = None, measure: bool = True
) -> Callable[..., Any]:
  """The clipped-gradient function of ``opts``; ``warned`` holds whether the shared-argument
  warning was given (once per function, its candidates under ``"auto"`` included);
  ``measure=False`` for ``"auto"``'s cost model alone (a candidate of its measurement)."""
  warned = [] if warned is None else warned
  measured: dict[Any, _measured.Measured] = {}  # "auto"'s measurement, at the first trace

  def clipped_grad(params, *args, example_mask=None):
    batch = _batching.batch_of(opts.batch_argnums, params, args, example_mask, warned)
    units = _batching.grouped(batch, opts.group_size, opts.microbatch_size)
    groups = _clip_batch.clip_groups(opts.l2_norm_clip, params)
    clip = groups.clip(_numerics.tree_accumulation_dtype(params), opts.normalize)
    loss = _batching.unit_loss(
      opts.loss_fn, batch.idx, opts.group_size, opts.has_aux, opts.keep_batch_dim
    )
    chunk = _clip_chunk
    if opts.method == "auto" and measure:

      def make(candidate):
        return clipped_grad_of(_measured.candidate_options(opts, candidate), warned, False)

      timed = _measured.timer(opts, make, measured, (params, args, example_mask))
      chunk = functools.partial(_clip_chunk, timed=timed)
    out = _clip_chunks.clipped_units(opts, clip, loss, params, units, chunk)
    if opts.group_size > 1 and opts.has_aux:  # each example's aux, in the batch's order
      size = batch.size
      out = out[:-1] + (jax.tree.map(lambda a: a.reshape((size,) + a.shape[2:]), out[-1]),)
    return out

  clipped_grad.measured = measured  # "auto"'s records (the docstring's Returns)
  return clipped_grad


# ----------------------------------------------------------------------------
# The two methods, on one chunk
# ----------------------------------------------------------------------------


def _clip_chunk(
  opts: _clip_options.Options,
  clip: Clip,
  loss: Callable[..., Any],
  params: Any,
  args: list[Any],
  idx: Sequence[int],
  mask: jax.Array | None,
  timed: Callable[[tuple[str, ...]], _measured.Measured] | None = None,
) -> tuple[Any, tuple[jax.Array, jax.Array], jax.Array, Any]:
  """One chunk's clipped sum (in each parameter's sum dtype), counts, norms and aux.

  Under ``"ghost"`` and ``"auto"`` the plan is chosen when tracing, for each
  platform the program may be lowered for: ``"auto"``'s cost model differs
  between CPU and the others, so where its plans differ both are staged under
  :func:`jaxclip._kernel._platform.on_cpu` and the lowering keeps one. With
  ``timed`` (``"auto"``), the branch of the platform this process runs on
  takes the fastest of the candidates it times (:mod:`jaxclip.privacy._measured`),
  where it could time them.
  """
  if opts.method == "vmap":
    return _clip_chunks.vmap_chunk(opts, clip, loss, params, args, idx, mask)
  traced = _ghost.trace(loss, params, args, idx, has_aux=opts.has_aux)
  if traced.plan.unknown:  # not a choice: the engine cannot read the loss
    warnings.warn(
      f"per_example_clipped_grad(method={opts.method!r}) runs the program of method='vmap' "
      f"(every per-example gradient at once): {'; '.join(traced.plan.unknown)}. "
      "jaxclip.ghost_plan(...) gives the plan.",
      stacklevel=2,
    )
  cpu = _ghost.plan_for(traced.plan, opts.method, "cpu")[0]
  other = _ghost.plan_for(traced.plan, opts.method, None)[0]
  if timed is not None and not traced.plan.unknown:
    cpu, other = _measured.picked(timed, traced.plan, cpu, other)

  def run(plan):
    if plan is None:  # method="vmap"'s program
      return _clip_chunks.vmap_chunk(opts, clip, loss, params, args, idx, mask)
    return _ghost_chunk(opts, clip, traced, plan, mask)

  if cpu == other:
    return run(cpu)
  return _platform.on_cpu(lambda: run(cpu), lambda: run(other))


def _ghost_chunk(
  opts: _clip_options.Options,
  clip: Clip,
  traced: _ghost.Traced,
  plan: _ghost.Plan,
  mask: jax.Array | None,
) -> tuple[Any, tuple[jax.Array, jax.Array], jax.Array, Any]:
  """The clipped sum from ghost norms and book-keeping, by ``plan``."""
  grads, norms, counts, aux_leaves = _ghost.clipped_sum(
    traced, plan, clip, mask, spmd_axis_name=opts.spmd_axis_name
  )
  aux = None
  if opts.has_aux:
    aux = jax.tree.unflatten(jax.tree.structure(traced.out_shape[1]), aux_leaves)
  return jax.tree.unflatten(traced.params_tree, grads), counts, norms, aux
