"""quantile_clip_norm_update against a NumPy port of Andrew et al.'s rule, and its convergence."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip import ops
from tests.helpers import mlp_loss, mlp_problem

NUM_STEPS = 40
BATCH = 64


# ------------------------------------------------------------------ NumPy port


def port_step(c, norms, *, q, lr, stddev, noise, geometric):
  """One step of the rule in float64; ``noise`` is the standard normal draw."""
  norms = np.asarray(norms, np.float64)
  fraction = (np.sum(norms <= c) + stddev * noise) / norms.shape[0]
  step = lr * (fraction - q)
  return c * math.exp(-step) if geometric else max(c - step, 0.0)


def norm_run(seed=0, steps=NUM_STEPS, batch=BATCH):
  """Per-step float32 norms: lognormal, their scale rising then falling so that C follows."""
  rng = np.random.default_rng(seed)
  scale = np.exp(1.5 * np.sin(np.linspace(0.0, 1.5 * np.pi, steps)))[:, None]
  return (scale * rng.lognormal(0.0, 0.8, size=(steps, batch))).astype(np.float32)


def noises(keys):
  """The standard normal draws the function makes from ``keys``."""
  return [float(jax.random.normal(k, (), jnp.float32)) for k in keys]


CONFIGS = {
  "geometric_median": dict(q=0.5, lr=0.2, stddev=0.0, geometric=True, c0=0.3),
  "geometric_p90_noisy": dict(q=0.9, lr=0.2, stddev=BATCH / 20, geometric=True, c0=5.0),
  "linear_median": dict(q=0.5, lr=0.1, stddev=0.0, geometric=False, c0=0.3),
  "linear_p25_noisy": dict(q=0.25, lr=0.3, stddev=BATCH / 20, geometric=False, c0=2.0),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_numpy_port_over_a_run(name):
  cfg = CONFIGS[name]
  runs = norm_run(seed=len(name))
  keys = jax.random.split(jax.random.key(7), NUM_STEPS)
  draws = noises(keys)
  update = jax.jit(jaxclip.quantile_clip_norm_update, static_argnames=("geometric",))
  c, want = jnp.float32(cfg["c0"]), cfg["c0"]
  got_run, want_run = [], []
  for t in range(NUM_STEPS):
    # Under jit count_stddev is traced, so a key is always passed (0 * noise when unused).
    c = update(
      c,
      jnp.asarray(runs[t]),
      target_quantile=cfg["q"],
      learning_rate=cfg["lr"],
      count_stddev=cfg["stddev"],
      key=keys[t],
      geometric=cfg["geometric"],
    )
    want = port_step(
      want,
      runs[t],
      q=cfg["q"],
      lr=cfg["lr"],
      stddev=cfg["stddev"],
      noise=draws[t],
      geometric=cfg["geometric"],
    )
    assert c.dtype == jnp.float32 and c.shape == ()
    got_run.append(float(c))
    want_run.append(want)
  np.testing.assert_allclose(got_run, want_run, rtol=2e-5)
  # The run exercises the rule: C moves both ways, over a wide range.
  moves = np.diff([cfg["c0"], *want_run])
  assert np.any(moves > 0) and np.any(moves < 0)
  assert max(want_run) > 1.5 * min(want_run)


def test_noise_is_the_keys_normal_draw_scaled_by_count_stddev():
  norms = jnp.asarray(norm_run(3)[0])
  key = jax.random.key(11)
  (z,) = noises([key])
  for geometric in (True, False):
    plain = jaxclip.quantile_clip_norm_update(1.5, norms, geometric=geometric)
    noisy = jaxclip.quantile_clip_norm_update(
      1.5, norms, count_stddev=4.0, key=key, geometric=geometric
    )
    want = port_step(1.5, norms, q=0.5, lr=0.2, stddev=4.0, noise=z, geometric=geometric)
    np.testing.assert_allclose(float(noisy), want, rtol=1e-6)
    assert float(noisy) != float(plain)
    # A key with count_stddev=0 adds nothing.
    silent = jaxclip.quantile_clip_norm_update(1.5, norms, key=key, geometric=geometric)
    assert float(silent) == float(plain)
  # A legacy uint32 key works too.
  legacy = jaxclip.quantile_clip_norm_update(
    1.5, norms, count_stddev=4.0, key=jax.random.PRNGKey(0)
  )
  assert np.isfinite(float(legacy))


def test_linear_update_is_clamped_at_zero():
  norms = jnp.full((8,), 1e-3)  # all below C: the fraction is 1
  c = jaxclip.quantile_clip_norm_update(
    0.05, norms, target_quantile=0.1, learning_rate=1.0, geometric=False
  )
  assert float(c) == 0.0
  assert port_step(0.05, norms, q=0.1, lr=1.0, stddev=0.0, noise=0.0, geometric=False) == 0.0
  # and from 0 it grows again once the norms are above it
  c = jaxclip.quantile_clip_norm_update(c, jnp.ones(8), learning_rate=1.0, geometric=False)
  np.testing.assert_allclose(float(c), 0.5)


# ------------------------------------------------------------------ convergence


def run_to_convergence(q, geometric, lr, count_stddev, steps=1500, batch=256, mu=0.5, sigma=1.0):
  """C after ``steps`` updates on fresh lognormal(mu, sigma) batches, and its late mean."""

  @jax.jit
  def run(c0, key):
    def step(c, k):
      k_norms, k_noise = jax.random.split(k)
      norms = jnp.exp(mu + sigma * jax.random.normal(k_norms, (batch,)))
      c = jaxclip.quantile_clip_norm_update(
        c,
        norms,
        target_quantile=q,
        learning_rate=lr,
        count_stddev=count_stddev,
        key=k_noise,
        geometric=geometric,
      )
      return c, c

    _, cs = jax.lax.scan(step, c0, jax.random.split(key, steps))
    return cs

  cs = np.asarray(run(jnp.float32(0.2), jax.random.key(int(q * 100) + int(geometric))))
  assert np.all(np.isfinite(cs))
  return cs, float(np.mean(cs[-steps // 3 :]))


NORMAL_QUANTILE = {0.5: 0.0, 0.9: 1.2815515655446004}


@pytest.mark.parametrize("q", [0.5, 0.9])
@pytest.mark.parametrize(
  "geometric,lr,count_stddev", [(True, 0.2, 0.0), (True, 0.2, 256 / 20), (False, 0.3, 0.0)]
)
def test_converges_to_the_target_quantile_of_the_norms(q, geometric, lr, count_stddev):
  mu, sigma = 0.5, 1.0
  cs, settled = run_to_convergence(q, geometric, lr, count_stddev, mu=mu, sigma=sigma)
  true_quantile = math.exp(mu + sigma * NORMAL_QUANTILE[q])
  assert abs(cs[0] - true_quantile) > 0.5 * true_quantile  # it started far away
  np.testing.assert_allclose(settled, true_quantile, rtol=0.06)
  # Said in terms of the norms: about a fraction q of fresh ones fall below it.
  fresh = np.random.default_rng(0).lognormal(mu, sigma, size=200_000)
  assert abs(np.mean(fresh <= settled) - q) < 0.02


# ------------------------------------------------------------------ jit, dtypes, edge cases


def test_jit_with_every_hyperparameter_traced_matches_eager():
  norms = jnp.asarray(norm_run(5)[3])
  key = jax.random.key(2)
  traced = jax.jit(
    lambda c, n, q, lr, s, k, g: jaxclip.quantile_clip_norm_update(
      c, n, target_quantile=q, learning_rate=lr, count_stddev=s, key=k, geometric=g
    )
  )
  for q, lr, s, g in ((0.5, 0.2, 0.0, True), (0.9, 0.1, 3.0, True), (0.3, 0.4, 3.0, False)):
    eager = jaxclip.quantile_clip_norm_update(
      2.0, norms, target_quantile=q, learning_rate=lr, count_stddev=s, key=key, geometric=g
    )
    got = traced(
      jnp.float32(2.0), norms, jnp.float32(q), jnp.float32(lr), jnp.float32(s), key, jnp.asarray(g)
    )
    np.testing.assert_allclose(float(got), float(eager), rtol=1e-6)
    assert got.dtype == jnp.float32


def test_traced_count_stddev_without_a_key_raises():
  with pytest.raises(ValueError, match="count_stddev"):
    jax.jit(lambda s: jaxclip.quantile_clip_norm_update(1.0, jnp.ones(4), count_stddev=s))(
      jnp.float32(0.0)
    )


def test_traced_negative_clip_norm_acts_as_zero():
  got = jax.jit(
    lambda c: jaxclip.quantile_clip_norm_update(c, jnp.ones(4), learning_rate=0.5, geometric=False)
  )(jnp.float32(-3.0))
  np.testing.assert_allclose(float(got), 0.25)  # 0 - 0.5 * (0 - 0.5)
  got = jax.jit(lambda c: jaxclip.quantile_clip_norm_update(c, jnp.ones(4)))(jnp.float32(-3.0))
  assert float(got) == 0.0


@pytest.mark.parametrize("geometric", [True, False])
def test_nonfinite_norms_count_as_above_and_keep_c_finite(geometric):
  clean = np.array([0.5, 0.7, 3.0, 4.0, 5.0, 0.1], np.float32)
  dirty = clean.copy()
  dirty[[2, 3, 4]] = [np.nan, np.inf, np.nan]  # all three were above C = 1
  kw = dict(target_quantile=0.6, learning_rate=0.3, geometric=geometric)
  for update in (
    jaxclip.quantile_clip_norm_update,
    jax.jit(jaxclip.quantile_clip_norm_update, static_argnames=tuple(kw)),
  ):
    got = update(1.0, jnp.asarray(dirty), **kw)
    assert np.isfinite(float(got))
    assert float(got) == float(update(1.0, jnp.asarray(clean), **kw))
  # All NaN: nothing is below, so C grows as for norms all above it.
  got = jaxclip.quantile_clip_norm_update(1.0, jnp.full((4,), jnp.nan), **kw)
  want = port_step(1.0, np.full(4, 1e9), q=0.6, lr=0.3, stddev=0.0, noise=0.0, geometric=geometric)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  # Even a NaN norm with noise keeps C finite.
  got = jaxclip.quantile_clip_norm_update(
    1.0, jnp.asarray(dirty), count_stddev=2.0, key=jax.random.key(0), **kw
  )
  assert np.isfinite(float(got))


def test_edge_cases_of_the_docstring_table():
  norms = jnp.asarray([0.5, 2.0, 3.0])
  assert float(jaxclip.quantile_clip_norm_update(0.0, norms)) == 0.0  # geometric stays 0
  assert float(jaxclip.quantile_clip_norm_update(jnp.inf, norms)) == math.inf
  assert float(jaxclip.quantile_clip_norm_update(jnp.inf, norms, geometric=False)) == math.inf
  for geometric in (True, False):
    got = jaxclip.quantile_clip_norm_update(1.25, norms, learning_rate=0.0, geometric=geometric)
    assert float(got) == 1.25
  # A norm equal to C counts as below (the indicator is n <= C).
  got = jaxclip.quantile_clip_norm_update(2.0, norms, target_quantile=2 / 3, geometric=False)
  np.testing.assert_allclose(float(got), 2.0, rtol=1e-6)


def test_an_empty_batch_leaves_c_unchanged_without_expected_batch_size():
  """Every row masked out: nothing is measured, so C stays, noise or not, eager or jitted.

  (Before, the noise alone divided by 1 took C from 1.0 to 1.105 at q = 0.5.)
  With ``expected_batch_size`` the centred count of an empty batch is ½ plus
  noise over B: C moves by the noise only at q = ½, as the accounted mechanism says.
  """
  norms, none = jnp.asarray([0.5, 2.0, 3.0, 9.0]), jnp.zeros(4, jnp.bool_)
  update = jax.jit(
    lambda c, s, k, g, m: jaxclip.quantile_clip_norm_update(
      c, norms, count_stddev=s, key=k, geometric=g, example_mask=m
    )
  )
  for geometric in (True, False):
    for stddev in (0.0, 3.0):
      for seed in range(3):
        key = jax.random.key(seed)
        assert float(update(1.0, stddev, key, geometric, none)) == 1.0
        eager = jaxclip.quantile_clip_norm_update(
          1.0, norms, count_stddev=stddev, key=key, geometric=geometric, example_mask=none
        )
        assert float(eager) == 1.0
    # One real example still moves it (norm 0.5 <= 1: a fraction of 1, so C shrinks).
    one = jnp.asarray([True, False, False, False])
    assert float(update(1.0, 0.0, jax.random.key(0), geometric, one)) < 1.0
  # The centred form: no noise at q = 1/2 keeps C; with noise it moves by the noise alone.
  for stddev, key in ((0.0, None), (4.0, jax.random.key(5))):
    got = jaxclip.quantile_clip_norm_update(
      1.0, norms, count_stddev=stddev, key=key, example_mask=none, expected_batch_size=8
    )
    noise = 0.0 if key is None else float(jax.random.normal(key, (), jnp.float32))
    np.testing.assert_allclose(float(got), math.exp(-0.2 * stddev * noise / 8), rtol=1e-6)
  assert stddev * abs(noise) > 0.1  # the noisy case did move C


@pytest.mark.usefixtures("strict_promotion")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_clip_norm_dtype_is_kept(dtype):
  norms32 = jnp.asarray(norm_run(4)[0])
  for norms in (norms32, norms32.astype(jnp.bfloat16)):
    for geometric in (True, False):
      c = jnp.asarray(1.5, dtype)
      got = jaxclip.quantile_clip_norm_update(
        c, norms, count_stddev=2.0, key=jax.random.key(1), geometric=geometric
      )
      assert got.dtype == dtype and got.shape == ()
      # Computed in float32, then rounded once to the dtype.
      want = jaxclip.quantile_clip_norm_update(
        c.astype(jnp.float32), norms, count_stddev=2.0, key=jax.random.key(1), geometric=geometric
      )
      assert got == want.astype(dtype)
  # An integer clip norm gives float32.
  got = jaxclip.quantile_clip_norm_update(jnp.asarray(2, jnp.int32), norms32)
  assert got.dtype == jnp.float32


def test_norms_from_per_example_gradients():
  """The usual source of the norms: the pre-clip norms of the per-example gradients."""
  params, x, y = mlp_problem(batch=16)
  grads = jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0))(params, x, y)
  norms = jax.vmap(ops.global_norm)(grads)
  c = float(np.median(np.asarray(norms)))
  _, num_clipped = jaxclip.per_example_clipped_grad(mlp_loss, c, batch_argnums=(1, 2))(params, x, y)
  # With q = 0 and lr = 1, the linear update subtracts exactly the fraction below C.
  new = jaxclip.quantile_clip_norm_update(
    c, norms, target_quantile=0.0, learning_rate=1.0, geometric=False
  )
  np.testing.assert_allclose(c - float(new), (16 - int(num_clipped)) / 16, rtol=1e-5)


# ------------------------------------------------------------------ bad input

BAD = [
  (dict(clip_norm=-1.0), ValueError, "clip_norm"),
  (dict(clip_norm=math.nan), ValueError, "clip_norm"),
  (dict(clip_norm=jnp.ones(2)), ValueError, "clip_norm"),
  (dict(clip_norm=None), TypeError, "clip_norm"),
  (dict(clip_norm="1.0"), TypeError, "clip_norm"),
  (dict(target_quantile=-0.1), ValueError, "target_quantile"),
  (dict(target_quantile=1.5), ValueError, "target_quantile"),
  (dict(target_quantile=math.nan), ValueError, "target_quantile"),
  (dict(target_quantile=[0.5, 0.9]), ValueError, "target_quantile"),
  (dict(learning_rate=-0.2), ValueError, "learning_rate"),
  (dict(learning_rate=math.inf), ValueError, "learning_rate"),
  (dict(learning_rate=True), TypeError, "learning_rate"),
  (dict(count_stddev=-1.0), ValueError, "count_stddev"),
  (dict(count_stddev=math.inf, key=jax.random.key(0)), ValueError, "count_stddev"),
  (dict(count_stddev=1.0), ValueError, "key"),
  (dict(count_stddev=1.0, key=0), TypeError, "key"),
  (dict(count_stddev=1.0, key=jax.random.split(jax.random.key(0))), TypeError, "key"),
  (dict(geometric="yes"), TypeError, "geometric"),
  (dict(geometric=2), TypeError, "geometric"),
  (dict(norms=jnp.ones((2, 3))), ValueError, "norms"),
  (dict(norms=jnp.ones(())), ValueError, "norms"),
  (dict(norms=jnp.ones((0,))), ValueError, "norms"),
  (dict(norms=jnp.ones(3, jnp.complex64)), TypeError, "norms"),
  (dict(norms=["a", "b"]), TypeError, "norms"),
  (dict(norms=None), TypeError, "norms"),
]


@pytest.mark.parametrize("kwargs,error,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_naming_the_argument(kwargs, error, name):
  args = dict(clip_norm=1.0, norms=jnp.ones(4))
  args.update(kwargs)
  clip_norm, norms = args.pop("clip_norm"), args.pop("norms")
  with pytest.raises(error, match=name):
    jaxclip.quantile_clip_norm_update(clip_norm, norms, **args)
