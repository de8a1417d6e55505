"""``method="auto"``'s measured choice: its candidate programs timed where they run.

The cost model (:mod:`jaxclip.privacy._ghost._cost_model`) weighs flops or
floats; what a program costs also depends on what the compiler fuses and on
the machine (``benchmarks/results/ghost_calibration-*.md``: no constant
fitted on single layers chose right on every model). So, when it can,
``method="auto"`` compiles each candidate of its clipped-gradient function
(the cost model's plan, ghost's rules, ``method="vmap"``'s program) for the
backend this process runs on, times them in turn on stand-in inputs of the
call's shapes and dtypes, and runs the fastest in the branch of the program
lowered for that platform (of candidates within ``TIE`` of the fastest, the
one of least temporary memory; a candidate that would not fit in the device's
free memory or fails to run is left out, and one many times slower in its first
two runs is not timed further); the branches for other platforms keep the cost model. It times
nothing, and the cost model decides, where the user asks so (``measure=False``:
one compile, the same plan in every run) and where a timing on one device
of this process would not be the program's own:

* symbolic shapes (``jax.export``), or a typed PRNG key among the inputs (no
  stand-in is made for it);
* a loss closing over a value traced by an enclosing transformation (the
  candidates cannot be compiled apart from it);
* ``axis_name`` or ``spmd_axis_name``, a mesh set with ``jax.set_mesh``, or
  an input spread over several devices (under ``jit`` with no mesh set: over
  the mesh JAX's type of it names);
* a job of several processes (``jax.distributed``): each process would time
  its own candidates, and two processes that picked different programs
  failed at their first collective (gloo: "Received data size doesn't match
  expected size", ``tests/test_multihost.py``).

Each function measures once, at its first trace, and every later trace runs
the same pick, whatever the batch size: two neighbouring batches must go
through one program, or their sums differ by more than rounding allows. :func:`jaxclip.ghost_plan`
reports the times and why nothing was timed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxclip._kernel import _sharding

# Rounds of timed steps (one of each candidate, the order turned each round): at least the
# first for a median, then more while the timed steps took under BUDGET_S, up to the second.
ROUNDS = (3, 9)
BUDGET_S = 1.0
# A candidate whose first two runs each took over DROP times the fastest first run (and over
# the time its first ROUNDS[0] runs may take within BUDGET_S) is not timed further:
# it cannot win by the margins timing decides (TIE, a few percent), and a program many times
# slower (vmap's per-example gradients of a large batch: 23 s a step against ghost's 0.9 s)
# would make the rounds take minutes.
DROP = 2.0
# Medians this close to the fastest are a tie (this machine's noise on one program is
# larger: benchmarks/results/ghost_zoo.md), broken by the least temporary memory.
TIE = 0.03

# What each candidate runs, as the reasons name it.
PROGRAMS = {"auto": "the cost model's plan", "ghost": "ghost's rules", "vmap": "vmap's program"}


@dataclasses.dataclass(frozen=True)
class Measured:
  """One measurement of ``method="auto"``'s candidates.

  Attributes:
    platform: The backend the candidates ran on (``jax.default_backend()``).
    pick: The fastest candidate (``"auto"``: the cost model's plan,
      ``"ghost"`` or ``"vmap"``), or ``None`` where nothing was timed.
    why: The median times, or why nothing was timed.
  """

  platform: str
  pick: str | None
  why: str


def unmeasurable(opts: Any, inputs: Any) -> str | None:
  """Why the candidates of a function with options ``opts`` cannot be timed on ``inputs``
  (its params, args and mask), or ``None``."""
  if not opts.measure:
    return "measure=False: the cost model's plan, nothing timed"
  if jax.process_count() > 1:  # each would time its own and might compile another program
    return (
      f"a job of {jax.process_count()} processes (each would time its own candidates, and "
      "processes running different programs mismatch at their collectives)"
    )
  if opts.axis_name is not None or opts.spmd_axis_name is not None:
    return "the batch is sharded over a mesh axis (axis_name or spmd_axis_name)"
  if not jax.sharding.get_abstract_mesh().empty:
    return "a mesh is set (jax.set_mesh)"
  for x in jax.tree.leaves(inputs):
    dtype, shape = getattr(x, "dtype", None), np.shape(x)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      return "a typed PRNG key among the inputs"
    if not all(isinstance(d, int) for d in shape):
      return "symbolic shapes"
    if isinstance(x, jax.core.Tracer):  # under jit: the devices its type names
      if _sharding.typed_devices(x) > 1:
        return "an input spread over several devices"
    elif isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
      return "an input spread over several devices"
  return None


def stand_in(tree: Any, seed: int = 0) -> Any:
  """NumPy arrays of ``tree``'s shapes and dtypes: small normal floats, zero integers (valid
  ids), True booleans (a mask keeping every example)."""
  rng = np.random.default_rng(seed)

  def one(x):
    if isinstance(x, (bool, int, float, complex)):  # concrete already, weakly typed
      return x
    dtype = np.dtype(x.dtype)
    shape = np.shape(x)
    if jax.dtypes.issubdtype(dtype, np.inexact):
      return (0.1 * rng.standard_normal(shape)).astype(dtype)
    if dtype == np.bool_:
      return np.ones(shape, dtype)
    return np.zeros(shape, dtype)

  return jax.tree.map(one, tree)


def measure(
  make: Callable[[str], Callable[..., Any]],
  candidates: Sequence[str],
  params: Any,
  args: Sequence[Any],
  mask: Any,
) -> Measured:
  """Times ``make(c)`` for each candidate ``c`` on stand-ins of ``params``, ``args`` and
  ``mask`` (each compiled for the default backend, run once, then in turn for a few rounds,
  the order turned each round) and picks the fastest median, or, of those within ``TIE`` of
  it, the one of least temporary memory. A candidate is left out, and named, where its
  arguments, outputs and temporaries exceed the device's free memory (:func:`room`; it is not
  run), where it fails to run (out of memory), and where its first two runs each took over
  ``DROP`` times the fastest candidate's first run (and over ``BUDGET_S / ROUNDS[0]``).
  ``Measured.pick`` is ``None`` where a candidate closes over a traced value, or none ran."""
  platform = jax.default_backend()
  inputs = stand_in((params, tuple(args), mask))
  compiled = {}
  for c in candidates:
    fn = make(c)
    traced = jax.jit(lambda p, a, m, fn=fn: fn(p, *a, example_mask=m)).trace(*inputs)
    # A value traced outside is hoisted to an input of its own (or kept as a constant).
    hoisted = len(traced.jaxpr.jaxpr.invars) != len(jax.tree.leaves(inputs))
    if hoisted or any(isinstance(v, jax.core.Tracer) for v in traced.jaxpr.consts):
      why = "the loss closes over a value traced by an enclosing transformation"
      return Measured(platform, None, why)
    compiled[c] = traced.lower().compile()

  def step(c):
    start = time.perf_counter()
    jax.block_until_ready(compiled[c](*inputs))
    return time.perf_counter() - start

  left_out, first = [], {}
  free = room()
  for c in candidates:  # a program the device cannot hold is not run (nor allocated)
    need = _footprint(compiled[c])
    if free is not None and need > free:
      left_out.append(f"{PROGRAMS[c]} not run (it needs {_mib(need)}, {_mib(free)} free)")
      del compiled[c]
  for c in candidates:  # warm-up: the first run of each
    if c not in compiled:
      continue
    try:
      first[c] = step(c)
    except jax.errors.JaxRuntimeError as e:
      left_out.append(f"{PROGRAMS[c]} failed to run ({str(e).splitlines()[0][:120]})")
      del compiled[c]
  if not first:
    return Measured(platform, None, "; ".join(left_out))
  best = min(first.values())
  # Over DROP times the fastest, and over what its first rounds may take within the budget:
  # run once more (a first run can carry the process's one-time costs), and left out if the
  # second run is over too.
  over = max(DROP * best, BUDGET_S / ROUNDS[0])
  for c in [c for c in candidates if first.get(c, 0.0) > over]:
    again = step(c)
    if again <= over:
      continue
    left_out.append(
      f"{PROGRAMS[c]} {1e3 * min(first[c], again):.3g} ms in two runs (over {DROP:g}x the "
      "fastest first run: not timed further)"
    )
    del compiled[c]
  ran = [c for c in candidates if c in compiled]
  times: dict[str, list[float]] = {c: [] for c in ran}
  rounds, spent = 0, 0.0
  while len(ran) > 1 and rounds < ROUNDS[1] and (rounds < ROUNDS[0] or spent < BUDGET_S):
    for c in ran if rounds % 2 == 0 else reversed(ran):
      times[c].append(step(c))
      spent += times[c][-1]
    rounds += 1
  medians = {c: statistics.median(t or [first[c]]) for c, t in times.items()}
  memory = {c: _temp_mib(compiled[c]) for c in ran}
  fastest = min(medians.values())
  near = [c for c in ran if medians[c] <= (1 + TIE) * fastest]
  pick = min(near, key=lambda c: (memory[c], medians[c]))
  timed = ", ".join(f"{PROGRAMS[c]} {1e3 * medians[c]:.3g} ms ({memory[c]:.3g} MiB)" for c in ran)
  if len(ran) == 1:
    how = "the one left"
  elif len(near) == 1:
    how = "the fastest"
  else:
    how = f"within {TIE:.0%} of the fastest, the least memory"
  why = (
    f"measured on {platform} ({f'{rounds} rounds' if rounds else 'no rounds'} on stand-in "
    "inputs of the call's shapes): "
    f"{'; '.join(left_out + [timed])}: {PROGRAMS[pick]} runs ({how})"
  )
  return Measured(platform, pick, why)


def room() -> int | None:
  """Bytes the default backend's first device can still allocate: its allocator's limit less
  what is in use (GPU, TPU), else, on CPU, the host's available memory (Linux's
  ``MemAvailable``); ``None`` where neither is known."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  if device.platform != "cpu":
    return None
  try:
    with open("/proc/meminfo") as f:
      kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
  except (OSError, StopIteration, ValueError, IndexError):
    return None
  return 1024 * kib


