"""The zoo's plain-JAX models: one stacked pytree of layers, under lax.scan or in a Python loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from workloads.zoo import _common


def _stacked_params(cfg: dict) -> dict:
  d, f, n, v = cfg["d"], 4 * cfg["d"], cfg["layers"], cfg["vocab"]
  init = jax.nn.initializers.lecun_normal()
  ks = jax.random.split(jax.random.key(0), 4)
  return {
    "embed": 0.02 * jax.random.normal(ks[0], (v, d)),
    "layers": {
      "scale": jnp.ones((n, d)),
      "w_in": init(ks[1], (n, d, f)),
      "b_in": jnp.zeros((n, f)),
      "w_out": 0.5 * init(ks[2], (n, f, d)),
    },
    "head": init(ks[3], (d, v)),
  }


def _stacked_layer(h: jax.Array, layer: dict) -> jax.Array:
  x = jax.nn.standardize(h, axis=-1) * layer["scale"]
  return h + jax.nn.gelu(x @ layer["w_in"] + layer["b_in"]) @ layer["w_out"]


def _jax_stacked(size: str, loop: bool) -> _common.Model:
  cfg = _common._LM[size]

  def loss_fn(params, x, y):
    h = params["embed"][x]
    if loop:
      for i in range(cfg["layers"]):
        h = _stacked_layer(h, jax.tree.map(lambda w, i=i: w[i], params["layers"]))
    else:
      h, _ = jax.lax.scan(lambda h, layer: (_stacked_layer(h, layer), None), h, params["layers"])
    return _common._xent(h @ params["head"], y)

  how = "a Python loop over static slices w[l]" if loop else "jax.lax.scan"
  return _common.Model(
    "jax_loop_mlp" if loop else "jax_scan_mlp",
    f"plain JAX: token embedding (E[ids]), {cfg['layers']} residual MLP blocks "
    f"(standardize * scale, GELU MLP of {4 * cfg['d']}) whose weights are one "
    f"stacked pytree applied by {how}, Dense head; vocab {cfg['vocab']}, "
    f"d {cfg['d']}, T {cfg['seq']}",
    _common._run_once(lambda: _stacked_params(cfg)),
    loss_fn,
    _common._tokens(cfg),
  )
