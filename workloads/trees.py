"""Synthetic gradient trees (GPT-2-small's parameter shapes, many-leaf trees) and a train step.

Shared by the kernel's tests (``tests/test_kernel.py``) and the benchmarks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def gpt2_shapes(shrink: int = 1) -> dict[str, tuple[int, ...]]:
  """The 148 parameter shapes of GPT-2 small (124M), every width divided by ``shrink``."""
  d, vocab, ctx = 768 // shrink, 50257 // shrink, 1024 // shrink
  shapes = {"wte": (vocab, d), "wpe": (ctx, d)}
  for i in range(12):
    p = f"h{i:02d}."
    shapes.update(
      {
        p + "ln_1.scale": (d,),
        p + "ln_1.bias": (d,),
        p + "attn.c_attn.kernel": (d, 3 * d),
        p + "attn.c_attn.bias": (3 * d,),
        p + "attn.c_proj.kernel": (d, d),
        p + "attn.c_proj.bias": (d,),
        p + "ln_2.scale": (d,),
        p + "ln_2.bias": (d,),
        p + "mlp.c_fc.kernel": (d, 4 * d),
        p + "mlp.c_fc.bias": (4 * d,),
        p + "mlp.c_proj.kernel": (4 * d, d),
        p + "mlp.c_proj.bias": (d,),
      }
    )
  shapes["ln_f.scale"] = (d,)
  shapes["ln_f.bias"] = (d,)
  return shapes


def many_leaf_shapes(n: int, mixed: bool = False) -> dict[str, tuple[int, ...]]:
  """``n`` small leaves: all ``(64,)``, or (``mixed``) 64 to 100 elements, 1-D and 2-D."""
  if not mixed:
    return {f"l{i:05d}": (64,) for i in range(n)}
  return {f"l{i:05d}": ((64 + i % 37,) if i % 2 else (8, 8 + i % 5)) for i in range(n)}


def num_params(shapes: dict[str, tuple[int, ...]]) -> int:
  return int(sum(np.prod(s) for s in shapes.values()))


def make_tree(shapes: dict[str, tuple[int, ...]], dtype=jnp.float32, seed: int = 0) -> dict:
  """A dict of arrays of ``shapes``, values ~ N(0, 1e-2).

  Drawn on the host and copied to the device: drawn on the device, each new
  shape would compile its own random-number program (a tree of many shapes took
  tens of seconds to make).
  """
  rng = np.random.default_rng(seed)
  return {
    name: jnp.asarray((1e-2 * rng.standard_normal(shape, np.float32)).astype(dtype))
    for name, shape in shapes.items()
  }


def compile_train_step(tx: optax.GradientTransformation, params: Any, grads: Any):
  """``params, opt_state -> apply_updates(tx.update(grads))``, jitted with both donated.

  Returns:
    The compiled step and ``tx.init(params)``.
  """

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, grads).compile()
  return compiled, opt_state
