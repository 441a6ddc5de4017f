//! TLS on the kvix TCP port (`--tls-cert`, `--tls-key`, optionally `--tls-client-ca`):
//! gateways on other hosts send prompts' hashes, and the token alone gates them in
//! clear. The Unix socket (local, guarded by its file mode) and the metrics port stay
//! plain. rustls with the ring provider, TLS 1.2 and 1.3.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why the TLS settings do not make a server config (the start is refused).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: {source}")]
    Pem {
        flag: &'static str,
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{flag} {path}: no certificate in it")]
    NoCertificate { flag: &'static str, path: PathBuf },
    #[error("--tls-client-ca {path}: {source}")]
    ClientCa {
        path: PathBuf,
        source: rustls::server::VerifierBuilderError,
    },
    #[error("--tls-cert and --tls-key do not make a TLS server: {0}")]
    Config(#[from] rustls::Error),
}

/// The certificates of a PEM file (at least one).
pub fn certificates(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        flag,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            flag,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// ring's provider: it builds with a C compiler alone (aws-lc-rs, rustls's default, needs
/// cmake). Deprecated in rustls 0.23.48 for its lack of post-quantum key exchange.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server's TLS config: its chain and key, and where `client_ca` is given, client
/// certificates required and checked against it.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = provider();
    let chain = certificates("--tls-cert", cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Pem {
        flag: "--tls-key",
        path: key.to_owned(),
        source,
    })?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certificates("--tls-client-ca", path)? {
                roots.add(c)?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|source| TlsError::ClientCa {
                        path: path.to_owned(),
                        source,
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    Ok(Arc::new(builder.with_single_cert(chain, key)?))
}
