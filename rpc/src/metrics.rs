//! Serving a Prometheus registry as text on `/metrics` (control plane and executors).

use std::net::SocketAddr;

use prometheus::{Encoder, Registry, TextEncoder};

/// The Prometheus text exposition of every metric in `registry`.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .expect("text encoding");
    String::from_utf8(buf).expect("prometheus text is UTF-8")
}

/// Serve `/metrics` on `addr` until the task is dropped. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let r = registry.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4",
                    )],
                    render(&r),
                )
            }
        }),
    );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("metrics server: {e}");
        }
    });
    Ok((bound, task))
}
