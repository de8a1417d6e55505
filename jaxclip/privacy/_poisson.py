"""Poisson-sampled batches of a fixed shape, for DP-SGD under ``jit``."""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _validation
from jaxclip.privacy import _quantile


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
  """

  indices: jax.Array
  mask: jax.Array
  overflow: jax.Array


def _static_int(value: Any, name: str, low: int) -> int:
  try:
    out = operator.index(value)
  except TypeError:
    raise TypeError(
      f"{name} must be a Python int (it fixes a shape), got {value!r:.100}."
    ) from None
  if isinstance(value, bool) or out < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
  return out


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

  One uniform :math:`u_i` per example decides: example :math:`i` is drawn iff
  :math:`u_i < q`, and the rows hold the drawn examples in increasing order
  of :math:`u_i` (a random order). If more than ``max_batch_size`` are drawn,
  ``overflow`` is True and the rows keep the ``max_batch_size`` with the
  smallest :math:`u_i`, a uniformly random subset of the drawn ones.

  **Truncation and the guarantee.** The Poisson analysis holds for the
  untruncated batch. Truncating to a random subset of size
  :math:`\le B_{\max}` is *truncated Poisson sampling*, accounted for exactly
  by ``dp_accounting``'s ``TruncatedSubsampledGaussianDpEvent`` (its PLD
  accountant). Accounted as plain Poisson instead, the guarantee
  :math:`(\varepsilon, \delta)` still holds as :math:`(\varepsilon, \delta +
  (1 + e^{\varepsilon}) T p)` over :math:`T` steps, with :math:`p =
  P[\mathrm{Binomial}(N + 1, q) > B_{\max}]` (on a dataset or its neighbour,
  the truncated and untruncated runs differ with probability at most
  :math:`Tp`). Pick ``max_batch_size`` a few
  standard deviations :math:`\sqrt{Nq(1-q)}` above :math:`qN` so that
  :math:`Tp \ll \delta`, and check ``overflow``.

  Args:
    key: A ``jax.random`` key; use a fresh one each step.
    num_examples: :math:`N`, the dataset size (a Python int: it fixes the
      work's shape).
    sampling_rate: :math:`q \in [0, 1]`. May be traced.
    max_batch_size: :math:`B_{\max} \ge 1`, the rows returned (a Python int).

  Returns:
    A :class:`PoissonBatch` ``(indices, mask, overflow)``.

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
    >>> bool(20 < batch.mask.sum() < 80), bool(batch.overflow)
    (True, False)

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
  _quantile._check_key(key)
  n = _static_int(num_examples, "num_examples", 0)
  rows = _static_int(max_batch_size, "max_batch_size", 1)
  _validation.check_hparam(sampling_rate, "sampling_rate", lo=0.0, hi=1.0, scalar=True)
  q = jnp.asarray(sampling_rate, jnp.float32)
  u = jax.random.uniform(key, (n,), jnp.float32)
  drawn = u < q
  k = min(rows, n)
  # The k smallest u: the drawn examples first (u < q), in a random order.
  neg_u, indices = jax.lax.top_k(-u, k) if k else (jnp.zeros((0,)), jnp.zeros((0,), jnp.int32))
  mask = -neg_u < q
  if k < rows:  # fewer examples than rows: pad with masked copies of index 0
    indices = jnp.pad(indices, (0, rows - k))
    mask = jnp.pad(mask, (0, rows - k))
  overflow = jnp.sum(drawn.astype(jnp.int32)) > rows
  return PoissonBatch(indices.astype(jnp.int32), mask, overflow)
