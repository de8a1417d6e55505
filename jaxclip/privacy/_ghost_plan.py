"""What ``per_example_clipped_grad(method="ghost")`` (or ``"auto"``) does with each parameter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _validation
from jaxclip.privacy import _batching, _clip_batch, _clip_options, _ghost, _measured, _per_example


@dataclasses.dataclass(frozen=True)
class GhostLeafPlan:
  """How one parameter leaf's per-example norm is computed.

  Attributes:
    path: The leaf's path, ``jax.tree_util.keystr`` of its key path.
    rule: ``"dot"`` (mixed ghost rule of a ``dot_general``), ``"lookup"``
      (embedding lookup), ``"tied"`` (a table read by a lookup and by an
      output head, with their cross term), ``"conv"`` (ghost rule of a
      convolution's kernel), ``"scale"`` (a layer norm's, RMS norm's or
      group norm's scale: an elementwise product with data), ``"instantiate"``
      (the per-example gradient is formed exactly) or ``"unused"`` (the loss
      does not depend on it).
    reason: Why the leaf is instantiated (no rule, or, under ``"auto"``, the
      costs that chose its per-example gradient); under ``"auto"``, why it
      keeps its rule (the costs weighed); otherwise ``None`` for a ghost
      rule.
    floats: The leaf's size.
    shape: The leaf's shape.
    norm_flops: For a leaf with a ghost rule, per example, the flops of its
      norms by the rule's form: the rule's name, ``"dot:gram"`` (or
      ``"conv:gram"``, ``"lookup:gram"``) where it takes the Gram form; a
      tied table has its lookup's, its head's and their cross term's.
    grad_flops: For a leaf with a ghost rule, per example, the flops of
      forming its per-example gradient instead, by rule.
    site_calls: For a leaf with a ghost rule, how many times per example its
      sites are evaluated (once per iteration inside a scan).
    grad_writes: For a leaf with a ghost rule, per example, the floats
      written forming its per-example gradient: its size, times the
      iterations of a scan whose every iteration reads it whole (each adds
      its term to the gradient).
  """

  path: str
  rule: str
  reason: str | None
  floats: int
  shape: tuple[int, ...] = ()
  norm_flops: tuple[tuple[str, int], ...] = ()
  grad_flops: tuple[tuple[str, int], ...] = ()
  site_calls: int = 0
  grad_writes: int = 0


@dataclasses.dataclass(frozen=True)
class GhostPlan:
  """The rule each parameter leaf gets under ``method="ghost"`` or ``"auto"``.

  Attributes:
    leaves: One :class:`GhostLeafPlan` per parameter leaf, in
      ``jax.tree_util.tree_flatten_with_path`` order.
    passes: ``1`` where the clipped sum is book-kept from the norms' own
      backward pass; ``2`` where a ghost rule's layer is rematerialised
      (``jax.checkpoint``, flax ``nn.remat``): the norms are taken in one
      backward pass, which keeps nothing per layer, and the clipped sum is a
      second, weighted backward pass.
    sum_passes: With a clip norm per group of leaves (``l2_norm_clip=``), how
      many times the clipped sum is pulled back to the parameters: ``1``,
      each site weighted by its own group; one more per group that a
      parameter input mixes with another (the leaves say where); one per
      group where the clipped sum is a second backward pass (``passes == 2``).
    method: ``"ghost"`` or ``"auto"``.
    platform: Under ``"auto"``, the platform whose plan is reported.
    measured: Under ``"auto"`` on the platform this process runs on, the
      median times of its candidates and the one that runs
      (:func:`jaxclip.per_example_clipped_grad` times them the same way when
      traced), or why none was timed; ``None`` where nothing was measured.
    passes_note: Why ``passes`` is ``1`` although a ghost rule's layer is
      rematerialised (the loss computes in bfloat16 or float16), else ``None``.
  """

  leaves: tuple[GhostLeafPlan, ...]
  passes: int = 1
  sum_passes: int = 1
  method: str = "ghost"
  platform: str | None = None
  measured: str | None = None
  passes_note: str | None = None

  @property
  def rules(self) -> dict[str, str]:
    """Each leaf's path mapped to its rule."""
    return {leaf.path: leaf.rule for leaf in self.leaves}

  @property
  def fallback_share(self) -> float:
    """The share of the parameters' floats whose per-example gradient is instantiated."""
    total = sum(leaf.floats for leaf in self.leaves)
    fallen = sum(leaf.floats for leaf in self.leaves if leaf.rule == "instantiate")
    return fallen / total if total else 0.0

  def __str__(self) -> str:
    rows = [("path", "shape", "rule", "floats", "reason")] + [
      (leaf.path, str(leaf.shape), leaf.rule, str(leaf.floats), leaf.reason or "")
      for leaf in self.leaves
    ]
    widths = [max(len(r[j]) for r in rows) for j in range(4)]
    lines = [
      "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows
    ]
    lines = [line.rstrip() for line in lines]
    where = f" (method='auto' on {self.platform})" if self.method == "auto" else ""
    lines.append(
      f"{len(self.leaves)} leaves; {self.fallback_share:.1%} of the floats instantiated{where}"
    )
    if self.measured is not None:
      lines.append(self.measured)
    if self.passes == 2:
      lines.append("two backward passes (rematerialised layers): the norms, then the clipped sum")
    if self.passes_note is not None:
      lines.append(self.passes_note)
    if self.sum_passes > 1:
      lines.append(f"the clipped sum pulled back {self.sum_passes} times (per clip group)")
    return "\n".join(lines)


HELD_IN_HALF = (
  "one backward pass although layers are rematerialised: the loss computes in bfloat16 or "
  "float16, where a second, weighted backward pass would round each example's weighted output "
  "gradients to that dtype, beyond what its norm bounds; every layer's a and g are held until "
  "the norms are known"
)


def ghost_plan(
  loss_fn: Callable[..., Any],
  params: Any,
  *args: Any,
  batch_argnums: int | Sequence[int] | None = None,
  keep_batch_dim: bool = False,
  has_aux: bool = False,
  method: str = "ghost",
  platform: str | None = None,
  l2_norm_clip: Any = None,
  measure: bool = True,
) -> GhostPlan:
  r"""The rule ``per_example_clipped_grad(method="ghost")`` (or ``"auto"``) gives each parameter.

  Traces ``loss_fn`` on one example and reports, for each parameter leaf,
  how its per-example gradient norm is computed (nothing is compiled or
  run, except where ``method="auto"`` times its candidates, below):

  ===============  ==========================================================
  rule             per-example norm
  ===============  ==========================================================
  ``dot``          :math:`\langle A A^\top, G G^\top\rangle` or
                   :math:`\|A^\top G\|^2`, whichever costs less
  ``lookup``       :math:`\sum_{t,s} [\mathrm{id}_t = \mathrm{id}_s]
                   \langle g_t, g_s\rangle`
  ``tied``         both of these and their cross term
  ``conv``         the ``dot`` rule over the convolution's patches
  ``instantiate``  the per-example gradient formed exactly (``reason`` says
                   why)
  ``unused``       zero: the loss does not depend on the leaf
  ===============  ==========================================================

  The rules also apply per iteration of a ``lax.scan`` over stacked layers,
  per static slice of a stacked weight, and, for the ``dot`` rule, to a
  weight a ``lax.scan`` closes over (an RNN's hidden-to-hidden matrix, a
  block shared by every layer), every iteration's rows taken together. A
  lookup at ids that do not depend on the example (``wpe[jnp.arange(T)]``)
  gets the ``lookup`` rule.

  ``method="ghost"`` (the default here) applies a rule wherever there is
  one. ``method="auto"`` follows the cost model of ``platform``: on
  ``"cpu"`` the rules, each with its own switch between the Gram form and
  the per-example gradient formed from ``a`` and ``g`` by flops, unless
  they cost more than a share (``GHOST_FLOPS_SHARE_CPU``, set from
  ``benchmarks/results/ghost_zoo.md``) of the flops of every per-example gradient;
  on any other platform, by memory: per leaf, the
  rule or the leaf's per-example gradient, whichever holds fewer floats per
  example (a leaf so instantiated reads ``instantiate``, the reason giving
  both). On the platform this process runs on (``measure=True``), ``"auto"``
  then times that plan against the other whole methods, as
  :func:`jaxclip.per_example_clipped_grad` does when it is traced (here for
  the whole batch at once, one clip norm), and reports what runs, the times
  in :attr:`GhostPlan.measured`. Where the whole loss takes
  ``method="vmap"``'s program, every leaf the loss uses reads
  ``instantiate``, the reason saying so. Where the loss
  uses a higher-order primitive (one that carries a sub-jaxpr: a call, a
  loop) that the engine does not know, or cannot read, on the parameters or
  the batch, both methods take ``"vmap"``'s
  program: every leaf reads ``instantiate``, the reason naming that
  primitive. Where a layer with a ghost rule is rematerialised
  (``jax.checkpoint``, flax ``nn.remat``), the model asks for memory over
  compute: :attr:`GhostPlan.passes` is then ``2`` (the norms in one backward
  pass that keeps no layer's ``a`` and ``g``, the clipped sum in a second),
  but where the loss computes in bfloat16 or float16: a second pass would round
  each example's weighted output gradients to that dtype, so the plan keeps
  one pass and says so (:attr:`GhostPlan.passes_note`).

  Args:
    loss_fn: As for :func:`jaxclip.per_example_clipped_grad`.
    params: The parameters.
    *args: The arguments after ``params``, as the clipped-gradient function
      takes them (the batched ones with the examples on axis 0).
    batch_argnums: Which arguments carry the batch, counted as in
      ``loss_fn`` (``1`` is the first after ``params``); ``None`` for all of
      them.
    keep_batch_dim: As for :func:`jaxclip.per_example_clipped_grad`.
    has_aux: As for :func:`jaxclip.per_example_clipped_grad`.
    method: ``"ghost"`` or ``"auto"``, as for
      :func:`jaxclip.per_example_clipped_grad`.
    platform: For ``"auto"``, the platform whose cost model to report
      (``"cpu"``, ``"gpu"``, ``"tpu"``...); ``None`` for
      ``jax.default_backend()``. ``per_example_clipped_grad`` chooses by the
      platform the program is lowered for.
    measure: For ``"auto"`` on ``jax.default_backend()``, compile and time
      its candidates (the cost model's plan, ghost's rules, ``"vmap"``'s
      program) on stand-in inputs of the arguments' shapes and report the
      fastest, as ``per_example_clipped_grad`` runs it; ``False`` for the
      cost model's plan alone, nothing compiled.
    l2_norm_clip: A clip norm per group of leaves (a pytree prefix of
      ``params``, as for :func:`jaxclip.per_example_clipped_grad`), to report
      the leaves whose parameter input mixes groups and
      :attr:`GhostPlan.sum_passes`; ``None`` (or a number) for one group.

  Returns:
    A :class:`GhostPlan`; ``print`` it for a table.

  Raises:
    ValueError: for ``batch_argnums`` naming ``params`` or missing arguments,
      an unknown ``method``, complex parameters, or a loss that is not a real
      scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxclip
    >>> def loss(p, x, y):
    ...   h = jnp.tanh(x @ p["w"] + p["b"])
    ...   return jnp.sum((h - y) ** 2)
    >>> params = {"w": jnp.ones((16, 16)), "b": jnp.zeros(16)}
    >>> plan = jaxclip.ghost_plan(loss, params, jnp.ones((8, 16)), jnp.ones((8, 16)),
    ...                           batch_argnums=(1, 2))
    >>> plan.rules
    {"['b']": 'instantiate', "['w']": 'dot'}
    >>> print(plan)  # doctest: +NORMALIZE_WHITESPACE
    path   shape     rule         floats  reason
    ['b']  (16,)     instantiate  16      used by `add`, not a dot/lookup/conv/scale
    ['w']  (16, 16)  dot          256
    2 leaves; 5.9% of the floats instantiated

    Each example is one row: the ``dot`` rule of ``w`` costs 32 flops where
    its per-example gradient costs 256, so ``"auto"``'s cost model keeps it
    on CPU too:

    >>> auto = jaxclip.ghost_plan(loss, params, jnp.ones((8, 16)), jnp.ones((8, 16)),
    ...                           method="auto", platform="cpu", measure=False)
    >>> auto.rules
    {"['b']": 'instantiate', "['w']": 'dot'}

    Measured on this machine, either program may be the faster at this size;
    :attr:`GhostPlan.measured` gives the times:

    >>> auto = jaxclip.ghost_plan(loss, params, jnp.ones((8, 16)), jnp.ones((8, 16)),
    ...                           method="auto", platform="cpu")
    >>> print(auto.measured)  # doctest: +ELLIPSIS
    measured on cpu (...): the cost model's plan ... ms (... MiB), vmap's program ... runs (...)
  """
  if method not in ("ghost", "auto"):
    raise ValueError(f"ghost_plan takes method 'ghost' or 'auto', got {method!r}.")
  batch_argnums = _batching.argnums(batch_argnums, len(args))
  if not batch_argnums or any(i < 1 for i in batch_argnums) or max(batch_argnums) > len(args):
    raise ValueError(
      f"batch_argnums must name some of the {len(args)} arguments after params (1, 2, ...), "
      f"got {batch_argnums!r}."
    )
  _validation.check_inexact_leaves(params, "ghost_plan")
  idx = [i - 1 for i in batch_argnums]

  def example_loss(p, *xs):
    return loss_fn(p, *(_batching.with_batch_dim(xs, idx) if keep_batch_dim else xs))

  traced = _ghost.trace(example_loss, params, args, idx, has_aux=has_aux)
  if method == "auto" and platform is None:
    platform = jax.default_backend()
  measured = None
  here = platform == jax.default_backend()
  if method == "auto" and measure and here and not traced.plan.unknown:
    measured = _measure(
      loss_fn,
      params,
      args,
      traced.plan,
      platform,
      batch_argnums,
      l2_norm_clip,
      keep_batch_dim=keep_batch_dim,
      has_aux=has_aux,
    )
  runs = method if measured is None or measured.pick is None else measured.pick
  rules = _ghost.leaf_rules(traced.plan, runs, platform)
  if runs == "vmap":
    rules = [
      (r, f"{why}: auto measured it fastest on {platform}" if why else why) for r, why in rules
    ]
  chosen = _ghost.plan_for(traced.plan, runs, platform)[0]
  groups = None if l2_norm_clip is None else _clip_batch.clip_groups(l2_norm_clip, params)
  of_leaf = groups.of_leaf if groups is not None and groups.per_group else None
  passes, sum_passes, notes = _ghost.report_passes(chosen, of_leaf)
  for i, note in notes.items():
    rule, reason = rules[i]
    rules[i] = (rule, note if not reason else f"{reason}; {note}")
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  costs = _ghost.leaf_costs(traced.plan)

  def leaf_plan(i, path, rule, reason, x):
    c = costs.get(i)
    work = {} if c is None else {"norm_flops": c.forms, "grad_flops": c.grads}
    if c is not None:
      work.update(site_calls=c.calls, grad_writes=c.size)
    return GhostLeafPlan(path, rule, reason, int(jnp.size(x)), tuple(jnp.shape(x)), **work)

  return GhostPlan(
    tuple(
      leaf_plan(i, path, rule, reason, x)
      for i, (path, (rule, reason), x) in enumerate(zip(paths, rules, traced.leaves, strict=True))
    ),
    passes=passes,
    sum_passes=sum_passes,
    passes_note=HELD_IN_HALF if chosen is not None and chosen.held_in_half else None,
    method=method,
    platform=platform if method == "auto" else None,
    measured=None if measured is None else measured.why,
  )


def _measure(
  loss_fn: Callable[..., Any],
  params: Any,
  args: Sequence[Any],
  plan: Any,
  platform: str,
  batch_argnums: tuple[int, ...],
  l2_norm_clip: Any,
  **options: Any,
) -> _measured.Measured:
  """``"auto"``'s candidates for the whole batch at once (no microbatches), timed as
  :func:`jaxclip.per_example_clipped_grad` times its own."""
  opts = _clip_options.Options.checked(
    loss_fn,
    1.0 if l2_norm_clip is None else l2_norm_clip,
    _ghost.METHODS,
    microbatch_size=None,
    batch_argnums=batch_argnums,
    spmd_axis_name=None,
    axis_name=None,
    method="auto",
    return_norms=False,
    group_size=1,
    normalize=None,
    return_num_nonfinite=False,
    **options,
  )

  def make(candidate):
    return _per_example.clipped_grad_of(_measured.candidate_options(opts, candidate), None, False)

  model = _ghost.plan_for(plan, "auto", platform)[0]
  timed = _measured.timer(opts, make, {}, (params, args, None))
  return timed(_measured.candidates_for(model, plan))
