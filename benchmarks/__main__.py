"""``python -m benchmarks``: see :mod:`benchmarks._main`."""

from benchmarks._main import main

if __name__ == "__main__":
  main()
