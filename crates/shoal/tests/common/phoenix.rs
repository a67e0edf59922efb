//! A bare Phoenix (protocol 1.0 JSON) client over a real WebSocket, for what the official
//! clients cannot do on purpose: send malformed frames, stop reading, stop heartbeating.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

pub type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

pub struct Phx {
    pub ws: Ws,
    next_ref: u64,
}

/// How a socket ended.
#[derive(Debug)]
pub enum Ended {
    Closed(Option<CloseFrame>),
    /// The connection dropped without a close frame.
    Dropped,
}

/// How long a read waits with nothing arriving.
const WAIT: Duration = Duration::from_secs(15);
/// How long [`Phx::until`] waits in all while other messages arrive: long enough for a
/// capture to start on a loaded machine, short enough that a lost message fails the test.
const UNTIL_WAIT: Duration = Duration::from_secs(60);

/// The upgrade URL for `tenant` with `token`.
pub fn url(rt: SocketAddr, tenant: &str, token: &str) -> String {
    format!("ws://{rt}/t/{tenant}/socket/websocket?vsn=1.0.0&apikey={token}")
}

impl Phx {
    /// Connects, or the refusal's status and body.
    pub async fn connect(rt: SocketAddr, tenant: &str, token: &str) -> Result<Phx, (u16, String)> {
        Phx::connect_with(rt, tenant, token, None).await
    }

    /// Connects with a small receive buffer, when `rcvbuf` is given (a reader that stalls
    /// soon).
    pub async fn connect_with(
        rt: SocketAddr,
        tenant: &str,
        token: &str,
        rcvbuf: Option<u32>,
    ) -> Result<Phx, (u16, String)> {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        if let Some(n) = rcvbuf {
            sock.set_recv_buffer_size(n).unwrap();
        }
        let tcp = sock.connect(rt).await.unwrap();
        match tokio_tungstenite::client_async(url(rt, tenant, token), tcp).await {
            Ok((ws, _)) => Ok(Phx { ws, next_ref: 1 }),
            Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
                let body = r
                    .body()
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default();
                Err((r.status().as_u16(), body))
            }
            Err(e) => panic!("upgrade failed: {e}"),
        }
    }

    /// Sends a message; its ref.
    pub async fn push(&mut self, topic: &str, event: &str, payload: serde_json::Value) -> String {
        let r = self.next_ref.to_string();
        self.next_ref += 1;
        let m = serde_json::json!({
            "topic": topic, "event": event, "payload": payload, "ref": r, "join_ref": "1",
        });
        self.ws.send(Message::text(m.to_string())).await.unwrap();
        r
    }

    pub async fn send_raw(&mut self, m: Message) {
        self.ws.send(m).await.unwrap();
    }

    /// Joins `topic` with `config`; the reply's payload.
    pub async fn join(&mut self, topic: &str, config: serde_json::Value) -> serde_json::Value {
        let r = self
            .push(topic, "phx_join", serde_json::json!({ "config": config }))
            .await;
        self.reply(&r).await
    }

    /// Broadcasts `payload` as `event` on `topic`.
    pub async fn broadcast(
        &mut self,
        topic: &str,
        event: &str,
        payload: serde_json::Value,
    ) -> String {
        let p = serde_json::json!({"type": "broadcast", "event": event, "payload": payload});
        self.push(topic, "broadcast", p).await
    }

    /// The reply to the message with ref `r`.
    pub async fn reply(&mut self, r: &str) -> serde_json::Value {
        let m = self
            .until(|m| m["event"] == "phx_reply" && m["ref"] == r)
            .await;
        m["payload"].clone()
    }

    /// The next message, heartbeating every half second while waiting.
    pub async fn next(&mut self) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let got = tokio::time::timeout(Duration::from_millis(500), self.ws.next()).await;
            match got {
                Ok(Some(Ok(Message::Text(t)))) => return serde_json::from_str(&t).unwrap(),
                Ok(Some(Ok(Message::Close(f)))) => panic!("closed while waiting: {f:?}"),
                Ok(Some(Ok(_))) => {}
                Ok(other) => panic!("socket ended while waiting: {other:?}"),
                Err(_) => {
                    assert!(tokio::time::Instant::now() < deadline, "timed out waiting");
                    self.push("phoenix", "heartbeat", serde_json::json!({}))
                        .await;
                }
            }
        }
    }

    /// Reads until a message satisfies `want`; that message. Other messages (heartbeat
    /// replies among them) do not extend the wait past [`UNTIL_WAIT`].
    pub async fn until(&mut self, want: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + UNTIL_WAIT;
        loop {
            let m = self.next().await;
            if want(&m) {
                return m;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting; last message {m}"
            );
        }
    }

    /// The replies' payloads to the messages with refs `refs`, in that order, however the
    /// server ordered them (a refused join is answered before an earlier one that succeeds).
    pub async fn replies(&mut self, refs: &[String]) -> Vec<serde_json::Value> {
        let mut got = vec![serde_json::Value::Null; refs.len()];
        let mut left = refs.len();
        while left > 0 {
            let m = self
                .until(|m| m["event"] == "phx_reply" && refs.iter().any(|r| m["ref"] == r.as_str()))
                .await;
            let i = refs
                .iter()
                .position(|r| m["ref"] == r.as_str())
                .unwrap_or(0);
            if got[i].is_null() {
                left -= 1;
            }
            got[i] = m["payload"].clone();
        }
        got
    }

    /// Reads (without heartbeating) until the socket ends; how it ended.
    pub async fn ended(&mut self) -> Ended {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, self.ws.next()).await {
                Err(_) => panic!("the socket did not end"),
                Ok(Some(Ok(Message::Close(f)))) => return Ended::Closed(f),
                Ok(Some(Ok(_))) => {}
                Ok(None | Some(Err(_))) => return Ended::Dropped,
            }
        }
    }
}
