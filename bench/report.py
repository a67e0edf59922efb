"""Turns benchmark results into the target checks, a Markdown table and plots for
docs/benchmarks.md."""

import os
from collections import defaultdict

import benchlib as B

DOC = os.path.join(B.ROOT, "docs", "benchmarks.md")
PLOTS = os.path.join(B.ROOT, "docs", "bench")
START, END = "<!-- compare:start -->", "<!-- compare:end -->"
COLORS = {"direct": "tab:blue", "pgbouncer": "tab:orange", "shoal": "tab:green", "pgbouncer-b": "tab:gray"}


CONTROL = "pgbouncer-b"


def median(vals):
    vals = sorted(v for v in vals if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def index(results):
    """One row per configuration and target: the median of its runs (--repeat)."""
    groups = defaultdict(list)
    for r in results:
        groups[(r["workload"], r["mode"], r["connect"], r["clients"], r["target"])].append(r)
    by = {}
    for key, rows in groups.items():
        ok = [r for r in rows if r.get("ok", True)] or rows
        by[key] = {
            **rows[0],
            "runs": len(rows),
            "failed": sum(max(r["failed"], 0) for r in rows),
            **{f: median(r.get(f) for r in ok) for f in ("tps", "cpu_us_per_tx", "p50_us", "p99_us", "peak_rss_kb")},
        }
    return by


def ratio(a, b):
    return None if not a or not b else a / b


def geomean(vals):
    vals = [v for v in vals if v]
    if not vals:
        return None
    import math
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


# The targets: (name, which configurations, metric, direction, bound).
TARGETS = [
    ("CPU µs/tx ≤ PgBouncer's", lambda w, m, c, n: not c, "cpu_us_per_tx", "le", 1.0),
    ("CPU µs/tx ≤ 0.8× PgBouncer's", lambda w, m, c, n: not c, "cpu_us_per_tx", "le", 0.8),
    ("-C CPU µs/tx ≤ PgBouncer's", lambda w, m, c, n: c, "cpu_us_per_tx", "le", 1.0),
    ("tps ≥ PgBouncer's", lambda w, m, c, n: True, "tps", "ge", 1.0),
    ("tps ≥ 1.2× PgBouncer's at 200-1000 clients", lambda w, m, c, n: not c and n >= 200, "tps", "ge", 1.2),
    ("p99 ≤ PgBouncer's at 200-1000 clients", lambda w, m, c, n: not c and n >= 200, "p99_us", "le", 1.0),
]


def summarize(results):
    """The targets met by Shoal and, as the yardstick, by the control (a second, identical
    PgBouncer): a check that the control fails as often as Shoal does is within this
    machine's noise."""
    by = index(results)
    keys = sorted({(r["workload"], r["mode"], r["connect"], r["clients"]) for r in results})
    has_control = any(r["target"] == CONTROL for r in results)
    f2 = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| target | configurations | met by Shoal | met by the control | Shoal/PgBouncer (geometric mean) "
             "| control/PgBouncer (geometric mean) |", "|---|---|---|---|---|---|"]
    for name, which, metric, direction, bound in TARGETS:
        shoal_r, control_r = [], []
        for (w, m, c, n) in keys:
            s, p, b = (by.get((w, m, c, n, t)) for t in ("shoal", "pgbouncer", CONTROL))
            if not s or not p or not which(w, m, c, n):
                continue
            shoal_r.append(ratio(s.get(metric), p.get(metric)))
            if b:
                control_r.append(ratio(b.get(metric), p.get(metric)))
        if not shoal_r:
            continue
        met = lambda rs: sum(1 for r in rs if r is not None and (r <= bound if direction == "le" else r >= bound))  # noqa: E731
        lines.append(f"| {name} | {len(shoal_r)} | {met(shoal_r)} | "
                     f"{met(control_r) if has_control else '-'} | {f2(geomean(shoal_r))} | "
                     f"{f2(geomean(control_r)) if has_control else '-'} |")
    lines += ["", "Per configuration (medians of the runs; in brackets the control's ratio to PgBouncer):", "",
              "| configuration | tps Shoal | tps PgBouncer | tps ratio | CPU µs/tx Shoal | CPU µs/tx PgBouncer "
              "| CPU ratio | p99 ms Shoal | p99 ms PgBouncer | p99 ratio | added p50 µs Shoal / PgBouncer |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (w, m, c, n) in keys:
        s, p, b, d = (by.get((w, m, c, n, t)) for t in ("shoal", "pgbouncer", CONTROL, "direct"))
        if not s or not p:
            continue

        def cell(metric):
            rs = ratio(s.get(metric), p.get(metric))
            rb = ratio(b.get(metric), p.get(metric)) if b else None
            return f"{f2(rs)}" + (f" ({f2(rb)})" if b else "")

        ms = lambda v: "-" if v is None else f"{v / 1000:.2f}"  # noqa: E731
        added = "-"
        if n == 1 and not c and d and d.get("p50_us") and s.get("p50_us") and p.get("p50_us"):
            added = f"{s['p50_us'] - d['p50_us']:.0f} / {p['p50_us'] - d['p50_us']:.0f}"
        lines.append(f"| {w} {m}{' -C' if c else ''} c={n} | {s['tps']:.0f} | {p['tps']:.0f} | {cell('tps')} | "
                     f"{f2(s.get('cpu_us_per_tx'))} | {f2(p.get('cpu_us_per_tx'))} | {cell('cpu_us_per_tx')} | "
                     f"{ms(s.get('p99_us'))} | {ms(p.get('p99_us'))} | {cell('p99_us')} | {added} |")

    def name(r):
        return f"{r['target']} {r['workload']} {r['mode']}{' -C' if r['connect'] else ''} c={r['clients']}"

    failed = [r for r in results if r["failed"] > 0]
    broken = [r for r in results if not r.get("ok", True)]
    lines.append("")
    total = sum(max(r['failed'], 0) for r in results)
    if failed:
        lines.append(f"Failed transactions: {total}, in {len(failed)} of {len(results)} runs: "
                     + ", ".join(map(name, failed)))
    else:
        lines.append(f"Failed transactions: none in any of the {len(results)} runs")
    if broken:
        lines.append(f"Runs that did not complete ({len(broken)} of {len(results)}; not counted above): " + "; ".join(
            f"{name(r)}: {' '.join(r.get('error') or [])}" for r in broken))
    return "\n".join(lines)


def table(results):
    out = ["| workload | mode | -C | clients | target | run | tps | p50 ms | p95 ms | p99 ms | failed | CPU µs/tx | peak RSS MB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda v: "-" if v is None else f"{v / 1000:.2f}"  # noqa: E731
    for r in sorted(results, key=lambda r: (r["workload"], r["mode"], r["connect"], r["clients"], r["target"],
                                            r.get("round", 0))):
        cpu = r.get("cpu_us_per_tx")
        rss = r.get("peak_rss_kb")
        out.append(f"| {r['workload']} | {r['mode']} | {'yes' if r['connect'] else 'no'} | {r['clients']} | {r['target']} | "
                   f"{r.get('round', 0) + 1} | {r['tps']:.0f} | {ms(r['p50_us'])} | {ms(r['p95_us'])} | {ms(r['p99_us'])} | {r['failed']} | "
                   f"{'-' if cpu is None else f'{cpu:.1f}'} | {'-' if rss is None else f'{rss / 1024:.1f}'} |")
    return "\n".join(out)


def plots(results, quick):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(PLOTS, exist_ok=True)
    groups = defaultdict(lambda: defaultdict(list))
    for r in index(results).values():
        if r["connect"]:
            continue
        groups[(r["workload"], r["mode"])][r["target"]].append(r)
    names = []
    suffix = "-quick" if quick else ""
    for metric, label in (("tps", "transactions/s"), ("p99_us", "p99 latency (ms)")):
        keys = sorted(groups)
        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for target, rows in sorted(groups[key].items()):
                rows = sorted(rows, key=lambda r: r["clients"])
                xs = [r["clients"] for r in rows]
                ys = [(r[metric] or 0) / (1000 if metric == "p99_us" else 1) for r in rows]
                ax.plot(xs, ys, marker="o", label=target, color=COLORS.get(target))
            ax.set_xscale("log")
            ax.set_title(f"{key[0]} / {key[1]}")
            ax.set_xlabel("clients")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"compare-{metric.split('_')[0]}{suffix}.png"
        fig.savefig(os.path.join(PLOTS, name), dpi=90)
        plt.close(fig)
        names.append(name)
    return names


def write_docs(meta, results, summary, quick):
    names = plots(results, quick)
    body = [START, "",
            f"Run of {meta['date']} (commit {meta['commit']}, {meta['cores']} cores, {meta['pgbouncer']}, "
            f"{meta['seconds']} s{', --quick' if quick else ''}; pool_size {meta['args']['pool_size']}, "
            f"{meta['args']['duration']} s per run)." + (
                "" if meta.get("pgbouncer_prepared") else
                f" `-M prepared` runs without PgBouncer: {meta['pgbouncer']} cannot follow protocol-level"
                " prepared statements in transaction mode (max_prepared_statements needs 1.21+)."), "",
            "### Targets", "",
            ("The control (`pgbouncer-b`) is a second PgBouncer with the same configuration, run in"
             " every configuration: what an identical pooler scores against PgBouncer here."
             if any(r["target"] == CONTROL for r in results) else ""), "",
            summary, "", "### Plots", ""]
    body += [f"![{n}](bench/{n})" for n in names]
    body += ["", "### All runs", "", table(results), "", END]
    text = open(DOC).read() if os.path.exists(DOC) else f"# Benchmarks\n\n{START}\n{END}\n"
    if START not in text:
        text += f"\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w") as f:
        f.write(head + "\n".join(body) + tail)


if __name__ == "__main__":
    # Re-renders docs/benchmarks.md from a saved run: python3 bench/report.py RESULTS.json
    import json
    import sys

    with open(sys.argv[1]) as f:
        data = json.load(f)
    summary = summarize(data["results"])
    write_docs(data["meta"], data["results"], summary, quick=data["meta"]["args"].get("quick", False))
    print(summary)
