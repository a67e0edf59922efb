"""Shared pieces of Shoal's benchmark scripts: throwaway PostgreSQL, Shoal and PgBouncer
processes, and process accounting from /proc.

Everything runs on loopback. As root, PostgreSQL and PgBouncer (which both refuse to run as
root) run as the `postgres` user.
"""

import base64
import glob
import hashlib
import hmac
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_USER = "bench"
BENCH_PASSWORD = "bench-pw"
BENCH_DB = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def scram_verifier(password, salt=b"shoal-bench-salt", iterations=4096):
    """A fixed SCRAM-SHA-256 verifier, given to PostgreSQL, PgBouncer and Shoal alike so that
    neither pooler runs PBKDF2 per login (PgBouncer derives fresh keys per login from a
    plain-text password) and PgBouncer can pass the client's SCRAM keys upstream."""
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored = hashlib.sha256(client_key).digest()
    server = hmac.new(salted, b"Server Key", "sha256").digest()
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored)}:{b64(server)}"


BENCH_SECRET = scram_verifier(BENCH_PASSWORD)


def hs256_jwt(secret, claims):
    """A JWT signed with HS256 (what realtime tenants verify)."""
    def b64(b):
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps(claims).encode())
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


def is_root():
    return os.geteuid() == 0


def as_pg(cmd):
    user = os.environ.get("SHOAL_BENCH_PG_USER", "postgres")
    return ["runuser", "-u", user, "--"] + cmd if is_root() else cmd


def pg_user_exists():
    import pwd
    try:
        pwd.getpwnam("postgres")
        return True
    except KeyError:
        return False


def pg_bindir():
    """PostgreSQL's programs: SHOAL_BENCH_PG_BIN (bench/manycore's bundle) or the newest installed."""
    if os.environ.get("SHOAL_BENCH_PG_BIN"):
        return os.environ["SHOAL_BENCH_PG_BIN"]
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    if not dirs:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    return dirs[-1]


_GIVEN_PORTS = set()


def free_port():
    """A port free now, below the kernel's ephemeral range: a port from that range may be
    taken, between this call and the server's bind, by one of the many connections a
    benchmark opens (a 55-node cluster's links once took a node's metrics port)."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(1000):
        port = random.randrange(10000, max(10001, low))
        if port in _GIVEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN_PORTS.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


def ensure_installed():
    """Installs PgBouncer and matplotlib if they are missing (Debian / PyPI)."""
    if not shutil.which("pgbouncer") and not os.path.exists("/usr/sbin/pgbouncer"):
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "pgbouncer"], check=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        subprocess.run(["python3", "-m", "pip", "install", "-q", "matplotlib"], check=True)


def build_shoal():
    """Release binaries, built where cargo puts them (CARGO_TARGET_DIR, if set)."""
    subprocess.run(["cargo", "build", "--release", "--bin", "shoal", "--bin", "loadgen", "--bin", "hop"],
                   cwd=ROOT, check=True)
    return os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"), "release")


class Workdir:
    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="shoal-bench-", dir="/tmp")
        os.chmod(self.path, 0o777)

    def file(self, name, text, mode=0o644):
        p = os.path.join(self.path, name)
        with open(p, "w") as f:
            f.write(text)
        os.chmod(p, mode)
        return p

    def cleanup(self):
        shutil.rmtree(self.path, ignore_errors=True)


class Postgres:
    """A throwaway cluster tuned for benchmarking (durability off)."""

    def __init__(self, work, max_connections=1200, extra_opts=""):
        self.bin = pg_bindir()
        self.port = free_port()
        self.data = os.path.join(work.path, "pg")
        pw = work.file("pgpw", "postgres\n")
        subprocess.run(as_pg([f"{self.bin}/initdb", "-D", self.data, "-U", "postgres",
                              "-A", "scram-sha-256", f"--pwfile={pw}", "--no-sync"]),
                       check=True, stdout=subprocess.DEVNULL)
        opts = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                f"-c unix_socket_directories={work.path} -c max_connections={max_connections} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                f"-c shared_buffers=512MB {extra_opts}")
        subprocess.run(as_pg([f"{self.bin}/pg_ctl", "-D", self.data, "-o", opts, "-l",
                              os.path.join(work.path, "pg.log"), "-w", "start"]),
                       check=True, stdout=subprocess.DEVNULL)
        self.psql(f"CREATE ROLE {BENCH_USER} LOGIN PASSWORD '{BENCH_SECRET}'")
        self.psql(f"CREATE DATABASE {BENCH_DB} OWNER {BENCH_USER}")

    def psql(self, sql, user="postgres", password="postgres", db="postgres"):
        out = subprocess.run(["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                              "-p", str(self.port), "-U", user, "-d", db, "-c", sql],
                             env=dict(os.environ, PGPASSWORD=password), check=True,
                             capture_output=True, text=True)
        return out.stdout.strip()

    def stop(self):
        subprocess.run(as_pg([f"{self.bin}/pg_ctl", "-D", self.data, "-m", "immediate", "stop"]),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Proc:
    """A pooler process whose CPU time and peak RSS we account."""

    def __init__(self, name, popen, port, pid=None):
        self.name, self.popen, self.port = name, popen, port
        self.pid = pid or popen.pid

    def cpu_split(self):
        """(user, kernel) CPU seconds so far."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # utime and stime are fields 14 and 15 of stat; after the ')' split they are 11, 12.
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK

    def cpu_seconds(self):
        return sum(self.cpu_split())

    def status_kb(self, key):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        return 0

    def rss_kb(self):
        return self.status_kb("VmRSS")

    def reset_peak(self):
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def peak_rss_kb(self):
        return self.status_kb("VmHWM")

    def stop(self):
        for pid in {self.pid, self.popen.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.popen.wait()


def make_cert(work):
    """A throwaway CA and a server certificate for localhost / 127.0.0.1 (EC P-256) signed by
    it, readable by the postgres user that PgBouncer runs as; returns (cert, key, ca)."""
    def path(name):
        return os.path.join(work.path, name)

    def openssl(*argv):
        subprocess.run(["openssl", *argv], check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", path("bench-ca-key.pem"), "-out", path("bench-ca.pem"),
            "-days", "2", "-subj", "/CN=shoal bench CA")
    openssl("req", *ec, "-keyout", path("bench-key.pem"), "-out", path("bench.csr"), "-subj", "/CN=localhost")
    ext = work.file("bench-ext.cnf", "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", path("bench.csr"), "-CA", path("bench-ca.pem"), "-CAkey", path("bench-ca-key.pem"),
            "-CAcreateserial", "-out", path("bench-cert.pem"), "-days", "2", "-extfile", ext)
    cert, key, ca = path("bench-cert.pem"), path("bench-key.pem"), path("bench-ca.pem")
    os.chmod(cert, 0o644)
    os.chmod(ca, 0o644)
    os.chmod(key, 0o600)
    if is_root():
        import pwd
        pw = pwd.getpwnam("postgres")
        os.chown(key, pw.pw_uid, pw.pw_gid)
        os.chown(cert, pw.pw_uid, pw.pw_gid)
    return cert, key, ca


def tls_section(tls):
    if not tls:
        return ""
    return f'\n[tls]\ncert_file = "{tls[0]}"\nkey_file = "{tls[1]}"\nclient_tls = "require"\n'


def start_shoal(work, release_dir, pg, pool_size, mode="transaction", extra_server="", workers=0, tls=None,
                extra="", env=None, extra_pool=""):
    port = free_port()
    cfg = work.file("shoal.toml", f"""
[server]
listen = ["127.0.0.1:{port}"]
max_client_conn = 100000
# A connect storm on 2 shared cores can have more than the default 10,000 logins in flight;
# PgBouncer has no such limit, so measure both without one.
max_logins_in_progress = 100000
listen_backlog = 4096
worker_threads = {workers}
{extra_server}

[pool]
pool_mode = "{mode}"
pool_size = {pool_size}
query_wait_timeout = 120
{extra_pool}

[databases.{BENCH_DB}]
host = "127.0.0.1"
port = {pg.port}

[users.{BENCH_USER}]
secret = "{BENCH_SECRET}"
server_password = "{BENCH_PASSWORD}"
""" + tls_section(tls) + extra)
    log = open(os.path.join(work.path, "shoal.log"), "w")
    p = subprocess.Popen([os.path.join(release_dir, "shoal"), "--config", cfg],
                         stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "SHOAL_LOG": os.environ.get("SHOAL_LOG", "warn"), **(env or {})})
    wait_port(port)
    return Proc("shoal", p, port)


