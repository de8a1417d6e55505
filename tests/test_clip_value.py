"""One way through for each argument (issue #49): a call's clip is one value passed down.

``per_example_clipped_grad``'s options are its arguments, checked once and
never replaced per call; each call's clip (the bounds, the group of each
leaf, ``normalize``) is a :class:`jaxclip.privacy._clip_factors.Clip` that
both methods take, the ghost engine's ``clipped_sum`` included (a value, not
a callback up into the options); and the sum is widened to float32 once,
where each method forms it, never again above.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip.privacy import _clip_options, _ghost
from jaxclip.privacy._clip_factors import Clip

ROOT = Path(__file__).resolve().parents[1]
PRIVACY = ROOT / "jaxclip" / "privacy"


def test_options_hold_the_functions_arguments_and_nothing_of_a_call():
  fields = {f.name for f in dataclasses.fields(_clip_options.Options)}
  assert fields == set(inspect.signature(jaxclip.per_example_clipped_grad).parameters)
  opts = _clip_options.Options.checked(
    lambda p, x: jnp.sum(p * x),
    1.0,
    _ghost.METHODS,
    microbatch_size=None,
    batch_argnums=None,
    keep_batch_dim=False,
    spmd_axis_name=None,
    axis_name=None,
    has_aux=False,
    method="vmap",
    return_norms=False,
    group_size=1,
    normalize=None,
    return_num_nonfinite=False,
  )
  with pytest.raises(dataclasses.FrozenInstanceError):
    opts.method = "ghost"


def _calls(path: Path) -> list[str]:
  """The dotted names of every call in ``path`` (``a.b(...)`` as ``a.b``)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Call):
      f, parts = node.func, []
      while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
      if isinstance(f, ast.Name):
        parts.append(f.id)
      out.append(".".join(reversed(parts)))
  return out


def test_no_options_are_replaced_per_call():
  """Per-call state lives in values passed down, not in a copy of the options (nor of any other
  dataclass, outside the ghost engine's own ``Traced``)."""
  for path in sorted(PRIVACY.glob("*.py")):
    replaced = [c for c in _calls(path) if c in ("dataclasses.replace", "replace")]
    assert not replaced, (path.name, replaced)


@pytest.mark.parametrize(
  "module", ["_per_example.py", "_clip_chunks.py", "_clip_options.py", "_ghost/__init__.py"]
)
def test_the_sum_is_widened_where_it_is_formed_and_not_again(module):
  casts = [
    c
    for c in _calls(PRIVACY / module)
    if c.split(".")[-1] in ("astype", "compute_dtype", "upcast_for_accumulation")
  ]
  assert not casts, casts


def test_the_ghost_engine_takes_the_clip_as_a_value():
  params = inspect.signature(_ghost.clipped_sum).parameters
  assert params["clip"].annotation == "Clip"
  assert not [p for p in params.values() if "Callable" in str(p.annotation)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clipped_sum_by_a_clip_value(dtype):
  """``w.x + b.x[:1]``: each example's gradient is ``(x, x[:1])``; clipped by one bound, by a
  bound per leaf (per-layer), and with a row masked out."""
  xs = jnp.array([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [1.0, 1.0]], dtype)
  params = [jnp.zeros(2, dtype), jnp.zeros(1, dtype)]
  traced = _ghost.trace(lambda p, x: p[0] @ x + p[1] @ x[:1], params, [xs], [0], has_aux=False)
  grads = np.concatenate([xs, xs[:, :1]], axis=1).astype(np.float64)
  mask = jnp.array([True, True, False, True])

  sums, norms, (num_clipped, num_bad), _ = _ghost.clipped_sum(
    traced, traced.plan, Clip(jnp.float32(2.0)), None, spmd_axis_name=None
  )
  want_norms = np.linalg.norm(grads, axis=1)
  np.testing.assert_allclose(norms, want_norms, rtol=1e-6)
  weights = np.minimum(1.0, 2.0 / want_norms)
  want = (weights[:, None] * grads).sum(0)
  assert all(s.dtype == jnp.float32 for s in sums)
  np.testing.assert_allclose(np.concatenate(sums), want, rtol=1e-5)
  assert int(num_clipped) == 2 and int(num_bad) == 0

  per_leaf = Clip(jnp.array([2.0, 1.0], jnp.float32), (0, 1))
  sums, norms, (num_clipped, _), _ = _ghost.clipped_sum(
    traced, traced.plan, per_leaf, mask, spmd_axis_name=None
  )
  leaf_norms = np.stack([np.linalg.norm(grads[:, :2], axis=1), np.abs(grads[:, 2])], axis=1)
  np.testing.assert_allclose(norms, leaf_norms, rtol=1e-6)
  weights = np.minimum(1.0, np.array([2.0, 1.0]) / np.maximum(leaf_norms, 1e-30))
  weights = weights * np.asarray(mask)[:, None]
  want = np.concatenate(
    [(weights[:, :1] * grads[:, :2]).sum(0), (weights[:, 1] * grads[:, 2]).sum(0, keepdims=True)]
  )
  np.testing.assert_allclose(np.concatenate(sums), want, rtol=1e-5)
  np.testing.assert_array_equal(num_clipped, [1, 1])  # example 0 only
