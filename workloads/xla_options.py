"""The XLA options the suite compiles with, for the XLA it runs on (imports no JAX).

``tests/conftest.py`` sets :data:`FAST_COMPILE` as ``XLA_FLAGS`` before JAX
starts; programs run once (the zoo's initialisations) compile with it too.
XLA aborts the process on an ``XLA_FLAGS`` entry it does not know, so an
option that a newer XLA dropped is set only where it exists.
"""

from __future__ import annotations

import re
from importlib.metadata import version


def _jaxlib_before(major: int, minor: int) -> bool:
  numbers = re.match(r"(\d+)\.(\d+)", version("jaxlib"))
  return numbers is not None and tuple(map(int, numbers.groups())) < (major, minor)


# XLA:CPU's fusion emitters can be turned off up to jaxlib 0.10; jaxlib
# 0.11.2's XLA no longer has the option, nor has jaxlib 0.12.0.1's (it aborts on
# the flag). The three other options of FAST_COMPILE are read by jaxlib 0.10.2
# and 0.12.0.1 alike (each checked alone in XLA_FLAGS).
FUSION_EMITTERS_OPTION = _jaxlib_before(0, 11)

FAST_COMPILE = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
  "xla_cpu_parallel_codegen_split_count": 1,
  **({"xla_cpu_use_fusion_emitters": False} if FUSION_EMITTERS_OPTION else {}),
}

# What FAST_COMPILE turns off that changes a compiled program's structure (an
# elementwise op a kernel of its own, not a fusion): a test that reads a
# compiled program compiles it with this override, as users compile.
AS_USERS_COMPILE = {"xla_cpu_use_fusion_emitters": True} if FUSION_EMITTERS_OPTION else {}


def as_flags(options: dict) -> str:
  """``options`` as ``XLA_FLAGS`` entries."""
  return " ".join(f"--{k}={str(v).lower()}" for k, v in options.items())
