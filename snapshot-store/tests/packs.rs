//! Pack export/import, signatures and hostile packs.

mod common;

use std::io::Read;
use std::path::Path;

use common::*;
use prost::Message;
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::keys::generate_signing_key;
use tine_snapshot_store::manifest::pb;
use tine_snapshot_store::pack::{
    export_pack, import_pack, ImportOptions, PackHead, INDEX_NAME, SIGNATURE_NAME,
};

struct Fixture {
    _dir: tempfile::TempDir,
    src: LocalCache,
    dst: LocalCache,
    chain: Chain,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let src = LocalCache::open(dir.path().join("src")).unwrap();
    let dst = LocalCache::open(dir.path().join("dst")).unwrap();
    let chain = build_chain(&src, dir.path(), 2048, 600, 150);
    Fixture {
        _dir: dir,
        src,
        dst,
        chain,
    }
}

fn pack_bytes(f: &Fixture, key: Option<&ed25519_dalek::SigningKey>) -> Vec<u8> {
    let heads = [PackHead {
        tag: Some("py+repo".into()),
        head: f.chain.heads[2],
    }];
    let mut out = Vec::new();
    export_pack(&f.src, &heads, key, &mut out).unwrap();
    out
}

/// Every file under the cache with its size: "left clean" means unchanged.
fn tree(root: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push((
                    e.path().strip_prefix(root).unwrap().display().to_string(),
                    e.metadata().unwrap().len(),
                ));
            }
        }
    }
    out.sort();
    out
}

fn assert_refused(f: &Fixture, pack: &[u8], opts: &ImportOptions, needle: &str) {
    let before = tree(f.dst.root());
    let err = import_pack(&f.dst, pack, opts).unwrap_err().to_string();
    assert!(err.contains(needle), "expected {needle:?} in error: {err}");
    assert_eq!(
        tree(f.dst.root()),
        before,
        "cache changed after refused import ({err})"
    );
}

/// (path, type, data) of every member.
fn members(pack: &[u8]) -> Vec<(String, tar::EntryType, Vec<u8>)> {
    let mut a = tar::Archive::new(pack);
    a.entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            (
                String::from_utf8(e.path_bytes().to_vec()).unwrap(),
                e.header().entry_type(),
                data,
            )
        })
        .collect()
}

/// A raw tar member whose name bypasses the tar crate's own path checks.
fn raw_member(name: &[u8], kind: tar::EntryType, data: &[u8], link: &[u8]) -> Vec<u8> {
    let mut h = tar::Header::new_ustar();
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    let mut out = h.as_bytes().to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out
}

fn rebuild(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out: Vec<u8> = parts.concat();
    out.extend_from_slice(&[0u8; 1024]); // end-of-archive marker
    out
}

fn regular(m: &(String, tar::EntryType, Vec<u8>)) -> Vec<u8> {
    raw_member(m.0.as_bytes(), tar::EntryType::Regular, &m.2, b"")
}

#[test]
fn signed_pack_roundtrips_byte_for_byte() {
    let f = fixture();
    let key = generate_signing_key().unwrap();
    let pack = pack_bytes(&f, Some(&key));
    let opts = ImportOptions {
        verify_key: Some(key.verifying_key()),
        ..Default::default()
    };
    let summary = import_pack(&f.dst, pack.as_slice(), &opts).unwrap();
    assert_eq!(summary.layers, 3);
    assert_eq!(
        summary.signer,
        Some(hex::encode(key.verifying_key().to_bytes()))
    );
    let head = f.dst.get_tag("py+repo").unwrap();
    assert_eq!(head, f.chain.heads[2]);
    assert_same_file(&assemble(&f.dst, &head).unwrap(), &f.chain.memories[2]);
    assert!(
        std::fs::read_dir(f.dst.tmp_dir()).unwrap().next().is_none(),
        "staging left behind"
    );
    // Importing again is a no-op that succeeds.
    import_pack(&f.dst, pack.as_slice(), &opts).unwrap();
}

#[test]
fn tampered_chunk_is_refused() {
    let f = fixture();
    let pack = pack_bytes(&f, None);
    let ms = members(&pack);
    let mut parts: Vec<Vec<u8>> = ms.iter().map(regular).collect();
    let chunk = ms.iter().position(|m| m.0.starts_with("chunks/")).unwrap();
    let mut data = ms[chunk].2.clone();
    let mid = data.len() / 2;
    data[mid] ^= 0x40;
    parts[chunk] = raw_member(ms[chunk].0.as_bytes(), tar::EntryType::Regular, &data, b"");
    assert_refused(
        &f,
        &rebuild(&parts),
        &ImportOptions::default(),
        "is corrupt",
    );
}

#[test]
fn truncated_pack_is_refused() {
    let f = fixture();
    let pack = pack_bytes(&f, None);
    // Cut inside a member...
    assert_refused(
        &f,
        &pack[..pack.len() / 2],
        &ImportOptions::default(),
        "truncated",
    );
    // ...and cleanly at a member boundary, dropping the tail members.
    let ms = members(&pack);
    let parts: Vec<Vec<u8>> = ms[..ms.len() - 2].iter().map(regular).collect();
    assert_refused(&f, &parts.concat(), &ImportOptions::default(), "truncated");
    assert_refused(&f, &[], &ImportOptions::default(), "not a Tine pack");
}

