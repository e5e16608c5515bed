//! Initramfs compression in the formats the guest kernel can unpack (RD_GZIP, RD_ZSTD, RD_LZ4,
//! RD_XZ). Measurements and the reasons for the default are in docs/image.md.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::progress::ProgressReader;

/// zstd level for initramfs images: decompression speed barely depends on the level, and above
/// 9 compression gets several times slower for about one percent of size (docs/image.md).
pub const ZSTD_LEVEL: i32 = 9;

/// The kernel's unlz4 reads only the legacy frame format: a magic, then blocks of at most 8 MiB
/// of input, each behind its little-endian compressed size.
const LZ4_LEGACY_MAGIC: u32 = 0x184C_2102;
const LZ4_LEGACY_BLOCK: usize = 8 << 20;

#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    Gzip,
    #[default]
    Zstd,
    Lz4,
    Xz,
    /// Uncompressed cpio (largest file, nothing to decompress).
    None,
}

impl Compression {
    pub const ALL: [Compression; 5] = [
        Compression::Gzip,
        Compression::Zstd,
        Compression::Lz4,
        Compression::Xz,
        Compression::None,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
            Compression::Lz4 => "lz4",
            Compression::Xz => "xz",
            Compression::None => "none",
        }
    }

    /// File name of an initramfs compressed this way.
    pub fn file_name(self) -> &'static str {
        match self {
            Compression::Gzip => "initrd.cpio.gz",
            Compression::Zstd => "initrd.cpio.zst",
            Compression::Lz4 => "initrd.cpio.lz4",
            Compression::Xz => "initrd.cpio.xz",
            Compression::None => "initrd.cpio",
        }
    }

    /// Compresses `input` into `output`, reporting progress on stderr.
    pub fn compress_file(self, input: &Path, output: &Path) -> Result<()> {
        let src = File::open(input).with_context(|| format!("opening {}", input.display()))?;
        let total = src.metadata()?.len();
        let reader = BufReader::with_capacity(
            1 << 20,
            ProgressReader::new(src, &format!("{} compression", self.name()), Some(total)),
        );
        let dst = File::create(output).with_context(|| format!("creating {}", output.display()))?;
        self.compress(reader, BufWriter::with_capacity(1 << 20, dst))
            .with_context(|| format!("{} compression of {}", self.name(), input.display()))
    }

    /// Compresses everything from `input` into `output`.
    pub fn compress(self, mut input: impl Read, mut output: impl Write) -> Result<()> {
        match self {
            Compression::Gzip => {
                let mut enc = flate2::write::GzEncoder::new(output, flate2::Compression::default());
                io::copy(&mut input, &mut enc)?;
                enc.finish()?.flush()?;
            }
            Compression::Zstd => {
                let mut enc = zstd::stream::Encoder::new(output, ZSTD_LEVEL)?;
                // A content checksum lets the kernel detect a corrupt image instead of booting it.
                enc.include_checksum(true)?;
                io::copy(&mut input, &mut enc)?;
                enc.finish()?.flush()?;
            }
            Compression::Lz4 => lz4_legacy(input, &mut output)?,
            Compression::Xz => xz(input, output)?,
            Compression::None => {
                io::copy(&mut input, &mut output)?;
                output.flush()?;
            }
        }
        Ok(())
    }

    /// Decompresses a whole image (used by tests and by tools that inspect images).
    pub fn decompress(self, data: &[u8]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        match self {
            Compression::Gzip => {
                flate2::read::GzDecoder::new(data).read_to_end(&mut out)?;
            }
            Compression::Zstd => {
                zstd::stream::Decoder::new(data)?.read_to_end(&mut out)?;
            }
            Compression::Lz4 => out = crate::lz4_legacy::decompress(data)?,
            Compression::Xz => out = pipe_through(&["xz", "-dc"], data)?,
            Compression::None => out.extend_from_slice(data),
        }
        Ok(out)
    }
}

fn lz4_legacy(mut input: impl Read, out: &mut impl Write) -> Result<()> {
    out.write_all(&LZ4_LEGACY_MAGIC.to_le_bytes())?;
    let mut block = vec![0u8; LZ4_LEGACY_BLOCK];
    loop {
        let n = read_full(&mut input, &mut block)?;
        if n == 0 {
            break;
        }
        let packed = lz4_flex::block::compress(&block[..n]);
        out.write_all(&(packed.len() as u32).to_le_bytes())?;
        out.write_all(&packed)?;
        if n < block.len() {
            break;
        }
    }
    out.flush()?;
    Ok(())
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// xz through xz-utils: the kernel's XZ decoder wants CRC32 checks (not the default CRC64) and
/// one stream; no pure-Rust encoder is in our dependency set.
fn xz(mut input: impl Read, mut output: impl Write) -> Result<()> {
    let mut child = Command::new("xz")
        .args(["--check=crc32", "-6", "-c"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("running xz (package xz-utils)")?;
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = child.stdout.take().expect("piped");
    // Drain xz's output on a thread so neither pipe can fill up and stall the other.
    let reader = std::thread::spawn(move || -> io::Result<Vec<u8>> {
        let mut buf = Vec::new();
        stdout.read_to_end(&mut buf)?;
        Ok(buf)
    });
    io::copy(&mut input, &mut stdin)?;
    drop(stdin);
    let packed = reader
        .join()
        .map_err(|_| anyhow::anyhow!("xz reader thread panicked"))??;
    let status = child.wait()?;
    if !status.success() {
        bail!("xz failed ({status})");
    }
    output.write_all(&packed)?;
    output.flush()?;
    Ok(())
}

fn pipe_through(cmd: &[&str], data: &[u8]) -> Result<Vec<u8>> {
    let mut child = Command::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", cmd.join(" ")))?;
    let mut stdin = child.stdin.take().expect("piped");
    let owned = data.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&owned));
    let out = child.wait_with_output()?;
    feeder
        .join()
        .map_err(|_| anyhow::anyhow!("feeder thread panicked"))??;
    if !out.status.success() {
        bail!("{} failed ({})", cmd.join(" "), out.status);
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_round_trips() {
        // Compressible but not trivial, and larger than one lz4 legacy block.
        let data: Vec<u8> = (0..(9u32 << 20))
            .map(|i| (i / 7 % 251) as u8 ^ (i >> 13) as u8)
            .collect();
        for c in Compression::ALL {
            if c == Compression::Xz && Command::new("xz").arg("--version").output().is_err() {
                eprintln!("xz not installed; skipped");
                continue;
            }
            let mut packed = Vec::new();
            c.compress(&data[..], &mut packed).unwrap();
            if c != Compression::None {
                assert!(packed.len() < data.len(), "{c:?} did not compress");
            }
            assert_eq!(c.decompress(&packed).unwrap(), data, "{c:?}");
        }
    }

    #[test]
    fn lz4_uses_the_legacy_frame_the_kernel_reads() {
        let mut packed = Vec::new();
        Compression::Lz4
            .compress(&b"hello hello hello"[..], &mut packed)
            .unwrap();
        assert_eq!(packed[..4], LZ4_LEGACY_MAGIC.to_le_bytes());
    }
}
