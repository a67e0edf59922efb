//! A throwaway single-member etcd (Debian's `etcd-server`) on free loopback ports, for the
//! cluster's tests. It can be stopped and started again on the same ports and data.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Etcd {
    child: Option<Child>,
    pub url: String,
    host: String,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts etcd on free ports. A port found free can be taken before etcd binds it (by
    /// another test's connection): etcd then exits, and it is started again on others.
    pub fn start() -> Etcd {
        Self::start_on("127.0.0.1")
    }

    /// As [`Etcd::start`], listening for clients on `host` (its peer port stays on
    /// loopback).
    pub fn start_on(host: &str) -> Etcd {
        let mut e = Etcd {
            host: host.to_owned(),
            child: None,
            client_port: 0,
            peer_port: 0,
            url: String::new(),
            dir: tempfile::tempdir().unwrap(),
        };
        for _ in 0..3 {
            e.client_port = super::free_port();
            e.peer_port = super::free_port();
            e.url = format!("http://{host}:{}", e.client_port);
            if e.run() {
                return e;
            }
            e.stop();
        }
        panic!("etcd did not start on three sets of free ports");
    }

    /// Starts etcd and waits until it is healthy; false if it exited first.
    fn run(&mut self) -> bool {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .args([
                "--name",
                "test",
                "--data-dir",
                self.dir.path().join("data").to_str().unwrap(),
                "--listen-client-urls",
                &self.url,
                "--advertise-client-urls",
                &self.url,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("test={peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd runs (Debian package etcd-server)");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !self.healthy() {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                return false;
            }
            assert!(std::time::Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    }

    /// Whether etcd answers its health check (HTTP, no client library needed).
    pub fn healthy(&self) -> bool {
        let Ok(mut s) = std::net::TcpStream::connect((self.host.as_str(), self.client_port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply.contains("\"health\":\"true\"")
    }

    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// Kills etcd (as a crash would).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.stop();
        assert!(self.run(), "etcd did not start again on its ports");
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}
