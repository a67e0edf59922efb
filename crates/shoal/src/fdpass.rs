//! Descriptors passed between processes over a Unix socket (`SCM_RIGHTS`): the listening
//! sockets an upgrade hands over ([`crate::upgrade`]) and the idle clients after them
//! ([`crate::handoff`]). The one place with the `unsafe` that adopts a received descriptor.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Most descriptors one message carries (the listening sockets of every shard and address).
pub const MAX_FDS: usize = 64;

/// Sends `data` with the descriptors `fds` attached (`SCM_RIGHTS`): the receiver gets its own
/// copies, the same kernel objects.
pub fn send_with_fds(stream: &UnixStream, data: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let iov = [std::io::IoSlice::new(data)];
    let cmsg = [nix::sys::socket::ControlMessage::ScmRights(fds)];
    nix::sys::socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &iov,
        &cmsg,
        nix::sys::socket::MsgFlags::empty(),
        None,
    )
    .map_err(std::io::Error::from)?;
    Ok(())
}

/// Receives into `buf` (up to [`MAX_FDS`] descriptors attached): the bytes read and the
/// descriptors, now this process's own.
pub fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
    flags: nix::sys::socket::MsgFlags,
) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let msg =
        nix::sys::socket::recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), flags)
            .map_err(std::io::Error::from)?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let nix::sys::socket::ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: SCM_RIGHTS gave this process a new descriptor that nothing else
                // owns yet.
                #[allow(unsafe_code)]
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Ok((msg.bytes, fds))
}
