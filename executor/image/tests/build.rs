//! Real image builds: the cloud kernel, busybox-static and the static tine-agent go into an
//! initramfs, which is then unpacked and checked. The busybox image takes seconds (plus one
//! static agent build); the python-numpy one runs debootstrap (minutes), hence `#[ignore]`:
//! `cargo test -p tine-image --test build -- --ignored`.

use std::path::PathBuf;

use tine_agent::config::AgentConfig;
use tine_agent::server::modules::DepTable;
use tine_image::cpio::{read_archive, Entry};
use tine_image::{build_image, list_images, load_image_in, BuildOptions, Recipe};

/// A scratch cache that shares the real cache's kernels (and debootstrap trees), so the test
/// does not download them again but its images stay private.
fn scratch_cache() -> tempfile::TempDir {
    let real = tine_image::default_cache_dir();
    let tmp = tempfile::tempdir().unwrap();
    for shared in ["kernels", "rootfs"] {
        std::fs::create_dir_all(real.join(shared)).unwrap();
        std::os::unix::fs::symlink(real.join(shared), tmp.path().join(shared)).unwrap();
    }
    tmp
}

/// The static agent (see `tine_agent::build::static_agent_for_tests`).
fn agent_binary() -> PathBuf {
    tine_agent::build::static_agent_for_tests().to_path_buf()
}

fn unpack(m: &tine_image::ImageManifest) -> Vec<Entry> {
    let packed = std::fs::read(m.initrd_path()).unwrap();
    read_archive(&m.compression.decompress(&packed).unwrap()).unwrap()
}

fn get<'a>(entries: &'a [Entry], name: &str) -> &'a Entry {
    entries
        .iter()
        .find(|e| e.name == name)
        .unwrap_or_else(|| panic!("{name} not in the image"))
}

/// Paths the agent will open at boot, checked against the archive the way the agent resolves
/// them (through modules.dep, relative to /lib/modules/<release>).
fn check_agent_can_load_modules(entries: &[Entry], lib_modules: &str, cfg: &AgentConfig) {
    let dep = String::from_utf8_lossy(&get(entries, &format!("{lib_modules}/modules.dep")).data)
        .into_owned();
    let builtin = entries
        .iter()
        .find(|e| e.name == format!("{lib_modules}/modules.builtin"))
        .map(|e| String::from_utf8_lossy(&e.data).into_owned())
        .unwrap_or_default();
    let order = DepTable::parse(&dep, &builtin)
        .load_order(&cfg.modules)
        .expect("the agent resolves its modules");
    assert!(order.len() >= 2, "{order:?}");
    for rel in order {
        let e = get(entries, &format!("{lib_modules}/{rel}"));
        // Plain ELF relocatable objects: the agent loads them without decompression.
        assert_eq!(&e.data[..4], b"\x7fELF", "{rel}");
    }
}

#[test]
fn busybox_image_has_agent_init_config_and_modules() {
    let cache = scratch_cache();
    let agent = agent_binary();
    let opts = BuildOptions::new(
        Recipe::resolve("busybox").unwrap(),
        cache.path().to_path_buf(),
        agent.clone(),
    );
    let built = build_image(&opts).unwrap();
    assert!(!built.reused);
    let m = &built.manifest;
    assert_eq!(m.recipe, "busybox");
    assert_eq!(m.cmdline_append, "quiet");
    assert!(m.kernel_path().is_file() && m.initrd_path().is_file());
    assert_eq!(
        m.agent.modules,
        ["virtio_mmio", "vmw_vsock_virtio_transport", "virtio_net"]
    );

    let entries = unpack(m);
    let init = String::from_utf8_lossy(&get(&entries, "init").data).into_owned();
    assert!(
        init.contains("exec /usr/sbin/tine-agent --config /etc/tine/agent.conf"),
        "{init}"
    );
    assert_eq!(get(&entries, "init").mode & 0o777, 0o755);
    let agent_entry = get(&entries, "usr/sbin/tine-agent");
    assert_eq!(agent_entry.data, std::fs::read(&agent).unwrap());
    assert_eq!(agent_entry.mode & 0o777, 0o755);
    assert_eq!(get(&entries, "bin/sh").data, b"busybox");
    assert_eq!(get(&entries, "dev/console").rdev, (5, 1));
    assert_eq!(
        get(&entries, "bin/busybox").data,
        std::fs::read("/bin/busybox").unwrap()
    );

    let cfg_text = String::from_utf8_lossy(&get(&entries, "etc/tine/agent.conf").data).into_owned();
    assert_eq!(cfg_text, m.agent.config);
    let cfg = AgentConfig::parse(&cfg_text).unwrap();
    assert_eq!(cfg.modules, m.agent.modules);
    check_agent_can_load_modules(&entries, &format!("lib/modules/{}", m.kernel_release), &cfg);
    for f in &m.agent.module_files {
        get(&entries, f.trim_start_matches('/'));
    }

    // Same inputs: the cached image comes back without a build.
    let again = build_image(&opts).unwrap();
    assert!(again.reused);
    assert_eq!(again.manifest.id, m.id);
    assert_eq!(
        load_image_in(cache.path(), "busybox").unwrap().id,
        m.id,
        "found by name"
    );
    assert_eq!(
        load_image_in(cache.path(), &m.id[..8]).unwrap().dir,
        m.dir,
        "found by id prefix"
    );
    let listed = list_images(cache.path()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].1, ["busybox"]);

    // A different warm-up is a different image.
    let mut changed = opts.clone();
    changed.recipe.agent.warmup = "import json".into();
    let other = build_image(&changed).unwrap();
    assert!(!other.reused);
    assert_ne!(other.manifest.id, m.id);
}

