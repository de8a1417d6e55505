"""The norm kernel every op and transform stands on.

Float32 accumulation and the safe square root (the ``_numerics`` folder), what JAX's types
say about a leaf's layout across devices (``_sharding``), norms of trees spread
over devices (``_reduction``), the XLA:CPU choices selected by the platform a
program is lowered for (the ``_platform`` folder), hyperparameter and leaf checks
(``_validation``), shapes known before tracing and symbolic dimensions
(``_shapes``), TensorFlow's reading of a list of numbers as one tensor
(``_tf_args``, for ``jaxclip.ops``) and the ring buffer of norm histories
(``_history``). Private: nothing here is public API.
"""
