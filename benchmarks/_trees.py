"""Synthetic gradient trees: GPT-2-small's parameter shapes and many-leaf trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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
  """A dict of arrays of ``shapes``, values ~ N(0, 1e-2), made on device."""
  key = jax.random.key(seed)
  return {
    name: (1e-2 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
    for i, (name, shape) in enumerate(shapes.items())
  }
