"""jaxclip's performance benchmark: ``python -m benchmarks`` from the repo root.

It measures, side by side in one process:

* a jitted adam train step (donated buffers) on a GPT-2-small gradient tree,
  alone and with jaxclip's / optax's clipping chained in front;
* the standalone jitted clip (donated) against the machine's bandwidth floor
  (one read pass plus one in-place scale pass over one flat buffer of the same
  bytes), against optax and, when installed, torch's foreach
  ``clip_grad_norm_``;
* compile time against the number of leaves (10 to 5,000 small leaves), and of
  every other transform that touches each leaf at 5,000 leaves;
* clip time and GB/s against the tree size.

It prints a table and writes ``results.md`` and ``results.png``.
"""
