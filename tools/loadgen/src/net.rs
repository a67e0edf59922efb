//! Client sockets over many loopback source addresses, so one address's ~28k ephemeral
//! ports towards one destination never run out.

use std::net::{Ipv4Addr, SocketAddr};

use tokio::net::TcpSocket;

/// Connections per source address.
pub const PER_SOURCE: usize = 10_000;

/// The source address of connection `k` of worker `worker`: 127.`octet`.(worker+1).(k/PER_SOURCE+1).
pub fn source_addr(octet: u8, worker: usize, k: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, octet, (worker + 1) as u8, (k / PER_SOURCE + 1) as u8)
}

pub fn bound_socket(source: Ipv4Addr) -> std::io::Result<TcpSocket> {
    let socket = TcpSocket::new_v4()?;
    set_bind_no_port(&socket);
    socket.bind(SocketAddr::new(source.into(), 0))?;
    Ok(socket)
}

/// Lets the kernel choose the source port at connect time, per destination, instead of at
/// bind time: many more connections per source address.
#[allow(unsafe_code)]
fn set_bind_no_port(socket: &TcpSocket) {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt on a valid socket descriptor with a correctly sized int option.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
