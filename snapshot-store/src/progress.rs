//! Transfer progress reporting.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgressEvent {
    pub phase: &'static str,
    pub done_objects: u64,
    pub total_objects: u64,
    /// Bytes actually transferred.
    pub done_bytes: u64,
    pub total_bytes: u64,
    /// Objects that needed no transfer (already present).
    pub skipped_objects: u64,
}

pub trait Progress: Send + Sync {
    fn update(&self, event: &ProgressEvent);
}

/// Discards progress.
pub struct NoProgress;

impl Progress for NoProgress {
    fn update(&self, _: &ProgressEvent) {}
}

/// Prints a line to stderr at most every `interval`, and the final state.
pub struct StderrProgress {
    interval: Duration,
    last: Mutex<Option<Instant>>,
}

impl StderrProgress {
    pub fn new(interval: Duration) -> Self {
        StderrProgress {
            interval,
            last: Mutex::new(None),
        }
    }
}

impl Progress for StderrProgress {
    fn update(&self, e: &ProgressEvent) {
        let finished = e.done_objects + e.skipped_objects >= e.total_objects;
        let mut last = self.last.lock().expect("progress lock");
        if !finished && last.is_some_and(|t| t.elapsed() < self.interval) {
            return;
        }
        *last = Some(Instant::now());
        eprintln!(
            "{}: {}/{} objects ({} already present), {:.1}/{:.1} MiB",
            e.phase,
            e.done_objects + e.skipped_objects,
            e.total_objects,
            e.skipped_objects,
            e.done_bytes as f64 / 1048576.0,
            e.total_bytes as f64 / 1048576.0
        );
    }
}
