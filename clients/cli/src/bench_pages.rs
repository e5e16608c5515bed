//! Where an idle child's memory goes: which guest pages it has written (its private copies of
//! snapshot pages), what the guest uses each of them for, and what its VMM process holds
//! besides guest RAM. `tine bench fork` prints this as a table by cause.
//!
//! The host side reads the child VMM's page map: a page of the `memory.img` mapping (mapped
//! MAP_PRIVATE) that is present and no longer the file's is one the guest wrote. The guest
//! side is a short Python program run in the child through its agent, which reads
//! `/proc/kpageflags` for those frames and every process's page map to name their owners.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;

use anyhow::{bail, Context, Result};
use tine_agent::client::{AgentClient, ExecOptions};

const PAGE: u64 = 4096;
/// Page map entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE_OR_SHARED: u64 = 1 << 61;

/// Guest frame numbers (guest-physical address / 4 KiB) of the pages the VMM process `pid`
/// holds as its own copies in its `memory.img` mapping, sorted.
pub fn written_guest_frames(pid: u32) -> Result<Vec<u64>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .with_context(|| format!("reading /proc/{pid}/maps"))?;
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))
        .with_context(|| format!("opening /proc/{pid}/pagemap"))?;
    // (start, end, file offset) of each mapping of the snapshot's memory file. Its path is as
    // the VMM sees it (a confined one lives in a mount namespace of its own), so the file's
    // size, which lays guest RAM out, is where its last mapping ends.
    let mut maps_of_ram = Vec::new();
    let ram_path = |l: &str| {
        l.find('/')
            .is_some_and(|i| tine_host::hot::is_guest_ram(&l[i..]))
    };
    for line in maps.lines().filter(|l| ram_path(l)) {
        let mut f = line.split_whitespace();
        let parsed = (|| {
            let (a, b) = f.next()?.split_once('-')?;
            let _perms = f.next()?;
            let offset = u64::from_str_radix(f.next()?, 16).ok()?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
                offset,
            ))
        })();
        let m = parsed.with_context(|| format!("unexpected line in /proc/{pid}/maps: {line}"))?;
        maps_of_ram.push(m);
    }
    let size = maps_of_ram
        .iter()
        .map(|(s, e, o)| o + (e - s))
        .max()
        .unwrap_or(0);
    let ranges = tine_vmm::GuestRam::ranges_for(size);
    let mut frames = Vec::new();
    for (start, end, offset) in maps_of_ram {
        let pages = (end - start) / PAGE;
        let mut buf = vec![0u8; pages as usize * 8];
        pagemap
            .read_exact_at(&mut buf, start / PAGE * 8)
            .with_context(|| format!("reading /proc/{pid}/pagemap"))?;
        for (i, e) in buf.chunks_exact(8).enumerate() {
            let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            let own = (e & PM_PRESENT != 0 && e & PM_FILE_OR_SHARED == 0) || e & PM_SWAPPED != 0;
            if !own {
                continue;
            }
            let file_off = offset + i as u64 * PAGE;
            if let Some(r) = ranges
                .iter()
                .find(|r| (r.file_offset..r.file_offset + r.size).contains(&file_off))
            {
                frames.push((r.guest_addr + file_off - r.file_offset) / PAGE);
            }
        }
    }
    frames.sort_unstable();
    frames.dedup();
    Ok(frames)
}

