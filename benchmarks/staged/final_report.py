#!/usr/bin/env python3
"""Ratios of the staged path's measured round (tools/gpu/staged_final.sh).

    final_report.py DIR

DIR holds raw.csv, naive.csv, gdr_device.csv, gdr_pinned.csv (REPS rounds
appended, alternating), copy_rates.csv, loop1.csv, both.csv and lat.csv.
For each size: the median over rounds of each program's per-round median,
then the goals' ratios, each marked met or not met.
"""
import collections
import statistics
import sys


def rows(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                p = line.strip().split(",")
                if len(p) < 8 or not p[1].isdigit():
                    continue
                out.append((p[0], int(p[1]), int(p[2]), int(p[3]), float(p[5])))
    except FileNotFoundError:
        pass
    return out


def by(path, key):
    d = collections.defaultdict(list)
    for r in rows(path):
        d[key(r)].append(r[4])
    return {k: statistics.median(v) for k, v in d.items()}


def mib(n):
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def verdict(ok):
    return "met" if ok else "NOT met"


def main(d):
    raw = by(f"{d}/raw.csv", lambda r: (r[1], r[2]))          # (size, chunk)
    naive = by(f"{d}/naive.csv", lambda r: r[1])
    gdev = by(f"{d}/gdr_device.csv", lambda r: r[1])
    gpin = by(f"{d}/gdr_pinned.csv", lambda r: r[1])
    sizes = sorted(gdev)
    print("Staged Device -> Device over TCP, two processes (median GB/s over rounds)")
    print(f"{'size':>8} {'gdr Dev':>8} {'raw 1M':>7} {'raw 4M':>7} {'naive':>6} {'gdr Pin':>8} "
          f"{'/best raw':>9} {'/naive':>7} {'/Pinned':>8}")
    for n in sizes:
        r1, r4 = raw.get((n, 1 << 20), 0), raw.get((n, 4 << 20), 0)
        best = max(r1, r4)
        g, nv, p = gdev[n], naive.get(n, 0), gpin.get(n, 0)
        a = g / best if best else 0
        b = g / nv if nv else 0
        c = g / p if p else 0
        marks = [verdict(a >= 1.0), verdict(b >= 1.35) if n >= 64 << 20 else "-", verdict(c >= 0.95)]
        print(f"{mib(n):>8} {g:8.2f} {r1:7.2f} {r4:7.2f} {nv:6.2f} {p:8.2f} {a:8.2f}x {b:6.2f}x {c:7.2f}x"
              f"   {marks[0]} / {marks[1]} / {marks[2]}")
    # Wire not the bottleneck: loop1 at a chunk against min(d2h, memcpy, h2d) at that chunk.
    cr = collections.defaultdict(dict)
    try:
        with open(f"{d}/copy_rates.csv") as f:
            for line in f:
                p = line.strip().split(",")
                if len(p) >= 5 and p[1].isdigit():
                    cr[(int(p[1]), int(p[2]))][p[0]] = float(p[4])
    except FileNotFoundError:
        pass
    loop = by(f"{d}/loop1.csv", lambda r: (r[1], r[2]))
    print("\nIn one process, staging forced (loopback: the wire is a memcpy between the bounce pools)")
    for (n, chunk), g in sorted(loop.items()):
        c = cr.get((chunk, 4), {})
        if not c:
            continue
        m = min(c.get("d2h", 0), c.get("memcpy_ring", 0), c.get("h2d", 0))
        ratio = g / m if m else 0
        print(f"  {mib(n):>8} chunk {chunk >> 10:>5} KiB: gdr {g:6.2f} GB/s, min(d2h {c.get('d2h', 0):.1f}, memcpy "
              f"{c.get('memcpy_ring', 0):.1f}, h2d {c.get('h2d', 0):.1f}) = {m:.2f}: {ratio:.2f}x  {verdict(ratio >= 0.8)}")
    both = by(f"{d}/both.csv", lambda r: r[1])
    if both:
        print("\nBoth directions at once, one process (GB/s each way): " +
              ", ".join(f"{mib(n)} {v:.2f}" for n, v in sorted(both.items())))
    lat = by(f"{d}/lat.csv", lambda r: r[0])
    if lat:
        print("\n8-byte latency, half a round trip (us): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(lat.items())))
        if "lat_device" in lat and "lat_pinned" in lat:
            print(f"  two processes: Device adds {lat['lat_device'] - lat['lat_pinned']:.2f} us")
        if "lat1_device" in lat and "lat1_pinned" in lat:
            print(f"  one process:   Device adds {lat['lat1_device'] - lat['lat1_pinned']:.2f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
