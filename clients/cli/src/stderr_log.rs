//! Logging to stderr at `warn` unless `RUST_LOG` says otherwise: the CLI's commands (besides
//! the services, which set up their own) and the VMM worker, whose stderr is its vmm.log.

pub fn init() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
}
