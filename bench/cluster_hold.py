"""Very many clients held by a cluster (bench/cluster --hold N): enough Shoal nodes on one etcd
that none holds more than PER_NODE clients (a process may hold 20,000 descriptors here),
tools/loadgen spreading N clients over all of them from many source addresses, every client
querying once per --interval seconds. One pool, owned by one node: every other node relays its
clients there.

Reports connections held, connect errors, time to connect them all, QPS, latency
percentiles, Shoal RSS in total and per idle client (the growth over the nodes' RSS before
any client, divided by the clients), and the kernel's slab growth (sockets, mostly)."""

import json
import math
import os
import statistics
import subprocess
import threading
import time
import urllib.request

import benchlib as B

PER_NODE = 18_500
SEED_QUERY = "SELECT * FROM (VALUES (1,'one'),(2,'two'),(3,'three')) AS t (num, letter)"


def slab_kb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1])
    return 0


def net_counters():
    """Kernel counters that explain stalls on loopback: packets the per-CPU backlog dropped,
    and every TCP counter (retransmissions, timeouts, drops, memory pressure), by name."""
    out = {}
    with open("/proc/net/softnet_stat") as f:
        out["backlog_drops"] = sum(int(line.split()[1], 16) for line in f)
    for path, prefix in (("/proc/net/snmp", "Tcp:"), ("/proc/net/netstat", "TcpExt:")):
        with open(path) as f:
            rows = [line.split() for line in f if line.startswith(prefix)]
        header, values = rows[0], rows[1]
        for name, value in zip(header[1:], values[1:]):
            if name not in ("RtoAlgorithm", "RtoMin", "RtoMax", "MaxConn", "CurrEstab"):
                out[name] = int(value)
    return out


def init_cpu_s():
    """CPU seconds the machine's init process has used. On this VM it is the sandbox's agent,
    which looks over the sockets about once a second at a cost that grows with them: it is
    CPU the held clients cost that is neither Shoal's nor the load's."""
    try:
        with open("/proc/1/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def tcp_mem_pages():
    """Pages the kernel has given TCP socket buffers (compare with tcp_mem)."""
    with open("/proc/net/sockstat") as f:
        for line in f:
            if line.startswith("TCP:"):
                w = line.split()
                return int(w[w.index("mem") + 1])
    return 0


def scrape(node, timeout=10):
    """A node's /metrics text, or None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


def histograms(nodes):
    """Each node's `shoal_pool_{wait,query,transaction}_seconds` buckets, summed over its
    pools: {(node index, family): {le: count}}."""
    out = {}
    for i, x in enumerate(nodes):
        for line in (scrape(x) or "").splitlines():
            for fam in ("wait", "query", "transaction"):
                name = f"shoal_pool_{fam}_seconds_bucket{{"
                if line.startswith(name):
                    le = line.split('le="')[1].split('"')[0]
                    h = out.setdefault((i, fam), {})
                    h[le] = h.get(le, 0) + float(line.rsplit(" ", 1)[1])
    return out


def rejections(nodes):
    """Logins the nodes refused, by reason (`shoal_connections_rejected_total`), summed."""
    out = {}
    for x in nodes:
        for line in (scrape(x) or "").splitlines():
            if line.startswith("shoal_connections_rejected_total{"):
                n = float(line.rsplit(" ", 1)[1])
                if n:
                    reason = line.split('reason="')[1].split('"')[0]
                    out[reason] = out.get(reason, 0) + int(n)
    return out


def slow_share(before, after, fam, nodes, at):
    """Of what the owner (`at`) and the relaying nodes counted in family `fam` during the
    hold: how many, and how many took over 100 ms and over 1 s (Shoal's own view of the
    tail, beside loadgen's)."""
    rows = {}
    for who, idx in (("owner", [at]), ("relaying", [i for i in range(len(nodes)) if i != at])):
        total = over_100ms = over_1s = 0.0
        for i in idx:
            a, b = before.get((i, fam), {}), after.get((i, fam), {})
            d = {le: b.get(le, 0) - a.get(le, 0) for le in b}
            inf = d.get("+Inf", 0)
            total += inf
            below = lambda limit: max((v for le, v in d.items() if le != "+Inf" and float(le) <= limit), default=0)  # noqa: E731
            over_100ms += inf - below(0.1)
            over_1s += inf - below(1.0)
        rows[who] = {"count": int(total), "over_100ms": int(over_100ms), "over_1s": int(over_1s)}
    return rows


def pool_gauges(node):
    """The owner's pool gauges now: clients waiting and active, servers in use and open."""
    out = {}
    for line in (scrape(node, timeout=5) or "").splitlines():
        for g in ("clients_waiting", "clients_active", "servers_in_use", "servers"):
            if line.startswith(f"shoal_pool_{g}{{"):
                out[g] = out.get(g, 0) + float(line.rsplit(" ", 1)[1])
    return out


class Sampler:
    """Samples the nodes' summed RSS and the kernel's slab every second, in a thread."""

    def __init__(self, nodes, owner=None):
        self.nodes, self.samples, self.stop = nodes, [], threading.Event()
        self.owner, self.pool = owner, []
        self.started = time.time()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            each = [n.rss_kb() for n in self.nodes]
            self.samples.append((time.time() - self.started, sum(each), slab_kb(), max(each), each,
                                 tcp_mem_pages(), init_cpu_s()))
            if self.owner is not None:
                self.pool.append((time.time() - self.started, pool_gauges(self.owner),
                                  [round(n.cpu_seconds(), 2) for n in self.nodes]))
            self.stop.wait(1.0)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return self.samples


def first_in_line(pids, pg):
    """The pool's owner and PostgreSQL first in line for the CPU (nice -20), every thread of
    them (and PostgreSQL's backends to come, which inherit it). In production each has
    machines of its own; here they share two cores with every relaying node and a million
    connecting clients, and at an equal share the one node all queries go through got a
    tenth of a core while its clients queued for minutes."""
    try:
        with open(os.path.join(pg.data, "postmaster.pid")) as f:
            postmaster = int(f.readline())
        pids = list(pids) + [postmaster] + [int(c) for c in open(f"/proc/{postmaster}/task/{postmaster}/children").read().split()]
    except (OSError, ValueError, AttributeError):
        pass
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), -20)
            except OSError:
                pass


