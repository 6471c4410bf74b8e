#!/usr/bin/env python3
"""Tables from the staged-path benchmark CSVs (build_and_run.sh prints them last).

  report.py --raw raw_pipeline.csv [--copy copy_rates.csv] [--gdr gdr_staged.csv]

--raw   raw_pipeline's CSV (mode,size,chunk,depth,iters,median_gbps,min_gbps,max_gbps;
        modes raw, naive, pinned; chunk and depth 0 where they do not apply).
--copy  copy_rates' CSV (what,chunk,depth,total_bytes,gbps).
--gdr   the gdr benchmark's CSV, same columns as raw_pipeline's; every mode in it
        that is not raw/naive/pinned is compared against the baselines: per size,
        gdr/raw at the same chunk and depth, gdr over the best raw of that size
        (any chunk and depth), gdr/naive and gdr/pinned, all on median GB/s.
Lines that are not CSV rows (a "[gdr-skip] ..." line, a repeated header) are
skipped. Exit status 1 if a file given cannot be read or holds no rows.
"""
import argparse
import csv
import sys

BASELINES = ("raw", "naive", "pinned")


def human(n):
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def load(path, fields, ints):
    rows = []
    try:
        with open(path, newline="") as f:
            for rec in csv.reader(f):
                if len(rec) != len(fields) or rec[0] == fields[0] or rec[0].startswith("["):
                    continue
                row = dict(zip(fields, rec))
                try:
                    for k in fields[1:]:
                        row[k] = int(row[k]) if k in ints else float(row[k])
                except ValueError:
                    continue
                rows.append(row)
    except OSError as e:
        sys.exit(f"report.py: {e}")
    if not rows:
        sys.exit(f"report.py: no rows in {path}")
    return rows


PIPE_FIELDS = ["mode", "size", "chunk", "depth", "iters", "median_gbps", "min_gbps", "max_gbps"]
PIPE_INTS = {"size", "chunk", "depth", "iters"}
COPY_FIELDS = ["what", "chunk", "depth", "total_bytes", "gbps"]
COPY_INTS = {"chunk", "depth", "total_bytes"}


def copy_table(rows):
    whats = ["d2h", "h2d", "memcpy_ring", "memcpy_big", "chain", "bidir_d2h", "bidir_h2d"]
    print("copy_rates (GB/s; min3 = min(d2h, memcpy_ring, h2d), what a pipeline of the three could reach):")
    keys = sorted({(r["chunk"], r["depth"]) for r in rows if r["depth"] > 0})
    big = {r["chunk"]: r["gbps"] for r in rows if r["what"] == "memcpy_big"}
    print(f"  {'chunk':>8} {'depth':>5} " + " ".join(f"{w:>11}" for w in whats) + f" {'min3':>7}")
    for chunk, depth in keys:
        got = {r["what"]: r["gbps"] for r in rows if r["chunk"] == chunk and r["depth"] == depth}
        got["memcpy_big"] = big.get(chunk, float("nan"))
        vals = " ".join(f"{got.get(w, float('nan')):11.2f}" for w in whats)
        m3 = min(got.get(w, float("inf")) for w in ("d2h", "memcpy_ring", "h2d"))
        print(f"  {human(chunk):>8} {depth:5d} {vals} {m3:7.2f}")


def baseline_table(rows):
    sizes = sorted({r["size"] for r in rows})
    print("raw_pipeline (median GB/s; best raw = the fastest chunk/depth of that size):")
    print(f"  {'size':>8} {'best raw':>9} {'at chunk/depth':>16} {'raw 1M/4':>9} {'naive':>7} {'pinned':>7}")
    for s in sizes:
        raw = [r for r in rows if r["mode"] == "raw" and r["size"] == s]
        best = max(raw, key=lambda r: r["median_gbps"]) if raw else None
        dflt = next((r for r in raw if r["chunk"] == 1 << 20 and r["depth"] == 4), None)
        naive = next((r for r in rows if r["mode"] == "naive" and r["size"] == s), None)
        pinned = next((r for r in rows if r["mode"] == "pinned" and r["size"] == s), None)
        f = lambda r: f"{r['median_gbps']:.2f}" if r else "-"
        at = f"{human(best['chunk'])}/{best['depth']}" if best else "-"
        print(f"  {human(s):>8} {f(best):>9} {at:>16} {f(dflt):>9} {f(naive):>7} {f(pinned):>7}")


def ratio_table(base, gdr):
    def ratio(a, b):
        return f"{a['median_gbps'] / b['median_gbps']:.2f}x" if a and b and b["median_gbps"] > 0 else "-"

    for mode in sorted({r["mode"] for r in gdr if r["mode"] not in BASELINES}):
        rows = sorted((r for r in gdr if r["mode"] == mode), key=lambda r: (r["size"], r["chunk"], r["depth"]))
        print(f"ratios, {mode} against the hand-written baselines (median GB/s):")
        print(f"  {'size':>8} {'chunk':>8} {'depth':>5} {mode + ' GB/s':>10} {'/raw':>7} {'/best raw':>9} {'/naive':>7} {'/pinned':>8}")
        for g in rows:
            s = g["size"]
            same = next((r for r in base if r["mode"] == "raw" and r["size"] == s and r["chunk"] == g["chunk"] and r["depth"] == g["depth"]), None)
            raw = [r for r in base if r["mode"] == "raw" and r["size"] == s]
            best = max(raw, key=lambda r: r["median_gbps"]) if raw else None
            naive = next((r for r in base if r["mode"] == "naive" and r["size"] == s), None)
            pinned = next((r for r in base if r["mode"] == "pinned" and r["size"] == s), None)
            print(f"  {human(s):>8} {human(g['chunk']):>8} {g['depth']:5d} {g['median_gbps']:10.2f} {ratio(g, same):>7} "
                  f"{ratio(g, best):>9} {ratio(g, naive):>7} {ratio(g, pinned):>8}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", required=True)
    ap.add_argument("--copy")
    ap.add_argument("--gdr")
    a = ap.parse_args()
    base = load(a.raw, PIPE_FIELDS, PIPE_INTS)
    if a.copy:
        copy_table(load(a.copy, COPY_FIELDS, COPY_INTS))
    baseline_table(base)
    if a.gdr:
        gdr = load(a.gdr, PIPE_FIELDS, PIPE_INTS)
        if not any(r["mode"] not in BASELINES for r in gdr):
            sys.exit(f"report.py: {a.gdr} has no rows of a mode other than {', '.join(BASELINES)}")
        ratio_table(base, gdr)


if __name__ == "__main__":
    main()
