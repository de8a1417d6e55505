"""jaxclip: gradient clipping for JAX and optax, over any pytree.

Pure TensorFlow-style ops live in :mod:`jaxclip.ops`, and the switch for the
kernel's compile-time tricks in :mod:`jaxclip.platform`; everything else at
the top level is an optax ``GradientTransformation`` (or a helper of optax's
clipping module) that chains with any optax optimizer.
"""

from jaxclip import ops as ops
from jaxclip import platform as platform
from jaxclip.privacy import DPSGD as DPSGD
from jaxclip.privacy import DPNoiseState as DPNoiseState
from jaxclip.privacy import GhostLeafPlan as GhostLeafPlan
from jaxclip.privacy import GhostPlan as GhostPlan
from jaxclip.privacy import PoissonBatch as PoissonBatch
from jaxclip.privacy import PrivacyAccountant as PrivacyAccountant
from jaxclip.privacy import calibrate_noise as calibrate_noise
from jaxclip.privacy import dp_epsilon as dp_epsilon
from jaxclip.privacy import dp_noise as dp_noise
from jaxclip.privacy import ghost_plan as ghost_plan
from jaxclip.privacy import per_example_clipped_grad as per_example_clipped_grad
from jaxclip.privacy import per_example_global_norm_clip as per_example_global_norm_clip
from jaxclip.privacy import per_example_layer_norm_clip as per_example_layer_norm_clip
from jaxclip.privacy import poisson_batch as poisson_batch
from jaxclip.privacy import quantile_clip_norm_update as quantile_clip_norm_update
from jaxclip.skipping import SkipAboveState as SkipAboveState
from jaxclip.skipping import SkipNonfiniteState as SkipNonfiniteState
from jaxclip.skipping import SkipOnSpikeState as SkipOnSpikeState
from jaxclip.skipping import ZeroNonfiniteState as ZeroNonfiniteState
from jaxclip.skipping import skip_above as skip_above
from jaxclip.skipping import skip_bad_microbatches as skip_bad_microbatches
from jaxclip.skipping import skip_nonfinite as skip_nonfinite
from jaxclip.skipping import skip_on_spike as skip_on_spike
from jaxclip.skipping import zero_nonfinite as zero_nonfinite
from jaxclip.transforms import AdaGCState as AdaGCState
from jaxclip.transforms import AdaptiveNormScaleState as AdaptiveNormScaleState
from jaxclip.transforms import AdaptiveValueClipState as AdaptiveValueClipState
from jaxclip.transforms import AutoClipState as AutoClipState
from jaxclip.transforms import ClipByGlobalNormState as ClipByGlobalNormState
from jaxclip.transforms import LeafStats as LeafStats
from jaxclip.transforms import RecordNormsState as RecordNormsState
from jaxclip.transforms import ThresholdSuggestion as ThresholdSuggestion
from jaxclip.transforms import ZClipState as ZClipState
from jaxclip.transforms import adagc as adagc
from jaxclip.transforms import adaptive_grad_clip as adaptive_grad_clip
from jaxclip.transforms import adaptive_norm_scale as adaptive_norm_scale
from jaxclip.transforms import adaptive_value_clip as adaptive_value_clip
from jaxclip.transforms import autoclip as autoclip
from jaxclip.transforms import clip as clip
from jaxclip.transforms import clip_by_average_norm as clip_by_average_norm
from jaxclip.transforms import clip_by_block_rms as clip_by_block_rms
from jaxclip.transforms import clip_by_global_norm as clip_by_global_norm
from jaxclip.transforms import clip_by_norm as clip_by_norm
from jaxclip.transforms import clip_by_value as clip_by_value
from jaxclip.transforms import clipped as clipped
from jaxclip.transforms import record_norms as record_norms
from jaxclip.transforms import suggest_threshold as suggest_threshold
from jaxclip.transforms import unitwise_clip as unitwise_clip
from jaxclip.transforms import unitwise_norm as unitwise_norm
from jaxclip.transforms import zclip as zclip

__version__ = "0.2.0"

__all__ = (
  "AdaGCState",
  "AdaptiveNormScaleState",
  "AdaptiveValueClipState",
  "AutoClipState",
  "ClipByGlobalNormState",
  "DPSGD",
  "DPNoiseState",
  "GhostLeafPlan",
  "GhostPlan",
  "LeafStats",
  "PoissonBatch",
  "PrivacyAccountant",
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
  "calibrate_noise",
  "clip",
  "clip_by_average_norm",
  "clip_by_block_rms",
  "clip_by_global_norm",
  "clip_by_norm",
  "clip_by_value",
  "clipped",
  "dp_epsilon",
  "dp_noise",
  "ghost_plan",
  "ops",
  "per_example_clipped_grad",
  "per_example_global_norm_clip",
  "per_example_layer_norm_clip",
  "platform",
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
