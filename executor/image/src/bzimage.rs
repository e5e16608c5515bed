//! Extracting the ELF `vmlinux` from an x86 bzImage.
//!
//! The boot protocol header (Documentation/arch/x86/boot.rst) tells where the compressed payload
//! sits: `payload_offset`/`payload_length` at 0x248/0x24c, relative to the protected-mode code
//! that starts after `setup_sects + 1` 512-byte sectors.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::lz4_legacy;

#[derive(Debug, thiserror::Error)]
pub enum BzImageError {
    #[error("not a bzImage: {0}")]
    NotBzImage(String),
    #[error("unsupported payload compression: {0} (supported: lz4 legacy, gzip)")]
    Unsupported(&'static str),
    #[error("corrupt payload at byte {offset}: {why}")]
    Corrupt { offset: usize, why: String },
    #[error("decompressed payload is not an x86_64 ELF")]
    NotElf,
}

/// Where the compressed kernel lives inside a bzImage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Payload {
    pub offset: usize,
    pub len: usize,
}

const SETUP_SECTS: usize = 0x1f1;
const HDR_MAGIC: usize = 0x202;
const VERSION: usize = 0x206;
const PAYLOAD_OFFSET: usize = 0x248;
const PAYLOAD_LENGTH: usize = 0x24c;

fn le32(data: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?))
}

/// Locates the compressed payload using the setup header.
pub fn parse_header(image: &[u8]) -> Result<Payload, BzImageError> {
    let bad = |why: &str| BzImageError::NotBzImage(why.to_string());
    if image.get(HDR_MAGIC..HDR_MAGIC + 4) != Some(b"HdrS") {
        return Err(bad("no HdrS magic at 0x202"));
    }
    let version = u16::from_le_bytes([image[VERSION], image[VERSION + 1]]);
    if version < 0x0208 {
        return Err(bad(&format!(
            "boot protocol {version:#x} predates payload_offset (2.08)"
        )));
    }
    // 0 means 4, for ancient loaders' sake.
    let setup_sects = match image[SETUP_SECTS] {
        0 => 4,
        n => n as usize,
    };
    let pm_start = (setup_sects + 1) * 512;
    let rel = le32(image, PAYLOAD_OFFSET).ok_or_else(|| bad("short header"))? as usize;
    let len = le32(image, PAYLOAD_LENGTH).ok_or_else(|| bad("short header"))? as usize;
    let offset = pm_start + rel;
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > image.len()) {
        return Err(bad(&format!(
            "payload {offset:#x}+{len:#x} outside the {}-byte file",
            image.len()
        )));
    }
    Ok(Payload { offset, len })
}

/// Decompresses a bzImage's payload into the ELF vmlinux.
pub fn vmlinux_from_bzimage(image: &[u8]) -> Result<Vec<u8>, BzImageError> {
    let p = parse_header(image)?;
    let payload = &image[p.offset..p.offset + p.len];
    let elf = match payload {
        [0x02, 0x21, 0x4c, 0x18, ..] => lz4_legacy::decompress(payload)?,
        [0x1f, 0x8b, ..] => {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(payload)
                .read_to_end(&mut out)
                .map_err(|e| BzImageError::Corrupt {
                    offset: 0,
                    why: format!("gzip: {e}"),
                })?;
            out
        }
        [0x28, 0xb5, 0x2f, 0xfd, ..] => return Err(BzImageError::Unsupported("zstd")),
        [0xfd, b'7', b'z', b'X', b'Z', ..] => return Err(BzImageError::Unsupported("xz")),
        [b'B', b'Z', b'h', ..] => return Err(BzImageError::Unsupported("bzip2")),
        [0x89, b'L', b'Z', b'O', ..] => return Err(BzImageError::Unsupported("lzo")),
        [0x5d, 0x00, 0x00, ..] => return Err(BzImageError::Unsupported("lzma")),
        _ => return Err(BzImageError::Unsupported("unknown magic")),
    };
    if !is_x86_64_elf(&elf) {
        return Err(BzImageError::NotElf);
    }
    Ok(elf)
}

/// ELF magic, 64-bit class, little endian, machine EM_X86_64.
pub fn is_x86_64_elf(data: &[u8]) -> bool {
    data.len() >= 20
        && data[..4] == *b"\x7fELF"
        && data[4] == 2
        && data[5] == 1
        && u16::from_le_bytes([data[18], data[19]]) == 0x3e
}

/// Where [`extract_vmlinux`] puts the vmlinux of `vmlinuz`: `vmlinux-<release>` next to
/// `vmlinuz-<release>`.
pub fn vmlinux_path(vmlinuz: &Path) -> anyhow::Result<PathBuf> {
    let name = vmlinuz
        .file_name()
        .context("kernel path has no file name")?
        .to_string_lossy();
    let out_name = match name.strip_prefix("vmlinuz") {
        Some(rest) => format!("vmlinux{rest}"),
        None => format!("{name}.vmlinux"),
    };
    Ok(vmlinuz.with_file_name(out_name))
}

