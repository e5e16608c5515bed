//! TLS files, client channels, and the rule for where a service may listen.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig,
};

/// PEM certificate chain and private key.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// Both or neither of `--tls-cert` and `--tls-key`.
    pub fn from_args(cert: Option<PathBuf>, key: Option<PathBuf>) -> Result<Option<TlsFiles>> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key })),
            (None, None) => Ok(None),
            _ => bail!("give both --tls-cert and --tls-key"),
        }
    }

    /// The rustls server configuration from the two PEM files.
    pub fn server_config(&self) -> Result<ServerTlsConfig> {
        let cert = std::fs::read(&self.cert)
            .with_context(|| format!("reading {}", self.cert.display()))?;
        let key =
            std::fs::read(&self.key).with_context(|| format!("reading {}", self.key.display()))?;
        // A handshake that stalls is dropped like a connection that sends no preface.
        Ok(ServerTlsConfig::new()
            .identity(Identity::from_pem(cert, key))
            .timeout(crate::conn::Connections::default().preface))
    }
}

/// A client TLS configuration trusting the CA in `ca` (PEM).
pub fn client_config(ca: &Path) -> Result<ClientTlsConfig> {
    let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
    Ok(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))
}

/// A lazily connected channel to `addr` (http(s)://host:port); https needs `ca`.
pub fn channel(addr: &str, ca: Option<&Path>) -> Result<Channel> {
    let mut ep = Endpoint::from_shared(addr.to_string())
        .with_context(|| format!("address {addr:?}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    if addr.starts_with("https://") {
        let Some(ca) = ca else {
            bail!("{addr} speaks TLS: give the CA that signed its certificate");
        };
        ep = ep.tls_config(client_config(ca)?)?;
    }
    Ok(ep.connect_lazy())
}

/// A listener off loopback needs authentication, and TLS unless plaintext is explicitly allowed.
pub fn check_listen(
    listen: SocketAddr,
    has_auth: bool,
    has_tls: bool,
    allow_plaintext_remote: bool,
) -> Result<()> {
    if listen.ip().is_loopback() {
        return Ok(());
    }
    if !has_auth {
        bail!("refusing to listen on {listen} without authentication: give tokens, or listen on a loopback address");
    }
    if !has_tls && !allow_plaintext_remote {
        bail!(
            "refusing to listen on {listen} without TLS (bearer tokens would cross the network in clear): \
             give --tls-cert/--tls-key, or --allow-plaintext-remote on a trusted network"
        );
    }
    Ok(())
}

/// A client sends its bearer token to `addr` only over TLS, or in clear to a loopback address,
/// unless `allow_plaintext_remote` (a trusted network).
pub fn check_token_transport(addr: &str, allow_plaintext_remote: bool) -> Result<()> {
    let uri: tonic::codegen::http::Uri = addr
        .parse()
        .map_err(|e| anyhow::anyhow!("address {addr:?}: {e}"))?;
    if uri.scheme_str() == Some("https") || allow_plaintext_remote {
        return Ok(());
    }
    let host = uri.host().unwrap_or("");
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!(
            "refusing to send the token in clear to {addr}: use https://, or set \
             TINE_ALLOW_PLAINTEXT_REMOTE=1 on a trusted network"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_go_in_clear_only_to_loopback() {
        for ok in [
            "http://127.0.0.1:7070",
            "http://localhost:7070",
            "http://[::1]:7070",
            "https://cp.example:7070",
            "https://10.0.0.1:7070",
        ] {
            check_token_transport(ok, false).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "http://10.0.0.1:7070",
            "http://cp.example:7070",
            "http://[fe80::1]:1",
        ] {
            let e = check_token_transport(bad, false).unwrap_err().to_string();
            assert!(e.contains("TINE_ALLOW_PLAINTEXT_REMOTE=1"), "{bad}: {e}");
            check_token_transport(bad, true).unwrap();
        }
    }

    #[test]
    fn remote_listeners_need_auth_and_tls() {
        let lo: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:1".parse().unwrap();
        check_listen(lo, false, false, false).unwrap();
        assert!(check_listen(any, false, true, false).is_err());
        assert!(check_listen(any, true, false, false).is_err());
        check_listen(any, true, false, true).unwrap();
        check_listen(any, true, true, false).unwrap();
    }
}
