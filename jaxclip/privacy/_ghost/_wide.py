"""Ghost norms: half-precision values widened to float32.

Where the model holds bfloat16 or float16 values, the engine evaluates what
it sums in float32: :func:`widened` widens a value (exactly) and
:func:`wide_bind` evaluates an equation on widened values (the parameters'
pass, in :class:`jaxclip.privacy._ghost._capture.WideParamsPass`; the
book-keeping, in :mod:`jaxclip.privacy._ghost._book`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._types import HALF, is_half


def widened(x: Any) -> Any:
  """``x`` in float32 if it is bfloat16 or float16 (exact), else ``x``."""
  return x.astype(jnp.float32) if is_half(x) else x


class _Wide(NamedTuple):
  primitive: Any
  params: dict[str, Any]


def wide_bind(eqn: Any, vals: Sequence[Any]) -> list[Any]:
  """An equation evaluated on its inputs widened (:func:`widened`), a half-precision dtype
  among its parameters taken as float32; an equation that holds a jaxpr is evaluated in its
  own dtypes, its outputs widened."""
  if _jax.sub_jaxprs(eqn):
    narrow = [
      x.astype(v.aval.dtype) if is_half(v.aval) and x is not None else x
      for x, v in zip(vals, eqn.invars, strict=True)
    ]
    return [widened(x) for x in _jax.bind(eqn, narrow)]
  params = {
    k: jnp.dtype(jnp.float32) if isinstance(v, np.dtype) and v in HALF else v
    for k, v in eqn.params.items()
  }
  return _jax.bind(_Wide(eqn.primitive, params), [widened(x) for x in vals])
