//! Steering new connections among the shards' listening sockets.
//!
//! With the per-core data plane every shard listens on its own `SO_REUSEPORT` socket, and by
//! default the kernel spreads connections over all of them by a hash of the addresses. While
//! packing keeps shards closed, a connection the kernel gave to a closed shard wakes that
//! shard's thread only to hand the client to an open one (a deregistration, a registration
//! and a cross-thread wake-up per connection: a visible share of a connect's cost under
//! `pgbench -C`). A classic BPF program on the socket group makes the kernel choose among the
//! open shards only: socket `random % open`, the sockets being indexed in the order they
//! started listening (shard 0 first). The accept loop of shard 0 re-attaches the program when
//! the number of open shards changes. Where the kernel refuses it, hand-over remains the
//! fallback, so this is an optimisation only.

/// One classic BPF instruction per element; at most three are needed.
pub type Program = Vec<(u16, u8, u8, u32)>;

/// `BPF_LD | BPF_W | BPF_ABS`
const BPF_LD_W_ABS: u16 = 0x20;
/// `BPF_ALU | BPF_MOD | BPF_K`
const BPF_ALU_MOD_K: u16 = 0x94;
/// `BPF_RET | BPF_K`
const BPF_RET_K: u16 = 0x06;
/// `BPF_RET | BPF_A`
const BPF_RET_A: u16 = 0x16;
/// `SKF_AD_OFF + SKF_AD_RANDOM`: loading from this offset yields a random 32-bit number.
const LOAD_RANDOM: u32 = (-0x1000i32 + 56) as u32;

/// The program choosing among the first `open` sockets of the group.
pub fn program(open: usize) -> Program {
    let open = open.clamp(1, u32::MAX as usize) as u32;
    if open == 1 {
        return vec![(BPF_RET_K, 0, 0, 0)];
    }
    vec![
        (BPF_LD_W_ABS, 0, 0, LOAD_RANDOM),
        (BPF_ALU_MOD_K, 0, 0, open),
        (BPF_RET_A, 0, 0, 0),
    ]
}

/// Makes the kernel give new connections on `socket`'s reuseport group to the first `open`
/// sockets only (`SO_ATTACH_REUSEPORT_CBPF`).
#[cfg(target_os = "linux")]
pub fn steer(socket: &impl std::os::fd::AsFd, open: usize) -> std::io::Result<()> {
    let mut filter: Vec<libc::sock_filter> = program(open)
        .into_iter()
        .map(|(code, jt, jf, k)| libc::sock_filter { code, jt, jf, k })
        .collect();
    // The kernel copies and validates the program during the call; `filter` outlives it.
    let prog = libc::sock_fprog {
        len: filter.len() as libc::c_ushort,
        filter: filter.as_mut_ptr(),
    };
    nix::sys::socket::setsockopt(
        socket,
        nix::sys::socket::sockopt::AttachReusePortCbpf,
        &prog,
    )
    .map_err(std::io::Error::from)
}

#[cfg(not(target_os = "linux"))]
pub fn steer(_socket: &impl std::os::fd::AsFd, _open: usize) -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_open_shard_takes_every_connection() {
        assert_eq!(program(1), vec![(BPF_RET_K, 0, 0, 0)]);
        assert_eq!(program(0), program(1));
    }

    #[test]
    fn several_open_shards_share_at_random() {
        let p = program(3);
        assert_eq!(p[0], (0x20, 0, 0, 0xffff_f038));
        assert_eq!(p[1], (0x94, 0, 0, 3));
        assert_eq!(p[2], (0x16, 0, 0, 0));
    }

    /// The kernel accepts both programs on a real reuseport group, and with one open
    /// socket of two every connection reaches the first.
    #[test]
    fn the_kernel_steers_to_the_first_socket() {
        let first =
            crate::listener::bind_tcp_std("127.0.0.1:0".parse().unwrap(), 64, true).expect("bind");
        let addr = first.local_addr().unwrap();
        let second = crate::listener::bind_tcp_std(addr, 64, true).expect("bind second");
        if let Err(e) = steer(&first, 2) {
            // Some kernels (and sandboxes) refuse the program; Shoal then hands connections
            // over between shards instead, which other tests cover.
            eprintln!("skipped: the kernel refuses SO_ATTACH_REUSEPORT_CBPF here ({e})");
            return;
        }
        steer(&first, 1).expect("a constant program is accepted");
        let clients: Vec<_> = (0..16)
            .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
            .collect();
        // Both sockets are non-blocking; every handshake completed before connect returned.
        assert!(
            second.accept().is_err(),
            "nothing may reach the closed socket"
        );
        for _ in &clients {
            first
                .accept()
                .expect("every connection waits on the first socket");
        }
    }
}
