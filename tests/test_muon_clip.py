"""Where a clip goes with Muon: before or after the optimizer, around or inside its groups.

Muon (``optax.contrib.muon``) orthogonalises the hidden weight matrices' updates and leaves
embeddings, norms and biases to Adam, two groups of ``optax.multi_transform``. A clip can go
in front of the whole optimizer (one global norm over both groups), inside each group (one
norm per group), or behind the optimizer (on the update). These tests pin what differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip

PARAMS = {"w": jnp.zeros((4, 3)), "v": jnp.zeros((3, 4)), "embed": jnp.zeros((5, 4))}
LABELS = {"w": "muon", "v": "muon", "embed": "adam"}
C = 1.0
# One Newton-Schulz step instead of five: the placements behave the same and compile faster.
MUON = lambda: optax.contrib.muon(0.02, ns_steps=1)  # noqa: E731
# Gradient scales per step (hidden matrices, embedding): the embedding spikes at step 2.
SCALES = [(0.3, 0.2), (0.3, 5.0), (0.3, 0.2)]


def grads_at(step: int, hidden: float, embed: float) -> dict:
  keys = jax.random.split(jax.random.key(step), 3)
  return {
    "w": hidden * jax.random.normal(keys[0], (4, 3)) / np.sqrt(12),
    "v": hidden * jax.random.normal(keys[1], (3, 4)) / np.sqrt(12),
    "embed": embed * jax.random.normal(keys[2], (5, 4)) / np.sqrt(20),
  }


def groups(muon_first=None, adam_first=None):
  return optax.multi_transform(
    {
      "muon": optax.chain(muon_first or optax.identity(), MUON()),
      "adam": optax.chain(adam_first or optax.identity(), optax.adam(1e-3)),
    },
    LABELS,
  )


PLACEMENTS = {
  "global before": lambda: optax.chain(jaxclip.clip_by_global_norm(C), groups()),
  "per group": lambda: groups(jaxclip.clip_by_global_norm(C), jaxclip.clip_by_global_norm(C)),
  "after": lambda: optax.chain(groups(), jaxclip.clip_by_global_norm(C)),
  "none": groups,
}


GRADS = jax.tree.map(lambda *g: jnp.stack(g), *(grads_at(i, *s) for i, s in enumerate(SCALES)))


def run(tx):
  """The updates of each step of SCALES, as a list of pytrees (one compile: a scan)."""

  def step(state, grads):
    updates, state = tx.update(grads, state, PARAMS)
    return state, updates

  stacked = jax.jit(lambda: jax.lax.scan(step, tx.init(PARAMS), GRADS)[1])()
  return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(len(SCALES))]


@pytest.fixture(scope="module")
def runs():
  return {name: run(make()) for name, make in PLACEMENTS.items()}


def close(a, b, rtol=1e-5):
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return all(np.allclose(x, y, rtol=rtol, atol=1e-8) for x, y in pairs)


def test_one_clip_around_the_groups_differs_from_one_clip_inside_each(runs):
  # The spike (embedding norm 5 against hidden norm 0.3) takes the global norm above C: one
  # clip in front scales every gradient by the same factor, the hidden matrices' too. Inside
  # each group, only the embedding's group is over C: the hidden matrices pass unclipped.
  norms = [
    (
      float(jaxclip.ops.global_norm({k: g[k] for k in ("w", "v")})),
      float(jaxclip.ops.global_norm(g["embed"])),
    )
    for g in (grads_at(i, *s) for i, s in enumerate(SCALES))
  ]
  assert all(h < C for h, _ in norms) and norms[1][1] > C and norms[0][1] < C
  glob, group, none = runs["global before"], runs["per group"], runs["none"]
  # Step 1: nothing is clipped anywhere, the three agree.
  assert close(glob[0], group[0]) and close(glob[0], none[0])
  # After the spike the hidden matrices' updates differ between the two placements ...
  hidden = lambda u: {k: u[k] for k in ("w", "v")}  # noqa: E731
  assert not close(hidden(glob[2]), hidden(group[2]))
  # ... and per group they are exactly the unclipped run's: the spike elsewhere did not touch
  # them (their own norm stayed under C), while the global clip shrank their momentum's input.
  for step in range(len(SCALES)):
    assert close(hidden(group[step]), hidden(none[step])), step
  assert not close(hidden(glob[2]), hidden(none[2]))


def test_muon_discards_the_scale_of_a_clipped_step_without_momentum_history():
  # Orthogonalisation keeps only the direction: on the first step (no momentum yet) clipping
  # the gradient before Muon changes nothing, whatever the threshold.
  tx = lambda c: optax.chain(jaxclip.clip_by_global_norm(c), optax.contrib.muon(0.02))  # noqa: E731
  # (five Newton-Schulz steps here: the default Muon)
  params = {"w": PARAMS["w"]}
  grads = {"w": grads_at(0, 3.0, 0.0)["w"]}
  first = jax.jit(lambda c: tx(c).update(grads, tx(c).init(params), params)[0])  # c traced
  updates = [first(c) for c in (0.01, 0.1, 1e3)]
  assert float(jaxclip.ops.global_norm(grads)) > 1.0
  # Equal up to Muon's eps (1e-8) added to the norm it divides by, relative 1e-6 at c = 0.01.
  assert close(updates[0], updates[2], 1e-4) and close(updates[1], updates[2], 1e-4)


def test_a_clip_after_the_optimizer_bounds_the_step_itself(runs):
  after, none = runs["after"], runs["none"]
  assert max(float(jaxclip.ops.global_norm(u)) for u in after) <= C * (1 + 1e-6)
  # With C above every update's norm it passes them through: here Muon's updates (lr 0.02 on
  # orthogonal matrices) are far below C, so the clip after changes nothing.
  assert all(float(jaxclip.ops.global_norm(u)) < C for u in none)
  for a, b in zip(after, none, strict=True):
    assert close(a, b)
  # A small enough C does bind: it scales the whole update, both groups alike.
  small = run(optax.chain(groups(), jaxclip.clip_by_global_norm(1e-3)))
  for a, b in zip(small, none, strict=True):
    ratio = float(jaxclip.ops.global_norm(a) / jaxclip.ops.global_norm(b))
    assert ratio == pytest.approx(1e-3 / float(jaxclip.ops.global_norm(b)), rel=1e-4)
    assert close(jax.tree.map(lambda x, r=ratio: x / r, a), b, 1e-4)
