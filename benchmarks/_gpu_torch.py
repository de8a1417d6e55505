"""The torch part of ``benchmarks.gpu_norm``: copies, the norm, the clip and Adam, same card."""

from __future__ import annotations

import statistics
import time

from benchmarks import _gpu_forms
from workloads import trees


def part_torch(args) -> list[dict]:
  """torch on the same card: copy bandwidth, foreach norm, clip_grad_norm_(foreach=True)."""
  import torch

  rows = []
  cuda = torch.cuda.is_available()
  dev = "cuda" if cuda else "cpu"

  def timed(name, fn, nbytes, reps):
    for _ in range(3):
      fn()
    if cuda:
      torch.cuda.synchronize()
      per = []
      for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
          fn()
        b.record()
        torch.cuda.synchronize()
        per.append(a.elapsed_time(b) / 1e3 / reps)
    else:
      per = []
      for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
          fn()
        per.append((time.perf_counter() - t0) / reps)
    t = statistics.median(per)
    row = {"case": name, "ms": 1e3 * t, "bytes": nbytes, "gbps": nbytes / t / 1e9}
    if cuda:
      try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
          fn()
          torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        dur = [getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) for e in evs]
        row["kernels"] = {"count": len(evs), "sum_us": sum(dur) if evs else None}
      except Exception as e:  # the profile is extra: keep the timing
        row["kernels"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    rows.append(row)
    k = row.get("kernels") or {}
    print(
      f"{name:48s} {1e3 * t:8.3f} ms {row['gbps']:7.0f} GB/s kernels {k.get('count')} "
      f"sum {k.get('sum_us')}",
      flush=True,
    )

  n = (1 << 20) if args.quick else (1 << 28)
  a = torch.randn(n, device=dev)
  b = torch.empty_like(a)
  timed("torch: copy_, 1 GiB (r+w)", lambda: b.copy_(a), 8 * n, args.reps)
  timed("torch: vector_norm (read), 1 GiB", lambda: torch.linalg.vector_norm(a), 4 * n, args.reps)
  shapes = trees.gpt2_shapes(args.shrink)
  for dname, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    if args.quick and dname != "float32":
      continue
    gen = torch.Generator(device=dev).manual_seed(0)
    params = []
    for shape in shapes.values():
      p = torch.zeros(shape, dtype=dtype, device=dev)
      p.grad = (torch.randn(shape, generator=gen, device=dev) * 1e-2).to(dtype)
      params.append(p)
    grads = [p.grad for p in params]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    timed(
      f"torch: _foreach_norm + norm of norms ({dname})",
      lambda g=grads: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g, 2)), 2),
      nbytes,
      args.reps,
    )
    timed(
      f"torch: clip_grad_norm_(foreach=True) ({dname})",
      lambda p=params: torch.nn.utils.clip_grad_norm_(p, _gpu_forms.MAX_NORM, foreach=True),
      3 * nbytes,
      args.reps,
    )
    if dname == "float32":
      for label, kw in (("foreach", {"foreach": True}), ("fused", {"fused": cuda})):
        if label == "fused" and not cuda:
          continue
        opt = torch.optim.Adam(params, lr=1e-4, **kw)
        timed(f"torch: Adam({label}=True) step", opt.step, 7 * nbytes, max(1, args.reps // 2))

        def clip_step(opt=opt, p=params):
          torch.nn.utils.clip_grad_norm_(p, _gpu_forms.MAX_NORM, foreach=True)
          opt.step()

        timed(
          f"torch: clip_grad_norm_ + Adam({label}=True) step",
          clip_step,
          7 * nbytes,
          max(1, args.reps // 2),
        )
  return rows
