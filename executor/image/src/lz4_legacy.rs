//! Decoder for the LZ4 "legacy" frame format that Linux uses for LZ4-compressed kernels.
//!
//! Stream: magic `02 21 4c 18`, then blocks of `[u32 LE compressed size][LZ4 block]`, each block
//! decompressing to at most 8 MiB. The magic may reappear (concatenated streams). The kernel build
//! appends the total uncompressed size as a final u32, which we recognise and check.

use crate::bzimage::BzImageError;

pub const MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
const MAX_BLOCK: usize = 8 << 20;

pub fn decompress(input: &[u8]) -> Result<Vec<u8>, BzImageError> {
    let corrupt = |offset: usize, why: String| BzImageError::Corrupt { offset, why };
    if !input.starts_with(&MAGIC) {
        return Err(corrupt(0, "missing LZ4 legacy magic".into()));
    }
    let mut out = Vec::new();
    let mut pos = MAGIC.len();
    while pos < input.len() {
        let Some(word) = input.get(pos..pos + 4) else {
            return Err(corrupt(pos, "truncated block header".into()));
        };
        let word = u32::from_le_bytes(word.try_into().expect("4 bytes"));
        pos += 4;
        if word.to_le_bytes() == MAGIC {
            continue;
        }
        let size = word as usize;
        if pos == input.len() {
            // The trailing size word appended by the kernel build.
            if size != out.len() {
                return Err(corrupt(
                    pos - 4,
                    format!("trailer says {size} bytes, decoded {}", out.len()),
                ));
            }
            break;
        }
        let block = input
            .get(pos..pos + size)
            .ok_or_else(|| corrupt(pos, format!("block of {size} bytes runs past the end")))?;
        let start = out.len();
        out.resize(start + MAX_BLOCK, 0);
        let n = lz4_flex::block::decompress_into(block, &mut out[start..])
            .map_err(|e| corrupt(pos, format!("lz4 block: {e}")))?;
        out.truncate(start + n);
        pos += size;
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) fn compress(data: &[u8], block: usize, with_trailer: bool) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    for chunk in data.chunks(block) {
        let c = lz4_flex::block::compress(chunk);
        out.extend_from_slice(&(c.len() as u32).to_le_bytes());
        out.extend_from_slice(&c);
    }
    if with_trailer {
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (((i * 7) % 251) ^ (i >> 10)) as u8)
            .collect()
    }

    #[test]
    fn round_trips_multiple_blocks_with_trailer() {
        let data = sample(3 * 1024 * 1024 + 17);
        let packed = compress(&data, 1 << 20, true);
        assert_eq!(decompress(&packed).unwrap(), data);
    }

    #[test]
    fn accepts_repeated_magic_and_no_trailer() {
        let a = sample(5000);
        let mut packed = compress(&a, 4096, false);
        packed.extend_from_slice(&compress(&a, 4096, false));
        let mut both = a.clone();
        both.extend_from_slice(&a);
        assert_eq!(decompress(&packed).unwrap(), both);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(decompress(b"not lz4").is_err());
        let data = sample(10_000);
        let packed = compress(&data, 4096, true);
        // Truncated in the middle of a block.
        assert!(decompress(&packed[..packed.len() / 2]).is_err());
        // Wrong trailer.
        let mut wrong = packed.clone();
        let n = wrong.len();
        wrong[n - 4..].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            decompress(&wrong),
            Err(BzImageError::Corrupt { .. })
        ));
    }
}
