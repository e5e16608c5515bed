//! Loading a Linux kernel, its command line and initramfs into guest RAM, and writing the
//! boot information the chosen entry protocol expects (PVH `hvm_start_info` or the Linux
//! zero page).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, Cmdline, KernelLoader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::error::{BootError, Result};
use crate::layout::*;
use crate::memory::GuestRam;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;

/// Where and how the boot vCPU starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryPoint {
    /// 32-bit protected mode, paging off, `%ebx` = `hvm_start_info`.
    Pvh { rip: u64 },
    /// 64-bit long mode with identity paging, `%rsi` = zero page.
    Linux64 { rip: u64 },
}

/// What the boot vCPU needs to know after loading.
#[derive(Clone, Copy, Debug)]
pub struct BootInfo {
    pub entry: EntryPoint,
    pub kernel_end: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KernelFormat {
    Elf,
    BzImage,
}

fn kernel_read_err(path: &Path) -> impl FnOnce(std::io::Error) -> BootError + '_ {
    move |source| BootError::KernelRead {
        path: path.to_path_buf(),
        source,
    }
}

fn sniff(path: &Path, f: &mut File) -> Result<KernelFormat> {
    let mut head = [0u8; 0x210];
    let n = f.read(&mut head).map_err(kernel_read_err(path))?;
    f.seek(SeekFrom::Start(0)).map_err(kernel_read_err(path))?;
    if n >= 4 && head[..4] == *b"\x7fELF" {
        return Ok(KernelFormat::Elf);
    }
    if n >= 0x206 && u32::from_le_bytes(head[0x202..0x206].try_into().unwrap()) == KERNEL_HDR_MAGIC
    {
        return Ok(KernelFormat::BzImage);
    }
    Err(BootError::NotAKernel {
        path: path.to_path_buf(),
    }
    .into())
}

/// The RAM map the guest sees: RAM below 640 KiB, the reserved BIOS/ACPI area, RAM above 1 MiB
/// up to the MMIO gap, and RAM above 4 GiB if any.
pub fn e820_map(ram: &GuestRam) -> Vec<(u64, u64, u32)> {
    let mut map = vec![
        (0, LOW_RAM_END, E820_RAM),
        (ACPI_START, ACPI_END - ACPI_START, E820_RESERVED),
    ];
    for r in ram.ranges() {
        let start = r.guest_addr.max(HIMEM_START);
        let end = r.guest_addr + r.size;
        if end > start {
            map.push((start, end - start, E820_RAM));
        }
    }
    map
}

/// Load kernel, command line and initramfs; write boot structures. Returns the entry point.
pub fn load(
    ram: &GuestRam,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
    rsdp_addr: u64,
) -> Result<BootInfo> {
    let mem = ram.memory();
    let mut kf = File::open(kernel).map_err(kernel_read_err(kernel))?;
    let format = sniff(kernel, &mut kf)?;

    let cmdline_err = |source| BootError::Cmdline {
        len: cmdline.len(),
        max: CMDLINE_MAX,
        source,
    };
    let mut cl = Cmdline::new(CMDLINE_MAX).map_err(cmdline_err)?;
    cl.insert_str(cmdline).map_err(cmdline_err)?;
    load_cmdline(mem, GuestAddress(CMDLINE), &cl)
        .map_err(|source| BootError::CmdlineWrite { source })?;
    let cmdline_len = cmdline.len() as u32 + 1;

    let (entry, kernel_end, setup_header) = match format {
        KernelFormat::Elf => {
            let r = Elf::load(mem, None, &mut kf, Some(GuestAddress(HIMEM_START))).map_err(
                |source| BootError::KernelLoad {
                    path: kernel.to_path_buf(),
                    format: "ELF",
                    source,
                },
            )?;
            let entry = match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(a) => EntryPoint::Pvh { rip: a.0 },
                _ => EntryPoint::Linux64 {
                    rip: r.kernel_load.0,
                },
            };
            (entry, r.kernel_end, None)
        }
        KernelFormat::BzImage => {
            let r = BzImage::load(
                mem,
                Some(GuestAddress(BZIMAGE_LOAD)),
                &mut kf,
                Some(GuestAddress(HIMEM_START)),
            )
            .map_err(|source| BootError::KernelLoad {
                path: kernel.to_path_buf(),
                format: "bzImage",
                source,
            })?;
            // The 64-bit entry of a bzImage sits 0x200 bytes into its protected-mode code.
            (
                EntryPoint::Linux64 {
                    rip: r.kernel_load.0 + 0x200,
                },
                r.kernel_end,
                r.setup_header,
            )
        }
    };
    if kernel_end >= ram.low_ram_end() {
        return Err(BootError::KernelTooBig {
            path: kernel.to_path_buf(),
            kernel_end,
            ram_end: ram.low_ram_end(),
        }
        .into());
    }

    let initrd_range = match initrd {
        Some(p) => Some(load_initrd(mem, ram.low_ram_end(), kernel_end, p)?),
        None => None,
    };

    match entry {
        EntryPoint::Pvh { .. } => write_pvh_info(mem, ram, rsdp_addr, initrd_range)?,
        EntryPoint::Linux64 { .. } => {
            write_zero_page(mem, ram, setup_header, rsdp_addr, cmdline_len, initrd_range)?
        }
    }
    Ok(BootInfo { entry, kernel_end })
}

