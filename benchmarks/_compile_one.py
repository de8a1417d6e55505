"""``python -m benchmarks._compile_one IMPL LEAVES MIXED``: print one compile time (s)."""

from __future__ import annotations

import sys

from benchmarks import _compile_cases

if __name__ == "__main__":
  impl, leaves, mixed = sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3]))
  print(f"{_compile_cases.compile_once(impl, leaves, mixed):.4f}")
