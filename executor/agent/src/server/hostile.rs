//! Breaches of the protocol on request, for tests only: compiled with the `hostile` feature,
//! which no shipped agent has. The lab's hostile-agent scenario builds a guest image with this
//! agent and runs `tine-hostile MODE` through exec (or uploads to [`NEVER_READ_PATH`]) to show
//! that the executor survives a compromised guest: a clear error, bounded time and memory.

use std::io::{Read, Write};
use std::time::Duration;

use super::listen::Conn;
use crate::frame::{write_message, CHUNK, MAX_FRAME};
use crate::pb::{self, response::Kind};

/// The exec argv[0] that asks for a breach instead of running a program.
pub const ARGV0: &str = "tine-hostile";

/// An upload to this path is accepted and then never read.
pub const NEVER_READ_PATH: &str = "/tine-hostile/never-read";

/// `tine-hostile MODE`:
/// - `garbage`: a frame that is not protobuf;
/// - `oversized`: a length prefix of 4 GiB;
/// - `stall`: a 4 MiB frame's prefix and its first KiB, then nothing;
/// - `silent`: no answer at all;
/// - `flood`: stdout chunks as fast as the host takes them, forever.
pub fn exec(argv: &[String], conn: &mut Conn) -> anyhow::Result<()> {
    match argv.get(1).map(String::as_str) {
        Some("garbage") => {
            // Wire type 7 does not exist: this never decodes.
            conn.write_all(&64u32.to_be_bytes())?;
            conn.write_all(&[0xff; 64])?;
        }
        Some("oversized") => conn.write_all(&u32::MAX.to_be_bytes())?,
        Some("stall") => {
            conn.write_all(&(MAX_FRAME as u32).to_be_bytes())?;
            conn.write_all(&[0; 1024])?;
        }
        Some("silent") => {}
        Some("flood") => loop {
            let data = vec![b'x'; CHUNK];
            let chunk = Kind::Stdout(pb::OutputChunk { data });
            write_message(conn, &pb::Response { kind: Some(chunk) })?;
        },
        other => anyhow::bail!("unknown hostile mode {other:?}"),
    }
    // Keep the connection open until the host gives up on it.
    let mut sink = [0u8; 4096];
    while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
    Ok(())
}

/// Holds an upload's connection open without reading another byte.
pub fn never_read(_conn: &mut Conn) -> anyhow::Result<()> {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
