"""Where a profiled window's GPU time goes, from the trainer's chrome trace.

    python -m bench.trainer.timeline RUN_DIR/profile.json --steps 3 [--gaps 15]

Reads the GPU kernels, copies and memsets of a ``train.profile_steps`` trace (every
stream of every device) and prints, per step of the window:

- the span from the first GPU activity to the last, the time at least one stream was
  busy (the union over streams) and the time no stream was (idle);
- GPU time by kind of kernel (matrix products, attention, the loss kernel, fused
  pointwise, optimiser, copies, other), summed over streams (streams overlap, so the
  kinds add up to more than the busy time);
- the longest idle gaps, each with the kernels on either side and the CUDA runtime
  calls (per CPU thread) that overlap it: a gap with a ``cudaStreamSynchronize`` is a
  host wait, one with only launches is the host being slow to send work.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

# (kind, substrings of the kernel name), first match wins; names are compared lower-case.
KINDS = (
    ("loss kernel", ("_chunk_ce_kernel",)),
    ("attention (flex)", ("flex_attention", "flex_decoding", "triton_tem_fused_flex")),
    ("attention (target)", ("flash", "cudnn", "fmha", "sdpa")),
    ("matrix products", ("nvjet", "gemm", "cutlass", "sm90_xmma", "wgmma", "triton_tem_fused_mm", "splitk")),
    ("optimiser", ("multi_tensor_apply", "fused_adam", "adam", "foreach", "norm_kernel")),
    ("fused pointwise/reduction", ("triton_",)),
    ("copies and memsets", ("memcpy", "memset")),
)


def kind_of(name: str, category: str) -> str:
    low = name.lower()
    if category != "kernel":
        return "copies and memsets"
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other (aten)"


def union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def analyse(trace: dict, steps: int, top_gaps: int = 15, min_gap_us: float = 50.0) -> dict:
    """Figures of one trace (times in ms per step); see the module docstring."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and e.get("dur", 0) > 0]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not gpu:
        raise SystemExit("no GPU activity in the trace (was it recorded on a GPU?)")
    gpu.sort(key=lambda e: e["ts"])
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    busy = union_intervals(spans)
    first, last = busy[0][0], busy[-1][1]
    busy_us = sum(b - a for a, b in busy)
    by_kind: Counter = Counter()
    by_kernel: Counter = Counter()
    for e in gpu:
        by_kind[kind_of(e.get("name", ""), e["cat"])] += float(e["dur"])
        by_kernel[e.get("name", "?")[:80]] += float(e["dur"])

    gaps = []
    for (a0, a1), (b0, b1) in zip(busy, busy[1:]):
        if b0 - a1 >= min_gap_us:
            gaps.append((a1, b0))
    gaps.sort(key=lambda g: g[0] - g[1])
    by_start = {float(e["ts"]): e.get("name", "?") for e in gpu}
    end_names = {float(e["ts"]) + float(e["dur"]): e.get("name", "?") for e in gpu}
    described = []
    for g0, g1 in gaps[:top_gaps]:
        calls: dict = defaultdict(Counter)
        for r in runtime:
            r0, r1 = float(r["ts"]), float(r["ts"]) + float(r.get("dur", 0))
            if r1 > g0 and r0 < g1:
                calls[r.get("tid")][r.get("name", "?")] += min(r1, g1) - max(r0, g0)
        described.append({
            "at_ms": round((g0 - first) / 1000, 2), "gap_ms": round((g1 - g0) / 1000, 3),
            "after": end_names.get(g0, "?")[:60], "before": by_start.get(g1, "?")[:60],
            "host_calls": {str(tid): {n: round(us / 1000, 3) for n, us in c.most_common(3)} for tid, c in calls.items()},
        })
    per_step = lambda us: round(us / 1000 / max(1, steps), 2)  # noqa: E731
    idle_us = (last - first) - busy_us
    return {
        "steps": steps,
        "span_ms": per_step(last - first),
        "busy_ms": per_step(busy_us),
        "idle_ms": per_step(idle_us),
        "idle_gaps_over_50us_ms": per_step(sum(b - a for a, b in gaps)),
        "gaps_over_50us": round(len(gaps) / max(1, steps), 1),
        "by_kind_ms": {k: per_step(v) for k, v in by_kind.most_common()},
        "top_kernels_ms": {k: per_step(v) for k, v in by_kernel.most_common(25)},
        "longest_gaps": described,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="profile.json written by train.profile_steps")
    ap.add_argument("--steps", type=int, default=1, help="training steps in the profiled window (per-step figures)")
    ap.add_argument("--gaps", type=int, default=15, help="how many of the longest idle gaps to describe")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    print(json.dumps(analyse(trace, args.steps, args.gaps), indent=1))


if __name__ == "__main__":
    main()
