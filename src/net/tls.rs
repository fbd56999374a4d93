//! TLS for the listeners (`server.tls`) and for `https://` replicas
//! (`upstream.tls`), with rustls on ring.
//!
//! A certificate and its key are read from PEM files into a
//! [`CertifiedKey`] behind an [`ArcSwap`]: every handshake takes the one
//! current then, so a rotated pair is served from the next handshake on,
//! without a restart and without touching the connections already open.
//! [`Certificate::reload_if_changed`] (run every `reload_interval`) swaps it
//! when either file's modification time or size changed; a pair that does
//! not load (a half-written rotation, a key that is not the certificate's)
//! is refused with an error and the one served stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, SignatureScheme};

use crate::config::{ServerTlsConfig, UpstreamTlsConfig};

/// The one crypto provider: ring (already built for the DNS resolver).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What a file looked like when it was read: its modification time and size.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// A certificate chain and its key, from files, reloadable.
#[derive(Debug)]
pub struct Certificate {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: ArcSwap<CertifiedKey>,
    /// The files' stamps when `current` was read.
    stamps: Mutex<(Stamp, Stamp)>,
}

impl Certificate {
    /// Read the pair; an error names the file and what is wrong with it.
    pub fn load(cert_file: &Path, key_file: &Path) -> anyhow::Result<Arc<Self>> {
        let stamps = (stamp(cert_file), stamp(key_file));
        let key = read_pair(cert_file, key_file)?;
        Ok(Arc::new(Self {
            cert_file: cert_file.to_path_buf(),
            key_file: key_file.to_path_buf(),
            current: ArcSwap::from_pointee(key),
            stamps: Mutex::new(stamps),
        }))
    }

    /// Read the files again and serve them from the next handshake (SIGHUP).
    /// On an error the pair served stays.
    pub fn reload(&self) -> anyhow::Result<()> {
        let stamps = (stamp(&self.cert_file), stamp(&self.key_file));
        let key = read_pair(&self.cert_file, &self.key_file)?;
        self.current.store(Arc::new(key));
        *self.stamps.lock() = stamps;
        Ok(())
    }

    /// [`reload`](Self::reload) if either file changed since it was read:
    /// whether it did. A failed read is retried at the next check only once
    /// the files change again (a broken pair is reported once, not every
    /// interval).
    pub fn reload_if_changed(&self) -> anyhow::Result<bool> {
        let now = (stamp(&self.cert_file), stamp(&self.key_file));
        {
            let mut seen = self.stamps.lock();
            if *seen == now {
                return Ok(false);
            }
            *seen = now;
        }
        let key = read_pair(&self.cert_file, &self.key_file)?;
        self.current.store(Arc::new(key));
        Ok(true)
    }

    /// The files, for log lines.
    pub fn files(&self) -> (&Path, &Path) {
        (&self.cert_file, &self.key_file)
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

impl ResolvesClientCert for Certificate {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A certificate chain and its key, checked to belong together.
fn read_pair(cert_file: &Path, key_file: &Path) -> anyhow::Result<CertifiedKey> {
    let certs = read_certs(cert_file)?;
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| anyhow::anyhow!("{}: no private key read: {e}", key_file.display()))?;
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .with_context(|| format!("{}: unusable private key", key_file.display()))?;
    let pair = CertifiedKey::new(certs, signing);
    pair.keys_match().with_context(|| {
        format!(
            "{} is not the key of the certificate in {}",
            key_file.display(),
            cert_file.display()
        )
    })?;
    Ok(pair)
}

/// Every certificate of a PEM file (at least one).
fn read_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("{}: cannot read certificates: {e}", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "{}: no certificate in it (PEM `BEGIN CERTIFICATE` blocks expected)",
        path.display()
    );
    Ok(certs)
}

/// A store of the CA certificates in a PEM file.
fn read_roots(path: &Path) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for c in read_certs(path)? {
        roots
            .add(c)
            .with_context(|| format!("{}: not a usable CA certificate", path.display()))?;
    }
    Ok(roots)
}

