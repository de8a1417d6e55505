"""Generated examples whose rows cancel, and the models that take them (``tests/ghost_cancel.py``).

A ghost rule reads an example's squared norm from sums of signed products
over its rows (the Gram form ``sum_{t,s} (a_t . a_s)(g_t . g_s)``, a
gradient formed from ``a`` and ``g``, a lookup's rows summed by id, a tied
table's cross term, a scale's ``sum_t g_t a_t``). Where large rows cancel and
leave a small rest, rounding can leave a result below the true norm: the
example is then under-clipped. :func:`adversarial_rows` generates such
examples (seeded): groups of large rows whose products cancel (``a`` the same
and ``g`` opposite, or the other way round, ratios, a rank-2 rest, a null
space), perturbed or not, plus small or zero rows, at magnitudes from
ordinary to near the dtype's overflow. The models below put them through
each rule (each loss is linear in the site's output, so that ``g`` is the
example's target exactly), with the exact per-example gradient (products
exact in float64, summed by ``math.fsum``); :data:`CONFIGS` sizes them so that
each rule takes each of its forms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
# Per dtype: the largest exponent of a large row's entries (below overflow), the smallest
# normal and the smallest subnormal exponent.
LIMITS = {"float32": (126, -126, -149), "bfloat16": (126, -126, -133), "float16": (15, -14, -24)}


# ----------------------------------------------------------------------------
# The examples: groups of large rows whose products cancel, and small residual rows
# ----------------------------------------------------------------------------


def _direction(rng, n):
  """Random signs and magnitudes in ``[1/16, 1]``, the largest 1."""
  v = rng.choice([-1.0, 1.0], size=n) * rng.uniform(1 / 16, 1, size=n)
  return v / np.max(np.abs(v))


def _split(rng, e, dtype, near=False, span=None, extreme=False):
  """``(ea, eg)`` with ``ea + eg = e``, each an exponent of the dtype's normal range (an
  entry below it is flushed by XLA:CPU's matrix products, exactly or not), and, with ``span``
  (but ``near`` overflow), at most ``2**span``. ``extreme``: one of them as large as it can be
  and the other as small, jittered (a row ``|a| ~ 2**123`` against ``|g| ~ 2**-112``: its
  weighted ``g`` falls below float32's normal range unless the book-keeping balances them,
  ``_rules/_dot.balanced``)."""
  hi, lo, _ = LIMITS[dtype]
  lo, hi = lo + 6, hi if near or span is None else min(hi, span)
  first, last = max(e - hi, lo), min(hi, e - lo)
  if extreme and last >= first:
    jitter = int(rng.integers(0, min(2, last - first) + 1))
    ea = last - jitter if rng.random() < 0.5 else first + jitter
  else:
    ea = int(rng.integers(first, last + 1))
  return ea, e - ea


def _group(rng, kind, m, c, f):
  """``m`` rows ``(a, g)`` whose products ``sum_i a_i g_i^T`` cancel (in real arithmetic but
  for ``rank2``'s small residual), entries at most about 1."""
  u, v = _direction(rng, c), _direction(rng, f)
  if kind == "null":  # A^T G = 0: G's columns in the null space of A^T
    a = np.stack([_direction(rng, c) for _ in range(m)]) if c > 1 else np.ones((m, 1))
    basis = np.linalg.svd(a, full_matrices=True)[0][:, np.linalg.matrix_rank(a) :]
    g = basis @ rng.normal(size=(basis.shape[1], f))
    return a, g / np.max(np.abs(g))
  beta = rng.uniform(0.5, 1.0, size=m)
  beta[-1] = -np.sum(beta[:-1])  # two rows: (b, -b), whose rounded products cancel exactly
  beta /= np.max(np.abs(beta))
  if kind == "a":  # g the same, a opposite
    return np.outer(beta, u), np.tile(v, (m, 1))
  if kind == "ratio":  # a = (x u, u), g = (v, -x v)
    x = rng.uniform(0.5, 1.0)
    return np.stack([x * u, u]), np.stack([v, -x * v])
  a, g = np.tile(u, (m, 1)), np.outer(beta, v)  # "g" and "rank2": a the same, g opposite
  if kind == "rank2":
    a[-1] += 2.0 ** -int(rng.integers(1, 30)) * _direction(rng, c)
  return a, g


KINDS = ("g", "a", "ratio", "rank2", "null")


def adversarial_rows(rng, t, c, f, dtype, kinds=KINDS, e_max=None, span=None):
  """An example's rows ``(a (t, c), g (t, f), group)`` (float64 values the dtype holds): one or
  more groups of large rows whose products cancel, perturbed or not, then small or zero rows
  (``group`` -1) at a level where a norm is finite; products up to ``2**e_max`` (default:
  near overflow); ``span``: the rows' ``a`` and ``g`` within ``2**span`` (:func:`_split`)."""
  hi = LIMITS[dtype][0]
  e_max = 2 * hi if e_max is None else e_max
  floor = max(-20, 2 * LIMITS[dtype][1] + 16)
  low = int(rng.integers(floor, min(e_max, 60 if hi > 100 else 24) - 4))  # the small rows
  rows_a, rows_g, group = np.zeros((t, c)), np.zeros((t, f)), np.full(t, -1)
  used = 0
  for j in range(int(rng.integers(1, max(1, (t - 1) // 2) + 1))):
    left = t - used
    if left < 2:
      break
    near = rng.random() < 0.3  # near the dtype's overflow: two rows that cancel exactly
    kind = kinds[int(rng.integers(len(kinds)))] if not near else "ga"[int(rng.integers(2))]
    m = 2 if kind == "ratio" or near else int(rng.integers(2, min(left, 3) + 1))
    if kind == "null":  # more rows than a's width (c == 1: rows of g that sum to zero)
      m = int(rng.integers(2, left + 1)) if c == 1 else c + 1 + int(rng.integers(2))
      if m > left:
        kind, m = "g", 2
    a, g = _group(rng, kind, m, c, f)
    # Extreme: a and g at the two ends of the range (_split), the products far from cancelling
    # (the example clipped hard: its weighted g near the bottom of the range).
    extreme = not near and rng.random() < 0.4
    if extreme or (not near and rng.random() < 0.5):  # the products no longer cancel
      g[-1] *= 1 + rng.choice([-1, 1]) * 2.0 ** -int(rng.integers(1, 4 if extreme else 40))
    # Above the small rows by up to 40 binades (float16: 20), or near overflow.
    top = e_max - 2 - int(rng.integers(0, 4))
    e = top if near else int(rng.integers(low, min(top, low + (40 if hi > 100 else 20)) + 1))
    ea, eg = _split(rng, e, dtype, near, span, extreme)
    rows_a[used : used + m], rows_g[used : used + m] = a * 2.0**ea, g * 2.0**eg
    group[used : used + m] = j
    used += m
  for r in range(used, t):
    if rng.random() < 0.2:
      continue
    ea, eg = _split(rng, low - int(rng.integers(0, 5)), dtype, span=span)
    rows_a[r], rows_g[r] = _direction(rng, c) * 2.0**ea, _direction(rng, f) * 2.0**eg
  order = rng.permutation(t)
  return held(rows_a[order], dtype), held(rows_g[order], dtype), group[order]


def adversarial_sums(rng, t, f, dtype):
  """Rows ``(g (t, f), group)`` whose groups sum to nearly zero (a lookup's rows at one id, a
  bias's output gradients), up to near the dtype's overflow."""
  a, g, group = adversarial_rows(rng, t, 1, f, dtype, e_max=LIMITS[dtype][0])
  return held(a * g, dtype), group


def held(x, dtype):
  """``x`` rounded to ``dtype``, as float64."""
  with np.errstate(over="ignore"):
    return np.asarray(jnp.asarray(x, jnp.dtype(dtype)).astype(jnp.float32), np.float64)


def ordinary_rows(rng, t, c, f, dtype):
  return held(rng.normal(size=(t, c)), dtype), held(rng.normal(size=(t, f)), dtype)


def exact_sum(products):
  """``sum`` over axis 0, each entry correctly rounded (``math.fsum``; products of values
  of float32 or narrower are exact in float64)."""
  flat = products.reshape(products.shape[0], -1)
  return np.array([math.fsum(flat[:, j]) for j in range(flat.shape[1])]).reshape(products.shape[1:])


def outer_sum(a, g):
  """``a^T g`` exactly (``a`` (t, c), ``g`` (t, f))."""
  return exact_sum(a[:, :, None] * g[:, None, :])


def _f32(x):
  return jnp.sum(x.astype(jnp.float32))


# ----------------------------------------------------------------------------
# The models: a loss linear in each site's output (its g is the example's target exactly),
# the parameters zero (every forward value finite), the exact per-example gradient
# ----------------------------------------------------------------------------


class Model(NamedTuple):
  """``loss(params, *args)``; ``params(dtype)``; ``ordinary(rng, dtype)`` and
  ``adversarial(rng, dtype)``: one example's args (float64 values the dtype holds, or ids);
  ``truth(*args)``: its exact gradient."""

  loss: Callable[..., Any]
  params: Callable[[str], Any]
  ordinary: Callable[..., tuple]
  adversarial: Callable[..., tuple]
  truth: Callable[..., np.ndarray]


def _zeros(*shape):
  return lambda dtype: jnp.zeros(shape, jnp.dtype(dtype))


def dense(t, c, f, wrap=None):
  """``x @ w`` (``wrap``: ``"scan"`` of ``t[0]`` iterations sharing ``w``, ``"remat"``)."""
  if wrap == "scan":
    step = lambda w, acc, xy: (acc + _f32((xy[0] @ w) * xy[1]), None)
    loss = lambda w, x, y: jax.lax.scan(lambda acc, xy: step(w, acc, xy), 0.0, (x, y))[0]
    lead, t = (t[0],), t[0] * t[1]
  else:
    mm = jax.checkpoint(lambda w, x: x @ w) if wrap == "remat" else (lambda w, x: x @ w)
    loss, lead = (lambda w, x, y: _f32(mm(w, x) * y)), ()
  shape = lambda a: a.reshape(lead + (-1, a.shape[-1]))
  rows = lambda gen, **kw: lambda rng, dt: tuple(map(shape, gen(rng, t, c, f, dt, **kw)[:2]))
  flat = lambda x: x.reshape(-1, x.shape[-1])
  # The second backward pass (remat, float32 only) weights each example's output gradients
  # inside the model's own backward pass, where no balancing reaches: rows within 2**110 there.
  # In half precision a rematerialised model keeps one pass: rows over the whole range.
  span = lambda dt: {"span": 110} if wrap == "remat" and dt == "float32" else {}
  return Model(
    loss,
    _zeros(c, f),
    rows(ordinary_rows),
    lambda rng, dt: rows(adversarial_rows, **span(dt))(rng, dt),
    lambda x, y: outer_sum(flat(x), flat(y)),
  )


def batched(n, t, c, f):
  """``einsum("ntc,ncf->ntf", x, w)``: a dot with a batch dim (``n`` weights)."""

  def gen(fn):
    def make(rng, dt):
      rows = [fn(rng, t, c, f, dt)[:2] for _ in range(n)]
      return tuple(np.stack(x) for x in zip(*rows, strict=True))

    return make

  return Model(
    lambda w, x, y: _f32(jnp.einsum("ntc,ncf->ntf", x, w) * y),
    _zeros(n, c, f),
    gen(ordinary_rows),
    gen(adversarial_rows),
    lambda x, y: np.stack([outer_sum(a, g) for a, g in zip(x, y, strict=True)]),
  )


def conv(positions, kernel, cin, cout):
  """A convolution whose stride is its window (``positions`` and ``kernel`` per spatial
  dim, 1-d or 2-d): its patches are the input's tiles, one row each."""
  nd = len(kernel)
  spec = ("NWC", "WIO", "NWC") if nd == 1 else ("NHWC", "HWIO", "NHWC")
  taps = math.prod(kernel) * cin

  def loss(w, x, y):
    out = jax.lax.conv_general_dilated(x[None], w, kernel, "VALID", dimension_numbers=spec)
    return _f32(out[0] * y)

  def image(p):  # rows (positions, kernel..., cin) -> the input
    tiles = p.reshape(*positions, *kernel, cin)
    order = [i for d in range(nd) for i in (d, nd + d)] + [2 * nd]
    sizes = [a * k for a, k in zip(positions, kernel, strict=True)]
    return tiles.transpose(order).reshape(*sizes, cin)

  def gen(fn, **kw):
    def make(rng, dt):
      a, g = fn(rng, math.prod(positions), taps, cout, dt, **kw)[:2]
      return image(a), g.reshape(*positions, cout)

    return make

  def truth(x, y):
    tiles = x.reshape(*[i for a, k in zip(positions, kernel, strict=True) for i in (a, k)], cin)
    order = list(range(0, 2 * nd, 2)) + list(range(1, 2 * nd, 2)) + [2 * nd]
    rows = tiles.transpose(order).reshape(math.prod(positions), taps)
    return outer_sum(rows, y.reshape(-1, cout)).reshape(*kernel, cin, cout)

  # The book-keeping balances a convolution's records example by example only (its patches
  # share the input's entries), and drops an example whose rows lie so far apart that a flush
  # could move the sum (_book.unbounded): rows over the whole range.
  adversarial = gen(adversarial_rows)
  return Model(loss, _zeros(*kernel, cin, cout), gen(ordinary_rows), adversarial, truth)


def _one_hot(ids, rows):
  return (ids[:, None] == np.arange(rows)[None, :]).astype(np.float64)


def lookup(t, rows, width):
  """``table[ids]``: a group's rows share an id."""

  def adversarial(rng, dt):
    g, group = adversarial_sums(rng, t, width, dt)
    ids = rng.integers(0, rows, size=t)
    for j in set(group[group >= 0].tolist()):
      ids[group == j] = rng.integers(0, rows)
    return ids.astype(np.int32), g

  return Model(
    lambda e, ids, y: _f32(e[ids] * y),
    _zeros(rows, width),
    lambda rng, dt: (
      rng.integers(0, rows, size=t).astype(np.int32),
      ordinary_rows(rng, t, 1, width, dt)[1],
    ),
    adversarial,
    lambda ids, y: exact_sum(_one_hot(ids, rows)[:, :, None] * y[:, None, :]),
  )


def tied(t_lookup, t_head, rows, width):
  """A table read by ``table[ids]`` and, transposed, by a head ``h @ table.T``: the lookup's
  rows at one id cancel the head's gradient of that row (and each part's rows their own)."""

  def adversarial(rng, dt):
    hi = LIMITS[dt][0]
    if rng.random() < 0.5:
      h, y2 = adversarial_rows(rng, t_head, width, rows, dt, e_max=hi - 4)[:2]
    else:  # ordinary head rows, scaled up
      e = int(rng.integers(0, hi - 4 - 2 * int(np.log2(t_head + 1))))
      scaled = zip(ordinary_rows(rng, t_head, width, rows, dt), _split(rng, e, dt), strict=True)
      h, y2 = (held(z / np.max(np.abs(z)) * 2.0**s, dt) for z, s in scaled)
    y1, group = adversarial_sums(rng, t_lookup, width, dt)
    ids = rng.integers(0, rows, size=t_lookup)
    head = exact_sum(y2[:, :, None] * h[:, None, :])  # (rows, width)
    r = int(np.argmax(np.max(np.abs(head), axis=1)))
    free = np.flatnonzero(group < 0)
    if free.size:  # a row at id r cancelling the head's gradient of row r, perturbed or not
      t = int(free[0])
      ids[t] = r
      y1[t] = held(-head[r] * (1 + rng.choice([0, 1, -1]) * 2.0 ** -int(rng.integers(1, 40))), dt)
    return ids.astype(np.int32), y1, h, y2

  def ordinary(rng, dt):
    ids = rng.integers(0, rows, size=t_lookup).astype(np.int32)
    y1 = ordinary_rows(rng, t_lookup, 1, width, dt)[1]
    return (ids, y1, *ordinary_rows(rng, t_head, width, rows, dt))

  def truth(ids, y1, h, y2):
    parts = [_one_hot(ids, rows)[:, :, None] * y1[:, None, :], y2[:, :, None] * h[:, None, :]]
    return exact_sum(np.concatenate(parts))

  return Model(
    lambda e, ids, y1, h, y2: _f32(e[ids] * y1) + _f32((h @ e.T) * y2),
    _zeros(rows, width),
    ordinary,
    adversarial,
    truth,
  )


def scale(t, d):
  """``x * s``, ``s`` repeated over the rows (a norm's scale): ``grad_j = sum_t x_tj y_tj``."""
  rows = lambda gen: lambda rng, dt: gen(rng, t, d, d, dt)[:2]
  return Model(
    lambda s, x, y: _f32(x * s * y),
    _zeros(d),
    rows(ordinary_rows),
    rows(adversarial_rows),
    lambda x, y: exact_sum(x * y),
  )


def bias(t, d):
  """``x + b``, ``b`` repeated over the rows (no rule: instantiated): ``grad = sum_t y_t``."""

  def adversarial(rng, dt):
    return np.zeros((t, d)), adversarial_sums(rng, t, d, dt)[0]

  return Model(
    lambda b, x, y: _f32((x + b) * y),
    _zeros(d),
    lambda rng, dt: ordinary_rows(rng, t, d, d, dt),
    adversarial,
    lambda x, y: exact_sum(y),
  )


def twice(t, c, f):
  """``x @ w`` twice, once through ``w * 1`` (a weight used twice: no rule, instantiated and
  pulled back to ``w``): ``grad = 2 x^T y``."""
  rows = lambda gen: lambda rng, dt: tuple(gen(rng, t, c, f, dt)[:2])
  return Model(
    lambda w, x, y: _f32((x @ w) * y) + _f32((x @ (w * 1)) * y),
    _zeros(c, f),
    rows(ordinary_rows),
    rows(adversarial_rows),
    lambda x, y: 2 * outer_sum(x, y),
  )


def remat_bias(t, c, f):
  """``checkpoint(x @ w) + b`` (a two-pass plan: its clipped sum a second backward pass), the
  adversarial rows in ``b``'s output gradients, ``x`` zero: ``grad = (x^T y, sum_t y_t)``."""
  mm = jax.checkpoint(lambda w, x: x @ w)

  def adversarial(rng, dt):
    return np.zeros((t, c)), adversarial_sums(rng, t, f, dt)[0]

  return Model(
    lambda p, x, y: _f32((mm(p[0], x) + p[1]) * y),
    lambda dtype: (jnp.zeros((c, f), jnp.dtype(dtype)), jnp.zeros((f,), jnp.dtype(dtype))),
    lambda rng, dt: ordinary_rows(rng, t, c, f, dt),
    adversarial,
    lambda x, y: np.concatenate([outer_sum(x, y).ravel(), exact_sum(y)]),
  )


# ----------------------------------------------------------------------------
# The configurations: each rule in each of its forms
# ----------------------------------------------------------------------------

# name: (model, the forms it is meant to reach, by dtype where they differ). Forms: "gram",
# "formed" (the gradient formed from a and g for the norm), "backward" (formed in the backward
# pass, float32 only: the released sum is then that same gradient), lookup's "sums" / "table".
CONFIGS = {
  "dot gram": lambda: dense(3, 8, 8),
  "dot gram wide": lambda: dense(6, 16, 16),
  "dot gram tall": lambda: dense(4, 32, 6),
  "dot formed": lambda: dense(8, 16, 4),
  "dot formed one out": lambda: dense(5, 6, 1),
  "dot backward": lambda: dense(16, 4, 4),
  "einsum gram": lambda: batched(2, 3, 8, 8),
  "einsum formed": lambda: batched(2, 8, 16, 4),
  "scan gram": lambda: dense((2, 2), 8, 8, "scan"),
  "scan formed": lambda: dense((3, 4), 8, 3, "scan"),
  "remat gram": lambda: dense(3, 8, 8, "remat"),
  "remat formed": lambda: dense(8, 16, 4, "remat"),
  "conv gram": lambda: conv((4,), (3,), 4, 8),
  "conv2d gram": lambda: conv((2, 2), (2, 2), 3, 12),
  "conv formed": lambda: conv((6,), (3,), 4, 2),
  "conv backward": lambda: conv((8,), (3,), 2, 4),
  "lookup gram": lambda: lookup(4, 16, 5),
  "lookup sums": lambda: lookup(8, 16, 5),
  "lookup table": lambda: lookup(12, 6, 5),
  "tied gram": lambda: tied(4, 3, 16, 8),
  "tied sums formed": lambda: tied(8, 12, 16, 8),
  "scale": lambda: scale(6, 4),
  "bias": lambda: bias(6, 4),
  "twice": lambda: twice(4, 8, 8),
  "twice untapped": lambda: twice(3, 16, 16),
  "remat bias": lambda: remat_bias(6, 4, 4),
}
