"""jaxclip's performance benchmark: ``python -m benchmarks`` from the repo root.

It measures, side by side in one process:

* a jitted adam train step (donated buffers) on a GPT-2-small gradient tree,
  alone and with jaxclip's / optax's clipping chained in front;
* a full jitted train step (forward, backward, clip, adam; donated buffers)
  of a ~20M-parameter GPT-like model in pure JAX on random tokens: adam
  alone, and behind jaxclip's / optax's ``clip_by_global_norm``, with each
  compiled step's temporary memory;
* the standalone jitted clip (donated) against the machine's bandwidth floor
  (one read pass plus one in-place scale pass over one flat buffer of the same
  bytes), against optax and, when installed, torch's foreach
  ``clip_grad_norm_``;
* compile time against the number of leaves (10 to 5,000 small leaves), and of
  every other transform that touches each leaf at 5,000 leaves;
* clip time and GB/s against the tree size.

It prints a table and writes ``results.md`` and ``results.png``.

Sections: ``train``, ``full-step``, ``standalone``, ``compile``, ``sizes``.
``--skip SECTION ...`` leaves some out; ``--only SECTION ...`` runs just
those, e.g. ``python -m benchmarks --only full-step --out /tmp/bench`` for the
full train step alone (``--out`` keeps the committed ``results.md``, written
by a run of every section, as it is). ``--quick`` makes every section a smoke
test (tiny sizes, a tiny model, few repetitions).

``python -m benchmarks.ghost`` is a separate benchmark of per-example clipping
(DP-SGD): the compiled memory and step time of
``jaxclip.per_example_clipped_grad`` with ``method="vmap"`` and, once it
exists, ``method="ghost"`` against a plain gradient, on a 0.85M-parameter
GPT with a tied output head; it writes ``ghost.md`` and ``ghost.png``.

Each writes its tables and figures into :data:`RESULTS` (``benchmarks/results/``)
unless given ``--out``.
"""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