/// The HTTP/1.1 we speak, offered in ALPN.
fn alpn() -> Vec<Vec<u8>> {
    vec![b"http/1.1".to_vec()]
}

/// The listeners' TLS (`None`: off).
pub struct Listeners {
    /// The API listener's: with the client CAs, if any.
    pub api: Arc<rustls::ServerConfig>,
    /// The admin listener's: never asks for a client certificate (probes
    /// and scrapers have none; its routes have the admin token).
    pub admin: Arc<rustls::ServerConfig>,
    /// The certificate both serve.
    pub cert: Arc<Certificate>,
}

/// The listeners' TLS from `server.tls` (`None`: TLS is off).
pub fn server(cfg: &ServerTlsConfig) -> anyhow::Result<Option<Listeners>> {
    let (Some(cert_file), Some(key_file)) = (&cfg.cert_file, &cfg.key_file) else {
        return Ok(None);
    };
    let cert = Certificate::load(cert_file, key_file).context("server.tls")?;
    Ok(Some(Listeners {
        api: server_config(cert.clone(), cfg.client_ca_file.as_deref())?,
        admin: server_config(cert.clone(), None)?,
        cert,
    }))
}

/// A server config serving `cert`, requiring client certificates signed by
/// the CAs of `client_ca` if given.
pub fn server_config(
    cert: Arc<Certificate>,
    client_ca: Option<&Path>,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let roots = read_roots(path).context("server.tls.client_ca_file")?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .context("server.tls.client_ca_file")?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(cert);
    config.alpn_protocols = alpn();
    Ok(Arc::new(config))
}

/// The client config for `https://` replicas, and its client certificate
/// (to reload) if one is configured.
pub fn client(
    cfg: &UpstreamTlsConfig,
) -> anyhow::Result<(Arc<rustls::ClientConfig>, Option<Arc<Certificate>>)> {
    let roots = match &cfg.ca_file {
        Some(path) => read_roots(path).context("upstream.tls.ca_file")?,
        None => {
            let mut roots = RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            roots
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let (mut config, cert) = match (&cfg.cert_file, &cfg.key_file) {
        (Some(c), Some(k)) => {
            let cert = Certificate::load(c, k).context("upstream.tls")?;
            (builder.with_client_cert_resolver(cert.clone()), Some(cert))
        }
        _ => (builder.with_no_client_auth(), None),
    };
    config.alpn_protocols = alpn();
    Ok((Arc::new(config), cert))
}

/// The client side of `https://` replicas: one config for a given
/// `upstream.tls`, shared by every replica and kept across reloads that do
/// not change it (the system's CA store is read once).
#[derive(Debug)]
pub struct Client {
    pub config: Arc<rustls::ClientConfig>,
    /// The client certificate, to reload when its files change.
    pub cert: Option<Arc<Certificate>>,
}

/// The clients built, one per distinct `upstream.tls`, newest last: the
/// same config always gives the same client, so the certificate a replica's
/// connections show is the one the reload task reloads (a single slot was
/// replaced by another gateway's config in the same process, and the task
/// then reloaded a copy nobody used).
static CLIENTS: Mutex<Vec<(UpstreamTlsConfig, Arc<Client>)>> = Mutex::new(Vec::new());

/// Distinct configs kept (reloads that change `upstream.tls` add one each).
const CLIENTS_KEPT: usize = 16;

/// The [`Client`] for `cfg` (built on first use).
pub fn shared_client(cfg: &UpstreamTlsConfig) -> anyhow::Result<Arc<Client>> {
    let mut held = CLIENTS.lock();
    if let Some((_, client)) = held.iter().find(|(c, _)| c == cfg) {
        return Ok(client.clone());
    }
    let (config, cert) = client(cfg)?;
    let built = Arc::new(Client { config, cert });
    if held.len() >= CLIENTS_KEPT {
        held.remove(0);
    }
    held.push((cfg.clone(), built.clone()));
    Ok(built)
}
