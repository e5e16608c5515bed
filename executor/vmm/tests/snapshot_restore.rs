//! Snapshot and restore with a hand-made guest on /dev/kvm: the guest prints, then spins until a
//! flag in its memory is set. We snapshot it mid-spin, restore copies ("children") from the
//! snapshot, set the flag only in their private memory, and watch each finish. This checks the
//! vCPU/irqchip/device state round trip, MAP_PRIVATE isolation of the memory image, and the
//! snapshot file checks.

mod common;

use common::{boot_guest, kvm_available, out8, wait_for, Capture, POWER_OFF};

use tine_vmm::boot::EntryPoint;
use tine_vmm::vm::{Prepared, RestoreOptions, Shell, VmOptions};
use tine_vmm::{GuestExit, GuestRam, Vm};
use vm_memory::{Bytes, GuestAddress};

const CODE: u64 = 0x10_0000;
const FLAG: u64 = 0x3008;

/// Print "1", spin until the u64 at FLAG is non-zero, print "2", power off.
fn spin_guest() -> Vec<u8> {
    let mut c = Vec::new();
    out8(&mut c, 0x3f8, b'1');
    // loop: mov rax, [FLAG]; test rax, rax; jz loop
    c.extend_from_slice(&[0x48, 0x8b, 0x04, 0x25]);
    c.extend_from_slice(&(FLAG as u32).to_le_bytes());
    c.extend_from_slice(&[0x48, 0x85, 0xc0, 0x74, 0xf3]);
    out8(&mut c, 0x3f8, b'2');
    out8(&mut c, POWER_OFF.0, POWER_OFF.1);
    c
}

/// Boot the parent, let it reach its spin loop, snapshot it into `dir`.
fn make_snapshot(dir: &std::path::Path, vcpus: u8) {
    let ram = GuestRam::new_memfd(64).unwrap();
    ram.memory()
        .write_slice(&spin_guest(), GuestAddress(CODE))
        .unwrap();
    let out = Capture::default();
    let mut vm = Vm::create(vcpus, ram, Box::new(out.clone())).unwrap();
    // A network device with no link: its MAC must survive the round trip (children restore
    // it without a tap).
    vm.add_net([6, 0, 10, 254, 0, 2], None).unwrap();
    vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
    let running = vm.start().unwrap();
    wait_for(&out, "1");
    let header = running.snapshot(dir).unwrap();
    assert_eq!(header.vcpus, vcpus as u32);
    assert_eq!(header.mem_size, 64 << 20);
    assert!(
        header.network,
        "the header says the guest has a network interface"
    );
    running.stop();
    assert_eq!(
        out.text(),
        "1",
        "the parent must not get past its spin loop"
    );
}

/// A child of the snapshot in `dir` whose console prints into `out`.
fn restore_printing_to(dir: &std::path::Path, out: &Capture) -> Vm {
    Vm::restore(
        dir,
        RestoreOptions {
            console: Box::new(out.clone()),
            vsock_uds: None,
            tap: None,
        },
    )
    .unwrap()
}

#[test]
fn restored_children_continue_where_the_parent_paused() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap");
    make_snapshot(&dir, 2);

    let mut children = Vec::new();
    for _ in 0..3 {
        let out = Capture::default();
        let vm = restore_printing_to(&dir, &out);
        // Only this child's private copy sees the flag.
        vm.ram()
            .memory()
            .write_obj(1u64, GuestAddress(FLAG))
            .unwrap();
        children.push((vm.start().unwrap(), out));
    }
    for (child, out) in children {
        assert_eq!(child.wait().unwrap(), GuestExit::PowerOff);
        assert_eq!(
            out.text(),
            "2",
            "a child resumes in the loop, not from the start"
        );
    }

    // The image never saw the children's writes.
    let image = std::fs::read(dir.join("memory.img")).unwrap();
    assert_eq!(&image[FLAG as usize..FLAG as usize + 8], &[0u8; 8]);
}

