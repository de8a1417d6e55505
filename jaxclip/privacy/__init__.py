"""Per-example clipping for differentially private training: the clipped sum by
vmap or ghost norms, the plan of the ghost pass, Poisson batches, the
quantile-adaptive clip norm, the noise, the accounting and its accountant, and
DPSGD, which ties them together.
"""

from jaxclip.privacy._accountant import PrivacyAccountant as PrivacyAccountant
from jaxclip.privacy._accounting import dp_epsilon as dp_epsilon
from jaxclip.privacy._calibration import calibrate_noise as calibrate_noise
from jaxclip.privacy._dpsgd import DPSGD as DPSGD
from jaxclip.privacy._ghost_plan import GhostLeafPlan as GhostLeafPlan
from jaxclip.privacy._ghost_plan import GhostPlan as GhostPlan
from jaxclip.privacy._ghost_plan import ghost_plan as ghost_plan
from jaxclip.privacy._noise import DPNoiseState as DPNoiseState
from jaxclip.privacy._noise import dp_noise as dp_noise
from jaxclip.privacy._optax_clips import (
  per_example_global_norm_clip as per_example_global_norm_clip,
)
from jaxclip.privacy._optax_clips import per_example_layer_norm_clip as per_example_layer_norm_clip
from jaxclip.privacy._per_example import per_example_clipped_grad as per_example_clipped_grad
from jaxclip.privacy._poisson import PoissonBatch as PoissonBatch
from jaxclip.privacy._poisson import poisson_batch as poisson_batch
from jaxclip.privacy._quantile import quantile_clip_norm_update as quantile_clip_norm_update

__all__ = (
  "DPSGD",
  "DPNoiseState",
  "GhostLeafPlan",
  "GhostPlan",
  "PoissonBatch",
  "PrivacyAccountant",
  "calibrate_noise",
  "dp_epsilon",
  "dp_noise",
  "ghost_plan",
  "per_example_clipped_grad",
  "per_example_global_norm_clip",
  "per_example_layer_norm_clip",
  "poisson_batch",
  "quantile_clip_norm_update",
)
