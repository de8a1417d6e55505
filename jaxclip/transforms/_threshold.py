"""Suggesting a clipping threshold from a recorded history of gradient norms."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxclip._kernel import _validation
from jaxclip.transforms._fixed import ClipByGlobalNormState
from jaxclip.transforms._record import RecordNormsState


class ThresholdSuggestion(NamedTuple):
  """What :func:`suggest_threshold` suggests, and how it got there.

  Attributes:
    max_norm: The suggested global-norm threshold.
    percentile: The percentile of the finite norms it is.
    num_norms: How many finite norms it was computed from.
    num_nonfinite: How many NaN/inf norms were dropped.
    median: The median of the finite norms.
    minimum: The smallest finite norm.
    maximum: The largest finite norm.
    fraction_clipped: The fraction of the finite recorded norms above
      ``max_norm``, i.e. of the steps it would have clipped.
    per_tensor_max_norm: ``max_norm / sqrt(num_tensors)`` if ``num_tensors``
      was given (a starting point for per-leaf clipping), else ``None``.
    explanation: The above, in a sentence or two.
  """

  max_norm: float
  percentile: float
  num_norms: int
  num_nonfinite: int
  median: float
  minimum: float
  maximum: float
  fraction_clipped: float
  per_tensor_max_norm: float | None
  explanation: str


def suggest_threshold(
  norms: Any, percentile: float = 50.0, *, num_tensors: int | None = None
) -> ThresholdSuggestion:
  r"""Suggests a ``max_norm`` from the pre-clip global norms of a run.

  Record the norms of a short run without clipping, or with a generous
  threshold (``optax.tree.get(state, "pre_clip_norm")`` of
  :func:`jaxclip.clip_by_global_norm`, logged each step), then pass them
  here. The suggestion is their ``percentile``-th percentile (linear
  interpolation, as ``np.percentile``) after dropping NaN and inf.

  The recipe (``docs/which_clip.md``, with the evidence in
  ``docs/clipping_study.md``): record about 100 steps after any
  learning-rate warm-up (the norms of its first steps are not those of the
  rest of the run), start from the median (the default, ``50``), raise
  ``percentile`` if training is stable and too slow and lower it if spikes
  still get through. To let the threshold follow the run instead, use
  :func:`jaxclip.autoclip` or :func:`jaxclip.zclip`.

  Two things to keep in mind when moving a threshold between methods:

  * A global-norm threshold is larger than a per-tensor one for the same
    model. The global norm of :math:`k` tensors is
    :math:`\sqrt{\sum_i \|g_i\|^2}`, so if they have similar norms it is
    about :math:`\sqrt k` times a single tensor's. Pass ``num_tensors`` (the
    number of leaves) to get ``max_norm / sqrt(num_tensors)`` as a starting
    point for :func:`jaxclip.clip_by_norm` (Keras's ``clipnorm``), and check
    the per-leaf norms if some layers dominate.
  * Value clipping (:func:`jaxclip.clip_by_value`, Keras's ``clipvalue``)
    has no norm threshold to translate to: it clips each entry on its own,
    which changes the direction of the update (``[0.1, 5]`` clipped to
    ``[-1, 1]`` becomes ``[0.1, 1]``, no longer parallel). Norm clipping only
    shortens the update, so prefer it.

  The norms may also come as recorded optimizer states: a
  :class:`jaxclip.RecordNormsState` (its ``global_norm``), or any state or
  pytree holding one, e.g. the states of a ``jax.lax.scan`` over steps
  (stacked: ``global_norm`` has a leading steps axis) or a Python list of
  per-step states. Put :func:`jaxclip.record_norms` first in the chain so it
  sees the raw gradient. Without a ``record_norms`` state, the
  ``pre_clip_norm`` of a :class:`jaxclip.ClipByGlobalNormState` is read
  instead (``clip_by_global_norm(float("inf"))`` records without clipping).
  ``num_tensors`` then defaults to the number of leaves of
  ``leaf_norms``.

  Args:
    norms: Recorded global norms, any array-like (a list, NumPy or JAX
      array), or recorded states (see above); NaN and inf entries are
      dropped. For an :class:`jaxclip.AutoClipState` history, pass only the
      slots in use.
    percentile: Which percentile of the finite norms to suggest, in
      ``[0, 100]``.
    num_tensors: The number of gradient tensors, to also suggest a
      per-tensor threshold (from a ``record_norms`` state: its number of
      leaves, unless given).

  Returns:
    A :class:`ThresholdSuggestion` (plain Python numbers and a string).

  Raises:
    ValueError: if no norm is finite, a finite norm is negative,
      ``percentile`` is outside ``[0, 100]``, or a state holds recorded
      norms at more than one place (pass the one you mean).

  Examples:
    >>> import jaxclip
    >>> s = jaxclip.suggest_threshold([1., 2., 3., 4., 100., float('nan')], 75)
    >>> s.max_norm
    4.0
    >>> print(s.explanation)
    max_norm=4: percentile 75 of 5 finite pre-clip norms (1 non-finite dropped);
    median 3, range [1, 100]. It would have clipped 20.0% of the recorded steps.

    From the states of a recorded run (here three steps, kept in a list):

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(jaxclip.record_norms(), optax.sgd(0.1))
    >>> params = {'w': jnp.zeros(2), 'b': jnp.zeros(1)}
    >>> state, states = tx.init(params), []
    >>> for g in (1., 2., 4.):
    ...   grads = {'w': jnp.array([3., 4.]) * g, 'b': jnp.array([12.]) * g}
    ...   _, state = tx.update(grads, state, params)
    ...   states.append(state)
    >>> s = jaxclip.suggest_threshold(states)
    >>> s.max_norm, s.num_norms, s.per_tensor_max_norm
    (26.0, 3, 18.384776310850235)
  """
  if norms is None:
    raise TypeError(
      "suggest_threshold needs norms: an array of recorded global norms, a "
      "RecordNormsState, or a chain's state holding one; got None."
    )
  norms, found_tensors = _recorded_norms(norms)
  if num_tensors is None:
    num_tensors = found_tensors
  _validation.check_hparam(percentile, "percentile", lo=0, hi=100)
  if num_tensors is not None:
    num_tensors = _validation.check_size(num_tensors, "num_tensors")
  values = np.asarray(norms, dtype=np.float64).ravel()
  finite = values[np.isfinite(values)]
  dropped = int(values.size - finite.size)
  if finite.size == 0:
    raise ValueError(
      f"suggest_threshold needs at least one finite norm, got {values.size} "
      f"values of which {dropped} are NaN or inf."
    )
  if np.any(finite < 0):
    raise ValueError(f"norms must be non-negative, got {float(finite.min())!r}.")
  percentile = float(percentile)
  max_norm = float(np.percentile(finite, percentile))
  median = float(np.median(finite))
  lo, hi = float(finite.min()), float(finite.max())
  fraction = float(np.mean(finite > max_norm))
  text = (
    f"max_norm={max_norm:.4g}: percentile {percentile:g} of {finite.size} finite "
    f"pre-clip norms ({dropped} non-finite dropped); median {median:.4g}, range "
    f"[{lo:.4g}, {hi:.4g}]. It would have clipped {fraction:.1%} of the recorded "
    "steps."
  )
  per_tensor = None
  if num_tensors is not None:
    per_tensor = max_norm / math.sqrt(num_tensors)
    text += (
      f" For per-tensor clipping of {num_tensors} tensors with similar norms, "
      f"start near max_norm / sqrt({num_tensors}) = {per_tensor:.4g}."
    )
  return ThresholdSuggestion(
    max_norm=max_norm,
    percentile=percentile,
    num_norms=int(finite.size),
    num_nonfinite=dropped,
    median=median,
    minimum=lo,
    maximum=hi,
    fraction_clipped=fraction,
    per_tensor_max_norm=per_tensor,
    explanation=text,
  )


def _is_recorded(x: Any) -> bool:
  return isinstance(x, (RecordNormsState, ClipByGlobalNormState))


def _recorded_norms(norms: Any) -> tuple[Any, int | None]:
  """The global norms in recorded states, and their number of tensors; plain norms unchanged."""
  if isinstance(norms, (RecordNormsState, ClipByGlobalNormState)):
    found = [((), norms)]
  else:
    try:
      found = [
        (path, node)
        for path, node in jax.tree_util.tree_flatten_with_path(norms, is_leaf=_is_recorded)[0]
        if _is_recorded(node)
      ]
    except TypeError:  # not a pytree jax knows: plain norms
      return norms, None
  if not found:
    return norms, None
  # A record_norms state wins over a clip_by_global_norm one: it is what the docs ask for.
  kinds = [n for n in found if isinstance(n[1], RecordNormsState)] or found
  # A Python list of per-step states: the same place in every step's state.
  steps = isinstance(norms, list)
  places = {jax.tree_util.keystr(tuple(path[1:] if steps else path)) for path, _ in kinds}
  if len(places) > 1:
    raise ValueError(
      "suggest_threshold found recorded norms at more than one place of the state: "
      f"{sorted(places)}; pass the one you mean, e.g. optax.tree.get(state, 'global_norm')."
    )
  values = [
    np.ravel(np.asarray(n.global_norm if isinstance(n, RecordNormsState) else n.pre_clip_norm))
    for _, n in kinds
  ]
  first = kinds[0][1]
  tensors = None
  if isinstance(first, RecordNormsState):
    tensors = len(jax.tree.leaves(first.leaf_norms))
    if tensors == 0:
      tensors = None
  return np.concatenate(values), tensors
