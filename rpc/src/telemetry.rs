//! Logs and traces. `tracing` events go to stderr; when an OTLP endpoint is configured
//! (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) spans are also exported
//! over OTLP/gRPC. W3C trace context travels in gRPC metadata from the control plane to the
//! executors, so one spawn is one trace across hosts.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::Context;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tonic::codegen::http::HeaderMap;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Keeps the exporter alive; dropping it flushes pending spans.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Install the global subscriber: stderr logs filtered by `RUST_LOG` (default `default_filter`),
/// plus OTLP span export when configured. Must run inside a Tokio runtime when OTLP is on.
pub fn init(service: &'static str, default_filter: &str) -> anyhow::Result<Telemetry> {
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    if !otlp_configured() {
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .try_init();
        return Ok(Telemetry { provider: None });
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .build(),
        )
        .build();
    let tracer = provider.tracer("tine");
    let otel = tracing_opentelemetry::layer().with_tracer(tracer);
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
    Ok(Telemetry {
        provider: Some(provider),
    })
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Put the current span's trace context into outgoing request metadata.
pub fn inject_current(md: &mut MetadataMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(md))
    });
}

/// The trace context an incoming request carries (empty if none).
pub fn extract(headers: &HeaderMap) -> Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// A span for one incoming gRPC request, child of the caller's trace when it sent one.
pub fn request_span<B>(
    req: &tonic::codegen::http::Request<B>,
    server: &'static str,
) -> tracing::Span {
    let span = tracing::info_span!("grpc", server, rpc = %req.uri().path());
    let _ = span.set_parent(extract(req.headers()));
    span
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt;

    #[test]
    fn trace_context_crosses_grpc_metadata() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("spawn");
            let _in = span.enter();
            let mut md = MetadataMap::new();
            inject_current(&mut md);
            let want = span.context().span().span_context().trace_id().to_string();
            let tp = md.get("traceparent").expect("traceparent injected");
            assert!(tp.to_str().unwrap().contains(&want), "{tp:?} vs {want}");
            // What the executor sees on its side of the wire.
            let cx = extract(&md.into_headers());
            assert_eq!(cx.span().span_context().trace_id().to_string(), want);
        });
    }
}
