//! `ClientError` as Python exceptions: one class per kind, all under `KvixError`, each
//! carrying the Rust error's message (and the server's error code, when it sent one).

use kvix_client::ClientError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    kvix,
    KvixError,
    PyException,
    "Any error of the kvix client."
);
create_exception!(
    kvix,
    ConfigError,
    KvixError,
    "The client configuration cannot work."
);
create_exception!(
    kvix,
    NotConnectedError,
    KvixError,
    "No kvix server is connected."
);
create_exception!(
    kvix,
    RequestTimeoutError,
    KvixError,
    "No reply within the request timeout."
);
create_exception!(
    kvix,
    DisconnectedError,
    KvixError,
    "The connection was lost before the reply."
);
create_exception!(
    kvix,
    RejectedError,
    KvixError,
    "The server refused the request; `code` names why."
);
create_exception!(
    kvix,
    ProtocolError,
    KvixError,
    "The server did not speak the kvix protocol."
);
create_exception!(
    kvix,
    TlsError,
    KvixError,
    "The TLS handshake failed: the server's certificate is not trusted or does not name it, it wants a client certificate, or its port is not TLS."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvixError", py.get_type::<KvixError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("NotConnectedError", py.get_type::<NotConnectedError>())?;
    m.add("RequestTimeoutError", py.get_type::<RequestTimeoutError>())?;
    m.add("DisconnectedError", py.get_type::<DisconnectedError>())?;
    m.add("RejectedError", py.get_type::<RejectedError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("TlsError", py.get_type::<TlsError>())?;
    Ok(())
}

/// The Python exception for a client error, with the Rust message and, for refusals,
/// the server's error code as the `code` attribute (e.g. `"UnknownWorker"`).
pub fn to_py(py: Python<'_>, e: ClientError) -> PyErr {
    let msg = e.to_string();
    let err = match &e {
        ClientError::Config(_) => ConfigError::new_err(msg),
        ClientError::NotConnected => NotConnectedError::new_err(msg),
        ClientError::Timeout => RequestTimeoutError::new_err(msg),
        ClientError::Disconnected | ClientError::Io(_) => DisconnectedError::new_err(msg),
        ClientError::Rejected(_) | ClientError::Refused { .. } => RejectedError::new_err(msg),
        ClientError::Protocol(_) | ClientError::Encode(_) => ProtocolError::new_err(msg),
        ClientError::Tls { .. } => TlsError::new_err(msg),
    };
    if let Some(code) = e.code() {
        let _ = err.value(py).setattr("code", format!("{code:?}"));
    }
    err
}

/// A bad argument from Python (`ValueError`).
pub fn bad_arg(msg: impl Into<String>) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(msg.into())
}
