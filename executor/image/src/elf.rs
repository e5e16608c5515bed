//! Just enough ELF reading to tell whether a binary can run as a guest program: the guest is
//! x86_64 and has no dynamic loader, so everything we put into an image (busybox, the agent)
//! must be a static x86_64 executable.

/// Why a file cannot run in the guest as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ElfProblem {
    #[error("not an ELF file")]
    NotElf,
    #[error("not a 64-bit little-endian ELF file")]
    NotElf64Le,
    #[error("built for ELF machine {0}, not x86_64")]
    WrongMachine(u16),
    #[error("not an executable (ELF type {0}, or no entry point)")]
    NotExecutable(u16),
    #[error("program headers run past the end of the file")]
    Truncated,
    #[error("dynamically linked (it names a program interpreter, PT_INTERP)")]
    Dynamic,
}

const EM_X86_64: u16 = 62;
const ET_EXEC: u16 = 2;
/// Position-independent executables (static-pie, as Rust links `+crt-static`) are ET_DYN.
const ET_DYN: u16 = 3;
const PT_INTERP: u32 = 3;

fn u16_at(data: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([data[at], data[at + 1]])
}

fn u64_at(data: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks that `data` is a static x86_64 ELF executable (ET_EXEC, or ET_DYN with an entry
/// point as static-pie is, and no PT_INTERP program header).
pub fn check_static_x86_64(data: &[u8]) -> Result<(), ElfProblem> {
    if data.len() < 4 || data[..4] != *b"\x7fELF" {
        return Err(ElfProblem::NotElf);
    }
    // The ELF64 header is 64 bytes; class 2 = 64-bit, data 1 = little-endian.
    if data.len() < 64 || data[4] != 2 || data[5] != 1 {
        return Err(ElfProblem::NotElf64Le);
    }
    let machine = u16_at(data, 0x12);
    if machine != EM_X86_64 {
        return Err(ElfProblem::WrongMachine(machine));
    }
    let kind = u16_at(data, 0x10);
    let entry = u64_at(data, 0x18);
    if !(kind == ET_EXEC || kind == ET_DYN) || entry == 0 {
        return Err(ElfProblem::NotExecutable(kind));
    }
    let phoff = usize::try_from(u64_at(data, 0x20)).map_err(|_| ElfProblem::Truncated)?;
    let phentsize = u16_at(data, 0x36) as usize;
    let phnum = u16_at(data, 0x38) as usize;
    if phentsize < 4 {
        return Err(ElfProblem::Truncated);
    }
    for i in 0..phnum {
        let at = phoff
            .checked_add(i * phentsize)
            .ok_or(ElfProblem::Truncated)?;
        let header = data.get(at..at + 4).ok_or(ElfProblem::Truncated)?;
        if u32::from_le_bytes(header.try_into().expect("4 bytes")) == PT_INTERP {
            return Err(ElfProblem::Dynamic);
        }
    }
    Ok(())
}

/// True for a static x86_64 ELF executable, see [`check_static_x86_64`].
pub fn is_static_elf(data: &[u8]) -> bool {
    check_static_x86_64(data).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 header with `types` program headers at offset 64.
    fn elf(machine: u16, kind: u16, entry: u64, types: &[u32]) -> Vec<u8> {
        let mut d = vec![0u8; 64];
        d[..4].copy_from_slice(b"\x7fELF");
        d[4] = 2;
        d[5] = 1;
        d[0x10..0x12].copy_from_slice(&kind.to_le_bytes());
        d[0x12..0x14].copy_from_slice(&machine.to_le_bytes());
        d[0x18..0x20].copy_from_slice(&entry.to_le_bytes());
        d[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        d[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        d[0x38..0x3a].copy_from_slice(&(types.len() as u16).to_le_bytes());
        for t in types {
            let mut ph = vec![0u8; 56];
            ph[..4].copy_from_slice(&t.to_le_bytes());
            d.extend(ph);
        }
        d
    }

    #[test]
    fn static_executables_pass_and_everything_else_says_why() {
        // PT_LOAD only: static; ET_DYN with an entry point is static-pie.
        assert_eq!(check_static_x86_64(&elf(62, 2, 0x401000, &[1, 1])), Ok(()));
        assert_eq!(check_static_x86_64(&elf(62, 3, 0x1000, &[6, 1])), Ok(()));
        assert_eq!(
            check_static_x86_64(&elf(62, 3, 0x1000, &[6, 3, 1])),
            Err(ElfProblem::Dynamic)
        );
        assert_eq!(
            check_static_x86_64(&elf(183, 2, 0x1000, &[1])),
            Err(ElfProblem::WrongMachine(183))
        );
        // A shared library: ET_DYN without an entry point; an object file: ET_REL.
        assert_eq!(
            check_static_x86_64(&elf(62, 3, 0, &[1])),
            Err(ElfProblem::NotExecutable(3))
        );
        assert_eq!(
            check_static_x86_64(&elf(62, 1, 0, &[])),
            Err(ElfProblem::NotExecutable(1))
        );
        let mut cut = elf(62, 2, 0x1000, &[1, 1]);
        cut.truncate(64 + 56 + 2);
        assert_eq!(check_static_x86_64(&cut), Err(ElfProblem::Truncated));
        assert_eq!(check_static_x86_64(b"#!/bin/sh\n"), Err(ElfProblem::NotElf));
        let mut elf32 = elf(62, 2, 0x1000, &[]);
        elf32[4] = 1;
        assert_eq!(check_static_x86_64(&elf32), Err(ElfProblem::NotElf64Le));
    }

    #[test]
    fn a_real_dynamic_executable_is_refused() {
        // This test binary is linked the ordinary (dynamic) way: real headers, real PT_INTERP.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert_eq!(check_static_x86_64(&me), Err(ElfProblem::Dynamic));
    }
}
