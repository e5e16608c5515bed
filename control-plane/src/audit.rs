//! Append-only audit trail: one JSON object per line for every call, accepted or rejected.
//! `reopen` (wired to SIGHUP) starts a new file after logrotate moved the old one away.
//!
//! Whole lines only: a write that fails part-way (a full disk) is cut back off, and a file
//! that ends in a torn line (a crash mid-write) is cut back to its last whole line when
//! opened, so no record is ever glued onto a fragment.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct AuditRecord<'a> {
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    /// Token name, or null when authentication failed.
    pub principal: Option<&'a str>,
    pub rpc: &'a str,
    pub args: serde_json::Value,
    /// gRPC status code name ("OK", "UNAUTHENTICATED", ...).
    pub status: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<&'a str>,
    pub latency_ms: f64,
    pub peer: Option<String>,
}

pub struct AuditLog {
    path: PathBuf,
    file: Mutex<File>,
}

fn open(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    let whole = whole_lines_len(&file)?;
    if whole < file.metadata()?.len() {
        tracing::warn!(path = %path.display(), "cutting a torn last line off the audit log");
        file.set_len(whole)?;
    }
    Ok(file)
}

/// How much of a regular `file` is whole lines (up to and including its last newline).
fn whole_lines_len(file: &File) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Ok(meta.len());
    }
    let mut end = meta.len();
    let mut buf = vec![0u8; 64 << 10];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..(end - start) as usize];
        file.read_exact_at(chunk, start)?;
        if let Some(i) = chunk.iter().rposition(|b| *b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

impl AuditLog {
    pub fn open(path: &Path) -> std::io::Result<AuditLog> {
        Ok(AuditLog {
            path: path.to_path_buf(),
            file: Mutex::new(open(path)?),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one record as a single write, so concurrent records never interleave. A write
    /// that fails leaves nothing of the record behind (and is logged as an error).
    pub fn record(&self, r: &AuditRecord<'_>) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(r).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let before = f.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
        let written = f.write_all(&line);
        if let Err(e) = &written {
            tracing::error!(path = %self.path.display(), "audit write failed: {e}");
            if let Some(len) = before {
                if let Err(e) = f.set_len(len) {
                    tracing::error!(path = %self.path.display(), "cutting a failed audit write back off: {e}");
                }
            }
        }
        written
    }

    /// Reopen the file by path (after rotation).
    pub fn reopen(&self) -> std::io::Result<()> {
        let new = open(&self.path)?;
        *self.file.lock().unwrap_or_else(|p| p.into_inner()) = new;
        Ok(())
    }
}

/// `time` as RFC 3339 UTC with milliseconds (a time before 1970 as 1970's first instant).
pub fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339_millis(time.max(UNIX_EPOCH)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_651_200_123); // 2026-11-26
        assert_eq!(rfc3339(t), "2026-11-26T00:00:00.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339(before), "1970-01-01T00:00:00.000Z");
    }

    fn record(rpc: &str) -> AuditRecord<'_> {
        AuditRecord {
            time: rfc3339(SystemTime::now()),
            principal: Some("ops"),
            rpc,
            args: serde_json::json!({}),
            status: "OK",
            message: None,
            latency_ms: 0.0,
            peer: None,
        }
    }

    /// A log a crash left with a torn last line is cut back to its whole lines when opened, so
    /// the next record starts a line of its own.
    #[test]
    fn a_torn_tail_is_cut_off_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.log");
        std::fs::write(&p, "{\"rpc\":\"A\"}\n{\"rpc\":\"B\",\"sta").unwrap();
        let log = AuditLog::open(&p).unwrap();
        log.record(&record("C")).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        let rpcs: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["rpc"].to_string())
            .collect();
        assert_eq!(rpcs, ["\"A\"", "\"C\""]);
        // A file with no newline at all is all torn.
        std::fs::write(&p, "{\"rp").unwrap();
        AuditLog::open(&p).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"");
    }

    /// A write that cannot be made is an error the caller sees.
    #[test]
    fn a_full_disk_is_an_error() {
        let log = AuditLog::open(Path::new("/dev/full")).unwrap();
        assert!(log.record(&record("A")).is_err());
    }

    #[test]
    fn records_survive_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.log");
        let log = AuditLog::open(&p).unwrap();
        let rec = |rpc| AuditRecord {
            time: rfc3339(SystemTime::now()),
            principal: Some("ops"),
            rpc,
            args: serde_json::json!({"tag": "t"}),
            status: "OK",
            message: None,
            latency_ms: 1.5,
            peer: None,
        };
        log.record(&rec("A")).unwrap();
        std::fs::rename(&p, dir.path().join("audit.log.1")).unwrap();
        log.record(&rec("B")).unwrap(); // still the rotated file until reopened
        log.reopen().unwrap();
        log.record(&rec("C")).unwrap();
        let old = std::fs::read_to_string(dir.path().join("audit.log.1")).unwrap();
        let new = std::fs::read_to_string(&p).unwrap();
        assert_eq!(old.lines().count(), 2);
        let v: serde_json::Value = serde_json::from_str(new.trim()).unwrap();
        assert_eq!(v["rpc"], "C");
        assert_eq!(v["args"]["tag"], "t");
    }
}
