//! TLS to servers at TCP addresses ([`ClientTls`]). The handshake runs through
//! tokio-rustls; then both halves of the connection share the rustls state, so that the
//! write path stays synchronous (`try_write` under a short lock, see [`crate::conn`]) as
//! on plain TCP: plaintext goes into rustls, and its records go out as far as the socket
//! takes them now; what it does not take is flushed by the connection's writer task.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::ClientError;

/// TLS to the servers at TCP addresses (`kvix-server --tls-cert`); Unix socket
/// addresses stay plain, as the server's Unix socket is.
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// PEM file of the CA certificates a server's chain must lead to.
    pub ca: PathBuf,
    /// The name a server's certificate must hold. None: the host of each address.
    pub server_name: Option<String>,
    /// This client's certificate chain and private key (PEM files), for servers that
    /// require one (`--tls-client-ca`).
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// A [`ClientTls`] made ready: the rustls config every connection shares.
#[derive(Clone)]
pub(crate) struct Tls {
    config: Arc<rustls::ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

/// ring's provider: it builds with a C compiler alone (aws-lc-rs, rustls's default, needs
/// cmake). Deprecated in rustls 0.23.48 for its lack of post-quantum key exchange.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ClientTls {
    /// The rustls config these files make (what every connection of a client shares);
    /// an error names the file and why. Public for tools that speak the wire directly.
    pub fn rustls_config(&self) -> Result<Arc<rustls::ClientConfig>, ClientError> {
        let certs = |path: &PathBuf| -> Result<Vec<CertificateDer<'static>>, ClientError> {
            CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| bad(format!("{}: {e}", path.display())))
                .and_then(|c| match c.is_empty() {
                    true => Err(bad(format!("{}: no certificate in it", path.display()))),
                    false => Ok(c),
                })
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&self.ca)? {
            roots
                .add(c)
                .map_err(|e| bad(format!("{}: {e}", self.ca.display())))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(e.to_string()))?
            .with_root_certificates(roots);
        Ok(Arc::new(match &self.identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| bad(format!("{}: {e}", key.display())))?;
                builder
                    .with_client_auth_cert(certs(cert)?, key)
                    .map_err(|e| bad(format!("{}: {e}", cert.display())))?
            }
        }))
    }
}

fn bad(what: String) -> ClientError {
    ClientError::Config(format!("tls: {what}"))
}

impl Tls {
    /// Reads the files of `t`.
    pub(crate) fn new(t: &ClientTls) -> Result<Tls, ClientError> {
        let server_name = match &t.server_name {
            None => None,
            Some(n) => Some(
                ServerName::try_from(n.clone())
                    .map_err(|e| bad(format!("server name {n:?}: {e}")))?,
            ),
        };
        Ok(Tls {
            config: t.rustls_config()?,
            server_name,
        })
    }

    /// The TLS handshake over `sock`, connected to `addr` (`host:port`).
    pub(crate) async fn connect(&self, addr: &str, sock: TcpStream) -> io::Result<TlsConn> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => host_name(addr)?,
        };
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        let (sock, tls) = connector
            .connect(name, sock)
            .await
            .map_err(|e| {
                // A kvix port without TLS answers the ClientHello with a kvix error frame
                // (not a TLS record) or closes.
                let not_tls = matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                ) || e
                    .get_ref()
                    .and_then(|i| i.downcast_ref::<rustls::Error>())
                    .is_some_and(|r| matches!(r, rustls::Error::InvalidMessage(_)));
                match not_tls {
                    true => io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the server did not answer in TLS ({e}): is its port TLS (kvix-server --tls-cert)?"),
                    ),
                    false => e,
                }
            })?
            .into_inner();
        Ok(TlsConn {
            sock,
            tls: Mutex::new(tls),
            flush_wanted: Notify::new(),
        })
    }
}

/// An i/o error of a connection being set up, as the client reports it: rustls's
/// verdicts (a certificate, an alert such as a required client certificate, all
/// `InvalidData`) need an operator, not a retry.
pub(crate) fn setup_error(addr: &crate::Addr, e: io::Error) -> ClientError {
    match e.kind() {
        io::ErrorKind::InvalidData => ClientError::Tls {
            addr: addr.clone(),
            message: e.to_string(),
        },
        _ => ClientError::from(e),
    }
}

/// The host of `host:port` (`[v6]:port` too) as the name the certificate must hold.
fn host_name(addr: &str) -> io::Result<ServerName<'static>> {
    let host = match addr.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => addr,
    };
    ServerName::try_from(host.to_string()).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{addr}: not a TLS server name ({e}); set ClientTls::server_name"),
        )
    })
}

/// One TLS connection after its handshake, shared by the read and write halves.
pub(crate) struct TlsConn {
    sock: TcpStream,
    tls: Mutex<rustls::ClientConnection>,
    /// The read side left records to send (a TLS alert, a key update's answer).
    flush_wanted: Notify,
}

/// The socket as rustls reads and writes it: without waiting.
struct Now<'a>(&'a TcpStream);

impl Read for Now<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_read(buf)
    }
}

impl Write for Now<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl TlsConn {
    fn lock(&self) -> io::Result<MutexGuard<'_, rustls::ClientConnection>> {
        self.tls
            .lock()
            .map_err(|_| io::Error::other("TLS state poisoned"))
    }

    /// Sends what rustls holds as far as the socket takes it now: true when all went.
    fn flush_now(&self, tls: &mut rustls::ClientConnection) -> io::Result<bool> {
        while tls.wants_write() {
            match tls.write_tls(&mut Now(&self.sock)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Plaintext into `buf`; 0 at the end of the stream.
    pub(crate) async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            {
                let mut tls = self.lock()?;
                match tls.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    done => return done,
                }
                match tls.read_tls(&mut Now(&self.sock)) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                    Ok(_) => {
                        let processed = tls.process_new_packets();
                        if !self.flush_now(&mut tls)? {
                            self.flush_wanted.notify_one();
                        }
                        if let Err(e) = processed {
                            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                        }
                        continue;
                    }
                }
            }
            self.sock.readable().await?;
        }
    }

    /// Takes what of `buf` rustls will buffer, once what it held before went out;
    /// `WouldBlock` while the socket does not take that.
    pub(crate) fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        let mut tls = self.lock()?;
        if !self.flush_now(&mut tls)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = tls.writer().write(buf)?;
        self.flush_now(&mut tls)?;
        match n {
            0 => Err(io::ErrorKind::WouldBlock.into()),
            n => Ok(n),
        }
    }

    /// Whether records wait for the socket.
    pub(crate) fn pending(&self) -> bool {
        self.lock().is_ok_and(|t| t.wants_write())
    }

    /// Until every record rustls holds went out.
    pub(crate) async fn writable(&self) -> io::Result<()> {
        loop {
            if self.flush_now(&mut *self.lock()?)? {
                return Ok(());
            }
            self.sock.writable().await?;
        }
    }

    /// Resolves when the read side left records to send.
    pub(crate) async fn flush_wanted(&self) {
        self.flush_wanted.notified().await
    }
}