#[test]
fn a_child_restores_onto_a_shell_made_ahead_from_a_copy_of_the_image() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap");
    make_snapshot(&dir, 2);
    let opts = |out: &Capture| RestoreOptions {
        console: Box::new(out.clone()),
        vsock_uds: None,
        tap: None,
    };
    // The host's copy: marked where the guest never looks, so the mapping shows which file
    // the child's RAM comes from.
    let copy_path = tmp.path().join("copy.img");
    std::fs::copy(dir.join("memory.img"), &copy_path).unwrap();
    let copy = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&copy_path)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&copy, &[0xab], 0x5000).unwrap();

    let out = Capture::default();
    let prepared = Prepared {
        image: Some(copy),
        shell: Some(Shell::new().unwrap()),
    };
    let vm = Vm::restore_prepared(&dir, prepared, opts(&out), VmOptions::default()).unwrap();
    assert_eq!(
        vm.ram()
            .memory()
            .read_obj::<u8>(GuestAddress(0x5000))
            .unwrap(),
        0xab,
        "guest RAM maps the copy"
    );
    vm.ram()
        .memory()
        .write_obj(1u64, GuestAddress(FLAG))
        .unwrap();
    let child = vm.start().unwrap();
    assert_eq!(child.wait().unwrap(), GuestExit::PowerOff);
    assert_eq!(out.text(), "2", "two vCPUs: one from the shell, one added");

    // A copy of another size is not this snapshot's image.
    let short = tempfile::tempfile().unwrap();
    short.set_len(32 << 20).unwrap();
    let err = Vm::restore_prepared(
        &dir,
        Prepared {
            image: Some(short),
            shell: None,
        },
        opts(&Capture::default()),
        VmOptions::default(),
    )
    .err()
    .expect("refused");
    assert!(err.to_string().contains("wrong file"), "{err}");
}

#[test]
fn damaged_snapshots_are_refused_with_a_clear_error() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap");
    make_snapshot(&dir, 1);
    let restore = |d: &std::path::Path| {
        Vm::restore(
            d,
            RestoreOptions {
                console: Box::new(std::io::sink()),
                vsock_uds: None,
                tap: None,
            },
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    };

    // Corrupted state: one flipped byte.
    let bad = tmp.path().join("corrupt");
    copy_dir(&dir, &bad);
    let mut state = std::fs::read(bad.join("state.bin")).unwrap();
    state[100] ^= 0xff;
    std::fs::write(bad.join("state.bin"), &state).unwrap();
    assert!(
        restore(&bad).contains("checksum mismatch"),
        "{}",
        restore(&bad)
    );

    // Truncated state and memory.
    let bad = tmp.path().join("trunc-state");
    copy_dir(&dir, &bad);
    let state = std::fs::read(bad.join("state.bin")).unwrap();
    std::fs::write(bad.join("state.bin"), &state[..state.len() / 2]).unwrap();
    assert!(restore(&bad).contains("truncated"), "{}", restore(&bad));
    let bad = tmp.path().join("trunc-mem");
    copy_dir(&dir, &bad);
    std::fs::OpenOptions::new()
        .write(true)
        .open(bad.join("memory.img"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    assert!(restore(&bad).contains("truncated"), "{}", restore(&bad));

    // Taken on another CPU model.
    let bad = tmp.path().join("other-cpu");
    copy_dir(&dir, &bad);
    let mut header: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bad.join("snapshot.json")).unwrap()).unwrap();
    header["host"]["cpu_model_name"] = "Imaginary CPU 9000".into();
    std::fs::write(
        bad.join("snapshot.json"),
        serde_json::to_vec(&header).unwrap(),
    )
    .unwrap();
    let e = restore(&bad);
    assert!(
        e.contains("same CPU model") && e.contains("Imaginary CPU 9000"),
        "{e}"
    );

    // Not a snapshot at all.
    let e = restore(tmp.path());
    assert!(e.contains("snapshot.json"), "{e}");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn snapshot_into_a_directory_holding_anything_is_refused() {
    if !kvm_available() {
        return;
    }
    // An empty directory is one made for the VMM to write into (see `write_with`); one that
    // holds anything is someone else's.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("keep"), b"mine").unwrap();
    let (running, _) = boot_guest(&spin_guest(), CODE);
    let err = running.snapshot(tmp.path()).unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    // The VM is paused but fine: resume it and let it finish.
    running.resume();
    running.stop();
}

#[test]
fn each_restore_gets_a_new_generation_id() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let with = tmp.path().join("with");
    let without = tmp.path().join("without");
    let mut parent_id = None;
    for (dir, enable) in [(&with, true), (&without, false)] {
        let ram = GuestRam::new_memfd(64).unwrap();
        ram.memory()
            .write_slice(&spin_guest(), GuestAddress(CODE))
            .unwrap();
        let out = Capture::default();
        let mut vm = Vm::create(1, ram, Box::new(out.clone())).unwrap();
        if enable {
            vm.enable_generation_id().unwrap();
            parent_id = vm.generation_id().unwrap();
        }
        vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
        let running = vm.start().unwrap();
        wait_for(&out, "1");
        let header = running.snapshot(dir).unwrap();
        assert_eq!(header.vmgenid, enable);
        running.stop();
    }
    let parent_id = parent_id.expect("the parent has a generation ID");
    assert_ne!(parent_id, [0; 16]);

    let restore = |dir: &std::path::Path| {
        Vm::restore(
            dir,
            RestoreOptions {
                console: Box::new(Capture::default()),
                vsock_uds: None,
                tap: None,
            },
        )
        .unwrap()
    };
    let mut seen = vec![parent_id];
    for _ in 0..3 {
        let id = restore(&with)
            .generation_id()
            .unwrap()
            .expect("restored with one");
        assert!(!seen.contains(&id), "{id:02x?} repeats one of {seen:02x?}");
        seen.push(id);
    }
    // A snapshot whose guest was never told of one is restored without, its memory untouched.
    let old = restore(&without);
    assert_eq!(old.generation_id().unwrap(), None);
    let mut raw = [0u8; 16];
    old.ram()
        .memory()
        .read_slice(&mut raw, GuestAddress(tine_vmm::layout::VMGENID_ADDR))
        .unwrap();
    assert_eq!(raw, [0; 16]);
}

