//! Byte-count progress on stderr for the long build steps (cpio writing, compression).

use std::io::{self, IsTerminal, Read, Write};
use std::time::{Duration, Instant};

const MIB: f64 = 1024.0 * 1024.0;

pub struct Progress {
    label: String,
    total: Option<u64>,
    done: u64,
    started: Instant,
    last: Instant,
    tty: bool,
    finished: bool,
}

impl Progress {
    pub fn new(label: &str, total: Option<u64>) -> Progress {
        let now = Instant::now();
        Progress {
            label: label.to_string(),
            total,
            done: 0,
            started: now,
            last: now,
            tty: io::stderr().is_terminal(),
            finished: false,
        }
    }

    pub fn add(&mut self, n: u64) {
        self.done += n;
        // A terminal line is redrawn often; logs get a line every few seconds.
        let every = if self.tty {
            Duration::from_millis(250)
        } else {
            Duration::from_secs(3)
        };
        if self.last.elapsed() >= every {
            self.last = Instant::now();
            let line = self.line();
            if self.tty {
                eprint!("\r{line}\x1b[K");
            } else {
                eprintln!("{line}");
            }
        }
    }

    fn line(&self) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let pct = match self.total {
            Some(t) if t > 0 => format!(" ({:.0}%)", self.done as f64 * 100.0 / t as f64),
            _ => String::new(),
        };
        format!(
            "tine-image: {}: {:.1} MiB{pct}, {:.1} MiB/s",
            self.label,
            self.done as f64 / MIB,
            self.done as f64 / MIB / secs
        )
    }

    /// Prints the final figures once.
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let clear = if self.tty { "\r\x1b[K" } else { "" };
        eprintln!(
            "{clear}tine-image: {}: {:.1} MiB in {secs:.1} s ({:.1} MiB/s)",
            self.label,
            self.done as f64 / MIB,
            self.done as f64 / MIB / secs
        );
    }
}

/// Counts bytes written through it.
pub struct ProgressWriter<W: Write> {
    inner: W,
    progress: Progress,
}

impl<W: Write> ProgressWriter<W> {
    pub fn new(inner: W, label: &str) -> Self {
        ProgressWriter {
            inner,
            progress: Progress::new(label, None),
        }
    }

    pub fn written(&self) -> u64 {
        self.progress.done
    }

    /// Flushes, prints the summary line and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.inner.flush()?;
        self.progress.finish();
        Ok(self.inner)
    }
}

impl<W: Write> Write for ProgressWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.progress.add(n as u64);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Counts bytes read through it; prints the summary at end of input.
pub struct ProgressReader<R: Read> {
    inner: R,
    progress: Progress,
}

impl<R: Read> ProgressReader<R> {
    pub fn new(inner: R, label: &str, total: Option<u64>) -> Self {
        ProgressReader {
            inner,
            progress: Progress::new(label, total),
        }
    }
}

impl<R: Read> Read for ProgressReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.progress.finish();
        }
        self.progress.add(n as u64);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_passes_through() {
        let mut w = ProgressWriter::new(Vec::new(), "test");
        w.write_all(&[1; 1000]).unwrap();
        assert_eq!(w.written(), 1000);
        assert_eq!(w.finish().unwrap().len(), 1000);
        let mut r = ProgressReader::new(&[7u8; 300][..], "test", Some(300));
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        assert_eq!(out.len(), 300);
        assert_eq!(r.progress.done, 300);
    }
}
