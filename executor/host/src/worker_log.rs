//! A VMM worker's log: warnings and errors, from `tracing` and from the `log` crate (which
//! virtio-queue reports a guest's bad descriptors with), one line each on stderr, which is the
//! child's vmm.log.
//!
//! Each child's VMM is its own process, so what its logger allocates is paid per child:
//! tracing-subscriber's `fmt` keeps a registry of spans whose first table alone is 32 KiB of
//! heap, written at start-up and never used here (the worker opens no spans). This logger holds
//! nothing and allocates only the line it writes. Workers started with `RUST_LOG` set use the
//! full subscriber instead, whose filter directives this one does not read.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::SystemTime;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// Warnings and errors to stderr, for the rest of the process. Fails if a logger or a global
/// `tracing` subscriber is already set.
pub fn init() -> anyhow::Result<()> {
    tracing::subscriber::set_global_default(WorkerLog)?;
    log::set_logger(&WorkerLog).map_err(|e| anyhow::anyhow!("{e}"))?;
    log::set_max_level(log::LevelFilter::Warn);
    Ok(())
}

/// The logger: no state; every line is formatted and written on its own.
pub struct WorkerLog;

impl Subscriber for WorkerLog {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        // Levels compare by verbosity: ERROR < WARN < INFO.
        *metadata.level() <= Level::WARN
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::WARN)
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        // Spans are not recorded; any enabled one shares this id.
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let m = event.metadata();
        let mut fields = Fields::default();
        event.record(&mut fields);
        write_line(&line(SystemTime::now(), *m.level(), m.target(), &fields));
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

impl log::Log for WorkerLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record<'_>) {
        if !log::Log::enabled(self, record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Error => Level::ERROR,
            _ => Level::WARN,
        };
        let fields = Fields {
            message: record.args().to_string(),
            rest: String::new(),
        };
        write_line(&line(SystemTime::now(), level, record.target(), &fields));
    }

    fn flush(&self) {}
}

/// An event's message and its other fields as ` name=value`.
#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }
}

/// `2026-12-07T16:26:12.123456Z  WARN target: message name=value`, control characters of
/// the message escaped so that a line stays a line (a guest's bytes may reach a message).
fn line(at: SystemTime, level: Level, target: &str, fields: &Fields) -> String {
    let mut s = String::with_capacity(64 + fields.message.len() + fields.rest.len());
    let _ = write!(
        s,
        "{} {level:>5} {target}: ",
        humantime::format_rfc3339_micros(at)
    );
    for c in fields.message.chars().chain(fields.rest.chars()) {
        if c.is_control() {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    s.push('\n');
    s
}

/// One write, so that lines of concurrent threads do not interleave; a log that cannot be
/// written costs the line, never the VM.
fn write_line(line: &str) {
    let _ = std::io::stderr().write_all(line.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn a_line_has_the_time_level_target_message_and_fields() {
        let at =
            UNIX_EPOCH + Duration::new(20_794 * 86_400 + 16 * 3600 + 26 * 60 + 12, 123_456_789);
        let fields = Fields {
            message: "vsock: bad descriptor".into(),
            rest: " len=7 addr=\"0x10\"".into(),
        };
        assert_eq!(
            line(at, Level::WARN, "tine_vmm::vsock", &fields),
            "2026-12-07T16:26:12.123456Z  WARN tine_vmm::vsock: vsock: bad descriptor len=7 addr=\"0x10\"\n"
        );
    }

    #[test]
    fn a_guest_s_bytes_cannot_break_a_line() {
        let fields = Fields {
            message: "name: evil\nFAKE LINE\r\u{1b}[2J".into(),
            rest: String::new(),
        };
        let l = line(UNIX_EPOCH, Level::ERROR, "t", &fields);
        assert_eq!(l.matches('\n').count(), 1, "{l:?}");
        assert!(l.ends_with("evil\\nFAKE LINE\\r\\u{1b}[2J\n"), "{l:?}");
        assert!(
            l.starts_with("1970-01-01T00:00:00.000000Z ERROR t: "),
            "{l:?}"
        );
    }

    #[test]
    fn only_warnings_and_errors_are_enabled() {
        use tracing::subscriber::with_default;
        let seen = with_default(WorkerLog, || {
            (
                tracing::enabled!(Level::ERROR),
                tracing::enabled!(Level::WARN),
                tracing::enabled!(Level::INFO),
                tracing::enabled!(Level::DEBUG),
            )
        });
        assert_eq!(seen, (true, true, false, false));
        let meta = |level| log::MetadataBuilder::new().level(level).build();
        assert!(log::Log::enabled(&WorkerLog, &meta(log::Level::Warn)));
        assert!(!log::Log::enabled(&WorkerLog, &meta(log::Level::Info)));
    }

    #[test]
    fn an_event_s_fields_are_collected_in_order() {
        struct Collect(std::sync::Arc<std::sync::Mutex<Vec<String>>>);
        impl Subscriber for Collect {
            fn enabled(&self, _: &Metadata<'_>) -> bool {
                true
            }
            fn new_span(&self, _: &Attributes<'_>) -> Id {
                Id::from_u64(1)
            }
            fn record(&self, _: &Id, _: &Record<'_>) {}
            fn record_follows_from(&self, _: &Id, _: &Id) {}
            fn event(&self, event: &Event<'_>) {
                let mut f = Fields::default();
                event.record(&mut f);
                self.0
                    .lock()
                    .unwrap()
                    .push(format!("{}|{}", f.message, f.rest));
            }
            fn enter(&self, _: &Id) {}
            fn exit(&self, _: &Id) {}
        }
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        tracing::subscriber::with_default(Collect(got.clone()), || {
            tracing::warn!(port = 52, name = "agent", "refused {}", "twice");
        });
        assert_eq!(
            *got.lock().unwrap(),
            vec!["refused twice| port=52 name=\"agent\"".to_string()]
        );
    }
}
