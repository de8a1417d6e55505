"""The options of one :func:`jaxclip.per_example_clipped_grad` function, checked once when
it is made, and the clip factors they give each unit of a batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxclip._kernel import _validation
from jaxclip._kernel._typing import AxisName
from jaxclip.privacy import _batching, _clip_batch, _clip_factors
from jaxclip.privacy._batching import rows


@dataclasses.dataclass(frozen=True)
class Options:
  """The checked options of one :func:`per_example_clipped_grad` function."""

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
  # Per call: the clip bound's groups of parameter leaves (_clip_batch.clip_groups).
  groups: _clip_batch.ClipGroups | None = None

  @property
  def per_group(self) -> bool:
    """Whether ``l2_norm_clip`` is a pytree: counts and norms per group of leaves."""
    return self.groups is not None and self.groups.per_group

  def group_shape(self) -> tuple[int, ...]:
    """The trailing shape of per-group counts and norms: ``(groups,)``, or ``()``."""
    return (len(self.groups.bounds),) if self.per_group else ()

  def factors(
    self, norms: jax.Array, mask: jax.Array | None, floor: float | None = None
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Each unit's (and group's) weight, 0 where masked or not finite, and the counts
    ``(scaled down, not finite)``."""
    bound = self.groups.bound(norms.dtype)
    weights, count = _clip_factors.scale_factors(norms, bound, mask, self.normalize, floor)
    if mask is not None:
      weights = jnp.where(rows(mask, weights), weights, 0)
    return weights, count

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