#[test]
fn tarball_rootfs_is_packed_with_the_agent_on_top() {
    let cache = scratch_cache();
    let tmp = tempfile::tempdir().unwrap();
    // A tiny merged-/usr tree as a tarball, with a symlinked /lib like Debian's.
    let mut b = tar::Builder::new(Vec::new());
    let add_dir = |b: &mut tar::Builder<Vec<u8>>, p: &str| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        b.append_data(&mut h, p, &[][..]).unwrap();
    };
    add_dir(&mut b, "usr");
    add_dir(&mut b, "usr/lib");
    add_dir(&mut b, "usr/share/doc/x");
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    b.append_link(&mut h, "lib", "usr/lib").unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_mode(0o644);
    h.set_size(5);
    b.append_data(&mut h, "usr/share/doc/x/README", &b"docs\n"[..])
        .unwrap();
    let tarball = tmp.path().join("root.tar");
    std::fs::write(&tarball, b.into_inner().unwrap()).unwrap();

    let mut opts = BuildOptions::new(
        Recipe::resolve("busybox").unwrap(),
        cache.path().to_path_buf(),
        agent_binary(),
    );
    opts.rootfs = Some(tarball);
    opts.name = Some("from-tarball".into());
    let m = build_image(&opts).unwrap().manifest;
    assert!(m.rootfs.source.starts_with("tarball "));
    let entries = unpack(&m);
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    // Modules follow the lib -> usr/lib symlink; docs are slimmed away; sh falls back to busybox.
    let lib_modules = format!("usr/lib/modules/{}", m.kernel_release);
    assert!(names.contains(&format!("{lib_modules}/modules.dep").as_str()));
    assert_eq!(get(&entries, "lib").data, b"usr/lib");
    assert!(!names.contains(&"usr/share/doc/x/README"));
    assert_eq!(get(&entries, "bin/sh").data, b"busybox");
    get(&entries, "usr/sbin/tine-agent");
    assert_eq!(m.rootfs.excluded_entries, 2);
}

#[test]
#[ignore = "runs debootstrap (downloads ~100 MB of packages, a few minutes)"]
fn python_numpy_image_has_python_numpy_and_compiled_bytecode() {
    let cache = scratch_cache();
    let opts = BuildOptions::new(
        Recipe::resolve("python-numpy").unwrap(),
        cache.path().to_path_buf(),
        agent_binary(),
    );
    let m = build_image(&opts).unwrap().manifest;
    eprintln!(
        "python-numpy: initrd {} bytes ({:?}), unpacked {} bytes, {} files, built in {} s, memory {} MiB",
        m.initrd.bytes,
        m.compression,
        m.rootfs.unpacked_bytes,
        m.rootfs.files,
        m.build_seconds,
        m.memory_mib
    );
    assert!(m.rootfs.packages.contains_key("python3-numpy"));
    assert!(m.agent.config.contains("warmup = import numpy"));
    assert!(m.memory_mib >= 640);
    let entries = unpack(&m);
    let has = |p: &str| entries.iter().any(|e| e.name == p);
    assert!(has("usr/bin/python3") || has("usr/bin/python3.11"));
    assert!(has("usr/lib/python3/dist-packages/numpy/__init__.py"));
    assert!(!entries
        .iter()
        .any(|e| e.name.starts_with("usr/share/doc/") && e.name.matches('/').count() > 3));
    // Bytecode stays valid only if the sources keep their mtimes.
    let src = get(&entries, "usr/lib/python3/dist-packages/numpy/__init__.py");
    assert_ne!(src.mtime, 0);
    check_agent_can_load_modules(
        &entries,
        &format!("usr/lib/modules/{}", m.kernel_release),
        &AgentConfig::parse(&m.agent.config).unwrap(),
    );
}
