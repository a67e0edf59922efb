"""Plots of bench/cluster's results for docs/benchmarks.md: the relay's cost beside the owner
and PgBouncer, and the nodes' memory while a million clients connect and are held."""

import os

import benchlib as B

PLOTS = os.path.join(B.ROOT, "docs", "bench")
TARGETS = ("postgres", "owner", "relayed", "pgbouncer")
COLORS = {"postgres": "tab:blue", "owner": "tab:green", "relayed": "tab:red", "pgbouncer": "tab:orange"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(PLOTS, exist_ok=True)
    return plt


def relay(result, name="cluster-relay.png"):
    """CPU per transaction against the owner's, and p50 latency against PostgreSQL's direct,
    by workload and clients, for each target (ratios: select's and TPC-B's absolute values
    differ tenfold)."""
    rows = {(r["workload"], r["clients"], r["target"]): r for r in result["rows"]}
    groups = sorted({(w, c) for w, c, _ in rows})
    if not groups:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = (("cpu_us_per_tx", "owner", "pooler CPU per transaction, × the owner's",
               ("owner", "relayed", "pgbouncer"), 1.5),
              ("p50_us", "postgres", "p50 latency, × PostgreSQL's direct", TARGETS, None))
    for ax, (metric, base, label, targets, target_line) in zip(axes, panels):
        width = 0.8 / len(targets)
        for i, t in enumerate(targets):
            ys = []
            for w, c in groups:
                v, b = ((rows.get((w, c, x)) or {}).get(metric) for x in (t, base))
                ys.append(v / b if v and b else 0)
            xs = [g + (i - (len(targets) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, ys, width, label=t, color=COLORS[t])
        if target_line:
            ax.axhline(target_line, color="black", linestyle="--", linewidth=1)
            ax.text(len(groups) - 0.5, target_line, f"target {target_line}×", fontsize=8,
                    ha="right", va="bottom")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{'TPC-B' if w == 'tpcb' else w}\n{c} clients" for w, c in groups])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        # Room above the bars for the legend, in one row.
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        ax.legend(fontsize=8, loc="upper left", ncol=len(targets))
    fig.suptitle("The relay: through the owner, through a relaying node, through PgBouncer", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(PLOTS, name), dpi=90)
    plt.close(fig)
    return name


def hold(h, name="cluster-hold.png"):
    """The nodes' RSS and the kernel's slab over the hold, against the clients connected (the
    connects are paced, so their count follows the clock until all are in)."""
    series = h.get("series") if h else None
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ts = [s[0] for s in series]
    ax.plot(ts, [s[1] / 1024 for s in series], label="Shoal RSS, all nodes", color="tab:green")
    ax.plot(ts, [s[2] / 1024 for s in series], label="kernel slab", color="tab:gray")
    connect = h["connect_seconds"]
    ax.axvline(connect, color="black", linestyle=":", linewidth=1)
    ax.text(connect, ax.get_ylim()[1] * 0.95, f" {h['connected']:,} connected",
            fontsize=8, va="top")
    ax.set_xlabel("seconds since the first connect")
    ax.set_ylabel("growth (MB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"{h['clients']:,} clients over {h['nodes']} nodes: memory while they connect and are held",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(PLOTS, name), dpi=90)
    plt.close(fig)
    return name