/// Runs in the guest (python3): reads frame numbers on stdin, prints one line per cause,
/// "count<TAB>cause". A page mapped by a process is that process's (by name and kind of
/// mapping); otherwise its kernel page flags say what it is. Pages this program itself maps
/// were free a moment ago (it has just started) and are reported as such.
const CLASSIFY_PY: &str = r#"
import array, os, sys
want = set(int(x) for x in sys.stdin.read().split())
me = str(os.getpid())
owner = {}
for pid in os.listdir('/proc'):
    if not pid.isdigit():
        continue
    try:
        comm = open('/proc/%s/comm' % pid).read().strip()
        maps = open('/proc/%s/maps' % pid).read().splitlines()
        pm = open('/proc/%s/pagemap' % pid, 'rb')
    except OSError:
        continue
    with pm:
        for line in maps:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split('-'))
            if lo >= 1 << 47:
                continue
            name = parts[5] if len(parts) > 5 else ''
            kind = ('heap' if name == '[heap]' else 'stack' if name.startswith('[stack')
                    else 'anonymous' if not name or name.startswith('[') else 'file')
            try:
                pm.seek(lo // 4096 * 8)
                a = array.array('Q')
                a.frombytes(pm.read((hi - lo) // 4096 * 8))
            except (OSError, ValueError):
                continue
            for e in a:
                if e >> 63:
                    pfn = e & ((1 << 55) - 1)
                    if pfn in want and pfn not in owner:
                        owner[pfn] = ('free (taken by this report)' if pid == me
                                      else 'process %s: %s' % (comm, kind))
KPF = dict(LRU=5, SLAB=7, BUDDY=10, ANON=12, SWAPBACKED=14, PGTABLE=26, RESERVED=32)
def bit(f, n):
    return f >> KPF[n] & 1
counts = {}
with open('/proc/kpageflags', 'rb') as kf:
    for p in sorted(want):
        if p in owner:
            cause = owner[p]
        else:
            kf.seek(p * 8)
            b = kf.read(8)
            f = int.from_bytes(b, 'little') if len(b) == 8 else 0
            if bit(f, 'BUDDY'):
                cause = 'free'
            elif bit(f, 'SLAB'):
                cause = 'kernel: slab'
            elif bit(f, 'PGTABLE'):
                cause = 'kernel: page tables'
            elif bit(f, 'RESERVED'):
                cause = 'kernel: image and reserved'
            elif bit(f, 'LRU') and bit(f, 'SWAPBACKED') and not bit(f, 'ANON'):
                cause = 'files in memory (tmpfs, root filesystem)'
            elif bit(f, 'LRU') and not bit(f, 'ANON'):
                cause = 'page cache'
            elif bit(f, 'ANON'):
                cause = 'anonymous, no process'
            else:
                cause = 'kernel: other (stacks, vmalloc, per-CPU)'
        counts[cause] = counts.get(cause, 0) + 1
for c, n in sorted(counts.items(), key=lambda kv: -kv[1]):
    print('%d\t%s' % (n, c))
"#;

/// What the guest uses each of `frames` for: (cause, pages), most pages first.
pub fn guest_causes(agent: &AgentClient, frames: &[u64]) -> Result<Vec<(String, u64)>> {
    let stdin: String = frames.iter().map(|f| format!("{f}\n")).collect();
    let opts = ExecOptions {
        stdin: stdin.into_bytes(),
        timeout: Some(std::time::Duration::from_secs(120)),
        ..ExecOptions::default()
    };
    let (status, out, err) = agent
        .exec_output(&["python3", "-c", CLASSIFY_PY], &opts)
        .context("running the page classifier in the guest")?;
    if !status.success() {
        bail!(
            "the page classifier failed in the guest ({status:?}): {}",
            String::from_utf8_lossy(&err).trim()
        );
    }
    parse_causes(&String::from_utf8_lossy(&out))
}

fn parse_causes(out: &str) -> Result<Vec<(String, u64)>> {
    out.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (n, cause) = l
                .split_once('\t')
                .with_context(|| format!("unexpected classifier line {l:?}"))?;
            Ok((cause.to_string(), n.parse()?))
        })
        .collect()
}

/// What a VMM process holds privately besides guest RAM, in KiB by kind of mapping.
pub fn vmm_private_kib(pid: u32) -> Result<BTreeMap<&'static str, u64>> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .with_context(|| format!("reading /proc/{pid}/smaps"))?;
    Ok(split_private(&smaps))
}

fn split_private(smaps: &str) -> BTreeMap<&'static str, u64> {
    let mut out = BTreeMap::new();
    tine_host::smaps::for_each_field(smaps, |path, field, kib| {
        if field != "Private_Clean:" && field != "Private_Dirty:" {
            return;
        }
        let kind = match path {
            _ if tine_host::hot::is_guest_ram(path) => return,
            "[heap]" => "VMM: heap",
            _ if path.starts_with("[stack") => "VMM: main stack",
            "" => "VMM: anonymous (thread stacks, allocations)",
            _ if path.starts_with('[') => "VMM: kernel-provided ([vdso], [vvar])",
            _ if path.starts_with("/memfd:") => "VMM: memfd",
            _ => "VMM: binary and libraries",
        };
        *out.entry(kind).or_default() += kib;
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifier_lines_parse_and_bad_ones_are_errors() {
        let c = parse_causes("12\tfree\n3\tprocess python3: heap\n").unwrap();
        assert_eq!(
            c,
            vec![
                ("free".to_string(), 12),
                ("process python3: heap".to_string(), 3)
            ]
        );
        assert!(parse_causes("twelve\tfree\n").is_err());
        assert!(parse_causes("12 free\n").is_err());
    }

    #[test]
    fn private_memory_is_split_by_mapping_and_guest_ram_left_out() {
        let smaps = "\
55d0-55e0 r-xp 00000000 08:01 12 /usr/bin/tine
Private_Clean:        8 kB
Private_Dirty:        4 kB
7f00-7f10 rw-p 00000000 00:00 0 
Private_Dirty:       64 kB
7f20-7f30 rw-p 00000000 00:01 7 /data/snapshots/warm/memory.img
Private_Dirty:      900 kB
7f40-7f50 rw-p 00000000 00:00 0 [heap]
Private_Dirty:      100 kB
";
        let m = split_private(&format!(
            "{smaps}7f60-7f70 rw-p 00000000 00:01 8 /data dir/snapshots/w/memory.img\nPrivate_Dirty: 500 kB\n"
        ));
        assert_eq!(m["VMM: binary and libraries"], 12);
        assert_eq!(m["VMM: anonymous (thread stacks, allocations)"], 64);
        assert_eq!(m["VMM: heap"], 100);
        assert_eq!(
            m.values().sum::<u64>(),
            176,
            "guest RAM is not the VMM's: {m:?}"
        );
    }

    #[test]
    fn a_process_s_own_written_guest_pages_are_found_in_its_page_map() {
        // This process maps a file MAP_PRIVATE under the name memory.img and writes two pages:
        // exactly those two are its own.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory.img");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(64 * PAGE).unwrap();
        // SAFETY: a fresh private mapping of a file we own; unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                (64 * PAGE) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let base = p as *mut u8;
        // SAFETY: within the mapping.
        unsafe {
            let _ = std::ptr::read_volatile(base.add(5 * PAGE as usize)); // read: stays the file's
            *base.add(3 * PAGE as usize) = 1;
            *base.add(40 * PAGE as usize + 7) = 2;
        }
        let frames = written_guest_frames(std::process::id()).unwrap();
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, (64 * PAGE) as usize) };
        assert_eq!(frames, vec![3, 40]);
    }
}
