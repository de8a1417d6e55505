"""Trains a small MLP FSDP-style on 8 virtual CPU devices, clipping with jaxclip.

    python examples/fsdp_training.py [--steps 150]

The parameters are sharded over a 2-D mesh ``('data', 'model')`` of 8 devices
(4 x 2): every weight matrix over both axes (FSDP over 'data', tensor
parallelism over 'model'), the first bias over 'model', the last bias
replicated. The batch is sharded over 'data'. The train step is plain
``jax.jit``: ``jaxclip.clip_by_global_norm`` sits in an optax chain exactly as
on one device, and XLA computes the global norm from per-device partial sums
with scalar all-reduces; the gradients are never gathered.

Before the forward pass each weight is gathered over 'data'
(``jax.sharding.reshard``), which is what FSDP does; the transpose of that
gather sums the gradients over 'data' and leaves each device its shard (a
reduce-scatter; XLA:CPU writes it as an all-reduce and a slice). Clipping
then works on those shards. The script checks that the compiled clipping step
holds only all-reduces of scalars (no all-gather), that parameters, gradients
and optimizer state keep their shardings, and that the loss goes down.

On several hosts, call ``jax.distributed.initialize()`` first and build the
mesh from ``jax.devices()`` (all hosts' devices); nothing else changes.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # must precede `import jax`
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, reshard  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxclip  # noqa: E402

IN, HIDDEN, OUT, BATCH = 32, 64, 8, 64

# Where each parameter lives: dim 0 of every matrix over 'data' (FSDP), the
# hidden dimension over 'model' (tensor parallelism).
SPECS = {
  "w1": P("data", "model"),  # (IN, HIDDEN)
  "b1": P("model"),  # (HIDDEN,)
  "w2": P("model", "data"),  # (HIDDEN, OUT)
  "b2": P(),  # (OUT,): replicated
}
# What the forward pass needs: the weights gathered over 'data' only.
COMPUTE_SPECS = {"w1": P(None, "model"), "w2": P("model", None)}


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
    "b1": jnp.zeros(HIDDEN),
    "w2": jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
    "b2": jnp.zeros(OUT),
  }


def loss_fn(params, x, y):
  w1 = reshard(params["w1"], COMPUTE_SPECS["w1"])  # FSDP all-gather over 'data'
  w2 = reshard(params["w2"], COMPUTE_SPECS["w2"])
  h = jnp.tanh(x @ w1 + params["b1"])  # (batch over 'data', hidden over 'model')
  # Contracting the 'model'-sharded hidden axis leaves partial sums; say
  # where the result goes (a psum over 'model').
  pred = jnp.einsum("bh,ho->bo", h, w2, out_sharding=P("data", None)) + params["b2"]
  return jnp.mean((pred - y) ** 2)


def make_data(key, steps):
  """A fixed random teacher network; each step draws a fresh batch."""
  kt, kv, kx = jax.random.split(key, 3)
  teacher = jax.random.normal(kt, (IN, HIDDEN)), jax.random.normal(kv, (HIDDEN, OUT))
  xs = jax.random.normal(kx, (steps, BATCH, IN))
  ys = jnp.tanh(xs @ teacher[0] / np.sqrt(IN)) @ teacher[1] / np.sqrt(HIDDEN) * 4.0
  return np.asarray(xs), np.asarray(ys)


def collectives(compiled_text):
  """How many of each collective the compiled HLO holds."""
  kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
  return {k: len(re.findall(rf"\s{k}(-start)?\(", compiled_text)) for k in kinds}


def all_reduces_are_scalars(compiled_text):
  """Whether every all-reduce result (or tuple of results) has shape ``[]``."""
  types = re.findall(r"=\s*(\([^=]*?\)|\S+)\s+all-reduce(?:-start)?\(", compiled_text)
  return all(dims == "" for t in types for dims in re.findall(r"\[([^\]]*)\]", t))


def main(steps: int, max_norm: float = 1.0) -> None:
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  print(f"{jax.device_count()} devices, mesh {dict(mesh.shape)}")
  tx = optax.chain(jaxclip.clip_by_global_norm(max_norm), optax.adamw(3e-3))

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  with jax.set_mesh(mesh):
    params = jax.tree.map(
      lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), init_params(jax.random.key(0)), SPECS
    )
    opt_state = tx.init(params)
    xs, ys = make_data(jax.random.key(1), steps)
    batch_sharding = NamedSharding(mesh, P("data", None))

    start, losses, norms = time.perf_counter(), [], []
    for step in range(steps):
      x, y = (jax.device_put(a[step], batch_sharding) for a in (xs, ys))
      params, opt_state, loss, grads = train_step(params, opt_state, x, y)
      losses.append(float(loss))
      norms.append(float(optax.tree.get(opt_state, "pre_clip_norm")))
      if step % max(steps // 5, 1) == 0 or step == steps - 1:
        print(f"step {step:4d}  loss {losses[-1]:.4f}  pre-clip grad norm {norms[-1]:.3f}")
    print(
      f"{steps} steps in {time.perf_counter() - start:.1f}s; "
      f"{np.mean(np.array(norms) > max_norm):.0%} of steps clipped"
    )

    # The gradients come back sharded like the parameters, and so do the
    # parameters and Adam's moments after the update.
    mu = optax.tree.get(opt_state, "mu")
    for name, spec in SPECS.items():
      want = NamedSharding(mesh, spec)
      for tree in (params, grads, mu):
        assert tree[name].sharding.is_equivalent_to(want, tree[name].ndim), (
          name,
          tree[name].sharding,
        )
    print("parameters, gradients and Adam moments keep their FSDP shardings")

    # The clipping step on its own: scalar all-reduces, never an all-gather.
    clip = jaxclip.clip_by_global_norm(max_norm)
    clip_hlo = jax.jit(lambda g: clip.update(g, clip.init(g))).lower(grads).compile().as_text()
    found = collectives(clip_hlo)
    scalars = all_reduces_are_scalars(clip_hlo)
    print(f"clipping step collectives: {found}; all-reduces of scalars only: {scalars}")
    assert found["all-reduce"] >= 1 and found["all-gather"] == 0 and scalars, found
    step_hlo = train_step.lower(params, opt_state, x, y).compile().as_text()
    print(
      f"whole train step collectives: {collectives(step_hlo)} (all-gathers: FSDP's "
      "weight gathers in the forward pass)"
    )

  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  assert last < 0.5 * first, (first, last)
  print(f"loss decreased: {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=150)
  main(parser.parse_args().steps)
