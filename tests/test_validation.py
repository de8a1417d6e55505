"""The one room for validation: each check defined once, in ``jaxclip/_kernel/_validation.py``."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

import jaxclip
from jaxclip._kernel import _shapes, _validation

_PACKAGE = pathlib.Path(jaxclip.__file__).parent
# Checks that once had copies elsewhere (a size, a key, a mask, an ord, a symbolic shape), by
# the names the copies had, and the one module each lives in.
_VALIDATION, _SHAPES = "_kernel/_validation.py", "_kernel/_shapes.py"
_ONE_HOME = {
  "check_size": ("check_size", _VALIDATION),
  "_positive_int": ("check_size", _VALIDATION),
  "_static_int": ("check_size", _VALIDATION),
  "check_key": ("check_key", _VALIDATION),
  "_check_key": ("check_key", _VALIDATION),
  "check_mask": ("check_mask", _VALIDATION),
  "_check_mask": ("check_mask", _VALIDATION),
  "check_ord": ("check_ord", _VALIDATION),
  "is_symbolic": ("is_symbolic", _SHAPES),
  "constant_size": ("constant_size", _SHAPES),
  "min_dim": ("min_dim", _SHAPES),
}


def test_each_shared_check_is_defined_once_in_its_module():
  found: dict[str, list[str]] = {}
  for path in sorted(_PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef) and node.name in _ONE_HOME:
        found.setdefault(node.name, []).append(str(path.relative_to(_PACKAGE)))
  want = {name: [home] for name, home in _ONE_HOME.values()}
  assert found == want


def test_check_size_refuses_what_is_not_a_count_naming_it():
  assert _validation.check_size(3, "n") == 3 and _validation.check_size(jnp.int32(0), "n", 0) == 0
  for bad in (True, 2.0, 2.5, "3", None):
    with pytest.raises(TypeError, match="n must be an int"):
      _validation.check_size(bad, "n")
  for minimum, need in ((0, "a non-negative integer"), (1, "a positive integer"), (2, ">= 2")):
    with pytest.raises(ValueError, match=f"n must be .*{need}, got -1"):
      _validation.check_size(-1, "n", minimum)


def test_a_traced_size_is_left_alone_unless_it_is_needed_before_tracing():
  def size(n, static=None):
    return _validation.check_size(n, "n", static=static)

  assert jax.jit(lambda n: jnp.asarray(size(n) is None))(3)
  with pytest.raises(TypeError, match="n must be a concrete value, not traced: it fixes a shape"):
    jax.jit(lambda n: size(n, "it fixes a shape"))(3)
  with pytest.raises(TypeError, match="max_batch_size must be a concrete value"):
    jax.jit(lambda m: jaxclip.poisson_batch(jax.random.key(0), 10, 0.5, m))(4)


def test_constant_size_and_is_symbolic_read_shapes_under_export():
  (b,) = jax.export.symbolic_shape("b")
  assert _shapes.is_symbolic(b) and not _shapes.is_symbolic(3)
  assert _shapes.constant_size(jax.ShapeDtypeStruct((b, 3), jnp.float32)) is None
  assert _shapes.constant_size(jnp.ones((2, 3))) == 6
  assert _shapes.constant_size(2.0) == 1


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_per_example_clipped_grad_checks_its_options_once_not_per_call(method, monkeypatch):
  fn = jaxclip.per_example_clipped_grad(
    lambda p, x: jnp.dot(p["w"], x), {"w": 1.0}, microbatch_size=2, method=method
  )
  calls: list[str] = []
  for name in ("check_hparam", "check_size", "check_scalar"):
    real = getattr(_validation, name)
    monkeypatch.setattr(
      _validation, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1]
    )
  jax.make_jaxpr(fn)({"w": jnp.ones(3)}, jnp.ones((4, 3)))
  assert not calls
