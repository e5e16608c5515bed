//! Compares initramfs compression formats on an uncompressed cpio (e.g. one built with
//! `tine image build --compression none`): size, compression and decompression speed.
//!
//!   cargo run --release -p tine-image --example compression -- initrd.cpio

use std::io::Read;
use std::time::Instant;

use tine_image::Compression;

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: compression <initrd.cpio>"))?;
    let data = std::fs::read(&path)?;
    let mib = |n: usize| n as f64 / (1 << 20) as f64;
    println!("input: {path}, {:.1} MiB", mib(data.len()));
    println!(
        "{:<10} {:>9} {:>7} {:>12} {:>12}",
        "format", "MiB", "ratio", "comp MiB/s", "decomp MiB/s"
    );
    let row = |label: &str, packed: &[u8], comp_s: f64, decomp_s: f64| {
        println!(
            "{label:<10} {:>9.1} {:>6.1}% {:>12.0} {:>12.0}",
            mib(packed.len()),
            packed.len() as f64 * 100.0 / data.len() as f64,
            mib(data.len()) / comp_s,
            mib(data.len()) / decomp_s
        );
    };
    for c in [
        Compression::Gzip,
        Compression::Zstd,
        Compression::Lz4,
        Compression::Xz,
    ] {
        let t = Instant::now();
        let mut packed = Vec::new();
        c.compress(&data[..], &mut packed)?;
        let comp = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let back = c.decompress(&packed)?;
        let decomp = t.elapsed().as_secs_f64();
        anyhow::ensure!(back == data, "{c:?} did not round-trip");
        row(c.name(), &packed, comp, decomp);
    }
    // zstd levels: how much size each step of compression time buys.
    for level in [3, 9, 12, 15, 19] {
        let t = Instant::now();
        let packed = zstd::bulk::compress(&data, level)?;
        let comp = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut out = Vec::with_capacity(data.len());
        zstd::stream::Decoder::new(&packed[..])?.read_to_end(&mut out)?;
        let decomp = t.elapsed().as_secs_f64();
        row(&format!("zstd -{level}"), &packed, comp, decomp);
    }
    Ok(())
}
