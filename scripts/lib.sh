# Shared shell helpers: installing prerequisites and running throwaway PostgreSQL clusters.
# PostgreSQL refuses to run as root, so as root its programs run as the `postgres` user.

pg_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && echo "$d"; done | sort -V | tail -n 1
}

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

ensure_packages() {
  local missing=()
  [ -n "$(pg_bindir)" ] || missing+=(postgresql postgresql-contrib)
  command -v psql >/dev/null || missing+=(postgresql-client)
  command -v cc >/dev/null || missing+=(build-essential)
  command -v curl >/dev/null || missing+=(curl)
  # The upstream TLS tests encrypt a client key with the openssl command.
  command -v openssl >/dev/null || missing+=(openssl)
  # Building Shoal: protoc for the etcd client's gRPC code, libclang for the bindings of
  # libpg_query (PostgreSQL's parser, which proves statements read-only for replicas).
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  ls /usr/lib/llvm-*/lib/libclang*.so >/dev/null 2>&1 || missing+=(libclang-dev)
  if [ "${#missing[@]}" -gt 0 ]; then
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# What the whole test suite needs beyond running Shoal: etcd for the cluster's tests.
ensure_test_packages() {
  local missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  # The realtime tests drive Supabase's realtime-js (tests/clients/realtime) on Node.js.
  command -v node >/dev/null || missing+=(nodejs)
  command -v npm >/dev/null || missing+=(npm)
  # The dashboard's test drives Debian's Chromium, headless (tests/clients/dashboard).
  command -v chromium >/dev/null || missing+=(chromium)
  if [ "${#missing[@]}" -gt 0 ]; then
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# Shoal needs Rust 1.87 or newer (Cargo.toml's rust-version).
ensure_rust() {
  if ! command -v cargo >/dev/null; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! command -v cargo >/dev/null && curl -sSf --max-time 10 -o /tmp/rustup-init.sh https://sh.rustup.rs 2>/dev/null; then
    sh /tmp/rustup-init.sh -y --profile minimal -c rustfmt,clippy
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! command -v cargo >/dev/null; then
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get install -y -qq cargo rustc >/dev/null 2>&1 || true
  fi
  local v
  v=$(rustc --version 2>/dev/null | awk '{print $2}')
  if [ -z "$v" ] || [ "$(printf '%s\n1.87.0\n' "$v" | sort -V | head -n 1)" != "1.87.0" ]; then
    echo "Shoal needs Rust 1.87 or newer (found: ${v:-none}). Install it with rustup" >&2
    echo "(https://rustup.rs: curl -sSf https://sh.rustup.rs | sh) or from a newer" >&2
    echo "distribution package, then run this again." >&2
    return 1
  fi
}

pg_port_busy() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# start_throwaway_pg DATADIR PORT [extra postgres -c settings...]
start_throwaway_pg() {
  local data=$1 port=$2; shift 2
  local bin; bin=$(pg_bindir)
  mkdir -p "$data"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$data"
  local pwfile="$data.pw"
  echo postgres > "$pwfile"; chmod 644 "$pwfile"
  as_pg "$bin/initdb" -D "$data/db" -U postgres --pwfile="$pwfile" -A scram-sha-256 >/dev/null
  rm -f "$pwfile"
  local opts="-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$data"
  for o in "$@"; do opts="$opts -c $o"; done
  as_pg "$bin/pg_ctl" -D "$data/db" -o "$opts" -l "$data/log" -w start >/dev/null
}

stop_throwaway_pg() {
  local bin; bin=$(pg_bindir)
  as_pg "$bin/pg_ctl" -D "$1/db" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$1"
}

# psql_admin DATADIR PORT args... : psql as the postgres superuser
psql_admin() {
  local data=$1 port=$2; shift 2
  PGPASSWORD=postgres psql -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 "$@"
}

# Client libraries for the compatibility suite (tests/clients/).
ensure_client_libs() {
  local root; root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  # pip only when the libraries are not installed yet.
  local req="$root/tests/clients/python/requirements.txt"
  if ! python3 -c "import psycopg, asyncpg, prometheus_client, schemathesis, realtime" 2>/dev/null; then
    python3 -m pip install -q --disable-pip-version-check -r "$req" 2>&1 \
      | grep -v "Running pip as the 'root' user" || true
  fi
  if command -v go >/dev/null; then
    (cd "$root/tests/clients/go" && go mod download)
  fi
  if command -v mvn >/dev/null && [ ! -f "$root/tests/clients/java/lib/postgresql-42.7.4.jar" ]; then
    (cd "$root/tests/clients/java" && mvn -q dependency:copy \
      -Dartifact=org.postgresql:postgresql:42.7.4 -DoutputDirectory=lib)
  fi
  if command -v npm >/dev/null && [ ! -d "$root/tests/clients/node/node_modules/pg" ]; then
    (cd "$root/tests/clients/node" && npm install --silent --no-audit --no-fund >/dev/null)
  fi
  if command -v npm >/dev/null \
    && [ ! -d "$root/tests/clients/realtime/node_modules/@supabase/realtime-js" ]; then
    (cd "$root/tests/clients/realtime" && npm install --silent --no-audit --no-fund >/dev/null)
  fi
  if command -v npm >/dev/null \
    && [ ! -d "$root/tests/clients/dashboard/node_modules/playwright-core" ]; then
    (cd "$root/tests/clients/dashboard" && npm install --silent --no-audit --no-fund >/dev/null)
  fi
}
