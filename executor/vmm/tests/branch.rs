//! Branching running VMs with a hand-made guest on /dev/kvm: the guest counts in a loop and
//! stores each count into two pages far apart, first A then B. A branch taken mid-loop must
//! hold memory and vCPU state of one instant (B == A, or B == A - 1 when the pause fell between
//! the two stores), only the pages written since restore, and chains of diffs must restore by
//! mapping their layers.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{boot_guest, kvm_available, out8, Capture};

use tine_vmm::error::{Error, RestoreError};
use tine_vmm::snapshot::file::load_header;
use tine_vmm::vm::{RestoreOptions, RunningVm, SnapshotKind};
use tine_vmm::{GuestRam, Vm};
use vm_memory::{Bytes, GuestAddress};

const CODE: u64 = 0x10_0000;
const A: u64 = 0x20_0000;
const B: u64 = 0x300_0000;
/// Written by the host (the VMM) into a child's RAM, never by the guest.
const HOST_WRITE: u64 = 0x100_0000;

/// Print "1", then forever: rcx += 1; [A] = rcx; [B] = rcx.
fn counter_guest() -> Vec<u8> {
    let mut c = Vec::new();
    out8(&mut c, 0x3f8, b'1');
    c.extend_from_slice(&[0x48, 0x31, 0xc9]); // xor rcx, rcx
    let top = c.len();
    c.extend_from_slice(&[0x48, 0xff, 0xc1]); // inc rcx
    for addr in [A, B] {
        c.extend_from_slice(&[0x48, 0x89, 0x0c, 0x25]); // mov [addr32], rcx
        c.extend_from_slice(&(addr as u32).to_le_bytes());
    }
    let back = top as i64 - (c.len() as i64 + 2);
    c.extend_from_slice(&[0xeb, back as i8 as u8]); // jmp top
    c
}

fn opts(out: &Capture) -> RestoreOptions {
    RestoreOptions {
        console: Box::new(out.clone()),
        vsock_uds: None,
        tap: None,
    }
}

/// Boot the counter guest and snapshot it (complete) into `dir` once it counts.
fn make_root(dir: &Path) {
    let (running, _) = boot_guest(&counter_guest(), CODE);
    std::thread::sleep(Duration::from_millis(20));
    running.snapshot(dir).unwrap();
    running.stop();
}

fn counters(ram: &GuestRam) -> (u64, u64) {
    let m = ram.memory();
    (
        m.read_obj::<u64>(GuestAddress(A)).unwrap(),
        m.read_obj::<u64>(GuestAddress(B)).unwrap(),
    )
}

/// The counters a snapshot holds, read from a restored (never started) VM.
fn counters_in(dir: &Path) -> (u64, u64) {
    let vm = Vm::restore(dir, opts(&Capture::default())).unwrap();
    counters(vm.ram())
}

fn assert_one_instant((a, b): (u64, u64), what: &str) {
    assert!(a > 0, "{what}: the guest never counted");
    assert!(
        b == a || b + 1 == a,
        "{what}: A = {a} and B = {b} are from different instants"
    );
}

/// Wait (up to 30 s) until a running child counted past `past`.
fn counted_past(vm: &RunningVm, past: u64) {
    let t0 = std::time::Instant::now();
    while counters(vm.ram()).0 <= past {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the child does not count"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn start_child(dir: &Path) -> RunningVm {
    Vm::restore(dir, opts(&Capture::default()))
        .unwrap()
        .start()
        .unwrap()
}

#[test]
fn diff_branches_hold_one_instant_and_only_the_written_pages() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    make_root(&root);
    let at_root = counters_in(&root);
    assert_one_instant(at_root, "root");

    let child = start_child(&root);
    // The VMM writes guest memory too (virtio rings do): such pages belong in the diff.
    child
        .ram()
        .memory()
        .write_obj(0xfeed_u64, GuestAddress(HOST_WRITE))
        .unwrap();
    counted_past(&child, at_root.0 + 1);
    let mut previous = at_root;
    for i in 0..20 {
        std::thread::sleep(Duration::from_millis(2));
        let dir = tmp.path().join(format!("b{i}"));
        let b = child.branch(&dir, SnapshotKind::Diff).unwrap();
        // A, B and the host's page: nothing else was written since the restore.
        assert_eq!(b.pages_written, 3, "branch {i}");
        let header = load_header(&dir).unwrap();
        let d = header.diff.expect("a diff");
        assert_eq!(d.parent, "root");
        assert_eq!(d.pages, 3);
        assert_eq!(
            std::fs::metadata(dir.join("pages.bin")).unwrap().len(),
            3 * 4096
        );
        assert!(!dir.join("memory.img").exists());
        let c = counters_in(&dir);
        assert_one_instant(c, &format!("branch {i}"));
        assert!(c.0 >= previous.0, "branch {i} went back in time");
        previous = c;
        let vm = Vm::restore(&dir, opts(&Capture::default())).unwrap();
        assert_eq!(
            vm.ram()
                .memory()
                .read_obj::<u64>(GuestAddress(HOST_WRITE))
                .unwrap(),
            0xfeed
        );
    }
    // The source runs on after its branches.
    counted_past(&child, counters(child.ram()).0);
    child.stop();
}

