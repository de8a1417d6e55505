"""Every public transform in the loops users write, generated from ``jaxclip.__all__``.

Each factory of :mod:`workloads.every` (so a transform added later is
covered the day it is added) is run:

* with its state donated (``jax.jit(..., donate_argnums=...)``), from an
  eager and from a jitted ``init``, for two steps against the same steps
  undonated;
* exported with ``jax.export`` under a symbolic dimension, and the exported
  program called at two sizes against ``jit``; the chain of every factory is
  also lowered for CUDA and TPU with that symbolic dimension;
* chained all together, in flax linen's ``TrainState`` under
  ``jax.jit(step, donate_argnums=0)``, in flax nnx's ``nnx.Optimizer`` under
  ``nnx.jit`` with the optimizer donated, and in an equinox loop under
  ``eqx.filter_jit(donate="all")``, each against the same steps written with
  optax alone.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax import export

from tests.helpers import assert_tree_allclose
from workloads import every

FACTORIES = every.factories()


def _params(rows: int = 3) -> dict:
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "w": jax.random.normal(k[0], (rows, 4)),
    "b": jax.random.normal(k[1], (4,)),
    "v": jax.random.normal(k[2], (rows,)),
  }


def _grads(params: dict, step: int) -> dict:
  """Gradients that change from step to step, one of them large (so clips act)."""
  scale = 10.0 ** (step + 1)
  return jax.tree.map(lambda x: scale * jnp.sin(x + step), params)


def _buffers(tree) -> list[int]:
  return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]


def _assert_no_shared_buffers(tree, what: str) -> None:
  buffers = _buffers(tree)
  shared = len(buffers) - len(set(buffers))
  assert not shared, f"{what}: {shared} leaves share a buffer with another leaf"


# ------------------------------------------------- donation and a symbolic size


def _spec(rows) -> dict:
  """The shapes of :func:`_params` with ``rows`` (an int or a symbolic dimension) for its rows."""
  shapes = {"w": (rows, 4), "b": (4,), "v": (rows,)}
  return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("name", FACTORIES)
def test_donated_and_exported_steps_equal_the_jitted_ones(name):
  """Per factory, against two steps of ``jax.jit(tx.update)`` at 2 and 7 rows:

  * donated (``donate_argnums=1``) at 2 rows, from an eager and from a jitted
    ``init``: equal bit for bit, and no two state leaves share a buffer;
  * exported with the rows symbolic (``jax.export.symbolic_shape``) and
    called at 2 and 7 rows: equal to float rounding.
  """
  tx = every.build(name)
  plain, donated = jax.jit(tx.update), jax.jit(tx.update, donate_argnums=1)
  (rows,) = export.symbolic_shape("rows")
  exported = export.export(plain)(_spec(rows), jax.eval_shape(tx.init, _spec(rows)), _spec(rows))
  for n in (2, 7):
    params = _params(n)
    _assert_no_shared_buffers(tx.init(params), f"{name}'s init")
    _assert_no_shared_buffers(jax.jit(tx.init)(params), f"{name}'s jitted init")
    want = got = tx.init(params)
    donated_state = jax.jit(tx.init)(params) if n == 2 else None
    for step in range(2):
      grads = _grads(params, step)
      (want_updates, want), (got_updates, got) = (
        plain(grads, want, params),
        exported.call(grads, got, params),
      )
      assert_tree_allclose(got_updates, want_updates, rtol=1e-6)
      assert_tree_allclose(got, want, rtol=1e-6)
      if donated_state is not None:
        donated_updates, donated_state = donated(grads, donated_state, params)
        _assert_no_shared_buffers(donated_state, f"{name}'s donated state after step {step}")
        assert_tree_allclose(donated_updates, want_updates, rtol=0)
        assert_tree_allclose(donated_state, want, rtol=0)


def test_every_transform_exports_for_gpu_and_tpu_with_a_symbolic_size():
  """The chain of every factory lowers for CUDA and TPU with a symbolic size (from this CPU)."""
  tx = _every_transform()
  (rows,) = export.symbolic_shape("rows")
  spec = _spec(rows)
  exported = export.export(jax.jit(tx.update), platforms=("cuda", "tpu"))(
    spec, jax.eval_shape(tx.init, spec), spec
  )
  assert exported.platforms == ("cuda", "tpu")
  assert any("rows" in str(a) for a in exported.in_avals)


# ------------------------------------------------------------ flax TrainState


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.tanh(nn.Dense(8)(x)))


def _data(n: int = 6) -> tuple[jax.Array, jax.Array]:
  x = jax.random.normal(jax.random.key(1), (n, 5))
  return 30.0 * x, jnp.cos(x[:, :3])


def _every_transform() -> optax.GradientTransformation:
  """Every factory in one chain before SGD: one program per loop, whatever their number.

  Compiling each factory's loop on its own would cost the suite a minute;
  :func:`test_state_can_be_donated` pins a failure to its factory.
  """
  return optax.chain(*(every.build(name) for name in FACTORIES), optax.sgd(0.1))


def test_flax_train_state_under_donation():
  model, (x, y) = _Mlp(), _data()
  params = model.init(jax.random.key(0), x)
  tx = _every_transform()
  loss = lambda p: jnp.mean((model.apply(p, x) - y) ** 2)

  @jax.jit
  def optax_step(params, opt_state):
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def donated_step(state):
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  donated_step = jax.jit(donated_step, donate_argnums=0)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  want = (params, tx.init(params))
  for _ in range(2):
    want = optax_step(*want)
    state = donated_step(state)
  assert_tree_allclose(state.params, want[0], rtol=1e-6)
  assert_tree_allclose(state.opt_state, want[1], rtol=1e-6)
  assert int(state.step) == 2


# --------------------------------------------------------------- nnx.Optimizer


class _NnxMlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(5, 8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.tanh(self.hidden(x)))


def test_nnx_optimizer_under_donation():
  x, y = _data()
  model = _NnxMlp(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = _every_transform()
  loss_of_params = lambda p: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

  @jax.jit
  def optax_step(params, opt_state):
    updates, opt_state = tx.update(jax.grad(loss_of_params)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  want = (params, tx.init(params))
  for _ in range(2):
    want = optax_step(*want)

  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)

  for _ in range(2):
    step(model, optimizer)
  assert_tree_allclose(nnx.state(model, nnx.Param), want[0], rtol=1e-6)
  assert_tree_allclose(jax.tree.leaves(optimizer.opt_state), jax.tree.leaves(want[1]), rtol=1e-6)


# ------------------------------------------------------------ an equinox loop


def test_equinox_loop_under_donation():
  x, y = _data()
  model = eqx.nn.MLP(5, 3, 8, depth=1, activation=jnp.tanh, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  tx = _every_transform()

  def loss(params):
    model = eqx.combine(params, static)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)

  @jax.jit
  def optax_step(params, opt_state):
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  @eqx.filter_jit(donate="all")
  def step(model, opt_state):
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state

  want = (params, tx.init(params))
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  for _ in range(2):
    want = optax_step(*want)
    model, opt_state = step(model, opt_state)
  assert_tree_allclose(eqx.filter(model, eqx.is_inexact_array), want[0], rtol=1e-6)
  assert_tree_allclose(opt_state, want[1], rtol=1e-6)
