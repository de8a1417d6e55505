"""Finite in, finite out (issue #51): generated from ``jaxclip.__all__``.

For every public transform (chained with adam, several steps) and every op, a
finite gradient at any magnitude, from the smallest subnormal to near
float32's largest value and mixed across leaves, gives finite updates and a
finite state. At ee5c6d7 a single entry of about 2e19 overflowed the float32
sum of squares and made whole updates (and adam's moments) NaN.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip import ops
from workloads import every

FACTORIES = every.factories()
# The magnitudes the issue names, and a mixed tree.
MAGNITUDES = (1e-45, 1e-30, 1e-20, 1.0, 1e19, 1e30, 3e38)
DTYPES = ("float32", "bfloat16", "float16")


def _leaf(magnitude: float, dtype: str, shape=(3, 4)) -> jax.Array:
  info = jnp.finfo(dtype)
  value = min(magnitude, float(info.max))
  signs = np.where(np.arange(np.prod(shape)).reshape(shape) % 3 == 0, -1.0, 1.0)
  return jnp.asarray(signs * value, dtype)


def _tree(magnitudes, dtype) -> dict:
  return {f"w{i}": _leaf(m, dtype, (2 + i, 3)) for i, m in enumerate(magnitudes)}


def _all_finite(tree) -> bool:
  """Every float leaf finite, but a threshold field's ``+inf``: the documented "no threshold yet"
  of ``zclip_threshold`` and ``spike_norm_threshold`` (a warm-up, or no spike)."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)):
      continue
    x = np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)
    if "threshold" in jax.tree_util.keystr(path):
      x = np.where(x == np.inf, 0, x)
    if not np.all(np.isfinite(x)):
      return False
  return True


@functools.cache
def _transform(name: str, chained: bool, half: bool, x64: bool):
  """``(tx, jax.jit(tx.update))``: one per transform and form, so that the trees of one
  structure (each magnitude alone) share one compiled program and differ only in data.

  adam's default eps (1e-8) rounds to 0 in float16, where an all-zero leaf
  then gives adam's own 0 / 0: its eps is float16's smallest normal there.
  """
  del x64  # a key only: a program traced with x64 on is not reused with it off
  tx = every.build(name)
  if chained:
    tx = optax.chain(tx, optax.adam(1e-3, eps=6.2e-5 if half else 1e-8))
  return tx, jax.jit(tx.update)


def _run(name, tree, steps=3, chained=False):
  """``steps`` updates of transform ``name`` (``chained`` with adam) on ``tree``, params
  following: (updates, state, params) each."""
  tx, update = _transform(name, chained, _has_float16(tree), bool(jax.config.jax_enable_x64))
  params = jax.tree.map(jnp.zeros_like, tree)
  state = tx.init(params)
  out = []
  for _ in range(steps):
    updates, state = update(tree, state, params)
    params = optax.apply_updates(params, updates)
    out.append((updates, state, params))
  return out


def _largest(tree) -> float:
  return max(
    (float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in jax.tree.leaves(tree)), default=0
  )


def _has_float16(tree) -> bool:
  return any(x.dtype == jnp.float16 for x in jax.tree.leaves(tree))


def _check(name, tree, alone=True, steps=3):
  """The transform alone, then chained with adam.

  Adam squares its input in the leaf's dtype: a transform that passes an
  entry above ~1e19 through unchanged (``record_norms``, the skips) overflows
  adam's second moment, which is adam's, not the transform's; there only the
  transform's own state is held finite in the chain.
  """
  bounded = True
  for step, (updates, state, _) in enumerate(_run(name, tree, steps) if alone else []):
    assert _all_finite(updates), (name, step, "updates", updates)
    assert _all_finite(state), (name, step, "state", state)
    bounded &= not _largest(updates) >= (16.0 if _has_float16(tree) else 1e18)
  # adam squares in float16 what exceeds about 256 into inf (its eps: _transform).
  limit = 16.0 if _has_float16(tree) else 1e18
  for step, (updates, state, params) in enumerate(_run(name, tree, steps, chained=True)):
    assert _all_finite(state[0]), (name, step, "state in the chain", state[0])
    if not alone:  # the transform's own output, read off adam's first moment
      # (A NaN moment counts as bounded, so that the assertions below catch it.)
      bounded = not _largest(state[1][0].mu) >= limit
    if bounded:
      assert _all_finite(updates), (name, step, "chained updates", updates)
      assert _all_finite(state), (name, step, "adam's state", state[1])
      assert _all_finite(params), (name, step, "params")


