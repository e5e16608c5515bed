//! WriteFile / ReadFile / ListDir.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{bail, Context};

use super::listen::Conn;
use crate::frame::{read_message, write_message, CHUNK};
use crate::paths::validate_guest_path;
use crate::pb::{self, request, response::Kind};

/// Entries per ListDir frame, keeping each frame far below the size limit.
const LIST_BATCH: usize = 512;

/// Removes the temp file unless the upload completed and was renamed.
struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

pub fn write(req: pb::WriteFileRequest, conn: &mut Conn) -> anyhow::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let path = validate_guest_path(&req.path)?;
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        bail!("write_file: {} has no file name", path.display());
    };
    if req.create_parents {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // The temp file lives in the target directory so the rename is atomic.
    let tmp = dir.join(format!(
        ".{}.tine-{}-{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating temp file in {}", dir.display()))?;
    let mut guard = TempGuard(Some(tmp.clone()));
    let mut size = 0u64;
    loop {
        let msg: pb::Request = read_message(conn).context("write_file: reading data")?;
        let Some(request::Kind::FileChunk(chunk)) = msg.kind else {
            bail!("write_file: expected file_chunk frames after write_file");
        };
        file.write_all(&chunk.data)
            .with_context(|| format!("writing {}", tmp.display()))?;
        size += chunk.data.len() as u64;
        if chunk.last {
            break;
        }
    }
    let mode = match req.mode & 0o7777 {
        0 => 0o644,
        m => m,
    };
    file.set_permissions(fs::Permissions::from_mode(mode))?;
    drop(file);
    fs::rename(&tmp, &path).with_context(|| format!("renaming into {}", path.display()))?;
    guard.0 = None;
    write_message(
        conn,
        &pb::Response {
            kind: Some(Kind::WriteFile(pb::WriteFileResponse { size })),
        },
    )?;
    Ok(())
}

pub fn read(req: pb::ReadFileRequest, conn: &mut Conn) -> anyhow::Result<()> {
    let path = validate_guest_path(&req.path)?;
    let mut file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        bail!("{} is a directory", path.display());
    }
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        let chunk = pb::FileChunk {
            data: buf[..n].to_vec(),
            last: false,
        };
        write_message(
            conn,
            &pb::Response {
                kind: Some(Kind::FileChunk(chunk)),
            },
        )?;
    }
    let done = pb::ReadFileDone {
        mode: meta.permissions().mode() & 0o7777,
        size,
    };
    write_message(
        conn,
        &pb::Response {
            kind: Some(Kind::ReadFileDone(done)),
        },
    )?;
    Ok(())
}

pub fn list(req: pb::ListDirRequest, conn: &mut Conn) -> anyhow::Result<()> {
    let path = validate_guest_path(&req.path)?;
    let mut entries = Vec::new();
    for entry in fs::read_dir(&path).with_context(|| format!("listing {}", path.display()))? {
        let entry = entry?;
        entries.push(describe(
            &entry.path(),
            &entry.file_name().to_string_lossy(),
        ));
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let mut batches = entries.chunks(LIST_BATCH).peekable();
    if batches.peek().is_none() {
        return send_batch(conn, Vec::new(), true);
    }
    while let Some(batch) = batches.next() {
        send_batch(conn, batch.to_vec(), batches.peek().is_none())?;
    }
    Ok(())
}

fn describe(path: &Path, name: &str) -> pb::DirEntry {
    // lstat: a symlink is reported as such, not followed.
    let (file_type, size, mode) = match fs::symlink_metadata(path) {
        Ok(m) => {
            let ft = m.file_type();
            let t = if ft.is_file() {
                pb::FileType::File
            } else if ft.is_dir() {
                pb::FileType::Dir
            } else if ft.is_symlink() {
                pb::FileType::Symlink
            } else {
                pb::FileType::Other
            };
            (t, m.len(), m.permissions().mode() & 0o7777)
        }
        // Raced with deletion: still list the name.
        Err(_) => (pb::FileType::Unspecified, 0, 0),
    };
    pb::DirEntry {
        name: name.to_owned(),
        file_type: file_type as i32,
        size,
        mode,
    }
}

fn send_batch(conn: &mut Conn, entries: Vec<pb::DirEntry>, done: bool) -> anyhow::Result<()> {
    write_message(
        conn,
        &pb::Response {
            kind: Some(Kind::ListDir(pb::ListDirResponse { entries, done })),
        },
    )?;
    Ok(())
}
