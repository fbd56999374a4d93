//! Certificates made for a test (rcgen), written as PEM files as a
//! deployment would mount them, and a TLS client over real sockets.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A CA of its own, in a directory of its own.
pub struct Pki {
    pub dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
    /// The CA's certificate (PEM), what clients trust.
    pub ca: PathBuf,
}

/// A certificate's and its key's files.
#[derive(Clone)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        let cert = params.self_signed(&key).unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, cert.pem()).unwrap();
        Self {
            dir,
            issuer: Issuer::new(params, key),
            ca,
        }
    }

    /// A certificate for `localhost` and 127.0.0.1 (server and client use),
    /// `name` its common name, written as `file.crt`/`file.key`. `expired`:
    /// valid only in 2020.
    pub fn issue(&self, file: &str, name: &str, expired: bool) -> Pair {
        let pair = Pair {
            cert: self.dir.path().join(format!("{file}.crt")),
            key: self.dir.path().join(format!("{file}.key")),
        };
        self.issue_to(&pair, name, expired);
        pair
    }

    /// [`issue`](Self::issue) over existing files (a rotation): the key
    /// first, then the certificate, as a copy in place would.
    pub fn issue_to(&self, pair: &Pair, name: &str, expired: bool) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 12, 31);
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        std::fs::write(&pair.key, key.serialize_pem()).unwrap();
        std::fs::write(&pair.cert, cert.pem()).unwrap();
    }

    /// A client config trusting this CA, showing `client` if given.
    pub fn client(&self, client: Option<&Pair>) -> Arc<rustls::ClientConfig> {
        client_trusting(&self.ca, client)
    }
}

/// A client config trusting the CAs in `ca`, showing `client` if given.
pub fn client_trusting(ca: &Path, client: Option<&Pair>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some(p) => {
            let certs = CertificateDer::pem_file_iter(&p.cert)
                .unwrap()
                .map(|c| c.unwrap())
                .collect();
            let key = PrivateKeyDer::from_pem_file(&p.key).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
    };
    Arc::new(config)
}

/// A TLS connection to `addr` as `localhost`; the handshake's error if it
/// failed.
pub async fn connect(
    addr: std::net::SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut s = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await?;
    // TLS 1.3 verifies a client certificate after the client's handshake
    // is done: a refused one shows at the first read. Nothing is asked
    // here, so a zero-length write and flush make the server answer.
    s.flush().await?;
    Ok(s)
}

/// The common name of the certificate `addr` serves now.
pub async fn served_name(addr: std::net::SocketAddr, config: Arc<rustls::ClientConfig>) -> String {
    let s = connect(addr, config).await.unwrap();
    let (_, conn) = s.get_ref();
    let der = conn.peer_certificates().unwrap()[0].clone();
    common_name(&der)
}

/// A certificate's common name, read from its DER (the test certificates
/// carry it as a UTF8String after the CN's OID, 2.5.4.3).
fn common_name(der: &[u8]) -> String {
    let oid = [0x06, 0x03, 0x55, 0x04, 0x03];
    // The subject comes after the issuer: the last CN in the certificate.
    let at = der
        .windows(oid.len())
        .rposition(|w| w == oid)
        .expect("a CN in the certificate");
    let len = der[at + oid.len() + 1] as usize;
    let start = at + oid.len() + 2;
    String::from_utf8_lossy(&der[start..start + len]).into_owned()
}

/// One request over TLS (`Connection: close`): the status and the body as
/// received (chunked bodies left as they are).
pub async fn request(
    addr: std::net::SocketAddr,
    config: Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let mut s = connect(addr, config).await?;
    let wire = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-type: application/json\r\n{headers}content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(wire.as_bytes()).await?;
    s.flush().await?;
    let mut got = Vec::new();
    // A server that closes without close_notify still gave all it had.
    let _ = s.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP answer: {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}
