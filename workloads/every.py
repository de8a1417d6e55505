"""Every ``GradientTransformation`` factory of ``jaxclip.__all__``, built with sensible arguments.

Shared by the tests generated from ``jaxclip.__all__``
(``tests/test_every_transform.py``, ``tests/test_training_loops.py``) and the
benchmarks' compile table (``benchmarks/_compile_table.py``): a new factory is
covered by both without anyone adding it to a list, unless it has a
required argument, which :data:`REQUIRED` must then give (the tests fail
until it does).
"""

from __future__ import annotations

import inspect
from typing import Any

import optax

import jaxclip

# Public callables that are not factories of a GradientTransformation.
NOT_TRANSFORMS = {
  "calibrate_noise",
  "dp_epsilon",
  "ghost_plan",
  "ops",
  "per_example_clipped_grad",
  "per_example_global_norm_clip",
  "per_example_layer_norm_clip",
  "poisson_batch",
  "quantile_clip_norm_update",
  "skip_bad_microbatches",
  "suggest_threshold",
  "unitwise_clip",
  "unitwise_norm",
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
  "dp_noise": lambda: jaxclip.dp_noise(1.0, 1.1, expected_batch_size=16),
  "skip_above": lambda: jaxclip.skip_above(optax.identity(), 10.0),
  "skip_nonfinite": lambda: jaxclip.skip_nonfinite(optax.identity()),
  "skip_on_spike": lambda: jaxclip.skip_on_spike(optax.identity(), window=8),
}


def factories() -> list[str]:
  """The names of every transform factory in ``jaxclip.__all__``."""
  return sorted(
    name
    for name in jaxclip.__all__
    if name not in NOT_TRANSFORMS
    and callable(getattr(jaxclip, name))
    and not inspect.isclass(getattr(jaxclip, name))
  )


def build(name: str) -> optax.GradientTransformation:
  """``jaxclip.<name>`` built from :data:`REQUIRED`, or with no arguments."""
  make = REQUIRED.get(name, getattr(jaxclip, name))
  try:
    return make()
  except TypeError as e:
    raise AssertionError(
      f"jaxclip.{name} cannot be built with no arguments ({e}): add it to REQUIRED in "
      f"{__file__} (or to NOT_TRANSFORMS if it is no transform factory)."
    ) from e


def count_eqns(jaxpr: Any) -> int:
  """Equations of ``jaxpr`` and of every jaxpr nested in its equations' params."""
  total = 0
  for eqn in jaxpr.eqns:
    total += 1
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          total += count_eqns(inner)
  return total
