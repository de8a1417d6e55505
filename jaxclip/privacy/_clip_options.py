"""The options of one :func:`jaxclip.per_example_clipped_grad` function, checked once when
it is made."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxclip._kernel import _validation
from jaxclip._kernel._typing import AxisName
from jaxclip.privacy import _batching, _clip_batch


@dataclasses.dataclass(frozen=True)
class Options:
  """The checked options of one :func:`per_example_clipped_grad` function: its arguments,
  nothing of a call (each call's clip is a value of its own, a
  :class:`jaxclip.privacy._clip_factors.Clip`, passed down)."""

  loss_fn: Callable[..., Any]
  l2_norm_clip: jax.typing.ArrayLike
  microbatch_size: int | None
  batch_argnums: tuple[int, ...] | None
  keep_batch_dim: bool
  spmd_axis_name: AxisName | None
  axis_name: AxisName | None
  has_aux: bool
  method: str
  return_norms: bool
  group_size: int
  normalize: Any = None
  return_num_nonfinite: bool = False
  measure: bool = True

  @classmethod
  def checked(
    cls,
    loss_fn: Callable[..., Any],
    l2_norm_clip: jax.typing.ArrayLike,
    methods: Sequence[str],
    **kwargs: Any,
  ) -> Options:
    """The options, or a ``ValueError`` (``TypeError``) naming the first bad one."""
    _clip_batch.check_clip(l2_norm_clip)
    _clip_batch.check_normalize(kwargs["normalize"], l2_norm_clip)
    micro, group = kwargs["microbatch_size"], kwargs["group_size"]
    if micro is not None:
      micro = _validation.check_size(micro, "microbatch_size", static="it fixes a shape")
    group = _validation.check_size(group, "group_size", static="it fixes a shape")
    kwargs.update(microbatch_size=micro, group_size=group)
    measure = kwargs.get("measure", True)
    if not isinstance(measure, (bool, np.bool_)):
      raise TypeError(f"measure must be a bool, got {measure!r}.")
    kwargs["measure"] = bool(measure)
    if micro is not None and micro % group:
      raise ValueError(
        f"microbatch_size={micro} must be a multiple of "
        f"group_size={group}: each chunk holds whole groups."
      )
    nums = _batching.argnums(kwargs["batch_argnums"])
    if nums is not None:
      if not nums or any(i < 1 for i in nums):
        raise ValueError(
          f"batch_argnums must name arguments after params (1, 2, ...), got {nums!r}."
        )
      kwargs["batch_argnums"] = nums
    if kwargs["method"] not in methods:
      raise ValueError(
        f"method must be one of {', '.join(map(repr, methods))}, got {kwargs['method']!r}."
      )
    return cls(loss_fn, l2_norm_clip, **kwargs)
