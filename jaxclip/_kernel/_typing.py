"""Type aliases shared by jaxclip's modules."""

import jax

# A hyperparameter or leaf: a Python number, NumPy or JAX array (traced too).
ArrayLike = jax.typing.ArrayLike