#[test]
fn chains_of_diffs_restore_by_mapping_their_layers() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    make_root(&root);
    let mut dir = root.clone();
    let mut last = counters_in(&root);
    for depth in 1..=6 {
        let child = start_child(&dir);
        // Each level leaves a mark of its own on a page nobody else writes.
        child
            .ram()
            .memory()
            .write_obj(depth, GuestAddress(HOST_WRITE + depth * 4096))
            .unwrap();
        counted_past(&child, last.0 + 1);
        let next = tmp.path().join(format!("d{depth}"));
        let b = child.branch(&next, SnapshotKind::Diff).unwrap();
        child.stop();
        assert_eq!(b.pages_written, 3, "depth {depth}: A, B and its mark");
        let c = counters_in(&next);
        assert_one_instant(c, &format!("depth {depth}"));
        assert!(
            c.0 > last.0,
            "depth {depth} did not carry on from its parent"
        );
        last = c;
        dir = next;
    }
    // The deepest layer sees every ancestor's mark, maps (not copies) its chain, and runs.
    let vm = Vm::restore(&dir, opts(&Capture::default())).unwrap();
    for depth in 1..=6u64 {
        let mark: u64 = vm
            .ram()
            .memory()
            .read_obj(GuestAddress(HOST_WRITE + depth * 4096))
            .unwrap();
        assert_eq!(mark, depth, "mark of depth {depth}");
    }
    let running = vm.start().unwrap();
    counted_past(&running, last.0);
    running.stop();

    // A complete branch of the deepest child stands alone: no parent needed.
    let child = start_child(&dir);
    let full = tmp.path().join("full");
    child.branch(&full, SnapshotKind::Full).unwrap();
    child.stop();
    assert!(load_header(&full).unwrap().diff.is_none());
    let alone = tmp.path().join("alone");
    std::fs::create_dir(&alone).unwrap();
    let moved = alone.join("full");
    std::fs::rename(&full, &moved).unwrap();
    let c = counters_in(&moved);
    assert_one_instant(c, "full");
    assert!(c.0 >= last.0);
    let vm = Vm::restore(&moved, opts(&Capture::default())).unwrap();
    assert_eq!(
        vm.ram()
            .memory()
            .read_obj::<u64>(GuestAddress(HOST_WRITE + 3 * 4096))
            .unwrap(),
        3
    );
}

fn restore_err(dir: &Path) -> String {
    match Vm::restore(dir, opts(&Capture::default())) {
        Ok(_) => panic!("{} restored", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_chains_are_refused_with_a_clear_error() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    make_root(&root);
    let child = start_child(&root);
    counted_past(&child, counters_in(&root).0 + 1);
    let diff = tmp.path().join("diff");
    child.branch(&diff, SnapshotKind::Diff).unwrap();
    child.stop();
    let copy = |name: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir(&d).unwrap();
        for f in ["snapshot.json", "state.bin", "pages.bin", "pages.idx"] {
            std::fs::copy(diff.join(f), d.join(f)).unwrap();
        }
        d
    };

    let truncated = copy("truncated");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(truncated.join("pages.bin"))
        .unwrap();
    f.set_len(4096).unwrap();
    assert!(
        restore_err(&truncated).contains("truncated"),
        "{}",
        restore_err(&truncated)
    );

    let bad_index = copy("bad-index");
    let mut idx = std::fs::read(bad_index.join("pages.idx")).unwrap();
    idx[8] ^= 1;
    std::fs::write(bad_index.join("pages.idx"), idx).unwrap();
    let e = restore_err(&bad_index);
    assert!(e.contains("pages.idx is corrupt"), "{e}");

    let escape = copy("escape");
    let h = std::fs::read_to_string(escape.join("snapshot.json")).unwrap();
    std::fs::write(
        escape.join("snapshot.json"),
        h.replace("\"parent\": \"root\"", "\"parent\": \"../root\""),
    )
    .unwrap();
    let e = restore_err(&escape);
    assert!(e.contains("not a sibling directory name"), "{e}");

    // The parent replaced by another snapshot under the same name: the diff does not apply.
    let kept = tmp.path().join("kept-root");
    std::fs::rename(&root, &kept).unwrap();
    make_root(&root);
    let e = restore_err(&diff);
    assert!(e.contains("changed since the diff was taken"), "{e}");
    match Vm::restore(&diff, opts(&Capture::default())) {
        Err(Error::Restore(RestoreError::ParentChanged { .. })) => {}
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("restored"),
    }

    // A booted VM has no parent to take a diff over.
    let (running, _) = boot_guest(&counter_guest(), CODE);
    let e = running
        .branch(&tmp.path().join("orphan"), SnapshotKind::Diff)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a diff needs a VM restored from a snapshot"),
        "{e}"
    );
    running.stop();
}

