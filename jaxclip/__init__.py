"""jaxclip: gradient clipping for JAX and optax, over any pytree.

Pure TensorFlow-style ops live in :mod:`jaxclip.ops`; everything at the top
level is an optax ``GradientTransformation`` (or a helper of optax's clipping
module) that chains with any optax optimizer.
"""

from jaxclip import ops as ops
from jaxclip._accumulation import skip_bad_microbatches as skip_bad_microbatches
from jaxclip._autoclip import AutoClipState as AutoClipState
from jaxclip._autoclip import autoclip as autoclip
from jaxclip._ghost_plan import GhostLeafPlan as GhostLeafPlan
from jaxclip._ghost_plan import GhostPlan as GhostPlan
from jaxclip._ghost_plan import ghost_plan as ghost_plan
from jaxclip._keras import clipped as clipped
from jaxclip._optax_compat import adaptive_grad_clip as adaptive_grad_clip
from jaxclip._optax_compat import clip_by_block_rms as clip_by_block_rms
from jaxclip._optax_compat import per_example_global_norm_clip as per_example_global_norm_clip
from jaxclip._optax_compat import per_example_layer_norm_clip as per_example_layer_norm_clip
from jaxclip._optax_compat import unitwise_clip as unitwise_clip
from jaxclip._optax_compat import unitwise_norm as unitwise_norm
from jaxclip._per_example import per_example_clipped_grad as per_example_clipped_grad
from jaxclip._poisson import PoissonBatch as PoissonBatch
from jaxclip._poisson import poisson_batch as poisson_batch
from jaxclip._quantile import quantile_clip_norm_update as quantile_clip_norm_update
from jaxclip._record import RecordNormsState as RecordNormsState
from jaxclip._record import record_norms as record_norms
from jaxclip._robust import SkipAboveState as SkipAboveState
from jaxclip._robust import SkipNonfiniteState as SkipNonfiniteState
from jaxclip._robust import ZeroNonfiniteState as ZeroNonfiniteState
from jaxclip._robust import skip_above as skip_above
from jaxclip._robust import skip_nonfinite as skip_nonfinite
from jaxclip._robust import zero_nonfinite as zero_nonfinite
from jaxclip._spike import SkipOnSpikeState as SkipOnSpikeState
from jaxclip._spike import skip_on_spike as skip_on_spike
from jaxclip._stable import AdaGCState as AdaGCState
from jaxclip._stable import AdaptiveNormScaleState as AdaptiveNormScaleState
from jaxclip._stable import AdaptiveValueClipState as AdaptiveValueClipState
from jaxclip._stable import adagc as adagc
from jaxclip._stable import adaptive_norm_scale as adaptive_norm_scale
from jaxclip._stable import adaptive_value_clip as adaptive_value_clip
from jaxclip._threshold import ThresholdSuggestion as ThresholdSuggestion
from jaxclip._threshold import suggest_threshold as suggest_threshold
from jaxclip._transforms import ClipByGlobalNormState as ClipByGlobalNormState
from jaxclip._transforms import clip as clip
from jaxclip._transforms import clip_by_average_norm as clip_by_average_norm
from jaxclip._transforms import clip_by_global_norm as clip_by_global_norm
from jaxclip._transforms import clip_by_norm as clip_by_norm
from jaxclip._transforms import clip_by_value as clip_by_value
from jaxclip._zclip import ZClipState as ZClipState
from jaxclip._zclip import zclip as zclip

__version__ = "0.2.0"

__all__ = (
  "AdaGCState",
  "AdaptiveNormScaleState",
  "AdaptiveValueClipState",
  "AutoClipState",
  "ClipByGlobalNormState",
  "GhostLeafPlan",
  "GhostPlan",
  "PoissonBatch",
  "RecordNormsState",
  "SkipAboveState",
  "SkipNonfiniteState",
  "SkipOnSpikeState",
  "ThresholdSuggestion",
  "ZClipState",
  "ZeroNonfiniteState",
  "adagc",
  "adaptive_grad_clip",
  "adaptive_norm_scale",
  "adaptive_value_clip",
  "autoclip",
  "clip",
  "clip_by_average_norm",
  "clip_by_block_rms",
  "clip_by_global_norm",
  "clip_by_norm",
  "clip_by_value",
  "clipped",
  "ghost_plan",
  "ops",
  "per_example_clipped_grad",
  "per_example_global_norm_clip",
  "per_example_layer_norm_clip",
  "poisson_batch",
  "quantile_clip_norm_update",
  "record_norms",
  "skip_above",
  "skip_bad_microbatches",
  "skip_nonfinite",
  "skip_on_spike",
  "suggest_threshold",
  "unitwise_clip",
  "unitwise_norm",
  "zclip",
  "zero_nonfinite",
)
