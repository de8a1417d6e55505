"""Gradient transformations that clip: fixed thresholds, optax's clipping family, and
thresholds that adapt to the gradient's history.
"""

from jaxclip.transforms._adaptive import AdaGCState as AdaGCState
from jaxclip.transforms._adaptive import AdaptiveNormScaleState as AdaptiveNormScaleState
from jaxclip.transforms._adaptive import AdaptiveValueClipState as AdaptiveValueClipState
from jaxclip.transforms._adaptive import adagc as adagc
from jaxclip.transforms._adaptive import adaptive_norm_scale as adaptive_norm_scale
from jaxclip.transforms._adaptive import adaptive_value_clip as adaptive_value_clip
from jaxclip.transforms._autoclip import AutoClipState as AutoClipState
from jaxclip.transforms._autoclip import autoclip as autoclip
from jaxclip.transforms._fixed import ClipByGlobalNormState as ClipByGlobalNormState
from jaxclip.transforms._fixed import clip as clip
from jaxclip.transforms._fixed import clip_by_average_norm as clip_by_average_norm
from jaxclip.transforms._fixed import clip_by_global_norm as clip_by_global_norm
from jaxclip.transforms._fixed import clip_by_norm as clip_by_norm
from jaxclip.transforms._fixed import clip_by_value as clip_by_value
from jaxclip.transforms._keras import clipped as clipped
from jaxclip.transforms._per_tensor import LeafStats as LeafStats
from jaxclip.transforms._record import RecordNormsState as RecordNormsState
from jaxclip.transforms._record import record_norms as record_norms
from jaxclip.transforms._threshold import ThresholdSuggestion as ThresholdSuggestion
from jaxclip.transforms._threshold import suggest_threshold as suggest_threshold
from jaxclip.transforms._unitwise import adaptive_grad_clip as adaptive_grad_clip
from jaxclip.transforms._unitwise import clip_by_block_rms as clip_by_block_rms
from jaxclip.transforms._unitwise import unitwise_clip as unitwise_clip
from jaxclip.transforms._unitwise import unitwise_norm as unitwise_norm
from jaxclip.transforms._zclip import ZClipState as ZClipState
from jaxclip.transforms._zclip import zclip as zclip

__all__ = (
  "AdaGCState",
  "AdaptiveNormScaleState",
  "AdaptiveValueClipState",
  "AutoClipState",
  "ClipByGlobalNormState",
  "LeafStats",
  "RecordNormsState",
  "ThresholdSuggestion",
  "ZClipState",
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
  "record_norms",
  "suggest_threshold",
  "unitwise_clip",
  "unitwise_norm",
  "zclip",
)