/// Prints 1 and spins until FLAG is set, then writes the generation ID's watch port (as a
/// driver's evaluation of `ADDR` does), prints 2 and spins. `bind_first`: write it before
/// printing 1 as well (a driver that bound at boot).
fn binding_guest(bind_first: bool) -> Vec<u8> {
    let port = tine_vmm::layout::VMGENID_WATCH_PORT;
    let mut c = Vec::new();
    if bind_first {
        out8(&mut c, port, 1);
    }
    out8(&mut c, 0x3f8, b'1');
    c.extend_from_slice(&[0x48, 0x8b, 0x04, 0x25]);
    c.extend_from_slice(&(FLAG as u32).to_le_bytes());
    c.extend_from_slice(&[0x48, 0x85, 0xc0, 0x74, 0xf3]);
    out8(&mut c, port, 1);
    out8(&mut c, 0x3f8, b'2');
    c.extend_from_slice(&[0xeb, 0xfe]);
    c
}

#[test]
fn whether_the_generation_id_driver_bound_is_kept_from_snapshot_to_snapshot() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let snap = |name: &str| tmp.path().join(name);
    // Parents: one whose driver bound at boot, one whose never did.
    for (name, bind_first) in [("bound", true), ("unbound", false)] {
        let ram = GuestRam::new_memfd(64).unwrap();
        ram.memory()
            .write_slice(&binding_guest(bind_first), GuestAddress(CODE))
            .unwrap();
        let out = Capture::default();
        let mut vm = Vm::create(1, ram, Box::new(out.clone())).unwrap();
        vm.enable_generation_id().unwrap();
        vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
        let running = vm.start().unwrap();
        wait_for(&out, "1");
        let header = running.snapshot(&snap(name)).unwrap();
        assert!(header.vmgenid);
        assert_eq!(header.vmgenid_driver, Some(bind_first), "{name}");
        running.stop();
    }
    // One from before the record: as "unbound", without the field.
    copy_dir(&snap("unbound"), &snap("legacy"));
    let header = snap("legacy").join("snapshot.json");
    let mut h: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&header).unwrap()).unwrap();
    h.as_object_mut().unwrap().remove("vmgenid_driver");
    std::fs::write(&header, serde_json::to_vec(&h).unwrap()).unwrap();

    // A child's snapshot keeps its parent's record, and records a binding made in the child.
    let child = |parent: &str, bind: bool, name: &str| {
        let out = Capture::default();
        let vm = restore_printing_to(&snap(parent), &out);
        if bind {
            vm.ram()
                .memory()
                .write_obj(1u64, GuestAddress(FLAG))
                .unwrap();
        }
        let running = vm.start().unwrap();
        if bind {
            wait_for(&out, "2");
        }
        let header = running.snapshot(&snap(name)).unwrap();
        running.stop();
        assert!(header.vmgenid, "{name}");
        header.vmgenid_driver
    };
    assert_eq!(child("bound", false, "bound-child"), Some(true));
    assert_eq!(child("unbound", false, "unbound-child"), Some(false));
    assert_eq!(child("unbound-child", true, "bound-late"), Some(true));
    assert_eq!(child("legacy", false, "legacy-child"), None);
}

