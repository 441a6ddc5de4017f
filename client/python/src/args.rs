//! Python arguments into the client's types: keyspaces, prompts, workers, lanes,
//! configuration. Bad values are `ValueError`s / `TypeError`s naming the argument.

use std::time::Duration;

use kvix_client::wire::{EventSource as WireSource, Feed, Keyspace as WireKeyspace, Lane};
use kvix_client::{Addr, ClientConfig, WorkerRef};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::errors::bad_arg;

/// A keyspace: the model (and LoRA adapter, cache salt) two chains must share to mean
/// the same prefix. A plain `str` where a keyspace is expected is a model name.
#[pyclass(frozen, module = "kvix", eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Keyspace {
    pub inner: WireKeyspace,
}

#[pymethods]
impl Keyspace {
    #[new]
    #[pyo3(signature = (model, lora = String::new(), salt = String::new()))]
    fn new(model: String, lora: String, salt: String) -> Self {
        Keyspace {
            inner: WireKeyspace {
                model,
                lora,
                salt,
                ..WireKeyspace::tokens("")
            },
        }
    }
    #[getter]
    fn model(&self) -> &str {
        &self.inner.model
    }
    #[getter]
    fn lora(&self) -> &str {
        &self.inner.lora
    }
    #[getter]
    fn salt(&self) -> &str {
        &self.inner.salt
    }
    fn __repr__(&self) -> String {
        let k = &self.inner;
        format!(
            "Keyspace(model={:?}, lora={:?}, salt={:?})",
            k.model, k.lora, k.salt
        )
    }
}

/// Where the server can subscribe to a worker's own KV event stream (vLLM / SGLang
/// `ZmqEventPublisher`), and the keyspace its token ids are hashed into.
#[pyclass(frozen, get_all, module = "kvix")]
#[derive(Clone)]
pub struct EventSource {
    pub endpoint: String,
    pub model: String,
    pub replay: String,
    pub salt: String,
}

#[pymethods]
impl EventSource {
    #[new]
    #[pyo3(signature = (endpoint, model, replay = String::new(), salt = String::new()))]
    fn new(endpoint: String, model: String, replay: String, salt: String) -> Self {
        EventSource {
            endpoint,
            model,
            replay,
            salt,
        }
    }
}

impl From<&EventSource> for WireSource {
    fn from(s: &EventSource) -> Self {
        WireSource {
            endpoint: s.endpoint.clone(),
            replay: s.replay.clone(),
            model: s.model.clone(),
            salt: s.salt.clone(),
        }
    }
}

/// A `kvix.Keyspace` or a model name.
pub fn keyspace(obj: &Bound<'_, PyAny>) -> PyResult<WireKeyspace> {
    if let Ok(k) = obj.cast::<Keyspace>() {
        return Ok(k.get().inner.clone());
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(WireKeyspace::tokens(s.to_str()?));
    }
    Err(PyTypeError::new_err(
        "keyspace must be a kvix.Keyspace or a model name (str)",
    ))
}

/// How a prompt is given.
#[derive(Clone, Copy)]
pub enum PromptKind {
    Tokens,
    Bytes,
    Chain,
}

/// A prompt's contents, owned (async calls outlive the Python arguments).
pub enum Prompt {
    Tokens(Vec<u32>),
    Bytes(Vec<u8>),
    Chain(Vec<u64>),
}

impl Prompt {
    pub fn as_client(&self) -> kvix_client::Prompt<'_> {
        match self {
            Prompt::Tokens(t) => kvix_client::Prompt::Tokens(t),
            Prompt::Bytes(b) => kvix_client::Prompt::Bytes(b),
            Prompt::Chain(c) => kvix_client::Prompt::Chain(c),
        }
    }
}

/// Token ids from a buffer of uint32 (`array('I')`, a NumPy uint32 array: copied at
/// once) or any sequence of ints.
fn u32s(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Some(buf) = native::<u32>(obj) {
        return flat(buf, obj, "token ids");
    }
    if let Ok(list) = obj.cast_exact::<PyList>() {
        if let Some(v) = list_u32s(list)? {
            return Ok(v);
        }
    }
    obj.extract::<Vec<u32>>().map_err(|_| {
        PyTypeError::new_err(
            "token ids must be a sequence of ints in 0..2**32 or a one-dimensional uint32 \
             buffer (a buffer in another byte order or type is read element by element)",
        )
    })
}

