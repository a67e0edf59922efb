//! Sizes of what every client holds: the futures an idle or logging-in client is.

use super::*;

#[tokio::test]
async fn session_future_fits_a_small_task() {
    let config = crate::config::Config::embedded_default().unwrap();
    let (_tx, rx) = tokio::sync::watch::channel(false);
    let app = App::new(config, rx).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let stream = Stream::Tcp(client);
    let mut rx2 = app.lifecycle.shutdown.clone();
    println!(
        "changed future: {} bytes",
        std::mem::size_of_val(&rx2.changed())
    );
    let other = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let login = login::login_phase(app.clone(), Stream::Tcp(other), None);
    println!("login future: {} bytes", std::mem::size_of_val(&login));
    // Every login moves this future into the heap (and a connect storm holds thousands):
    // phases only some logins need (auth_query, a server for new parameters, refusals)
    // are boxed apart.
    assert!(std::mem::size_of_val(&login) <= 1408, "login future grew");
    drop(login);
    let fut = serve(app.clone(), stream, None);
    println!("serve future: {} bytes", std::mem::size_of_val(&fut));
    println!("Session: {} bytes", std::mem::size_of::<Session>());
    // An idle client is this future in a tokio task (~100 bytes of header): keep the
    // whole within 384 bytes. Growing these is a memory cost for every idle client.
    assert!(
        std::mem::size_of_val(&fut) <= 256,
        "idle client future grew"
    );
    assert!(std::mem::size_of::<Session>() <= 160, "Session grew");
    // A client relayed here by another node (cluster) costs what a local one does.
    let (link, _incoming) = shoal_cluster::link::Link::new(
        "peer".into(),
        shoal_cluster::link::Side::Acceptor,
        Default::default(),
    );
    let relayed = relayed::serve_relayed(app.clone(), link.open(b"").unwrap(), Default::default());
    println!(
        "relayed serve future: {} bytes",
        std::mem::size_of_val(&relayed)
    );
    assert!(
        std::mem::size_of_val(&relayed) <= 256,
        "relayed client future grew"
    );
    drop(relayed);
    // A client of this node relayed to another: the login's box is freed first, and what
    // stays is the loop that parks and resumes it (the relay proper is boxed, and freed
    // while the client is parked): what a parked client costs besides its socket and its
    // opening. A tokio task is a 128-byte-aligned cell with 104 bytes besides the future and
    // 8 of the future's stage: up to 152 bytes it takes 256, past that 384.
    let relaying = returned_size(relayed::relay_out);
    println!("relaying future: {relaying} bytes");
    assert!(relaying <= 152, "relaying client future grew");
    println!(
        "SessionError: {} bytes",
        std::mem::size_of::<SessionError>()
    );
}

/// The size of what `f` returns (a future), without making one.
fn returned_size<A, F>(_: impl Fn(A) -> F) -> usize {
    std::mem::size_of::<F>()
}
