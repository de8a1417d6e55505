"""The kernel's compile-time tricks, by name, and a switch that turns them off.

jaxclip computes every norm with one math, but gives it to each compiler in
the form that compiles and runs fastest there: on XLA:CPU small leaves are
reduced together, scaled as stacks and read back at indices XLA cannot fold
(a tree of thousands of small leaves written leaf by leaf compiles for
minutes); on CUDA GPUs the global 2-norm is one Pallas kernel. Each such
trick changes the program, never its values. They were measured on the
machines of ``benchmarks/results/tricks.md`` and ``benchmarks/results/gpu.md``.
:data:`TRICKS` names each one with a line that says what it does, and
:func:`without` builds programs without some, to measure them on your machine.
"""

from __future__ import annotations

import contextlib

from jaxclip._kernel import _platform

TRICKS = _platform.TRICKS
"""Every trick's name, mapped to a one-line description (read-only)."""


def without(*names: str) -> contextlib.AbstractContextManager[None]:
  """A context under which programs traced are built without the tricks ``names``.

  Each trick (:data:`TRICKS`) is a choice of how the compiler gets the
  kernel's math, made when a program is traced: turned off, the program holds
  the plain math that the trick replaces (what other platforms run), with
  the same values. Use it to measure what a trick buys on your machine, as
  ``python -m benchmarks.tricks`` does (``benchmarks/results/tricks.md``), or
  to rule one out.

  ``jax.jit`` caches each function's trace: a function traced before with the
  same argument types keeps its program, even under a new ``jax.jit``. Trace
  a function made inside the block (a ``lambda``, an optax transform built
  there), or call ``jax.clear_caches()`` first. Blocks nest (the tricks off
  are those of every open block), and the switch is local to the thread or
  ``asyncio`` task that opens it.

  Args:
    names: names of :data:`TRICKS`.

  Returns:
    A context manager; inside it the tricks ``names`` are off.

  Raises:
    ValueError: if a name is not a trick's (raised by the call, before any
      block opens); the message lists the tricks.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jaxclip
    >>> tree = {f"b{i}": jnp.full((4,), i + 1.0) for i in range(3)}
    >>> def norm_program():
    ...   fn = jax.jit(lambda t: jaxclip.ops.global_norm(t))
    ...   return fn.lower(tree).as_text(), float(fn(tree))
    >>> grouped, value = norm_program()
    >>> with jaxclip.platform.without("grouped_parts"):
    ...   per_leaf, plain_value = norm_program()
    >>> grouped != per_leaf, plain_value == value, round(value, 4)
    (True, True, 7.4833)
    >>> sorted(jaxclip.platform.TRICKS)[:3]
    ['bf16_barrier', 'computed_once', 'cuda_norm']
  """
  return _platform.without(*names)


__all__ = ("TRICKS", "without")
