"""Test configuration: strict dtype promotion catches silent upcasts."""

import jax
import pytest


@pytest.fixture
def strict_promotion():
  """Runs a test with ``jax_numpy_dtype_promotion='strict'``."""
  with jax.numpy_dtype_promotion("strict"):
    yield
