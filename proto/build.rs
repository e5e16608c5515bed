//! Compiles every `.proto` file under `tine/` so new packages (e.g. the later
//! gRPC services) only need a file dropped in and a `pub mod` in lib.rs.

use std::path::{Path, PathBuf};

fn collect_protos(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_protos(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

/// Packages that define gRPC services (the public and the executor API).
fn is_grpc(proto_root: &Path, p: &Path) -> bool {
    p.starts_with(proto_root.join("v1")) || p.starts_with(proto_root.join("executor"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = root.join("tine");
    let mut protos = Vec::new();
    collect_protos(&proto_root, &mut protos)?;
    protos.sort(); // deterministic generated output
    println!("cargo:rerun-if-changed={}", proto_root.display());
    for p in &protos {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!("cargo:rerun-if-env-changed=PROTOC");
    let mut config = prost_build::Config::new();
    // prost-build honours $PROTOC itself. Otherwise prefer Debian's protoc and
    // fall back to the vendored binary so a bare machine still builds.
    if std::env::var_os("PROTOC").is_none() {
        if Path::new("/usr/bin/protoc").exists() {
            config.protoc_executable("/usr/bin/protoc");
        } else {
            config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
        }
    }
    // The gRPC packages (with services) only when asked for, so the static guest agent,
    // which needs just the message types, does not pull in tonic.
    if std::env::var_os("CARGO_FEATURE_GRPC").is_none() {
        protos.retain(|p| !is_grpc(&proto_root, p));
        config.compile_protos(&protos, &[root])?;
        return Ok(());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        // For gRPC server reflection.
        .file_descriptor_set_path(out.join("tine_descriptor.bin"))
        .compile_with_config(config, &protos, &[root])?;
    Ok(())
}
