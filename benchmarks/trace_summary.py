"""Where the GPU time of a `jax.profiler` trace goes: kernels grouped by name.

Reads the ``*.xplane.pb`` a `jax.profiler.trace(DIR)` wrote and, for every GPU plane, sums the
kernel events of its stream lines by name. Printed per device: the traced span (first kernel
start to last kernel end), busy time (sum of kernel durations), the idle share of the span
(launch gaps and host waits), the number of kernels, and the top kernels by total time with
their count and mean duration. This answers "how many kernels per step and what do they cost"
without a trace viewer.

    python benchmarks/trace_summary.py DIR [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os

from jax.profiler import ProfileData


def summarize(trace_dir: str, top: int = 30) -> list[dict]:
    """One dict per GPU plane: span_us, busy_us, kernels, and `top` rows (name, count, total_us, mean_us)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    out = []
    for plane in ProfileData.from_file(files[-1]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        per_name = collections.defaultdict(lambda: [0, 0.0])
        start, end, busy, n = float("inf"), 0.0, 0.0, 0
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                acc = per_name[ev.name]
                acc[0] += 1
                acc[1] += ev.duration_ns
                start, end = min(start, ev.start_ns), max(end, ev.start_ns + ev.duration_ns)
                busy += ev.duration_ns
                n += 1
        rows = sorted(((k, c, t / 1e3, t / 1e3 / c) for k, (c, t) in per_name.items()), key=lambda r: -r[2])
        out.append(dict(device=plane.name, span_us=(end - start) / 1e3 if n else 0.0, busy_us=busy / 1e3,
                        kernels=n, top=rows[:top]))
    return out


def print_summary(trace_dir: str, top: int = 30) -> None:
    for dev in summarize(trace_dir, top):
        idle = 1 - dev["busy_us"] / dev["span_us"] if dev["span_us"] else 0.0
        print(f"{dev['device']}: span {dev['span_us']:.1f} us, kernels busy {dev['busy_us']:.1f} us "
              f"({100 * idle:.1f}% idle), {dev['kernels']} kernels")
        for name, count, total, mean in dev["top"]:
            print(f"  {total:10.1f} us {count:6d} x {mean:8.2f} us  {name[:110]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    print_summary(args.trace_dir, args.top)


if __name__ == "__main__":
    main()