/// `obj` as a buffer of `T` in this machine's byte order. pyo3 takes a big-endian
/// format (`>I`, NumPy's `>u4`) for a native one on little-endian machines: such a
/// buffer is refused here and read element by element, as Python ints.
fn native<T: pyo3::buffer::Element>(obj: &Bound<'_, PyAny>) -> Option<PyBuffer<T>> {
    let buf = PyBuffer::<T>::get(obj).ok()?;
    let order = buf.format().to_bytes().first().copied();
    let foreign = if cfg!(target_endian = "little") {
        matches!(order, Some(b'>' | b'!'))
    } else {
        order == Some(b'<')
    };
    (!foreign).then_some(buf)
}

/// A one-dimensional buffer's items. (A buffer of another byte order or item type is
/// not taken here: the caller reads it element by element, as Python ints.)
fn flat<T: pyo3::buffer::Element + Copy>(
    buf: PyBuffer<T>,
    obj: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<Vec<T>> {
    if buf.dimensions() != 1 {
        return Err(PyTypeError::new_err(format!(
            "{what}: a one-dimensional buffer, not one of {} dimensions {:?} (flatten it if \
             that is meant)",
            buf.dimensions(),
            buf.shape()
        )));
    }
    buf.to_vec(obj.py())
}

/// A tokenizer's list of ints, read with the C API directly: this is most of what a
/// Python query costs over a Rust one (2,000 ids: a few ns each this way, 7 ns through
/// the generic extraction; `PyList_GetItem` because the wheel is built for the stable
/// ABI, where `PyList_GET_ITEM` is not). `None` when an item is not exactly an int (a
/// NumPy integer, an int subclass): the generic extraction reads those.
fn list_u32s(list: &Bound<'_, PyList>) -> PyResult<Option<Vec<u32>>> {
    let n = list.len();
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: `list` is an exact list held (GIL attached, so it cannot shrink under
        // us: nothing here runs Python code) and `i < len`; the item is borrowed only
        // for the conversion, which does not call back into Python for an exact int.
        let x = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() || ffi::PyLong_CheckExact(item) == 0 {
                let _ = PyErr::take(list.py());
                return Ok(None);
            }
            ffi::PyLong_AsUnsignedLong(item)
        };
        match u32::try_from(x) {
            Ok(x) if x != u32::MAX || !PyErr::occurred(list.py()) => v.push(x),
            _ => {
                let _ = PyErr::take(list.py());
                return Err(PyTypeError::new_err("token ids must be ints in 0..2**32"));
            }
        }
    }
    Ok(Some(v))
}

fn u64s(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Some(buf) = native::<u64>(obj) {
        return flat(buf, obj, "a chain");
    }
    obj.extract::<Vec<u64>>().map_err(|_| {
        PyTypeError::new_err("a chain must be a sequence of ints in 0..2**64 or a uint64 buffer")
    })
}

/// A string prompt as UTF-8, or bytes as they are.
fn bytes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err("a text prompt must be str or bytes"))
}

pub fn prompt(kind: PromptKind, obj: &Bound<'_, PyAny>) -> PyResult<Prompt> {
    Ok(match kind {
        PromptKind::Tokens => Prompt::Tokens(u32s(obj)?),
        PromptKind::Bytes => Prompt::Bytes(bytes(obj)?),
        PromptKind::Chain => Prompt::Chain(u64s(obj)?),
    })
}

/// A worker by name (`str`) or by the primary server's id (`int`).
pub fn worker(obj: &Bound<'_, PyAny>) -> PyResult<WorkerRef> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(WorkerRef::from(s.to_str()?));
    }
    if let Ok(id) = obj.extract::<u32>() {
        return Ok(WorkerRef::Id(id));
    }
    Err(PyTypeError::new_err(
        "a worker is its name (str) or its id (int)",
    ))
}

pub fn workers(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<WorkerRef>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    // A string is iterable too: "w0" would be read as the workers "w" and "0".
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "candidates: a list of worker names or ids, not one string (write [\"w0\"])",
        ));
    }
    obj.try_iter()
        .map_err(|_| PyTypeError::new_err("candidates: a list of worker names or ids"))?
        .map(|w| worker(&w?))
        .collect()
}

/// `top_k` as the wire carries it: 0 (all) or more.
pub fn top_k(top_k: i64) -> PyResult<u32> {
    u32::try_from(top_k)
        .map_err(|_| bad_arg(format!("top_k: 0 (every score) or more, not {top_k}")))
}

/// `kind@block_tokens` strings (e.g. `sliding_window:4096@16`); none: one full lane.
pub fn lanes(lanes: Option<Vec<String>>, token_block: u32) -> PyResult<Vec<Lane>> {
    match lanes {
        None => Ok(vec![Lane::full(token_block)]),
        Some(v) => v
            .iter()
            .map(|t| Lane::parse(t).map_err(|e| bad_arg(format!("lane {t:?}: {e}"))))
            .collect(),
    }
}

