"""The tricks' switches: each compile-time trick of the room can be turned off while tracing.

Every trick is a choice of how XLA gets the kernel's one math, not of what it
computes; turned off, its code path runs the plain math it already has (the
one other platforms run). Which tricks are off is read while a program is
*traced*, from a context variable (:func:`without`), so a switch is local to
a thread or task and changes no program already traced.

The kernel's caches of jitted functions are keyed by the tricks that are off
(:func:`cache`): jax reuses a jitted function's trace for arguments of the
types it has seen, which would carry a trick's choice across the switch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

# One line per trick: what it is, and what turning it off runs instead.
TRICKS = types.MappingProxyType(
  {
    "bf16_barrier": "XLA:CPU: an optimization barrier before a bfloat16 norm (off: none).",
    "f16_two_output": (
      "XLA:CPU: a float16 norm as a two-output reduction in blocks (off: the plain reduction)."
    ),
    "stacked_scales": (
      "XLA:CPU: the per-leaf clips scale small leaves of one shape as stacks (off: leaf by leaf)."
    ),
    "opaque_indices": (
      "XLA:CPU: a stack's rows read at indices XLA cannot fold (off: at constant offsets)."
    ),
    "grouped_parts": (
      "A tree norm's small leaves reduced together, a few sums per tree (off: a sum per leaf)."
    ),
    "stacked_rules": (
      "XLA:CPU: the per-tensor rules run once on vectors of every leaf's scalars (off: per leaf)."
    ),
    "segment_parts": (
      "XLA:CPU: those vectors' small-leaf norms by one segment reduction (off: one per leaf)."
    ),
    "computed_once": (
      "The skip and non-finite flags computed in one kernel that every leaf reads (off: inline)."
    ),
    "cuda_norm": (
      "CUDA: the global 2-norm as one Pallas kernel, no conditional (off: XLA's reductions)."
    ),
    "cuda_packing": (
      "CUDA: that kernel's small leaves packed into one input (off: a kernel branch per leaf)."
    ),
  }
)

_OFF: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
  "jaxclip_tricks_off", default=frozenset()
)


def check_names(names: tuple[str, ...]) -> None:
  """Raises ``ValueError`` naming the first of ``names`` that is no trick, and the tricks."""
  for name in names:
    if name not in TRICKS:
      raise ValueError(f"unknown trick {name!r}; the tricks are: {', '.join(TRICKS)}")


def is_on(name: str) -> bool:
  """Whether the trick ``name`` is on for the programs traced now."""
  return name not in _OFF.get()


def without(*names: str) -> contextlib.AbstractContextManager[None]:
  """Programs traced in the block are built without the tricks ``names`` (and those already off).

  The names are checked here, before the block opens.
  """
  check_names(names)
  return _switched_off(frozenset(names))


@contextlib.contextmanager
def _switched_off(names: frozenset[str]) -> Iterator[None]:
  token = _OFF.set(_OFF.get() | names)
  try:
    yield
  finally:
    _OFF.reset(token)


def cache(maxsize: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """``functools.lru_cache(maxsize)`` keyed also by the tricks that are off.

  For the kernel's caches of jitted functions: each switch state gets its own
  function, whose jax trace cache then holds that state's programs only.
  """

  def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.lru_cache(maxsize=maxsize)
    def keyed(off: frozenset[str], *args: Any) -> Any:
      del off
      return fn(*args)

    @functools.wraps(fn)
    def cached(*args: Any) -> Any:
      return keyed(_OFF.get(), *args)

    return cached

  return decorate