def run_hold(work, release, pg, n, args, etcd_cls, start_node, owns, psql_one):
    """Holds `n` clients over a fresh cluster; returns the measurements."""
    # etcd first in line for the CPU: in production it runs on machines of its own, and here
    # a million clients connecting starved it until the nodes' leases lapsed.
    etcd = etcd_cls(work, "etcd-hold", nice=-10)
    count = args.hold_nodes or max(2, math.ceil(n / PER_NODE))
    nodes = []
    try:
        started = time.time()
        for i in range(count):
            nodes.append(start_node(work, release, pg, etcd, f"h{i:02}", args.pool_size))
        print(f"hold: {count} nodes up in {time.time() - started:.1f} s", flush=True)
        if not psql_one(nodes[0].port):
            raise RuntimeError("the cluster serves no query")
        owner = next((x for x in nodes if owns(x)), None)
        first_in_line([owner.pid] if owner else [], pg)
        time.sleep(2.0)
        each0 = [x.rss_kb() for x in nodes]
        rss0 = sum(each0)
        slab0 = slab_kb()
        cpu0 = sum(x.cpu_seconds() for x in nodes)
        out_json = os.path.join(work.path, f"loadgen-hold-{n}.json")
        cmd = [os.path.join(release, "loadgen"), "--port", ",".join(str(x.port) for x in nodes),
               "--user", B.BENCH_USER, "--password", B.BENCH_PASSWORD, "--dbname", B.BENCH_DB,
               "-n", str(n), "--interval", str(args.interval), "--duration", str(args.hold_seconds),
               "--query", SEED_QUERY, "--source-octet", "40", "--steady-only", "--json", out_json,
               "--slow-log", work.path, "--slow-ms", "20"]
        if args.connect_rate:
            cmd += ["--connect-rate", str(args.connect_rate)]
        net0 = net_counters()
        hist0 = histograms(nodes)
        sampler = Sampler(nodes, owner)
        with open(os.path.join(work.path, "loadgen.err"), "w") as err:
            lg = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err)
        samples = sampler.finish()
        last_cpu = None
        for t, g, cpu in sampler.pool:
            d = [round(b - a, 2) for a, b in zip(last_cpu, cpu)] if last_cpu else []
            last_cpu = cpu
            print(f"hold: t={t:5.1f} owner pool {g} node cpu/s {d}", flush=True)
        net = {k: v - net0.get(k, 0) for k, v in net_counters().items() if v != net0.get(k, 0)}
        hist1 = histograms(nodes)
        at = nodes.index(owner) if owner else 0
        shoal_view = {fam: slow_share(hist0, hist1, fam, nodes, at) for fam in ("wait", "query", "transaction")}
        print(f"hold: Shoal's own view: {shoal_view}", flush=True)
        print(f"hold: logins refused by the nodes: {rejections(nodes)}", flush=True)
        print(f"hold: kernel during the hold: {net}", flush=True)
        print(f"hold: TCP buffer pages, peak {max(s[5] for s in samples)}; tcp_mem "
              f"{open('/proc/sys/net/ipv4/tcp_mem').read().split()}", flush=True)
        slow_report(work.path, nodes, at)
        cpu = sum(x.cpu_seconds() for x in nodes) - cpu0
        if lg.returncode != 0 or not os.path.exists(out_json):
            raise RuntimeError(f"loadgen failed ({lg.returncode})")
        with open(out_json) as f:
            summary = json.load(f)
        if summary["errors"]:
            print(f"hold: loadgen errors: {summary['errors']}", flush=True)
        # Steady state: the last quarter of the hold, before the clients leave.
        connect_s = summary.get("connect_seconds") or 0
        hold_end = connect_s + args.hold_seconds
        steady = [s for s in samples if hold_end - args.hold_seconds / 4 <= s[0] <= hold_end - 1] or samples
        rss = statistics.median(s[1] for s in steady)
        span = steady[-1][0] - steady[0][0]
        init_cores = (steady[-1][6] - steady[0][6]) / span if span > 0 else None
        slab = statistics.median(s[2] for s in steady)
        # Shoal's CPU in the steady state, owner and relaying nodes apart, and per query.
        window = [p for p in sampler.pool if hold_end - args.hold_seconds / 4 <= p[0] <= hold_end - 1]
        steady_cpu = None
        if len(window) >= 2 and owner:
            dt = window[-1][0] - window[0][0]
            used = [b - a for a, b in zip(window[0][2], window[-1][2])]
            owner_cores, all_cores = used[at] / dt, sum(used) / dt
            steady_cpu = {"owner_cores": round(owner_cores, 3), "all_cores": round(all_cores, 3),
                          "owner_us_per_query": round(owner_cores * 1e6 / max(1, summary["qps"]), 1),
                          "all_us_per_query": round(all_cores * 1e6 / max(1, summary["qps"]), 1)}
            print(f"hold: steady-state Shoal CPU {steady_cpu}", flush=True)
        held = summary["held_at_end"]
        # Where the memory went: the owner serves its own clients and every relayed one; a
        # relaying node holds only its own (relayed) clients.
        last = steady[len(steady) // 2][4]
        per_node = summary["connected"] / count
        growth = [(b - a) * 1024 for a, b in zip(each0, last)]
        relaying = [g for i, g in enumerate(growth) if i != at]
        return {
            "clients": n, "nodes": count, "owner": owner.popen.pid if owner else None,
            "connected": summary["connected"], "held_at_end": held,
            "connect_seconds": connect_s, "qps": summary["qps"],
            "latency_ms": summary["latency_ms"], "errors": summary["errors"],
            "rss0_kb": rss0, "rss_kb": rss, "peak_rss_kb": max(s[1] for s in samples),
            "max_node_rss_kb": max(s[3] for s in samples),
            "bytes_per_client": (rss - rss0) * 1024 / max(1, summary["connected"]),
            "slab_growth_kb": slab - slab0,
            "slab_bytes_per_connection": (slab - slab0) * 1024 / max(1, summary["connected"]),
            "shoal_cpu_s": cpu,
            "init_cpu_cores": init_cores,
            "steady_cpu": steady_cpu,
            "kernel": net,
            "shoal_view": shoal_view,
            "owner_growth_kb": growth[at] / 1024,
            "bytes_per_relayed_client_on_its_node": statistics.mean(relaying) / per_node if relaying else None,
            # For the plot in docs/benchmarks.md: seconds since loadgen started, the nodes'
            # RSS and the kernel's slab, in kB, every 5 s.
            "series": [(round(s[0], 1), s[1] - rss0, s[2] - slab0) for s in samples[::5]],
        }
    finally:
        for x in nodes:
            x.stop()
        warnings = node_warnings(nodes)
        for what, count in warnings[:25]:
            print(f"hold: {count} x {what}", flush=True)
        for x in nodes:
            if os.environ.get("KEEP_LOGS"):
                print(f"hold: log kept at {x.log}", flush=True)
            else:
                x.work.cleanup()
        etcd.stop()


def slow_report(path, nodes, at):
    """Where loadgen's slow queries (over its --slow-ms) were: by node and by second, to tell
    one node's stall from a stall of all."""
    rows = []
    for name in os.listdir(path):
        if name.startswith("slow-") and name.endswith(".txt"):
            with open(os.path.join(path, name)) as f:
                rows += [tuple(int(v) for v in line.split()) for line in f if line.strip()]
            os.remove(os.path.join(path, name))
    if not rows:
        print("hold: no slow queries", flush=True)
        return
    ports = {x.port: i for i, x in enumerate(nodes)}
    by_node, by_second, by_end = {}, {}, {}
    t0 = min(r[0] for r in rows)
    for start, ms, port in rows:
        i = ports.get(port, -1)
        by_node[i] = by_node.get(i, 0) + 1
        s = (start - t0) // 1000
        by_second.setdefault(s, []).append(ms)
        e = (start + ms - t0) // 100
        by_end[e] = by_end.get(e, 0) + 1
    print(f"hold: {len(rows)} slow queries; by node (owner {at}): {dict(sorted(by_node.items()))}", flush=True)
    for s, v in sorted(by_second.items()):
        print(f"hold:   +{s:>3}s started {len(v):>5} slow, max {max(v)} ms", flush=True)
    print("hold: slow queries ended (+tenths of a second: count): "
          + ", ".join(f"{e / 10:.1f}: {c}" for e, c in sorted(by_end.items())), flush=True)


def node_warnings(nodes):
    """The nodes' warnings and errors, by message, most frequent first."""
    counts = {}
    for x in nodes:
        try:
            with open(x.log) as f:
                for line in f:
                    if " WARN " in line or " ERROR " in line or " INFO " in line:
                        # The level and the message, without the timestamp and the fields.
                        words = line.split()[1:]
                        what = " ".join(w if "=" not in w or w.startswith("reason=") or w.startswith("why=") else ""
                                        for w in words).split()
                        what = " ".join(what)[:140]
                        counts[what] = counts.get(what, 0) + 1
        except OSError:
            pass
    return sorted(counts.items(), key=lambda kv: -kv[1])


def render(h):
    lat = h["latency_ms"]
    errs = sum(h["errors"].values())
    return "\n".join([
        "| clients | nodes | held | connect errors | connect s | QPS | p50 ms | p95 ms | p99 ms "
        "| Shoal RSS MB (before → held) | bytes per idle client | kernel slab per connection |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {h['clients']} | {h['nodes']} | {h['held_at_end']} | {errs} | {h['connect_seconds']:.1f} "
        f"| {h['qps']:.0f} | {lat.get('p50', 0):.2f} | {lat.get('p95', 0):.2f} | {lat.get('p99', 0):.2f} "
        f"| {h['rss0_kb'] / 1024:.0f} → {h['rss_kb'] / 1024:.0f} | {h['bytes_per_client']:.0f} "
        f"| {h['slab_bytes_per_connection']:.0f} |",
    ])
