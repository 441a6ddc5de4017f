//! The listening sockets: one SO_REUSEPORT TCP socket per executor, created in order
//! on the main thread (the group's index order is what the steering program returns),
//! and one Unix socket served by executor 0.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};

use socket2::{Domain, Socket, Type};

use crate::config::Steering;
use crate::error::StartError;

/// The bound, listening TCP sockets (one per executor) and the steering in force.
pub struct TcpGroup {
    pub fds: Vec<RawFd>,
    pub addr: SocketAddr,
    pub steering: Steering,
}

pub fn tcp_group(
    addr: SocketAddr,
    executors: usize,
    wanted: Steering,
) -> Result<TcpGroup, StartError> {
    if addr.port() != 0 {
        ensure_unserved(addr)?;
    }
    let mut socks: Vec<Socket> = Vec::with_capacity(executors);
    let mut bound = addr;
    for i in 0..executors {
        let io = |what: &str| StartError::io(format!("{what} {bound} (executor {i})"));
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)
            .map_err(io("a socket for"))?;
        sock.set_reuse_port(true).map_err(io("SO_REUSEPORT on"))?;
        sock.set_reuse_address(true)
            .map_err(io("SO_REUSEADDR on"))?;
        sock.set_nodelay(true).map_err(io("TCP_NODELAY on"))?;
        sock.bind(&bound.into()).map_err(io("binding"))?;
        sock.listen(1024).map_err(io("listening on"))?;
        // Port 0 resolves on the first bind; the rest of the group joins that port.
        let local = sock.local_addr().map_err(io("the address of"))?;
        bound = local
            .as_socket()
            .ok_or_else(|| StartError::Unresolved(format!("the TCP socket bound to {bound}")))?;
        socks.push(sock);
    }
    let steering = crate::steering::attach(socks[0].as_raw_fd(), executors as u32, wanted);
    Ok(TcpGroup {
        fds: socks.into_iter().map(IntoRawFd::into_raw_fd).collect(),
        addr: bound,
        steering,
    })
}

/// How long a start waits for a port still held by a process that just exited (the
/// kernel releases an io_uring process's sockets a moment after it is gone).
const PORT_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// SO_REUSEPORT would let this server share a port another process serves (answering
/// some of its clients from an empty index): a plain bind first says whether it is free.
/// A port in use is tried again for [`PORT_WAIT`] before the start is refused.
pub fn ensure_unserved(addr: SocketAddr) -> Result<(), StartError> {
    let started = std::time::Instant::now();
    loop {
        match probe_bind(addr) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                if started.elapsed() >= PORT_WAIT {
                    let waited_s = PORT_WAIT.as_secs();
                    return Err(StartError::Served { addr, waited_s });
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => return Err(StartError::io(format!("binding {addr}"))(e)),
        }
    }
}

/// Whether `addr` can be bound now: a plain bind with SO_REUSEADDR (a closed
/// connection's TIME_WAIT does not count), its error kind `AddrInUse` where another
/// process serves it.
pub fn probe_bind(addr: SocketAddr) -> std::io::Result<()> {
    let probe = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    probe.set_reuse_address(true)?;
    probe.bind(&addr.into())
}

/// The metrics endpoint's listening socket. SO_REUSEADDR (which glommio's own bind
/// does not set) so that the connections a previous instance closed after answering
/// scrapes, in TIME_WAIT on this port for a minute, do not refuse a restart.
pub fn metrics_socket(addr: &str) -> Result<RawFd, StartError> {
    use std::net::ToSocketAddrs;
    let shown = addr;
    let addr = addr
        .to_socket_addrs()
        .map_err(StartError::io(format!("metrics address {shown}")))?
        .next()
        .ok_or_else(|| StartError::Unresolved(format!("metrics address {shown}")))?;
    let io = |what: &str| StartError::io(format!("{what} metrics on {addr}"));
    let sock =
        Socket::new(Domain::for_address(addr), Type::STREAM, None).map_err(io("a socket for"))?;
    sock.set_reuse_address(true)
        .map_err(io("SO_REUSEADDR on"))?;
    sock.bind(&addr.into()).map_err(io("binding"))?;
    sock.listen(128).map_err(io("listening for"))?;
    Ok(sock.into_raw_fd())
}

/// Makes `path` free for a new Unix socket: removes a stale socket file left by a dead
/// server, but never a live server's socket or a file that is not a socket.
pub fn free_unix_path(path: &str) -> Result<(), StartError> {
    if stale_unix_socket(path)? {
        std::fs::remove_file(path)
            .map_err(StartError::io(format!("removing stale socket {path}")))?;
    }
    Ok(())
}

/// Whether `path` holds a dead server's socket (false: nothing there); an error when it
/// holds something a start must not replace (a file that is not a socket, a live server's).
pub fn stale_unix_socket(path: &str) -> Result<bool, StartError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(false);
    };
    if !meta.file_type().is_socket() {
        return Err(StartError::NotASocket(path.to_string()));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(StartError::UnixServed(path.to_string()));
    }
    Ok(true)
}
