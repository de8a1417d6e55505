"""The ghost cost model's platform constants: how ``method="auto"`` picks per layer.

:func:`jaxclip.per_example_clipped_grad` with ``method="auto"`` weighs each
layer's ghost rule against its per-example gradient. Only the XLA:CPU
weighing has been measured (``benchmarks/results/ghost_zoo.md``, ``benchmarks/results/ghost.md``),
so the constant below applies only to programs lowered for CPU.
"""

from __future__ import annotations

# On XLA:CPU the ghost rules pay (against method="vmap") where their norms
# cost at most this share of the flops of every per-example gradient: they
# also hold each layer's inputs and output gradients for a book-keeping
# matmul. The evidence is in benchmarks/results/ghost_zoo.md and ghost.md.
GHOST_FLOPS_SHARE_CPU = 0.9


def ghost_cost_model(platform: str | None) -> str:
  """How ``method="auto"`` weighs a layer's ghost rule against its per-example gradient.

  ``"flops"`` where the program is lowered for CPU (the share above);
  ``"memory"`` on any other platform (``None``: any but CPU): per layer, the
  form that holds fewer floats per example, which is why ghost norms are
  used.
  """
  return "flops" if platform == "cpu" else "memory"
