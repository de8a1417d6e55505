"""Pure clip ops over pytrees, with TensorFlow's names and formulas.

>>> import jax.numpy as jnp
>>> from jaxclip import ops
>>> ops.clip_by_global_norm({'w': jnp.array([3., 4.])}, 1.0)[1]
Array(5., dtype=float32)
"""

from jaxclip._ops import clip_by_average_norm as clip_by_average_norm
from jaxclip._ops import clip_by_global_norm as clip_by_global_norm
from jaxclip._ops import clip_by_norm as clip_by_norm
from jaxclip._ops import clip_by_value as clip_by_value
from jaxclip._ops import global_norm as global_norm

__all__ = (
  "clip_by_average_norm",
  "clip_by_global_norm",
  "clip_by_norm",
  "clip_by_value",
  "global_norm",
)
