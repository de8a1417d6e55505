"""What the tests and the benchmarks run jaxclip on (not part of the installed package).

Both ``tests/`` and ``benchmarks/`` import these; neither imports the other's
modules for them:

* :mod:`workloads.every`: every transform factory of ``jaxclip.__all__``, with
  the arguments a test or a profile calls it with;
* :mod:`workloads.trees`: gradient trees (GPT-2's shapes, mixed leaves);
* :mod:`workloads.zoo`: models built from flax linen, flax nnx, equinox and
  plain JAX layers, with their per-example losses and synthetic batches;
* :mod:`workloads.xla_options`: the XLA options that programs compiled to be
  checked rather than timed use (the suite's ``XLA_FLAGS``, the zoo's
  initialisations).
"""