def _footprint(compiled: Any) -> int:
  """The bytes a compiled program allocates to run: its arguments, outputs and temporaries."""
  return _analysed(compiled, "argument", "output", "temp")


def _mib(n: float) -> str:
  return f"{n / 2**20:.3g} MiB"


def _temp_mib(compiled: Any) -> float:
  """A compiled program's temporary memory in MiB."""
  return _analysed(compiled, "temp") / 2**20


def _analysed(compiled: Any, *kinds: str) -> int:
  """The sum of a compiled program's ``<kind>_size_in_bytes`` by XLA's memory analysis (0
  where the backend gives none)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return 0
  return sum(int(getattr(analysis, f"{k}_size_in_bytes", 0)) for k in kinds)


def candidates_for(model: Any, ghost: Any) -> tuple[str, ...]:
  """The distinct programs ``"auto"`` may run: the cost model's plan (``model``, ``None`` for
  vmap's program) and the other whole methods (``ghost``: every rule's plan)."""
  out = ["auto"]
  if model is not None:
    out.append("vmap")
  if model is None or model != ghost:
    out.append("ghost")
  return tuple(out)


def timer(
  opts: Any,
  make: Callable[[str], Callable[..., Any]],
  measured: dict[Any, Measured],
  inputs: tuple[Any, Any, Any],
) -> Callable[[tuple[str, ...]], Measured]:
  """``timed(candidates)``: the measurement of ``make(c)`` for each candidate on stand-ins of
  one call's ``inputs`` (params, args, mask), or why none can be made, kept in ``measured``:
  made at the function's first trace only. Every later trace (another batch size included)
  runs the same pick, so that neighbouring batches (``D`` and ``D`` with one more example)
  go through the same program: a pick per shape let their sums differ by rounding far
  beyond the clip norm (``tests/test_dp_adversarial.py``, bfloat16)."""

  def timed(candidates):
    if not measured:  # once per function: the first trace's pick holds for every batch size
      key = key_of(candidates, inputs)
      why = unmeasurable(opts, inputs)
      if why is not None:
        measured[key] = Measured(jax.default_backend(), None, why)
      else:
        measured[key] = measure(make, candidates, *inputs)
    return next(iter(measured.values()))

  return timed


def picked(
  timed: Callable[[tuple[str, ...]], Measured], ghost: Any, cpu: Any, other: Any
) -> tuple[Any, Any]:
  """The plans of CPU and of the other platforms (``None``: vmap's program) once the branch of
  this process's platform takes the measured pick among the cost model's plan there, vmap's
  program and ``ghost`` (every rule's plan)."""
  here = jax.default_backend() == "cpu"
  model = cpu if here else other
  pick = timed(candidates_for(model, ghost)).pick
  if pick is None:
    return cpu, other
  plan = {"auto": model, "ghost": ghost, "vmap": None}[pick]
  return (plan, other) if here else (cpu, plan)


def candidate_options(opts: Any, candidate: str) -> Any:
  """The options of a function like ``opts``'s but of method ``candidate`` (``"auto"``: the
  cost model's plan, when made untimed), with ones for a clip norm or ``normalize`` that is
  traced; checked as :func:`jaxclip.per_example_clipped_grad` checks its own."""
  same = {
    f.name: getattr(opts, f.name)
    for f in dataclasses.fields(opts)
    if f.name not in ("loss_fn", "l2_norm_clip", "method", "normalize")
  }
  clip = jax.tree.map(_concrete, opts.l2_norm_clip)
  normalize = None if opts.normalize is None else _concrete(opts.normalize)
  return type(opts).checked(
    opts.loss_fn, clip, PROGRAMS, method=candidate, normalize=normalize, **same
  )


def _concrete(x: Any) -> Any:
  """``x``, or ones of its shape and dtype where it is traced."""
  return np.ones(np.shape(x), x.dtype) if isinstance(x, jax.core.Tracer) else x


def key_of(candidates: Sequence[str], inputs: Any) -> Any:
  """A measurement's cache key: the candidates and the inputs' structure, shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(inputs)
  avals = tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)
  return tuple(candidates), treedef, avals, jax.default_backend()
