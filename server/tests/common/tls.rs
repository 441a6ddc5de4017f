//! Certificates made for a test (rcgen): a CA, the server's certificate, a client's.

use std::path::PathBuf;

use kvix_client::ClientTls;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

/// PEM files of one test's certificates.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    /// A CA (`ca.pem`) signing the server's certificate (`server.pem`, `server.key`,
    /// for 127.0.0.1 and localhost) and a client's (`client.pem`, `client.key`); and an
    /// unrelated CA (`other-ca.pem`).
    pub fn new(tag: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("kvix-tls-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, pem: String| std::fs::write(dir.join(name), pem).unwrap();
        let ca = |name: &str| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let key = KeyPair::generate().unwrap();
            let cert = params.self_signed(&key).unwrap();
            write(name, cert.pem());
            (cert, key)
        };
        let (ca_cert, ca_key) = ca("ca.pem");
        ca("other-ca.pem");
        for (name, sans) in [
            (
                "server",
                vec!["127.0.0.1".to_string(), "localhost".to_string()],
            ),
            ("client", vec!["gateway-1".to_string()]),
        ] {
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(sans)
                .unwrap()
                .signed_by(&key, &ca_cert, &ca_key)
                .unwrap();
            write(&format!("{name}.pem"), cert.pem());
            write(&format!("{name}.key"), key.serialize_pem());
        }
        Pki { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }

    /// The server's TLS flags, with `--tls-client-ca` where `client_ca`.
    pub fn server_args(&self, client_ca: bool) -> Vec<String> {
        let mut args = vec![
            "--cores".into(),
            "2".into(),
            "--tls-cert".into(),
            self.arg("server.pem"),
            "--tls-key".into(),
            self.arg("server.key"),
        ];
        if client_ca {
            args.extend(["--tls-client-ca".into(), self.arg("ca.pem")]);
        }
        args
    }

    pub fn client(&self, ca: &str, identity: bool) -> ClientTls {
        ClientTls {
            ca: self.path(ca),
            server_name: None,
            identity: identity.then(|| (self.path("client.pem"), self.path("client.key"))),
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
