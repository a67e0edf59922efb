"""Turns benchmark results into the target checks, a Markdown table and plots for
docs/benchmarks.md."""

import os
from collections import defaultdict

import benchlib as B

DOC = os.path.join(B.ROOT, "docs", "benchmarks.md")
PLOTS = os.path.join(B.ROOT, "docs", "bench")
START, END = "<!-- compare:start -->", "<!-- compare:end -->"
COLORS = {"direct": "tab:blue", "pgbouncer": "tab:orange", "shoal": "tab:green"}


def index(results):
    by = {}
    for r in results:
        by[(r["workload"], r["mode"], r["connect"], r["clients"], r["target"])] = r
    return by


def ratio(a, b):
    return None if not a or not b else a / b


def summarize(results):
    by = index(results)
    keys = sorted({(r["workload"], r["mode"], r["connect"], r["clients"]) for r in results})
    lines = ["| check | configuration | Shoal | PgBouncer | direct | ratio | met |", "|---|---|---|---|---|---|---|"]

    def add(check, cfg, s, p, d, rat, met):
        f = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
        lines.append(f"| {check} | {cfg} | {f(s)} | {f(p)} | {f(d)} | {f(rat)} | {'yes' if met else 'NO' if met is not None else '-'} |")

    for (w, m, c, n) in keys:
        s, p, d = (by.get((w, m, c, n, t)) for t in ("shoal", "pgbouncer", "direct"))
        cfg = f"{w} {m}{' -C' if c else ''} c={n}"
        if not s or not p:
            continue
        if w == "select" and m in ("simple", "extended") and not c and n >= 50:
            rt = ratio(s["tps"], p["tps"])
            add("tps ≥ 1.2× PgBouncer", cfg, s["tps"], p["tps"], d and d["tps"], rt, rt is not None and rt >= 1.2)
        if not c:
            rc = ratio(s.get("cpu_us_per_tx"), p.get("cpu_us_per_tx"))
            add("CPU µs/tx ≤ 0.8× PgBouncer", cfg, s.get("cpu_us_per_tx"), p.get("cpu_us_per_tx"), None, rc,
                rc is not None and rc <= 0.8)
        if n == 1 and not c and d and d.get("p50_us") and s.get("p50_us") and p.get("p50_us"):
            sa, pa = s["p50_us"] - d["p50_us"], p["p50_us"] - d["p50_us"]
            add("added p50 µs ≤ PgBouncer's", cfg, float(sa), float(pa), float(d["p50_us"]), None, sa <= pa)
        if c:
            rt = ratio(s["tps"], p["tps"])
            add("-C tps ≥ PgBouncer", cfg, s["tps"], p["tps"], d and d["tps"], rt, rt is not None and rt >= 1.0)
    def name(r):
        return f"{r['target']} {r['workload']} {r['mode']}{' -C' if r['connect'] else ''} c={r['clients']}"

    failed = [r for r in results if r["failed"] > 0]
    broken = [r for r in results if not r.get("ok", True)]
    lines.append("")
    lines.append(f"Failed transactions: {sum(max(r['failed'], 0) for r in results)} in "
                 f"{len(failed)} of {len(results)} runs" + ("" if not failed else ": " + ", ".join(map(name, failed))))
    if broken:
        lines.append(f"Runs that did not complete ({len(broken)} of {len(results)}; not counted above): " + "; ".join(
            f"{name(r)}: {' '.join(r.get('error') or [])}" for r in broken))
    return "\n".join(lines)


def table(results):
    out = ["| workload | mode | -C | clients | target | tps | p50 ms | p95 ms | p99 ms | failed | CPU µs/tx | peak RSS MB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda v: "-" if v is None else f"{v / 1000:.2f}"  # noqa: E731
    for r in sorted(results, key=lambda r: (r["workload"], r["mode"], r["connect"], r["clients"], r["target"])):
        cpu = r.get("cpu_us_per_tx")
        rss = r.get("peak_rss_kb")
        out.append(f"| {r['workload']} | {r['mode']} | {'yes' if r['connect'] else 'no'} | {r['clients']} | {r['target']} | "
                   f"{r['tps']:.0f} | {ms(r['p50_us'])} | {ms(r['p95_us'])} | {ms(r['p99_us'])} | {r['failed']} | "
                   f"{'-' if cpu is None else f'{cpu:.1f}'} | {'-' if rss is None else f'{rss / 1024:.1f}'} |")
    return "\n".join(out)


def plots(results, quick):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(PLOTS, exist_ok=True)
    groups = defaultdict(lambda: defaultdict(list))
    for r in results:
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
            "### Targets", "", summary, "", "### Plots", ""]
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
