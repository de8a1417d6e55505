"""Type aliases shared by jaxclip's modules."""

from collections.abc import Hashable, Sequence
from typing import Any

import jax

# A hyperparameter or leaf: a Python number, NumPy or JAX array (traced too).
ArrayLike = jax.typing.ArrayLike

# A pytree of arrays (a gradient tree, an optimizer state).
PyTree = Any

# A mesh axis name, or a sequence of them (``shard_map``'s and ``pmap``'s axes).
AxisName = Hashable | Sequence[Hashable]
