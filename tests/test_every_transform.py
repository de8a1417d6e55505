"""Checks generated from ``jaxclip.__all__``: every transform, including ones added later.

Every public factory of an optax ``GradientTransformation`` is built from the
small table below (only where a required argument exists); a new public
function that is neither in the table, nor buildable with no arguments, nor
listed as not being a transform factory fails :func:`test_the_table_builds_every_factory`.
"""

from __future__ import annotations

import inspect
import time

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxclip
from benchmarks import _trees

# Public callables that are not factories of a GradientTransformation.
NOT_TRANSFORMS = {
    "ops", "per_example_clipped_grad", "per_example_global_norm_clip",
    "per_example_layer_norm_clip", "quantile_clip_norm_update", "skip_bad_microbatches",
    "suggest_threshold", "unitwise_clip", "unitwise_norm",
}

# Factories with a required argument: sensible defaults.
REQUIRED = {
    "adaptive_grad_clip": lambda: jaxclip.adaptive_grad_clip(0.1),
    "clip": lambda: jaxclip.clip(1.0),
    "clip_by_average_norm": lambda: jaxclip.clip_by_average_norm(1.0),
    "clip_by_block_rms": lambda: jaxclip.clip_by_block_rms(1.0),
    "clip_by_global_norm": lambda: jaxclip.clip_by_global_norm(1.0),
    "clip_by_norm": lambda: jaxclip.clip_by_norm(1.0),
    "clip_by_value": lambda: jaxclip.clip_by_value(-1.0, 1.0),
    "clipped": lambda: jaxclip.clipped(optax.identity(), global_clipnorm=1.0),
    "skip_above": lambda: jaxclip.skip_above(optax.identity(), 10.0),
    "skip_nonfinite": lambda: jaxclip.skip_nonfinite(optax.identity()),
    "skip_on_spike": lambda: jaxclip.skip_on_spike(optax.identity(), window=8),
}

# Transforms that read the params (passed to update as the updates' tree).
READS_PARAMS = {"adaptive_grad_clip"}


def _factories() -> list[str]:
  return sorted(name for name in jaxclip.__all__
                if name not in NOT_TRANSFORMS and callable(getattr(jaxclip, name))
                and not inspect.isclass(getattr(jaxclip, name)))


FACTORIES = _factories()


def build(name: str) -> optax.GradientTransformation:
  make = REQUIRED.get(name, getattr(jaxclip, name))
  try:
    return make()
  except TypeError as e:
    raise AssertionError(
        f"jaxclip.{name} cannot be built with no arguments ({e}): add it to REQUIRED in "
        f"{__file__} (or to NOT_TRANSFORMS if it is no transform factory).") from e


def test_the_table_builds_every_factory():
  assert len(FACTORIES) >= 15
  for name in FACTORIES:
    tx = build(name)
    assert isinstance(tx, optax.GradientTransformation), name
  assert set(REQUIRED) <= set(FACTORIES)


def _compile_seconds(tx: optax.GradientTransformation, tree) -> float:
  state = tx.init(tree)
  start = time.process_time()
  jax.jit(tx.update).lower(tree, state, tree).compile()
  return time.process_time() - start


# Several times the 2.5x target of the benchmark (benchmarks/results.md):
# loose enough not to flake on a loaded machine, where a transform whose
# compile time grows with the square of the leaf count takes 10-100x.
_BOUND = 8.0


def test_every_transform_compiles_at_400_leaves_in_a_few_times_adams_compile():
  """``chain(t, adam).update`` on 400 leaves of mixed shapes, against adam's own.

  CPU seconds of this process, so that other processes on the machine
  count less; adam is compiled before and after, the larger kept.
  """
  tree = _trees.make_tree(_trees.many_leaf_shapes(400, mixed=True))
  adam = _compile_seconds(optax.adam(1e-3), tree)
  times = {name: _compile_seconds(optax.chain(build(name), optax.adam(1e-3)), tree)
           for name in FACTORIES}
  adam = max(adam, _compile_seconds(optax.adam(1e-3), tree))
  slow = {name: f"{t / adam:.1f}x" for name, t in times.items() if t > _BOUND * adam}
  assert not slow, f"compile time against adam's ({adam:.1f} s CPU): {slow}"


@pytest.mark.parametrize("container", [tuple, list])
def test_every_state_keeps_its_structure_under_scan(container):
  """The state of ``init(tuple)`` stays a scan carry when the updates come as a list.

  As optax's own transforms do: the state's structure is that of init's
  params, whatever container the updates come in.
  """
  other = list if container is tuple else tuple
  params = container([jnp.ones((2, 3)), jnp.full(4, 2.0)])
  grads = jnp.stack([jnp.ones(6), jnp.full(6, 3.0)])
  broken = {}
  for name in FACTORIES:
    tx = build(name)
    init = tx.init(params)

    def body(state, g, tx=tx):
      updates = other([g.reshape(2, 3), g[:4]])
      out, state = tx.update(updates, state, updates)
      return state, jax.tree.leaves(out)

    try:
      state, _ = jax.lax.scan(body, init, grads)
    except TypeError as e:
      broken[name] = str(e).splitlines()[0]
      continue
    assert jax.tree.structure(state) == jax.tree.structure(init), name
  assert not broken, broken
