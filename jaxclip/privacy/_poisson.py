"""Poisson-sampled batches of a fixed shape, for DP-SGD under ``jit``."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _validation

_TWO_32 = 2**32
# float32 bit patterns, ordered as the floats they encode: the smallest normal
# number, and one above every drawn example's (theirs run from 2**-126 to below 4).
_SMALLEST_NORMAL = 0x00800000
_NOT_DRAWN = 0x7F000000


class PoissonBatch(NamedTuple):
  """A Poisson-sampled batch padded to a fixed shape (see :func:`poisson_batch`).

  Attributes:
    indices: ``(max_batch_size,)`` int32 indices into the dataset; the rows
      where ``mask`` is False hold indices of examples that were not drawn
      (valid indices, so gathering with them never goes out of range).
    mask: ``(max_batch_size,)`` bool, True for a drawn example: pass it as
      ``example_mask``.
    overflow: bool scalar, True if more than ``max_batch_size`` examples
      were drawn, so that a random subset of them was kept.
    num_truncated: int32 scalar, how many drawn examples were left out
      (``0`` unless ``overflow``). Like the drawn batch size, it depends on
      the dataset: monitor it, but do not publish it.
  """

  indices: jax.Array
  mask: jax.Array
  overflow: jax.Array
  num_truncated: jax.Array


def poisson_batch(
  key: jax.Array,
  num_examples: int,
  sampling_rate: jax.typing.ArrayLike,
  max_batch_size: int,
) -> PoissonBatch:
  r"""Draws a Poisson-sampled batch, as indices and a mask of a fixed shape.

  Each of the ``num_examples`` examples joins the batch independently with
  probability :math:`q` = ``sampling_rate``, the sampling that the standard
  DP-SGD analysis (and ``dp_accounting``'s ``PoissonSampledDpEvent``)
  assumes. The batch size is then random, Binomial :math:`(N, q)`, with mean
  :math:`qN`; under ``jit`` shapes are fixed, so the batch comes back padded
  to ``max_batch_size`` rows with a mask, to pass as ``example_mask`` to
  :func:`jaxclip.per_example_clipped_grad` and
  :func:`jaxclip.quantile_clip_norm_update`.

  **Exact inclusion.** Example :math:`i` is drawn iff a uniform 32-bit word
  :math:`b_i` (``jax.random.bits`` of the first key of
  ``jax.random.split(key)``) is below :math:`t = \lfloor q \cdot
  2^{32} \rfloor`, so it joins with probability :math:`t / 2^{32} \in (q -
  2^{-32}, q]`: exact up to :math:`2^{-32}` at any rate, and never above
  :math:`q`, so an accountant run with :math:`q` does not under-report
  :math:`\varepsilon`. (Comparing a float32 uniform with :math:`q` instead
  includes with probability :math:`\lceil q \cdot 2^{23} \rceil / 2^{23}`:
  twice :math:`q` at :math:`q = 2^{-24}`.) A concrete ``sampling_rate`` is
  read as a Python float (float64), so :math:`t` is exact; a traced one is
  used at its own precision (float32 unless it is float64), then
  :math:`t` is exact for that value. :math:`q = 1` draws every example.

  The rows hold the drawn examples first, in a random order (by a second,
  independent 32-bit word per example; the 30 bits of it that are compared
  tie with probability :math:`2^{-30}` per pair, and a tie goes to the lower
  index). If more than ``max_batch_size`` are drawn, ``overflow`` is True,
  ``num_truncated`` counts the drawn examples left out, and the rows keep
  the first ``max_batch_size`` of that order: a uniformly random subset of
  the drawn ones.

  **Truncation and the guarantee.** The Poisson analysis holds for the
  untruncated batch. Truncating to a random subset of size
  :math:`\le B_{\max}` is *truncated Poisson sampling*, accounted for exactly
  by ``dp_accounting``'s ``TruncatedSubsampledGaussianDpEvent`` (its PLD
  accountant): pass ``max_batch_size=`` and ``num_examples=`` to
  :func:`jaxclip.dp_epsilon` and :func:`jaxclip.calibrate_noise`, or let
  :class:`jaxclip.DPSGD` do it. Accounted as plain Poisson instead, the
  guarantee
  :math:`(\varepsilon, \delta)` still holds as :math:`(\varepsilon, \delta +
  (1 + e^{\varepsilon}) T p)` over :math:`T` steps, with :math:`p =
  P[\mathrm{Binomial}(N + 1, q) > B_{\max}]` (on a dataset or its neighbour,
  the truncated and untruncated runs differ with probability at most
  :math:`Tp`). Pick ``max_batch_size`` a few
  standard deviations :math:`\sqrt{Nq(1-q)}` above :math:`qN` so that
  :math:`Tp \ll \delta`, and check ``overflow``. At :math:`N = 10{,}000`,
  :math:`qN = 128` and :math:`B_{\max} = 140`, about one step in eight is
  truncated, and 1,000 steps at the :math:`\sigma` of :math:`\varepsilon = 1`
  untruncated spend :math:`\varepsilon = 2.08`.

  Args:
    key: A ``jax.random`` key; use a fresh one each step.
    num_examples: :math:`N`, the dataset size (a Python int: it fixes the
      work's shape).
    sampling_rate: :math:`q \in [0, 1]`. May be traced.
    max_batch_size: :math:`B_{\max} \ge 1`, the rows returned (a Python int).

  Returns:
    A :class:`PoissonBatch` ``(indices, mask, overflow, num_truncated)``.

  Raises:
    ValueError: for a concrete ``sampling_rate`` outside ``[0, 1]``, or a
      negative ``num_examples`` or ``max_batch_size < 1``.
    TypeError: for a ``key`` that is not one key, or sizes that are not ints.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jaxclip
    >>> batch = jaxclip.poisson_batch(jax.random.key(0), 1000, 0.05, 80)
    >>> batch.indices.shape, batch.mask.dtype
    ((80,), dtype('bool'))
    >>> bool(20 < batch.mask.sum() < 80), bool(batch.overflow), int(batch.num_truncated)
    (True, False, 0)

    Cut to 40 rows, the draws past 40 are left out, and counted:

    >>> small = jaxclip.poisson_batch(jax.random.key(0), 1000, 0.05, 40)
    >>> bool(small.overflow), int(small.num_truncated) == int(batch.mask.sum()) - 40
    (True, True)

    The batch feeds the per-example clipping as a mask (the loss of a
    masked-out row is computed on a stand-in and dropped):

    >>> xs = jax.random.normal(jax.random.key(1), (1000, 3))
    >>> loss = lambda w, x: jnp.dot(w, x)
    >>> fn = jaxclip.per_example_clipped_grad(loss, 1.0, return_norms=True)
    >>> total, count, norms = fn(jnp.zeros(3), xs[batch.indices], example_mask=batch.mask)
    >>> bool(jnp.all(norms[~batch.mask] == 0)), int(count) <= int(batch.mask.sum())
    (True, True)

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016 (Poisson-sampled DP-SGD)

    Mironov, Talwar and Zhang, `Rényi Differential Privacy of the Sampled
    Gaussian Mechanism <https://arxiv.org/abs/1908.10530>`_, 2019

    Chua et al., `Scalable DP-SGD: Shuffling vs. Poisson Subsampling
    <https://arxiv.org/abs/2411.04205>`_, 2024 (Poisson batches of a fixed
    shape)

    `arXiv:2508.15089 <https://arxiv.org/abs/2508.15089>`_, the analysis of
    truncated Poisson sampling behind ``dp_accounting``'s
    ``TruncatedSubsampledGaussianDpEvent``
  """
  _validation.check_key(key)
  n = _validation.check_size(num_examples, "num_examples", 0, static="it fixes a shape")
  rows = _validation.check_size(max_batch_size, "max_batch_size", static="it fixes a shape")
  _validation.check_hparam(sampling_rate, "sampling_rate", lo=0.0, hi=1.0, scalar=True)
  every, threshold = _inclusion_threshold(sampling_rate)
  k_draw, k_order = jax.random.split(key)
  drawn = (jax.random.bits(k_draw, (n,), jnp.uint32) < threshold) | every
  # The order: 30 random bits as a positive normal float32 for the drawn
  # examples (float32, for XLA's fast top_k; normal, so that no flush of
  # denormals to zero makes ties), a larger constant for the others.
  order = jax.random.bits(k_order, (n,), jnp.uint32) >> 2
  pattern = jnp.where(drawn, order + jnp.uint32(_SMALLEST_NORMAL), jnp.uint32(_NOT_DRAWN))
  priority = jax.lax.bitcast_convert_type(pattern, jnp.float32)
  k = min(rows, n)
  # The k smallest priorities: the drawn examples first, in a random order.
  if k:
    _, indices = jax.lax.top_k(-priority, k)
    mask = drawn[indices]
  else:
    indices, mask = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.bool_)
  if k < rows:  # fewer examples than rows: pad with masked copies of index 0
    indices = jnp.pad(indices, (0, rows - k))
    mask = jnp.pad(mask, (0, rows - k))
  num_drawn = jnp.sum(drawn.astype(jnp.int32))
  num_truncated = jnp.maximum(num_drawn - rows, 0).astype(jnp.int32)
  return PoissonBatch(indices.astype(jnp.int32), mask, num_drawn > rows, num_truncated)


def _inclusion_threshold(sampling_rate: Any) -> tuple[Any, jax.Array]:
  """``(every, t)``: draw example ``i`` iff ``bits_i < t`` (uint32) or ``every``.

  ``t = floor(q * 2**32)`` for ``q < 1``; ``every`` is ``q >= 1``. A concrete
  ``q`` is read in float64, where ``q * 2**32`` and its floor are exact; a
  traced one at its own precision (float32 unless float64), where they are
  exact too (``q * 2**32`` only moves the exponent, and ``q < 1`` keeps it
  below ``2**32``). A traced NaN or negative ``q`` draws nothing.
  """
  value = _validation.concrete_value(sampling_rate)
  if value is not None:
    t = math.floor(float(value) * _TWO_32)
    if t >= _TWO_32:
      return True, jnp.zeros((), jnp.uint32)
    return False, jnp.asarray(max(t, 0), jnp.uint32)
  q = jnp.asarray(sampling_rate)
  q = q.astype(jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
  every = q >= 1
  inside = (q > 0) & ~every  # False for NaN
  scaled = jnp.floor(jnp.where(inside, q, jnp.zeros((), q.dtype)) * jnp.asarray(_TWO_32, q.dtype))
  return every, scaled.astype(jnp.uint32)