pub fn feed(feed: &str, capacity_blocks: u64, ttl_ms: u64) -> PyResult<Feed> {
    match feed {
        "events" => Ok(Feed::Events),
        "placements" if capacity_blocks > 0 => Ok(Feed::Placements {
            capacity_blocks,
            ttl_ms,
        }),
        "placements" => Err(bad_arg("a placements feed needs capacity_blocks > 0")),
        other => Err(bad_arg(format!(
            "feed must be \"events\" or \"placements\", not {other:?}"
        ))),
    }
}

/// Milliseconds (float) as a duration; `what` names the argument in the error.
pub fn ms(what: &str, v: f64) -> PyResult<Duration> {
    if v.is_finite() && v > 0.0 {
        Ok(Duration::from_secs_f64(v / 1e3))
    } else {
        Err(bad_arg(format!(
            "{what} must be a positive number of milliseconds, not {v}"
        )))
    }
}

/// The client's options, as `kvix.Client(servers, **options)` takes them: the Rust
/// client's defaults, changed by the keywords given. An unknown keyword is a
/// `TypeError` naming it.
pub fn config(
    py: Python<'_>,
    servers: Vec<String>,
    options: Option<&Bound<'_, PyDict>>,
) -> PyResult<ClientConfig> {
    let servers = servers
        .iter()
        .map(|s| s.parse::<Addr>().map_err(|e| crate::errors::to_py(py, e)))
        .collect::<PyResult<Vec<_>>>()?;
    let mut cfg = ClientConfig {
        name: "kvix-python".into(),
        ..ClientConfig::new(servers)
    };
    let (mut tls_ca, mut tls_name, mut tls_cert, mut tls_key) = (
        None::<String>,
        None::<String>,
        None::<String>,
        None::<String>,
    );
    for (key, value) in options.into_iter().flatten() {
        let key: String = key.extract()?;
        let v = &value;
        match key.as_str() {
            "tls_ca" => tls_ca = v.extract()?,
            "tls_server_name" => tls_name = v.extract()?,
            "tls_cert" => tls_cert = v.extract()?,
            "tls_key" => tls_key = v.extract()?,
            "token_block" => cfg.token_block = v.extract()?,
            "deadline_ms" => cfg.deadline = ms(&key, v.extract()?)?,
            "name" => cfg.name = v.extract()?,
            "auth" => cfg.auth = v.extract()?,
            "replicas" => cfg.replicas = v.extract()?,
            "hedge_after_ms" => {
                cfg.hedge_after = match v.extract::<Option<f64>>()? {
                    None => None,
                    Some(f) if f == f64::INFINITY => Some(Duration::MAX),
                    Some(f) => Some(ms(&key, f)?),
                }
            }
            "connect_timeout_ms" => cfg.connect_timeout = ms(&key, v.extract()?)?,
            "request_timeout_ms" => cfg.request_timeout = ms(&key, v.extract()?)?,
            "placement_queue" => cfg.placement_queue = v.extract()?,
            "tier_weights" => {
                let (cpu, storage): (f32, f32) = v.extract().map_err(|_| {
                    PyTypeError::new_err("tier_weights: a (cpu, storage) pair of numbers")
                })?;
                cfg.tier_weights = kvix_client::TierWeights { cpu, storage };
            }
            "spin_us" => {
                cfg.spin_before_park = match v.extract::<Option<f64>>()? {
                    None => None,
                    Some(us) => Some(ms(&key, us / 1e3)?),
                }
            }
            other => {
                return Err(PyTypeError::new_err(format!(
                    "unknown client option {other:?} (see help(kvix.Client))"
                )))
            }
        }
    }
    cfg.tls = match (tls_ca, tls_cert, tls_key) {
        (None, None, None) if tls_name.is_none() => None,
        (Some(ca), cert, key) => Some(kvix_client::ClientTls {
            ca: ca.into(),
            server_name: tls_name,
            identity: match (cert, key) {
                (None, None) => None,
                (Some(c), Some(k)) => Some((c.into(), k.into())),
                _ => return Err(bad_arg("tls_cert and tls_key go together")),
            },
        }),
        _ => {
            return Err(bad_arg(
                "TLS needs tls_ca (the CA the server's certificate is signed by)",
            ))
        }
    };
    cfg.validate().map_err(|e| crate::errors::to_py(py, e))?;
    Ok(cfg)
}
