"""XLA:CPU policy: every choice jaxclip makes for one compiler, behind a small interface.

The kernel's math is written once, per leaf, in :mod:`jaxclip._kernel._numerics`
(and on one leaf's scalars in :mod:`jaxclip.transforms._per_tensor`). The
functions here take that one definition and decide how XLA:CPU gets it.

Why a room of its own: XLA:CPU compiles one kernel per distinct fusion,
compiles a reduction kernel per leaf slowly, and copies cheap elementwise
ops into every consumer, so a tree of thousands of small leaves written leaf
by leaf compiles for minutes. ``benchmarks/results/tricks.md`` measures each choice
with and without it, by switching it off (``_tricks``) through the public
``jaxclip.platform.without``.

How the platform is chosen: each choice but the grouping is staged with
:func:`on_cpu`, a :func:`jax.lax.platform_dependent` whose other branch is
the plain per-leaf math. It is made when the program is *lowered*, so a
program exported with ``jax.export(..., platforms=('cuda',))`` on a CPU-only
machine carries none of the CPU choices (XLA folds the choice away: the
compiled program holds no conditional). The grouping changes no value and
is cheaper to compile on any backend, so it runs everywhere, and its plain
branch is never traced.

The rooms:

* ``_switch``: :func:`on_cpu`, the rescues' :func:`cond`, and which leaves count as small;
* ``_reduce``: one leaf's norm reduction (bfloat16 barrier, float16
  two-output reduction);
* ``_groups``: a tree norm's partial sums, small leaves reduced by group;
* ``_segments``: every leaf's sum as one vector by one segment reduction;
* ``_stacks``: small leaves of one shape scaled as stacks, their rows read
  at opaque indices;
* ``_vectors``: a per-tensor rule vmapped over vectors of every leaf's
  scalars;
* ``_cuda``: the global 2-norm on CUDA GPUs, every leaf in one Pallas
  (Triton) kernel with no conditional (:func:`cuda_norm`), staged with
  :func:`on_cuda` in processes that have a CUDA backend
  (:func:`cuda_in_process`) and measured in ``benchmarks/results/gpu.md``;
* ``_tricks``: the switches. Every trick above has a name in :data:`TRICKS`,
  and its code asks :func:`is_on` while tracing: under :func:`without` (public
  as ``jaxclip.platform.without``) it runs the plain math it already has
  instead. The caches of jitted functions are keyed by the switches
  (:func:`cache`), so no choice outlives its switch.
"""

from jaxclip._kernel._platform._cuda import cuda_norm as cuda_norm
from jaxclip._kernel._platform._cuda import cuda_norm_applies as cuda_norm_applies
from jaxclip._kernel._platform._groups import scaled_sums as scaled_sums
from jaxclip._kernel._platform._groups import shares_by_group as shares_by_group
from jaxclip._kernel._platform._reduce import combine_scalars as combine_scalars
from jaxclip._kernel._platform._reduce import reduce as reduce
from jaxclip._kernel._platform._reduce import reduction_input as reduction_input
from jaxclip._kernel._platform._reduce import share as share
from jaxclip._kernel._platform._segments import count_all as count_all
from jaxclip._kernel._platform._segments import scaled_leaf_sums as scaled_leaf_sums
from jaxclip._kernel._platform._segments import share_vector as share_vector
from jaxclip._kernel._platform._stacks import flat_concatenate as flat_concatenate
from jaxclip._kernel._platform._stacks import join_plan as join_plan
from jaxclip._kernel._platform._stacks import map_joined as map_joined
from jaxclip._kernel._platform._stacks import scale_each_leaf as scale_each_leaf
from jaxclip._kernel._platform._switch import cond as cond
from jaxclip._kernel._platform._switch import cuda_in_process as cuda_in_process
from jaxclip._kernel._platform._switch import on_cpu as on_cpu
from jaxclip._kernel._platform._switch import on_cuda as on_cuda
from jaxclip._kernel._platform._tricks import TRICKS as TRICKS
from jaxclip._kernel._platform._tricks import cache as cache
from jaxclip._kernel._platform._tricks import is_on as is_on
from jaxclip._kernel._platform._tricks import without as without
from jaxclip._kernel._platform._vectors import map_leaves as map_leaves