# The inner loop: every transform chained with adam, two steps, on one tree
# mixing the magnitudes (float32) and an overflowing bfloat16 leaf; the
# cross-product of magnitudes and dtypes, with each transform alone, is slow.
def _quick_tree() -> dict:
  tree = _tree((1e-45, 1e-20, 1.0, 1e30, 3e38), "float32")
  tree["h"] = _leaf(1e30, "bfloat16", (2, 2))
  return tree


@pytest.mark.parametrize("name", FACTORIES)
def test_every_transform_finite_in_finite_out(name):
  _check(name, _quick_tree(), alone=False, steps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FACTORIES)
def test_every_transform_finite_at_every_magnitude_and_dtype(name, dtype):
  """Slow (conftest SLOW_TESTS): each magnitude alone, then all mixed."""
  for m in MAGNITUDES:
    _check(name, _tree((m,), dtype))
  _check(name, _tree(MAGNITUDES, dtype))


def test_every_transform_finite_in_float64():
  with jax.enable_x64(True):
    for name in FACTORIES:
      _check(name, _tree((1e-300, 1.0, 1e200, 1.7e308), "float64"))


OPS = {
  "global_norm": lambda t: ops.global_norm(t),
  "clip_by_global_norm": lambda t: ops.clip_by_global_norm(t, 1.0)[0],
  "clip_by_norm": lambda t: ops.clip_by_norm(t, 1.0),
  "clip_by_norm_axes": lambda t: ops.clip_by_norm(t, 1.0, axes=[0]),
  "clip_by_average_norm": lambda t: ops.clip_by_average_norm(t, 1.0),
  "clip_by_value": lambda t: ops.clip_by_value(t, -1.0, 1.0),
  "unitwise_norm": lambda t: jax.tree.map(jaxclip.unitwise_norm, t),
  "unitwise_clip": lambda t: jax.tree.map(
    lambda g: jaxclip.unitwise_clip(jaxclip.unitwise_norm(g), jnp.ones(g.shape, jnp.float32), g),
    t,
  ),
}


def test_ops_cover_every_public_op():
  public = {n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n))}
  public -= {"Any", "ArrayLike", "PyTree"}
  assert {n for n in public if not n[0].isupper()} <= set(OPS), public - set(OPS)


def _check_op(op, dtype):
  for mags in itertools.chain(((m,) for m in MAGNITUDES), [MAGNITUDES]):
    out = OPS[op](_tree(mags, dtype))
    assert _all_finite(out), (op, dtype, mags, out)


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_finite_in_finite_out(op):
  _check_op(op, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_finite_in_every_dtype(op, dtype):
  """Slow (conftest SLOW_TESTS)."""
  with jax.enable_x64(dtype == "float64"):
    _check_op(op, dtype)


def test_readme_guard_chain_keeps_adamw_finite():
  # skip_nonfinite(chain(record_norms(), clip_by_global_norm(1), adamw)): at
  # ee5c6d7 a finite gradient of 4.9e19 left AdamW's params and moments NaN.
  tx = jaxclip.skip_nonfinite(
    optax.chain(jaxclip.record_norms(), jaxclip.clip_by_global_norm(1.0), optax.adamw(1e-3))
  )
  params = {"w": jnp.ones(4), "b": jnp.ones(2)}
  state = tx.init(params)
  grads = {"w": jnp.array([3e19, 4e19, 0.0, 1.0]), "b": jnp.ones(2)}
  updates, state = tx.update(grads, state, params)
  assert _all_finite(updates) and _all_finite(state)
  norm = float(optax.tree.get(state, "global_norm"))
  np.testing.assert_allclose(norm, 5e19, rtol=1e-5)
  assert float(optax.global_norm(updates)) < 1e-2
