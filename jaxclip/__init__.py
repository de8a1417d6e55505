"""jaxclip: gradient clipping for JAX and optax, over any pytree.

Pure TensorFlow-style ops live in :mod:`jaxclip.ops`; everything at the top
level is an optax ``GradientTransformation`` (or a helper of optax's clipping
module) that chains with any optax optimizer.
"""

from jaxclip import ops as ops
from jaxclip._optax_compat import adaptive_grad_clip as adaptive_grad_clip
from jaxclip._optax_compat import clip_by_block_rms as clip_by_block_rms
from jaxclip._optax_compat import per_example_global_norm_clip as per_example_global_norm_clip
from jaxclip._optax_compat import per_example_layer_norm_clip as per_example_layer_norm_clip
from jaxclip._optax_compat import unitwise_clip as unitwise_clip
from jaxclip._optax_compat import unitwise_norm as unitwise_norm
from jaxclip._transforms import ClipByGlobalNormState as ClipByGlobalNormState
from jaxclip._transforms import clip as clip
from jaxclip._transforms import clip_by_average_norm as clip_by_average_norm
from jaxclip._transforms import clip_by_global_norm as clip_by_global_norm
from jaxclip._transforms import clip_by_norm as clip_by_norm
from jaxclip._transforms import clip_by_value as clip_by_value

__version__ = "0.1.0"

__all__ = (
    "ClipByGlobalNormState",
    "adaptive_grad_clip",
    "clip",
    "clip_by_average_norm",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "ops",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "unitwise_clip",
    "unitwise_norm",
)