#[test]
fn path_traversal_links_and_duplicates_are_refused() {
    let f = fixture();
    let pack = pack_bytes(&f, None);
    let ms = members(&pack);
    let index = regular(&ms[0]);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            raw_member(b"../../evil", tar::EntryType::Regular, b"x", b""),
            "'..'",
        ),
        (
            raw_member(b"chunks/../../evil", tar::EntryType::Regular, b"x", b""),
            "'..'",
        ),
        (
            raw_member(b"/etc/evil", tar::EntryType::Regular, b"x", b""),
            "absolute",
        ),
        (
            raw_member(
                ms[1].0.as_bytes(),
                tar::EntryType::Symlink,
                b"",
                b"/etc/passwd",
            ),
            "Symlink",
        ),
        (
            raw_member(
                ms[1].0.as_bytes(),
                tar::EntryType::Link,
                b"",
                b"../../outside",
            ),
            "Link",
        ),
        (
            raw_member(b"layers", tar::EntryType::Directory, b"", b""),
            "Directory",
        ),
        (
            raw_member(b"README", tar::EntryType::Regular, b"x", b""),
            "unexpected member",
        ),
    ];
    for (member, needle) in cases {
        assert_refused(
            &f,
            &rebuild(&[index.clone(), member]),
            &ImportOptions::default(),
            needle,
        );
    }
    let mut parts: Vec<Vec<u8>> = ms.iter().map(regular).collect();
    parts.push(regular(&ms[2]));
    assert_refused(
        &f,
        &rebuild(&parts),
        &ImportOptions::default(),
        "duplicate member",
    );
    assert!(!f.dst.root().parent().unwrap().join("evil").exists());
}

#[test]
fn signatures_are_enforced() {
    let f = fixture();
    let key = generate_signing_key().unwrap();
    let other = generate_signing_key().unwrap();
    let signed = pack_bytes(&f, Some(&key));
    let unsigned = pack_bytes(&f, None);

    let trust_other = ImportOptions {
        verify_key: Some(other.verifying_key()),
        ..Default::default()
    };
    assert_refused(&f, &signed, &trust_other, "not the trusted key");
    let trust_key = ImportOptions {
        verify_key: Some(key.verifying_key()),
        ..Default::default()
    };
    assert_refused(&f, &unsigned, &trust_key, "not signed");

    // Alter the index (add a tag) and keep the old signature.
    let ms = members(&signed);
    assert_eq!(ms[0].0, INDEX_NAME);
    assert_eq!(ms[1].0, SIGNATURE_NAME);
    let mut index = pb::PackIndex::decode(ms[0].2.as_slice()).unwrap();
    index.tags.push(pb::PackTag {
        name: "latest".into(),
        head: f.chain.heads[0].as_bytes().to_vec(),
    });
    let mut parts: Vec<Vec<u8>> = ms.iter().map(regular).collect();
    parts[0] = raw_member(
        INDEX_NAME.as_bytes(),
        tar::EntryType::Regular,
        &index.encode_to_vec(),
        b"",
    );
    assert_refused(&f, &rebuild(&parts), &trust_key, "does not match");

    // A forged signature member (random bytes under the trusted key).
    let mut forged = key.verifying_key().to_bytes().to_vec();
    forged.extend_from_slice(&[7u8; 64]);
    parts = ms.iter().map(regular).collect();
    parts[1] = raw_member(
        SIGNATURE_NAME.as_bytes(),
        tar::EntryType::Regular,
        &forged,
        b"",
    );
    assert_refused(&f, &rebuild(&parts), &trust_key, "signature");
}

/// An unverified pack may add tags and repeat ones the cache has, never move one: a tag that
/// names another snapshot here is refused (nothing changes) unless the caller says so.
#[test]
fn an_unverified_pack_does_not_re_point_a_tag() {
    let f = fixture();
    let none = ImportOptions::default();
    let pack = pack_bytes(&f, None);
    import_pack(&f.dst, pack.as_slice(), &none).unwrap();
    import_pack(&f.dst, pack.as_slice(), &none).expect("the same tag and head again");
    let older = {
        let heads = [PackHead {
            tag: Some("py+repo".into()),
            head: f.chain.heads[1],
        }];
        let mut out = Vec::new();
        export_pack(&f.src, &heads, None, &mut out).unwrap();
        out
    };
    assert_refused(&f, &older, &none, "--replace-tags");
    assert_eq!(f.dst.get_tag("py+repo").unwrap(), f.chain.heads[2]);
    let replace = ImportOptions {
        replace_tags: true,
        ..Default::default()
    };
    import_pack(&f.dst, older.as_slice(), &replace).unwrap();
    assert_eq!(f.dst.get_tag("py+repo").unwrap(), f.chain.heads[1]);
}
