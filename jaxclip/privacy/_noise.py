"""DP-SGD's Gaussian noise on the clipped sum, as an optax transform."""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from jaxclip._kernel import _numerics, _validation
from jaxclip.privacy import _clip_batch


class DPNoiseState(NamedTuple):
  """State of :func:`dp_noise`.

  Attributes:
    dp_noise_key: The raw data (``jax.random.key_data``, uint32) of the key
      the next step's noise comes from; each step splits it, uses one half
      and keeps the other. It is as secret as the training data: whoever
      reads it (in a checkpoint, say) can regenerate the noise and subtract
      it.
  """

  dp_noise_key: jax.Array


def _is_key(seed: Any) -> bool:
  return isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)


def secret_key_data() -> jax.Array:
  """Raw key data (uint32) of the default PRNG drawn from the operating system's entropy
  (:mod:`secrets`), never a constant. In a job of several processes every process draws and
  all take process 0's (:func:`_from_process_0`, a collective every process joins): a key
  drawn apart on each would give each process's replicas of the parameters their own noise,
  and the replicas would drift apart."""
  shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
  words = np.asarray([secrets.randbits(32) for _ in range(int(np.prod(shape)))], np.uint32)
  words = words.reshape(shape)
  if jax.process_count() > 1:
    words = _from_process_0(words)
  return jnp.asarray(words)