#[test]
fn live_branches_hold_one_instant_while_the_guest_runs_on() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    make_root(&root);
    let at_root = counters_in(&root);
    let child = start_child(&root);
    child
        .ram()
        .memory()
        .write_obj(0xfeed_u64, GuestAddress(HOST_WRITE))
        .unwrap();
    counted_past(&child, at_root.0 + 1);
    let mut previous = at_root;
    for i in 0..20 {
        let dir = tmp.path().join(format!("live{i}"));
        let b = child.branch_live(&dir, SnapshotKind::Diff).unwrap();
        assert_eq!(b.pages_written, 3, "live branch {i}");
        assert_eq!(load_header(&dir).unwrap().diff.unwrap().parent, "root");
        let stray: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(stray.is_empty(), "{stray:?}");
        let c = counters_in(&dir);
        assert_one_instant(c, &format!("live branch {i}"));
        assert!(c.0 >= previous.0, "live branch {i} went back in time");
        previous = c;
        // The source is no further back than its branch.
        assert!(counters(child.ram()).0 >= c.0);
    }
    // A live complete image stands alone and holds the host's write too.
    let full = tmp.path().join("live-full");
    child.branch_live(&full, SnapshotKind::Full).unwrap();
    assert!(load_header(&full).unwrap().diff.is_none());
    let vm = Vm::restore(&full, opts(&Capture::default())).unwrap();
    assert_one_instant(counters(vm.ram()), "live full");
    assert_eq!(
        vm.ram()
            .memory()
            .read_obj::<u64>(GuestAddress(HOST_WRITE))
            .unwrap(),
        0xfeed
    );
    counted_past(&child, counters(child.ram()).0);
    child.stop();

    // A booted VM's RAM is shared with its file: no live branch of it.
    let (running, _) = boot_guest(&counter_guest(), CODE);
    let e = running
        .branch_live(&tmp.path().join("nope"), SnapshotKind::Full)
        .unwrap_err()
        .to_string();
    assert!(e.contains("restored from a snapshot"), "{e}");
    running.stop();
}

/// Pages of the rebase test's working set (more than one rebase step of 2048).
const WORKING: u64 = 5000;
/// A page the rebase test marks, past its working set.
const MARK: u64 = HOST_WRITE + (WORKING + 100) * 4096;