def pgbouncer_exe():
    return os.environ.get("SHOAL_BENCH_PGBOUNCER") or shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def pgbouncer_version():
    """(major, minor, patch) of the installed PgBouncer, or None."""
    exe = pgbouncer_exe()
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"PgBouncer (\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else None


def pgbouncer_prepared_ok():
    """Whether the installed PgBouncer follows protocol-level prepared statements in
    transaction mode (max_prepared_statements, 1.21+)."""
    v = pgbouncer_version()
    return v is not None and v >= (1, 21, 0)


def start_pgbouncer(work, pg, pool_size, mode="transaction", tls=None, name="pgbouncer"):
    """Starts PgBouncer; `name` keeps a second instance's files apart (bench/compare's
    control: the same PgBouncer measured twice)."""
    port = free_port()
    users = work.file("userlist.txt", f'"{BENCH_USER}" "{BENCH_SECRET}"\n', 0o644)
    ini = work.file(f"{name}.ini", f"""
[databases]
{BENCH_DB} = host=127.0.0.1 port={pg.port} dbname={BENCH_DB}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = scram-sha-256
auth_file = {users}
pool_mode = {mode}
default_pool_size = {pool_size}
max_client_conn = 100000
max_db_connections = {pool_size}
listen_backlog = 4096
logfile = {work.path}/{name}.log
pidfile =
log_connections = 0
log_disconnections = 0
""" + ("max_prepared_statements = 200\n" if pgbouncer_prepared_ok() else "") + (f"client_tls_sslmode = require\nclient_tls_cert_file = {tls[0]}\nclient_tls_key_file = {tls[1]}\n" if tls else ""))
    exe = pgbouncer_exe()
    # runuser applies PAM limits (1024 descriptors); PgBouncer may raise its soft limit to
    # the hard one, as Shoal runs with.
    p = subprocess.Popen(as_pg(["sh", "-c", f'ulimit -n "$(ulimit -Hn)" && exec {exe} {ini}']),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    # runuser forks: account the pgbouncer process itself, not the wrapper.
    return Proc("pgbouncer", p, port, pid=find_child(p.pid, "pgbouncer"))


def find_child(parent, name, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    text = f.read()
            except OSError:
                continue
            comm = text[text.index("(") + 1:text.rindex(")")]
            ppid = int(text.rsplit(")", 1)[1].split()[1])
            pid = int(stat.split("/")[2])
            if comm == name and (ppid == parent or pid == parent):
                return pid
        time.sleep(0.05)
    return parent
