"""Transforms that skip or repair a step: non-finite gradients, norms above a bound,
loss spikes, bad microbatches. One scaffolding decides, zeroes and keeps the state.
"""

from jaxclip.skipping._accumulation import skip_bad_microbatches as skip_bad_microbatches
from jaxclip.skipping._rules import SkipAboveState as SkipAboveState
from jaxclip.skipping._rules import SkipNonfiniteState as SkipNonfiniteState
from jaxclip.skipping._rules import ZeroNonfiniteState as ZeroNonfiniteState
from jaxclip.skipping._rules import skip_above as skip_above
from jaxclip.skipping._rules import skip_nonfinite as skip_nonfinite
from jaxclip.skipping._rules import zero_nonfinite as zero_nonfinite
from jaxclip.skipping._spike import SkipOnSpikeState as SkipOnSpikeState
from jaxclip.skipping._spike import skip_on_spike as skip_on_spike

__all__ = (
  "SkipAboveState",
  "SkipNonfiniteState",
  "SkipOnSpikeState",
  "ZeroNonfiniteState",
  "skip_above",
  "skip_bad_microbatches",
  "skip_nonfinite",
  "skip_on_spike",
  "zero_nonfinite",
)