#[test]
fn a_source_rebased_onto_its_branch_writes_only_what_changed_since() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    make_root(&root);
    let child = start_child(&root);
    let mem = child.ram().memory();
    // A working set written once (by the VMM, as virtio would), then only A and B change.
    // Larger than one rebase step, so the rebase pauses more than once.
    for k in 0..WORKING {
        mem.write_obj(k + 1, GuestAddress(HOST_WRITE + k * 4096))
            .unwrap();
    }
    counted_past(&child, counters_in(&root).0 + 1);
    let b1 = tmp.path().join("b1");
    assert_eq!(
        child.branch(&b1, SnapshotKind::Diff).unwrap().pages_written,
        WORKING + 2
    );
    let r = child.rebase(&b1).unwrap();
    // The working set is unchanged since b1 and now maps b1's pages; A and B moved on.
    assert!(r.counts.pages_mapped >= WORKING, "{r:?}");
    assert_eq!(
        r.counts.pages_mapped + r.counts.pages_kept,
        WORKING + 2,
        "{r:?}"
    );
    mem.write_obj(0xabcd_u64, GuestAddress(MARK)).unwrap();
    // The guest counts on: A and B are written after the rebase whatever it mapped.
    counted_past(&child, counters(child.ram()).0 + 1);
    let b2 = tmp.path().join("b2");
    let second = child.branch(&b2, SnapshotKind::Diff).unwrap();
    // A, B and the new page: not the working set again.
    assert_eq!(second.pages_written, 3);
    assert_eq!(load_header(&b2).unwrap().diff.unwrap().parent, "b1");
    child.rebase(&b2).unwrap();
    // A page of the working set written again is private again, and in the next diff.
    mem.write_obj(999_u64, GuestAddress(HOST_WRITE + 5 * 4096))
        .unwrap();
    counted_past(&child, counters(child.ram()).0 + 1);
    let b3 = tmp.path().join("b3");
    assert_eq!(
        child.branch(&b3, SnapshotKind::Diff).unwrap().pages_written,
        3
    );
    // Only a diff over what the VM is a diff over now is taken as its new base.
    let e = child.rebase(&b1).unwrap_err().to_string();
    assert!(e.contains("diff over root taken before"), "{e}");
    let full = tmp.path().join("full");
    child.branch(&full, SnapshotKind::Full).unwrap();
    let e = child.rebase(&full).unwrap_err().to_string();
    assert!(e.contains("complete snapshot"), "{e}");
    // A live branch after the rebases is a diff over the last base.
    let live = tmp.path().join("live");
    let l = child.branch_live(&live, SnapshotKind::Diff).unwrap();
    assert_eq!(load_header(&live).unwrap().diff.unwrap().parent, "b2");
    assert!(l.pages_written >= 3, "{}", l.pages_written);

    // Every branch restores with all of it: the chain, or the complete image.
    for dir in [&b3, &full, &live] {
        let vm = Vm::restore(dir, opts(&Capture::default())).unwrap();
        let m = vm.ram().memory();
        for k in 0..WORKING {
            let want = if k == 5 { 999 } else { k + 1 };
            let got: u64 = m.read_obj(GuestAddress(HOST_WRITE + k * 4096)).unwrap();
            assert_eq!(got, want, "{}: page {k}", dir.display());
        }
        let mark: u64 = m.read_obj(GuestAddress(MARK)).unwrap();
        assert_eq!(mark, 0xabcd, "{}", dir.display());
        let c = counters(vm.ram());
        assert_one_instant(c, &dir.display().to_string());
        let running = vm.start().unwrap();
        counted_past(&running, c.0);
        running.stop();
    }
    // A base deleted since is passed over: the next diff is over the newest one left and
    // also holds the pages mapped from the deleted one.
    std::fs::rename(&b2, tmp.path().join("b2-gone")).unwrap();
    let fb = tmp.path().join("fb");
    let f = child.branch(&fb, SnapshotKind::Diff).unwrap();
    assert_eq!(load_header(&fb).unwrap().diff.unwrap().parent, "b1");
    assert!(f.pages_written >= 4, "{}", f.pages_written);
    let vm = Vm::restore(&fb, opts(&Capture::default())).unwrap();
    let m = vm.ram().memory();
    let mark: u64 = m.read_obj(GuestAddress(MARK)).unwrap();
    let five: u64 = m.read_obj(GuestAddress(HOST_WRITE + 5 * 4096)).unwrap();
    let six: u64 = m.read_obj(GuestAddress(HOST_WRITE + 6 * 4096)).unwrap();
    assert_eq!((mark, five, six), (0xabcd, 999, 7));
    assert_one_instant(counters(vm.ram()), "over an older base");
    // Such a diff holds everything mapped since its parent: the VM is rebased onto it.
    child.rebase(&fb).unwrap();
    counted_past(&child, counters(child.ram()).0 + 1);
    let fb2 = tmp.path().join("fb2");
    assert_eq!(
        child
            .branch(&fb2, SnapshotKind::Diff)
            .unwrap()
            .pages_written,
        2
    );
    assert_eq!(load_header(&fb2).unwrap().diff.unwrap().parent, "fb");
    // None left: a diff is refused with the reason, a complete branch still works.
    for gone in ["fb", "b1", "root"] {
        std::fs::rename(
            tmp.path().join(gone),
            tmp.path().join(format!("{gone}-gone")),
        )
        .unwrap();
    }
    let e = child
        .branch(&tmp.path().join("none"), SnapshotKind::Diff)
        .unwrap_err()
        .to_string();
    assert!(e.contains("deleted or replaced"), "{e}");
    child
        .branch(&tmp.path().join("whole"), SnapshotKind::Full)
        .unwrap();
    // The source runs on.
    counted_past(&child, counters(child.ram()).0);
    child.stop();
}