def _from_process_0(words: np.ndarray) -> np.ndarray:
  """Process 0's ``words`` on every process: a sum over the processes of process 0's words and
  the others' zeros, computed now even under a trace (``multihost_utils.broadcast_one_to_all``
  sets a mesh, which JAX refuses inside ``jit``: a ``dp_noise`` made in a traced function
  failed), on a mesh of its own whatever mesh the caller set (``jax.set_mesh``)."""
  devices = np.asarray(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = jax.sharding.Mesh(devices, ("processes", "local"), axis_types=auto)
  mine = words if jax.process_index() == 0 else np.zeros_like(words)
  # concrete even if made under a trace, and on this mesh whatever mesh the caller set
  with jax.ensure_compile_time_eval(), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    rows = multihost_utils.host_local_array_to_global_array(
      mine[None], mesh, jax.sharding.PartitionSpec("processes")
    )
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    total = jax.jit(lambda r: jnp.sum(r, axis=0, dtype=r.dtype), out_shardings=replicated)(rows)
    return np.asarray(total.addressable_data(0), np.uint32)


def _check_seed(seed: Any) -> None:
  if seed is None or _is_key(seed):
    if seed is not None and jnp.shape(seed) != ():
      raise ValueError(f"seed must be one PRNG key (shape ()), got keys of shape {seed.shape}.")
    return
  value = _validation.concrete_value(seed)
  if value is None:
    if not jnp.issubdtype(jnp.result_type(seed), jnp.integer):
      raise TypeError(f"seed must be an integer, got a traced {jnp.result_type(seed)}.")
    return
  if value.shape != () or value.dtype == np.bool_ or not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(
      "seed must be an int or a jax.random.key (the noise's secret seed), or None to draw "
      f"one from the OS's entropy; got {seed!r:.100}."
    )


def _sensitivity(l2_norm_clip: Any) -> jax.Array:
  """``S``: the root-sum-square of the clip norms (float32), one per leaf of ``l2_norm_clip``."""
  leaves = [_numerics.hparam_float32(c) for c in jax.tree.leaves(l2_norm_clip)]
  return jnp.sqrt(sum(c * c for c in leaves))


def _check_prefix(l2_norm_clip: Any, updates: Any) -> None:
  """Raises ``ValueError`` unless a pytree ``l2_norm_clip`` is a prefix of ``updates``."""
  if not jax.tree.leaves(l2_norm_clip) or jax.tree.structure(l2_norm_clip).num_nodes == 1:
    return  # one number: the whole tree's clip
  try:
    jax.tree.map(lambda c, sub: None, l2_norm_clip, updates)
  except ValueError as e:
    raise ValueError(
      "dp_noise's l2_norm_clip must be a pytree prefix of the updates (one clip norm per "
      f"layer or group, as given to per_example_clipped_grad): {e}"
    ) from None


def dp_noise(
  l2_norm_clip: Any,
  noise_multiplier: jax.typing.ArrayLike,
  *,
  seed: int | jax.Array | None = None,
  expected_batch_size: jax.typing.ArrayLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Adds DP-SGD's Gaussian noise to a clipped sum of per-example gradients.

  Its input is the sum of the batch's per-example gradients, each clipped to
  L2 norm :math:`C` (as :func:`jaxclip.per_example_clipped_grad` returns
  it). One example then moves the sum by at most the sensitivity :math:`S =
  C`, and every entry gets independent Gaussian noise of standard deviation
  :math:`z S`, :math:`z` the noise multiplier (Abadi et al.):

  .. math::

    \tilde g = \frac{1}{\bar B}\Big(\sum_{i} \mathrm{clip}_C(g_i)
    + \mathcal{N}\big(0, (z S)^2 I\big)\Big).

  With ``expected_batch_size`` :math:`\bar B` the result is divided by it
  (public, unlike the drawn size of a Poisson batch), so the optimizer sees
  a mean gradient; without it (``None``) the noisy sum comes out.

  **Per-layer clip norms.** ``l2_norm_clip`` may be a pytree prefix of the
  params, one clip norm :math:`C_l` per layer or group, as given to
  ``per_example_clipped_grad``: each group of an example's gradient is then
  at most :math:`C_l`, the whole at most :math:`S = (\sum_l C_l^2)^{1/2}`,
  and every entry gets noise of standard deviation :math:`z S`.

  **The noise.** It comes from a key in the state: each step splits it into
  the next step's key and this step's, which is split once more, one key per
  leaf. So the noise is fresh each step, independent across leaves, and the
  same ``seed`` gives the same noise.

  **The seed is a secret.** Noise that a reader can regenerate protects
  nothing: subtracting it recovers the clipped sum (Mironov, 2012). With
  ``seed=None`` (the default) the key is drawn from the operating system's
  entropy (Python's :mod:`secrets`) when the transform is made, so two
  runs add independent noise. In a job of several processes
  (``jax.distributed``) each process makes the transform, and all take
  process 0's key (a collective), so that every replica of the parameters
  gets the same noise; pass a seed (an int, or a
  ``jax.random.key``) drawn from a secret source to reproduce a run, never
  a constant in public code. The key lives in :class:`DPNoiseState`: a
  checkpoint holding it is as secret as the data.

  **Rounding after the noise.** The noise is drawn and added in float32 for
  bfloat16 and float16 leaves (at the leaf's own precision otherwise); the
  result is then cast to the dtype of the matching leaf of ``params`` when
  ``update`` is given them (else to the update's own dtype). So a
  float32 clipped sum of half-precision parameters (as
  :func:`jaxclip.per_example_clipped_grad` returns it) is rounded to bfloat16
  only once the noise is in it: one example's contribution is not rounded
  away or magnified before the noise hides it, and a float16 sum above
  65504 is not ``inf`` before the noise is added. Under ``jax.jit`` with
  sharded leaves the noise is a function of the key and of the leaf's shape
  alone (JAX's partitionable threefry, the default), so a replicated leaf
  gets the same noise on every device and a sharded one the noise of the
  whole array, whatever the mesh. Inside ``shard_map`` each device would
  draw noise for its own shard from the same key: a sharded leaf's shards
  would repeat it, so add the noise outside ``shard_map``.

  ==========================================  ==============================
  case                                        result
  ==========================================  ==============================
  ``noise_multiplier = 0``                    the sum (divided by
                                              :math:`\bar B`), no noise
  ``l2_norm_clip = 0``                        no noise: nothing is released
                                              of any example
  a ``None`` leaf                             stays ``None``
  ==========================================  ==============================

  Account for :math:`z` (and the sampling rate, steps and :math:`\delta`)
  with :func:`jaxclip.dp_epsilon`, or choose it for a target
  :math:`\varepsilon` with :func:`jaxclip.calibrate_noise`.

  Args:
    l2_norm_clip: The clip norm :math:`C` of the per-example gradients in
      the sum, ``>= 0`` and finite, or a pytree prefix of the params with one
      per layer or group. May be traced (a number).
    noise_multiplier: :math:`z`, ``>= 0`` and finite: the noise's standard
      deviation in units of the sensitivity. May be traced.
    seed: The noise's secret seed: an int, a ``jax.random.key``, or
      ``None`` (default) to draw one from the operating system's entropy.
    expected_batch_size: :math:`\bar B > 0`, the expected batch size to
      divide by; ``None`` (default): no division. May be traced.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`DPNoiseState`.

  Raises:
    ValueError: for a concrete negative, NaN or infinite clip norm or
      ``noise_multiplier``, a non-positive ``expected_batch_size``, a
      hyperparameter that is not a scalar, or an ``l2_norm_clip`` pytree
      that is no prefix of the updates.
    TypeError: for a hyperparameter that is no real number, a ``seed`` that
      is no int, or an updates leaf that holds no real number (its path is
      named).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax, jaxclip
    >>> params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    >>> loss = lambda p, x: jnp.sum((x @ p["w"] + p["b"] - 1.0) ** 2)
    >>> x = jax.random.normal(jax.random.key(0), (16, 3))
    >>> clipped_sum, _ = jaxclip.per_example_clipped_grad(loss, 1.0)(params, x)
    >>> tx = optax.chain(  # seed=None: a secret key from the OS's entropy
    ...     jaxclip.dp_noise(1.0, noise_multiplier=1.1, expected_batch_size=16),
    ...     optax.sgd(0.1))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(clipped_sum, state, params)
    >>> jax.tree.map(jnp.shape, updates)
    {'b': (2,), 'w': (3, 2)}

    Without noise it is the sum divided by the expected batch size:

    >>> tx = jaxclip.dp_noise(1.0, 0.0, expected_batch_size=4)
    >>> tx.update({"w": jnp.array([2.0, 6.0])}, tx.init(None))[0]
    {'w': Array([0.5, 1.5], dtype=float32)}

    Per-layer clip norms 3 and 4 give a sensitivity of 5:

    >>> tx = jaxclip.dp_noise({"w": 3.0, "b": 4.0}, 1.0)
    >>> zeros = {"w": jnp.zeros(20_000), "b": jnp.zeros(20_000)}
    >>> noisy, _ = tx.update(zeros, tx.init(zeros))
    >>> bool(4.9 < jnp.std(noisy["w"]) < 5.1)
    True

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016

    Mironov, `On Significance of the Least Significant Bits for Differential
    Privacy <https://doi.org/10.1145/2382196.2382264>`_, 2012
  """
  _clip_batch.check_clip(l2_norm_clip, scalar=True, finite=True)
  _validation.check_hparam(noise_multiplier, "noise_multiplier", lo=0, scalar=True, finite=True)
  if expected_batch_size is not None:
    _validation.check_hparam(
      expected_batch_size, "expected_batch_size", lo=0, lo_open=True, scalar=True, finite=True
    )
  _check_seed(seed)

  if seed is None:
    key_data = secret_key_data()
  elif _is_key(seed):
    key_data = jax.random.key_data(seed)
  else:
    key_data = None

  def init_fn(params):
    del params
    if key_data is not None:
      return DPNoiseState(dp_noise_key=key_data)
    return DPNoiseState(dp_noise_key=jax.random.key_data(jax.random.key(seed)))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    _validation.check_state(state, DPNoiseState, "dp_noise")
    numbers = _validation.numeric_leaves(updates, "dp_noise")
    _validation.check_real_leaves(numbers, "dp_noise", "its Gaussian noise is real")
    _check_prefix(l2_norm_clip, numbers)
    key, noise_key = jax.random.split(jax.random.wrap_key_data(state.dp_noise_key))
    stddev = _numerics.hparam_float32(noise_multiplier) * _sensitivity(l2_norm_clip)
    leaves, treedef = jax.tree.flatten(numbers)
    keys = jax.random.split(noise_key, len(leaves)) if leaves else []
    dtypes = [_numerics.as_array(leaf).dtype for leaf in leaves]
    if params is not None:
      try:
        dtypes = treedef.flatten_up_to(
          jax.tree.map(lambda u, p: jnp.result_type(p), numbers, params)
        )
      except (ValueError, TypeError):
        pass  # params of another structure: keep each update's dtype
    out = []
    for leaf, k, final in zip(leaves, keys, dtypes, strict=True):
      leaf = _numerics.as_array(leaf)
      dtype = _numerics.compute_dtype(leaf.dtype)
      noisy = leaf.astype(dtype) + stddev.astype(dtype) * jax.random.normal(k, leaf.shape, dtype)
      if expected_batch_size is not None:
        noisy = noisy / jnp.asarray(expected_batch_size).astype(dtype)
      out.append(noisy.astype(final))
    return treedef.unflatten(out), DPNoiseState(dp_noise_key=jax.random.key_data(key))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
