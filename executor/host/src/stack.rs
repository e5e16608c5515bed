//! Stack pages a thread will not reach again, given back to the host.
//!
//! A VMM worker's main thread goes deep once, to restore (the snapshot's JSON header and the
//! decode of its state take about 60 KiB of stack), then spends the child's life waiting
//! near the top of its stack. Every stack page it touched stays resident and private to that
//! child until the process ends. Dropping the pages below the waiting frame costs nothing
//! later: a page reached again comes back zeroed, like any stack page reached the first time.

use std::io;

/// Kept below the calling frame: the frames of the release itself (the madvise call) and
/// the red zone below them stay resident.
const MARGIN: usize = 8 << 10;

/// The address range of the mapping that holds the calling thread's stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackMapping {
    low: usize,
    high: usize,
}

impl StackMapping {
    /// Found in /proc/self/maps: the mapping that holds the caller's frame.
    pub fn of_this_thread() -> io::Result<StackMapping> {
        let here = frame_address();
        let maps = std::fs::read_to_string("/proc/self/maps")?;
        Self::holding(&maps, here).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no mapping in /proc/self/maps holds {here:#x}"),
            )
        })
    }

    /// The mapping of `maps` (the text of /proc/PID/maps) whose range holds `addr`.
    fn holding(maps: &str, addr: usize) -> Option<StackMapping> {
        maps.lines().find_map(|line| {
            let range = line.split_whitespace().next()?;
            let (low, high) = range.split_once('-')?;
            let low = usize::from_str_radix(low, 16).ok()?;
            let high = usize::from_str_radix(high, 16).ok()?;
            (low <= addr && addr < high).then_some(StackMapping { low, high })
        })
    }

    /// Give back the pages of this mapping more than [`MARGIN`] below the calling frame.
    /// Returns how many bytes of address range were released (resident or not). The
    /// mapping must hold the calling thread's stack: anything below its frame is dead.
    #[inline(never)]
    pub fn release_below_caller(&self) -> io::Result<usize> {
        let here = frame_address();
        if here < self.low || here >= self.high {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the calling thread's stack is not in this mapping",
            ));
        }
        let end = here.saturating_sub(MARGIN) & !(page_size() - 1);
        if end <= self.low {
            return Ok(0);
        }
        let len = end - self.low;
        // SAFETY: [low, end) lies inside this thread's stack mapping and entirely below the
        // live frames (the caller's, this one, and MARGIN for the call below): nothing there
        // is in use. A private anonymous page dropped reads as zero when touched again.
        let r = unsafe { libc::madvise(self.low as *mut libc::c_void, len, libc::MADV_DONTNEED) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(len)
    }
}

/// An address in the calling function's frame (it is not inlined into its caller).
#[inline(never)]
fn frame_address() -> usize {
    let marker = 0u8;
    std::hint::black_box(&marker) as *const u8 as usize
}

fn page_size() -> usize {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident pages of [low, high), by mincore.
    fn resident(m: &StackMapping) -> usize {
        let pages = (m.high - m.low) / page_size();
        let mut v = vec![0u8; pages];
        // SAFETY: the range is a mapping of this process; v has a byte per page.
        let r =
            unsafe { libc::mincore(m.low as *mut libc::c_void, m.high - m.low, v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", io::Error::last_os_error());
        v.iter().filter(|b| **b & 1 == 1).count()
    }

    /// Touches `kib` KiB of stack below the caller and returns a value computed from it.
    #[inline(never)]
    fn go_deep(kib: usize) -> u64 {
        let mut buf = [0u8; 4096];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i as u8).wrapping_add(kib as u8);
        }
        let buf = std::hint::black_box(buf);
        let own: u64 = buf.iter().map(|b| *b as u64).sum();
        if kib <= 4 {
            own
        } else {
            own + go_deep(kib - 4)
        }
    }

    #[test]
    fn finds_the_mapping_that_holds_an_address() {
        let maps = "\
559a1c0d5000-559a1c0f7000 r--p 00000000 fd:01 123 /usr/bin/x
7ffc8a1e0000-7ffc8a201000 rw-p 00000000 00:00 0                          [stack]
7ffc8a2f0000-7ffc8a2f4000 r--p 00000000 00:00 0                          [vvar]
";
        let m = StackMapping::holding(maps, 0x7ffc8a200ff8).unwrap();
        assert_eq!(
            m,
            StackMapping {
                low: 0x7ffc8a1e0000,
                high: 0x7ffc8a201000
            }
        );
        assert_eq!(StackMapping::holding(maps, 0x7ffc8a201000), None);
        assert_eq!(StackMapping::holding(maps, 0x1000), None);
        assert_eq!(StackMapping::holding("garbage\n-\nzz-yy rw-p", 0x10), None);
    }

    #[test]
    fn pages_below_the_caller_are_given_back_and_come_back_zeroed() {
        // A thread of its own, so that the stack is one this test alone uses.
        std::thread::Builder::new()
            .stack_size(1 << 20)
            .spawn(|| {
                let m = StackMapping::of_this_thread().unwrap();
                let want = go_deep(256);
                let deep = resident(&m);
                let released = m.release_below_caller().unwrap();
                let after = resident(&m);
                assert!(released >= 256 << 10, "released only {released} bytes");
                assert!(
                    deep >= after + 48,
                    "{deep} resident stack pages deep, {after} after the release"
                );
                // The same work again on the pages given back gives the same result.
                assert_eq!(go_deep(256), want);
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn a_mapping_that_does_not_hold_the_caller_is_refused() {
        let m = StackMapping {
            low: 0x1000,
            high: 0x2000,
        };
        let e = m.release_below_caller().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
