"""Per-leaf clips on a GPU: step time, compile time and conditionals of one checkout.

  python3 benchmarks/gpu_rescue.py CHECKOUT_DIR LABEL   (CHECKOUT_DIR holds jaxclip/)

Run on an H200 (benchmarks/results/gpu.md) for main, a lax.cond per leaf and one per tree.
"""

import json
import sys
import time

sys.path.insert(0, sys.argv[1])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxclip  # noqa: E402

rng = np.random.default_rng(0)
shapes = []
for i in range(40):
  c = 64 * (1 + i % 4)
  shapes += [(3, 3, c, c), (c,), (c,), (c,)]
shapes += [(1000, 512), (512,), (50000, 256)]
tree = [jnp.asarray(rng.normal(size=s) * 0.01, jnp.float32) for s in shapes]
nbytes = sum(x.size * 4 for x in tree)
out = {
  "variant": sys.argv[2],
  "leaves": len(tree),
  "MB": nbytes / 1e6,
  "device": str(jax.devices()[0]),
}
txs = {
  "scale(0.5)": None,
  "clip_by_norm": jaxclip.clip_by_norm(1.0),
  "clip_by_block_rms": jaxclip.clip_by_block_rms(0.5),
  "adaptive_grad_clip": jaxclip.adaptive_grad_clip(0.01),
  "clip_by_global_norm": jaxclip.clip_by_global_norm(1.0),
}
for name, tx in txs.items():
  if tx is None:
    f = jax.jit(lambda g, p: jax.tree.map(lambda v: v * 0.5, g))
  else:
    st = tx.init(tree)
    f = jax.jit(lambda g, p, tx=tx, st=st: tx.update(g, st, p)[0])
  t0 = time.perf_counter()
  c = f.lower(tree, tree).compile()
  ct = time.perf_counter() - t0
  conds = c.as_text().count(" conditional(")
  for _ in range(20):
    r = c(tree, tree)
  jax.block_until_ready(r)
  best = []
  for _rep in range(5):
    t0 = time.perf_counter()
    for _ in range(100):
      r = c(tree, tree)
    jax.block_until_ready(r)
    best.append((time.perf_counter() - t0) / 100 * 1e6)
  # the rescue taken: one leaf with an entry whose square overflows
  bad = list(tree)
  bad[1] = bad[1].at[0].set(3e30)
  r = c(bad, tree)
  jax.block_until_ready(r)
  t0 = time.perf_counter()
  for _ in range(100):
    r = c(bad, tree)
  jax.block_until_ready(r)
  slow = (time.perf_counter() - t0) / 100 * 1e6
  finite = bool(all(jnp.all(jnp.isfinite(x)) for x in r))
  out[name] = {
    "compile_s": round(ct, 2),
    "us": round(min(best), 1),
    "us_rescue": round(slow, 1),
    "conditionals": conds,
    "rescued_finite": finite,
  }
  print(name, out[name], flush=True)
print(json.dumps(out))
