"""The one norm kernel behind every jaxclip op and transform.

Everything that measures a gradient goes through this folder:

* sums of squares accumulate in float32 whatever the leaf dtype (float64 for
  float64 leaves under ``jax_enable_x64``), within a leaf *and* across leaves,
  so bfloat16 trees do not lose precision and float16 trees do not overflow;
* the square root has a custom JVP whose tangent is zero at zero, so
  ``jax.grad`` through any clip is finite at an all-zero input;
* the clip factor ``max_norm / max(norm, max_norm)`` is written so that a zero
  threshold with a zero norm gives ``0``, an infinite threshold gives ``1``
  and a non-finite norm gives ``nan`` (the failure stays visible);
* scaling a half-precision leaf multiplies in float32 and casts back, so the
  product cannot overflow; under ``jit`` XLA fuses the casts into the scale,
  so no float32 copy of the leaf is materialised.

The rooms:

* ``_dtypes``: where sums accumulate and products are formed; saturation;
* ``_terms``: the elementwise terms of a norm (``|x|**2``, ``|x|``), the safe
  square root, the axes reduced over;
* ``_powers``: exact scaling by powers of two;
* ``_rescue``: norms that neither overflow nor underflow (a fast sum, rescued
  under one ``lax.cond`` where it cannot be trusted);
* ``_leaf_norms``: one leaf's norm, each leaf's share of a tree's;
* ``_scale``: the safe factors (:func:`clip_scale`, :func:`safe_divide`) and
  how a leaf is multiplied by one;
* ``_leaf_scale``: each leaf times a function of its own norm
  (:func:`scale_by_leaf_norms`);
* ``_per_example``: each example's norm over a batch's leaves.

Callers read every name from here (``_numerics.leaf_norm``).
"""

from jaxclip._kernel._numerics._dtypes import accumulation_dtype as accumulation_dtype
from jaxclip._kernel._numerics._dtypes import as_array as as_array
from jaxclip._kernel._numerics._dtypes import compute_dtype as compute_dtype
from jaxclip._kernel._numerics._dtypes import hparam_float32 as hparam_float32
from jaxclip._kernel._numerics._dtypes import saturate as saturate
from jaxclip._kernel._numerics._dtypes import saturated_float32 as saturated_float32
from jaxclip._kernel._numerics._dtypes import tree_accumulation_dtype as tree_accumulation_dtype
from jaxclip._kernel._numerics._dtypes import upcast_for_accumulation as upcast_for_accumulation
from jaxclip._kernel._numerics._leaf_norms import count_sum as count_sum
from jaxclip._kernel._numerics._leaf_norms import leaf_norm as leaf_norm
from jaxclip._kernel._numerics._leaf_norms import leaf_norm_shares as leaf_norm_shares
from jaxclip._kernel._numerics._leaf_norms import leaf_sumsq as leaf_sumsq
from jaxclip._kernel._numerics._leaf_scale import scale_by_leaf_norms as scale_by_leaf_norms
from jaxclip._kernel._numerics._per_example import ScaledNorms as ScaledNorms
from jaxclip._kernel._numerics._per_example import per_example_norms as per_example_norms
from jaxclip._kernel._numerics._per_example import (
  per_example_scaled_norms as per_example_scaled_norms,
)
from jaxclip._kernel._numerics._powers import combine_scaled as combine_scaled
from jaxclip._kernel._numerics._powers import scale_exponent as scale_exponent
from jaxclip._kernel._numerics._powers import scaled_down as scaled_down
from jaxclip._kernel._numerics._powers import scaled_norm as scaled_norm
from jaxclip._kernel._numerics._powers import times_pow2 as times_pow2
from jaxclip._kernel._numerics._rescue import any_needs_rescaling as any_needs_rescaling
from jaxclip._kernel._numerics._rescue import leaf_norm_rescued as leaf_norm_rescued
from jaxclip._kernel._numerics._rescue import needs_rescaling as needs_rescaling
from jaxclip._kernel._numerics._rescue import rescued_norm as rescued_norm
from jaxclip._kernel._numerics._scale import apply_scale as apply_scale
from jaxclip._kernel._numerics._scale import clip_scale as clip_scale
from jaxclip._kernel._numerics._scale import computed_once as computed_once
from jaxclip._kernel._numerics._scale import safe_divide as safe_divide
from jaxclip._kernel._numerics._scale import scale_entries_above as scale_entries_above
from jaxclip._kernel._numerics._terms import Axes as Axes
from jaxclip._kernel._numerics._terms import abs_sq as abs_sq
from jaxclip._kernel._numerics._terms import constant_size_of as constant_size_of
from jaxclip._kernel._numerics._terms import kept_shape as kept_shape
from jaxclip._kernel._numerics._terms import max_term as max_term
from jaxclip._kernel._numerics._terms import norm_op as norm_op
from jaxclip._kernel._numerics._terms import norm_term as norm_term
from jaxclip._kernel._numerics._terms import safe_abs as safe_abs
from jaxclip._kernel._numerics._terms import safe_sqrt as safe_sqrt
