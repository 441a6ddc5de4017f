//! The listening sockets: one SO_REUSEPORT TCP socket per executor, created in order
//! on the main thread (the group's index order is what the steering program returns),
//! and one Unix socket served by executor 0.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};

use anyhow::Context;
use socket2::{Domain, Socket, Type};

use crate::config::Steering;

/// The bound, listening TCP sockets (one per executor) and the steering in force.
pub struct TcpGroup {
    pub fds: Vec<RawFd>,
    pub addr: SocketAddr,
    pub steering: Steering,
}

pub fn tcp_group(addr: SocketAddr, executors: usize, wanted: Steering) -> anyhow::Result<TcpGroup> {
    if addr.port() != 0 {
        ensure_unserved(addr)?;
    }
    let mut socks: Vec<Socket> = Vec::with_capacity(executors);
    let mut bound = addr;
    for i in 0..executors {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)
            .context("creating a TCP socket")?;
        sock.set_reuse_port(true).context("setting SO_REUSEPORT")?;
        sock.set_reuse_address(true)
            .context("setting SO_REUSEADDR")?;
        sock.set_nodelay(true).context("setting TCP_NODELAY")?;
        sock.bind(&bound.into())
            .with_context(|| format!("binding {bound} (executor {i})"))?;
        sock.listen(1024)
            .with_context(|| format!("listening on {bound}"))?;
        // Port 0 resolves on the first bind; the rest of the group joins that port.
        bound = sock
            .local_addr()?
            .as_socket()
            .context("TCP socket without an address")?;
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
pub fn ensure_unserved(addr: SocketAddr) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    loop {
        match probe_bind(addr) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                if started.elapsed() >= PORT_WAIT {
                    anyhow::bail!(
                        "{addr} is already served by another process (is another kvix-server \
                         running?); waited {} s for it to be released",
                        PORT_WAIT.as_secs()
                    );
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => return Err(e).with_context(|| format!("binding {addr}")),
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
pub fn metrics_socket(addr: &str) -> anyhow::Result<RawFd> {
    use std::net::ToSocketAddrs;
    let addr = addr
        .to_socket_addrs()
        .with_context(|| format!("metrics address {addr}"))?
        .next()
        .with_context(|| format!("metrics address {addr} resolves to nothing"))?;
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)
        .context("creating the metrics socket")?;
    sock.set_reuse_address(true)
        .context("setting SO_REUSEADDR")?;
    sock.bind(&addr.into())
        .with_context(|| format!("binding metrics on {addr}"))?;
    sock.listen(128)
        .with_context(|| format!("listening on {addr}"))?;
    Ok(sock.into_raw_fd())
}

/// Makes `path` free for a new Unix socket: removes a stale socket file left by a dead
/// server, but never a live server's socket or a file that is not a socket.
pub fn free_unix_path(path: &str) -> anyhow::Result<()> {
    if stale_unix_socket(path)? {
        std::fs::remove_file(path).with_context(|| format!("removing stale socket {path}"))?;
    }
    Ok(())
}

/// Whether `path` holds a dead server's socket (false: nothing there); an error when it
/// holds something a start must not replace (a file that is not a socket, a live server's).
pub fn stale_unix_socket(path: &str) -> anyhow::Result<bool> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(false);
    };
    anyhow::ensure!(
        meta.file_type().is_socket(),
        "{path} exists and is not a socket; refusing to replace it"
    );
    anyhow::ensure!(
        std::os::unix::net::UnixStream::connect(path).is_err(),
        "another server is listening on {path}"
    );
    Ok(true)
}
