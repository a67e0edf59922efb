//! A primary with streaming replicas on loopback, made as an operator would: `initdb` for the
//! primary, `pg_basebackup -R` for each standby.

use std::time::{Duration, Instant};

use super::{free_port, pg_command, postgres_dir, Pg, CLUSTERS};

/// Server options a primary needs to stream to standbys.
const PRIMARY_OPTS: &str =
    "-c wal_level=replica -c max_wal_senders=10 -c wal_keep_size=256MB -c hot_standby=on";

pub struct Replicated {
    pub primary: Pg,
    pub replicas: Vec<Pg>,
}

impl Replicated {
    /// A primary and `n` streaming replicas, each caught up.
    pub fn start(n: usize) -> Replicated {
        let primary = Pg::start_with(free_port(), &[], PRIMARY_OPTS);
        let replicas = (0..n).map(|_| standby_of(&primary)).collect();
        let r = Replicated { primary, replicas };
        r.wait_caught_up();
        r
    }

    /// Waits until every running replica has replayed all the primary has written.
    pub fn wait_caught_up(&self) {
        let target = self.primary.psql_admin("SELECT pg_current_wal_lsn()");
        for r in &self.replicas {
            wait_replayed(r, &target);
        }
    }

    /// Shoal's configuration serving `db` on the primary with these replicas (checked
    /// every 100 ms unless `keys` says otherwise), `keys` more database keys and `extra`
    /// sections.
    pub fn shoal_config(&self, db: &str, keys: &str, extra: &str) -> String {
        let replicas: Vec<String> = self
            .replicas
            .iter()
            .map(|p| format!("{{ host = \"127.0.0.1\", port = {} }}", p.port))
            .collect();
        let base = super::base_config(&self.primary, &[db], extra);
        let section = format!("port = {}\n", self.primary.port);
        let interval = if keys.contains("replica_check_interval") {
            ""
        } else {
            "replica_check_interval = 0.1\n"
        };
        base.replacen(
            &section,
            &format!(
                "{section}replicas = [{}]\n{interval}replica_ban_time = 0.5\n{keys}\n",
                replicas.join(", ")
            ),
            1,
        )
    }
}

/// Waits until `replica` has replayed up to `lsn`.
pub fn wait_replayed(replica: &Pg, lsn: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let behind = replica.psql_admin(&format!(
            "SELECT pg_wal_lsn_diff('{lsn}', COALESCE(pg_last_wal_replay_lsn(), '0/0')) > 0"
        ));
        if behind == "f" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replica on port {} never caught up",
            replica.port
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A hot standby of `primary`, streaming from it.
fn standby_of(primary: &Pg) -> Pg {
    let dir = postgres_dir("shoal-test-replica");
    let out = pg_command(&primary.bin("pg_basebackup"))
        .arg("-d")
        .arg(format!(
            "host=127.0.0.1 port={} user=postgres password=postgres",
            primary.port
        ))
        .arg("-D")
        .arg(dir.join("db"))
        .args(["-R", "-X", "stream", "--no-sync", "-c", "fast"])
        .output()
        .expect("pg_basebackup runs");
    assert!(
        out.status.success(),
        "pg_basebackup failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    CLUSTERS
        .lock()
        .unwrap()
        .push((primary.bin.clone(), dir.clone()));
    let replica = Pg {
        port: free_port(),
        dir,
        bin: primary.bin.clone(),
        extra_opts:
            "-c hot_standby=on -c hot_standby_feedback=on -c wal_receiver_status_interval=1".into(),
    };
    replica.pg_ctl_start();
    replica
}

/// Promotes a standby to primary (as an operator or a failover manager would), waiting
/// until it accepts writes.
pub fn promote(replica: &Pg) {
    let out = pg_command(&replica.bin("pg_ctl"))
        .arg("-D")
        .arg(replica.dir.join("db"))
        .args(["-w", "promote"])
        .output()
        .expect("pg_ctl runs");
    assert!(
        out.status.success(),
        "pg_ctl promote failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A primary with two replicas and a database `db` with table `t` (and sequence `s`) on all
/// three, caught up.
pub fn with_table(db: &str) -> Replicated {
    let r = Replicated::start(2);
    r.primary.create_database(db);
    psql_in(
        &r.primary,
        db,
        "CREATE TABLE t (id serial PRIMARY KEY, v int NOT NULL); CREATE SEQUENCE s;",
    );
    r.wait_caught_up();
    r
}

/// The port of the server a query through `c` ran on.
pub async fn port_of(c: &tokio_postgres::Client) -> u16 {
    let row = c.query_one("SELECT inet_server_port()", &[]).await.unwrap();
    row.get::<_, i32>(0) as u16
}

/// Waits until reads through `c` reach a replica (the first checks have run).
pub async fn until_reads_reach_replicas(r: &Replicated, c: &tokio_postgres::Client) {
    let replica_ports: Vec<u16> = r.replicas.iter().map(|p| p.port).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !replica_ports.contains(&port_of(c).await) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reads never reached a replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `sql` in `db` on `pg` as `app`; its output.
pub fn psql_in(pg: &Pg, db: &str, sql: &str) -> String {
    let conn = format!(
        "host=127.0.0.1 port={} user=app password={} dbname={db}",
        pg.port,
        super::APP_PASSWORD
    );
    let out = std::process::Command::new("psql")
        .args(["-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", &conn, "-c", sql])
        .output()
        .expect("psql");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
