"""Fixed-size histories of finite scalars, for the adaptive transforms.

A history is a float32 ring buffer of ``capacity`` slots plus two int32
scalars, the number of slots in use (``size``, saturating at ``capacity``)
and the slot written next (``index``). Because the buffer fills from slot 0
and only wraps once full, the slots in use are always ``arange(capacity) <
size``. Every function here is jittable, has fixed shapes and dtypes (so a
history is a valid ``lax.scan`` carry) and keeps NaN and inf out: a value
that is not finite is simply not recorded.

Statistics ignore the unused slots; what they return for an empty history is
documented per function.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxclip._kernel import _numerics


class History(NamedTuple):
  """A ring buffer of finite float32 values (the fields of a caller's state)."""

  values: jax.Array  # (capacity,) float32
  size: jax.Array  # () int32, number of slots in use
  index: jax.Array  # () int32, slot written next


def empty(capacity: int) -> History:
  """An empty history with room for ``capacity`` values."""
  return History(
    values=jnp.zeros((capacity,), jnp.float32),
    size=jnp.zeros((), jnp.int32),
    index=jnp.zeros((), jnp.int32),
  )


def push(history: History, value: jax.Array) -> History:
  """Records ``value`` (overwriting the oldest once full) if it is finite."""
  values, size, index = history
  capacity = values.shape[0]
  value = _numerics.saturated_float32(value)  # a finite float64 norm stays finite
  keep = jnp.isfinite(value)
  written = values.at[index].set(jnp.where(keep, value, values[index]))
  return History(
    values=written,
    size=jnp.where(keep, jnp.minimum(size + 1, capacity), size),
    index=jnp.where(keep, (index + 1) % capacity, index),
  )


def mask(history: History) -> jax.Array:
  """Boolean ``(capacity,)`` mask of the slots in use."""
  return jnp.arange(history.values.shape[0]) < history.size


def mean_std(history: History, ddof: int = 1) -> tuple[jax.Array, jax.Array]:
  """Mean and standard deviation (``ddof=1``: unbiased, as ``torch.std``).

  Two-pass (mean first, then squared deviations), in float32. With fewer
  than ``ddof + 1`` values the standard deviation is ``0`` and with none the
  mean is ``0``: callers decide when a history is long enough to be used.
  """
  used = mask(history)
  n = history.size.astype(jnp.float32)
  # Computed on the values scaled by a power of two near their largest
  # magnitude, so that neither the sum nor the squared deviations overflow
  # for finite values (a norm of 1e20 squared is inf in float32); the
  # results are scaled back, the standard deviation saturated at finfo.max.
  values = jnp.where(used, history.values, 0)
  e = _numerics.scale_exponent(jnp.max(jnp.abs(values)))
  scaled = _numerics.times_pow2(values, -e)
  mean = jnp.sum(scaled) / jnp.maximum(n, 1)
  dev = jnp.where(used, scaled - mean, 0)
  var = jnp.sum(dev * dev) / jnp.maximum(n - ddof, 1)
  back = lambda v: _numerics.saturate(_numerics.times_pow2(v, e))  # noqa: E731
  return back(mean), back(jnp.sqrt(var))


def percentile(history: History, q: jax.Array) -> jax.Array:
  """The ``q``-th percentile (``0 <= q <= 100``) of the recorded values.

  Linear interpolation between the two nearest ranks, as ``np.percentile``'s
  default method: position ``q / 100 * (n - 1)`` in the sorted values. ``q``
  may be traced. An empty history gives ``inf``.
  """
  used = mask(history)
  ranked = jnp.sort(jnp.where(used, history.values, jnp.inf))
  n = history.size
  last = jnp.maximum(n - 1, 0)
  q = jnp.clip(jnp.asarray(q).astype(jnp.float32), 0, 100)
  pos = q / 100 * last.astype(jnp.float32)
  lo = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, last)
  hi = jnp.minimum(lo + 1, last)
  frac = pos - lo.astype(jnp.float32)
  a, b = ranked[lo], ranked[hi]
  value = a + (b - a) * frac
  return jnp.where(n > 0, value, jnp.inf)
