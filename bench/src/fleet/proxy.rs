//! What a Kubernetes Service is to engines that connect to kvix's replicas: one address,
//! each new connection sent to the next replica that accepts it (round robin), from the
//! engine's own address (kube-proxy keeps the pod's), so that kvix sees which engine is
//! which. A connection ends when either side does: a replica killed drops its engines'
//! connections, and they reconnect through the proxy to another.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// Starts the proxy for replicas listening on `backends` (loopback ports); its port.
pub async fn start(backends: Vec<u16>) -> anyhow::Result<u16> {
    anyhow::ensure!(!backends.is_empty(), "a proxy needs backends");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        let mut next = 0usize;
        loop {
            let Ok((client, from)) = listener.accept().await else {
                continue;
            };
            let (backends, first) = (backends.clone(), next);
            next = next.wrapping_add(1);
            tokio::spawn(async move {
                for k in 0..backends.len() {
                    let to =
                        SocketAddr::from(([127, 0, 0, 1], backends[(first + k) % backends.len()]));
                    if let Some(mut server) = connect_from(from, to).await {
                        let mut client = client;
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        return;
                    }
                }
            });
        }
    });
    Ok(port)
}

/// A connection to `to` from `from`'s address.
async fn connect_from(from: SocketAddr, to: SocketAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::new(from.ip(), 0)).ok()?;
    socket.connect(to).await.ok()
}