/// The /proc/self/pagemap entry of the page at `addr` (readable without privileges).
fn pagemap_entry(addr: *mut u8) -> u64 {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut e = [0u8; 8];
    f.read_exact_at(&mut e, (addr as u64 / 4096) * 8).unwrap();
    u64::from_le_bytes(e)
}

/// Whether the page at `addr` is mapped in this process (bit 63).
fn mapped_here(addr: *mut u8) -> bool {
    pagemap_entry(addr) >> 63 == 1
}

/// Whether it is mapped as a private copy rather than the file's page (bit 61 clear).
fn copied_here(addr: *mut u8) -> bool {
    mapped_here(addr) && pagemap_entry(addr) & (1 << 61) == 0
}

#[test]
fn a_prefaulted_child_has_its_working_set_mapped_before_it_runs_and_still_runs() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap");
    make_snapshot(&dir, 1);
    let out = Capture::default();
    let vm = restore_printing_to(&dir, &out);
    let page = |p: u64| vm.ram().image_host_ptr(p * 4096, 4096).unwrap();
    // The code page and its neighbour, one page well away, and one past the end of RAM.
    let code = CODE / 4096;
    let (far, beyond) = (9000, (64 << 20) / 4096 + 7);
    assert!(
        !mapped_here(page(far)),
        "nothing maps it before the prefault"
    );
    // The flag's page is the one this child will write.
    let flag = FLAG / 4096;
    let done = vm.prefault(&[code + 1, code, far, code, beyond], &[flag]);
    assert!(done.method.is_some(), "{done:?}");
    assert_eq!((done.pages, done.runs, done.copied), (4, 3, 1), "{done:?}");
    assert!(mapped_here(page(code)) && mapped_here(page(code + 1)) && mapped_here(page(far)));
    assert!(
        !copied_here(page(code)),
        "a page only read stays the image's"
    );
    assert!(
        copied_here(page(flag)),
        "a page to be written is copied ahead"
    );
    // The host may map a few neighbours along (fault-around), never the whole image.
    assert!(!mapped_here(page(far + 200)), "only the pages asked for");
    vm.ram()
        .memory()
        .write_obj(1u64, GuestAddress(FLAG))
        .unwrap();
    let child = vm.start().unwrap();
    assert_eq!(child.wait().unwrap(), GuestExit::PowerOff);
    assert_eq!(out.text(), "2");
    assert!(vm_memory_untouched(&dir));
}

/// The image never sees a child's writes, prefaulted or not.
fn vm_memory_untouched(dir: &std::path::Path) -> bool {
    let image = std::fs::read(dir.join("memory.img")).unwrap();
    image[FLAG as usize..FLAG as usize + 8] == [0u8; 8]
}