/// Place the initramfs page-aligned at the top of low RAM, above the kernel.
fn load_initrd(
    mem: &GuestMemoryMmap,
    low_end: u64,
    kernel_end: u64,
    path: &Path,
) -> Result<(u64, u64)> {
    let read_err = |source| BootError::InitrdRead {
        path: path.to_path_buf(),
        source,
    };
    let mut f = File::open(path).map_err(read_err)?;
    let size = f.metadata().map_err(read_err)?.len();
    if size == 0 {
        return Err(BootError::InitrdEmpty {
            path: path.to_path_buf(),
        }
        .into());
    }
    // Leave the kernel room to decompress and set up above its load address.
    let floor = (kernel_end + 0xfff) & !0xfff;
    let addr = low_end
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|a| *a >= floor)
        .ok_or_else(|| BootError::InitrdTooBig {
            path: path.to_path_buf(),
            size,
            kernel_end,
            ram_end: low_end,
        })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize)
        .map_err(|source| BootError::InitrdLoad {
            path: path.to_path_buf(),
            addr,
            source,
        })?;
    Ok((addr, size))
}

fn write_pvh_info(
    mem: &GuestMemoryMmap,
    ram: &GuestRam,
    rsdp_addr: u64,
    initrd: Option<(u64, u64)>,
) -> Result<()> {
    let memmap: Vec<hvm_memmap_table_entry> = e820_map(ram)
        .into_iter()
        .map(|(addr, size, type_)| hvm_memmap_table_entry {
            addr,
            size,
            type_,
            reserved: 0,
        })
        .collect();
    let mut start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE,
        rsdp_paddr: rsdp_addr,
        memmap_paddr: PVH_MEMMAP,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    let mut params = BootParams::new::<hvm_start_info>(&start_info, GuestAddress(PVH_START_INFO));
    if let Some((paddr, size)) = initrd {
        start_info.nr_modules = 1;
        start_info.modlist_paddr = PVH_MODLIST;
        params = BootParams::new::<hvm_start_info>(&start_info, GuestAddress(PVH_START_INFO));
        let module = hvm_modlist_entry {
            paddr,
            size,
            ..Default::default()
        };
        params.set_modules(&[module], GuestAddress(PVH_MODLIST));
    }
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP));
    PvhBootConfigurator::write_bootparams(&params, mem)
        .map_err(|source| BootError::PvhStartInfo { source }.into())
}

fn write_zero_page(
    mem: &GuestMemoryMmap,
    ram: &GuestRam,
    setup_header: Option<linux_loader::loader::bootparam::setup_header>,
    rsdp_addr: u64,
    cmdline_len: u32,
    initrd: Option<(u64, u64)>,
) -> Result<()> {
    let mut params = boot_params::default();
    if let Some(h) = setup_header {
        params.hdr = h;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE as u32;
    params.hdr.cmdline_size = cmdline_len;
    if params.hdr.kernel_alignment == 0 {
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    }
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    params.acpi_rsdp_addr = rsdp_addr;
    let map = e820_map(ram);
    if map.len() > params.e820_table.len() {
        return Err(BootError::TooManyE820 {
            entries: map.len(),
            max: params.e820_table.len(),
        }
        .into());
    }
    for (i, (addr, size, type_)) in map.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr: *addr,
            size: *size,
            r#type: *type_,
        };
    }
    params.e820_entries = map.len() as u8;
    mem.write_obj(params, GuestAddress(ZERO_PAGE))
        .map_err(|source| BootError::ZeroPage { source }.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::io::Write;

    fn ram() -> GuestRam {
        GuestRam::new_memfd(64).unwrap()
    }

    #[test]
    fn refuses_files_that_are_not_kernels() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"#!/bin/sh\necho hello\n").unwrap();
        let err = load(&ram(), f.path(), None, "console=ttyS0", 0).unwrap_err();
        assert!(
            matches!(&err, Error::Boot(BootError::NotAKernel { path }) if path == f.path()),
            "{err:?}"
        );
        assert!(err.to_string().contains("not a Linux kernel"), "{err}");
        let err = load(&ram(), Path::new("/nonexistent/vmlinux"), None, "", 0).unwrap_err();
        assert!(
            matches!(&err, Error::Boot(BootError::KernelRead { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound),
            "{err:?}"
        );
        assert!(err.to_string().contains("/nonexistent/vmlinux"), "{err}");
    }

    #[test]
    fn e820_skips_the_bios_hole() {
        let map = e820_map(&ram());
        assert_eq!(map[0], (0, LOW_RAM_END, E820_RAM));
        assert_eq!(map[1].2, E820_RESERVED);
        assert_eq!(map[2], (HIMEM_START, (64 << 20) - HIMEM_START, E820_RAM));
    }

    #[test]
    fn initrd_too_big_is_a_clear_error() {
        let r = ram();
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(100 << 20).unwrap();
        let err = load_initrd(r.memory(), r.low_ram_end(), 2 << 20, f.path()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Boot(BootError::InitrdTooBig {
                    size: 0x640_0000,
                    kernel_end: 0x20_0000,
                    ..
                })
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("100 MiB does not fit") && msg.contains("below 64 MiB"),
            "{msg}"
        );
    }

    #[test]
    fn initrd_lands_page_aligned_at_the_top() {
        let r = ram();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 5000]).unwrap();
        let (addr, size) = load_initrd(r.memory(), r.low_ram_end(), 2 << 20, f.path()).unwrap();
        assert_eq!(size, 5000);
        assert_eq!(addr & 0xfff, 0);
        assert!(addr + size <= 64 << 20);
        let b: u8 = r.memory().read_obj(GuestAddress(addr + 4999)).unwrap();
        assert_eq!(b, 7);
    }
}