/// Extracts `vmlinux-<release>` next to `vmlinuz-<release>` (once) and returns its path.
pub fn extract_vmlinux(vmlinuz: &Path) -> anyhow::Result<PathBuf> {
    let out = vmlinux_path(vmlinuz)?;
    if out.is_file() {
        return Ok(out);
    }
    extract_vmlinux_to(vmlinuz, &out)?;
    Ok(out)
}

/// Extracts the vmlinux of `vmlinuz` into `out` (atomically).
pub fn extract_vmlinux_to(vmlinuz: &Path, out: &Path) -> anyhow::Result<()> {
    let image = std::fs::read(vmlinuz).with_context(|| format!("reading {}", vmlinuz.display()))?;
    let elf = vmlinux_from_bzimage(&image)
        .with_context(|| format!("extracting vmlinux from {}", vmlinuz.display()))?;
    crate::fsutil::write_atomic(out, |f| {
        use std::io::Write;
        f.write_all(&elf)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_elf() -> Vec<u8> {
        let mut elf = vec![0u8; 64 * 1024];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[18] = 0x3e;
        for (i, b) in elf.iter_mut().enumerate().skip(64) {
            *b = (i % 13) as u8;
        }
        elf
    }

    /// A bzImage skeleton: setup sectors, header, some decompressor code, then the payload.
    fn fake_bzimage(payload: &[u8], setup_sects: u8) -> Vec<u8> {
        let sects = if setup_sects == 0 {
            4
        } else {
            setup_sects as usize
        };
        let pm_start = (sects + 1) * 512;
        let rel = 0x300;
        let mut img = vec![0u8; pm_start + rel];
        img[SETUP_SECTS] = setup_sects;
        img[HDR_MAGIC..HDR_MAGIC + 4].copy_from_slice(b"HdrS");
        img[VERSION..VERSION + 2].copy_from_slice(&0x020fu16.to_le_bytes());
        img[PAYLOAD_OFFSET..PAYLOAD_OFFSET + 4].copy_from_slice(&(rel as u32).to_le_bytes());
        img[PAYLOAD_LENGTH..PAYLOAD_LENGTH + 4]
            .copy_from_slice(&(payload.len() as u32).to_le_bytes());
        img.extend_from_slice(payload);
        img.extend_from_slice(&[0xcc; 100]);
        img
    }

    #[test]
    fn parses_payload_location() {
        let img = fake_bzimage(b"abcd", 27);
        assert_eq!(
            parse_header(&img).unwrap(),
            Payload {
                offset: 28 * 512 + 0x300,
                len: 4
            }
        );
        let img = fake_bzimage(b"abcd", 0);
        assert_eq!(parse_header(&img).unwrap().offset, 5 * 512 + 0x300);
    }

    #[test]
    fn rejects_non_bzimages() {
        assert!(matches!(
            parse_header(&[0u8; 4096]),
            Err(BzImageError::NotBzImage(_))
        ));
        let mut img = fake_bzimage(b"abcd", 10);
        let n = img.len() as u32;
        img[PAYLOAD_LENGTH..PAYLOAD_LENGTH + 4].copy_from_slice(&n.to_le_bytes());
        assert!(matches!(
            parse_header(&img),
            Err(BzImageError::NotBzImage(_))
        ));
    }

    #[test]
    fn decodes_lz4_legacy_payload() {
        let elf = fake_elf();
        let img = fake_bzimage(&lz4_legacy::compress(&elf, 8 << 20, true), 30);
        assert_eq!(vmlinux_from_bzimage(&img).unwrap(), elf);
    }

    #[test]
    fn decodes_gzip_payload() {
        use std::io::Write;
        let elf = fake_elf();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&elf).unwrap();
        let img = fake_bzimage(&gz.finish().unwrap(), 30);
        assert_eq!(vmlinux_from_bzimage(&img).unwrap(), elf);
    }

    #[test]
    fn reports_unsupported_and_non_elf_payloads() {
        let img = fake_bzimage(&[0x28, 0xb5, 0x2f, 0xfd, 0, 0], 30);
        assert!(matches!(
            vmlinux_from_bzimage(&img),
            Err(BzImageError::Unsupported("zstd"))
        ));
        let img = fake_bzimage(&lz4_legacy::compress(&[0u8; 100], 4096, true), 30);
        assert!(matches!(
            vmlinux_from_bzimage(&img),
            Err(BzImageError::NotElf)
        ));
    }

    /// Runs on the real Debian cloud kernel when `tine image kernel` has cached it.
    #[test]
    fn extracts_the_cached_debian_cloud_kernel() {
        let kernels = crate::kernel::kernels_dir(&crate::default_cache_dir());
        let Ok(Some(kernel)) = crate::kernel::newest_cached(crate::Flavor::Cloud, &kernels) else {
            eprintln!(
                "no cached cloud kernel under {}; skipped",
                kernels.display()
            );
            return;
        };
        let image = std::fs::read(&kernel.vmlinuz).unwrap();
        let p = parse_header(&image).unwrap();
        assert_eq!(&image[p.offset..p.offset + 4], &lz4_legacy::MAGIC);
        let elf = vmlinux_from_bzimage(&image).unwrap();
        assert!(is_x86_64_elf(&elf));
        assert!(elf.len() > image.len());
    }
}
