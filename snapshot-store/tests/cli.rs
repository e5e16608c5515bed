//! The CLI module end to end on a directory store.

mod common;

use clap::Parser;
use common::*;
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::cli::{images_table, run, StoreCommand};

#[derive(Parser)]
struct Tine {
    #[command(subcommand)]
    cmd: StoreCommand,
}

async fn tine(args: &[&str]) -> anyhow::Result<()> {
    let mut argv = vec!["tine"];
    argv.extend_from_slice(args);
    run(Tine::try_parse_from(argv)?.cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_push_pull_pack_unpack_images_gc() {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s).display().to_string();
    let (store, host_a, host_b, host_c) = (p("store"), p("a"), p("b"), p("c"));
    let on = |cache: &str| {
        vec![
            "--store".to_string(),
            store.clone(),
            "--layer-cache".to_string(),
            cache.to_string(),
        ]
    };
    let run_on = |cmd: Vec<&str>, cache: &str| {
        let mut v: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
        v.extend(on(cache));
        v
    };
    let go = |v: Vec<String>| async move {
        tine(&v.iter().map(String::as_str).collect::<Vec<_>>()).await
    };

    // Memory: base, then a diff touching a few pages.
    let mem0 = p("mem0");
    let f = create_memory(std::path::Path::new(&mem0), 512);
    for page in [1u64, 7, 100, 300] {
        write_page(&f, page, &page_bytes(page));
    }
    drop(f);
    let mem1 = p("mem1");
    std::fs::copy(&mem0, &mem1).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&mem1).unwrap();
    write_page(&f, 7, &vec![0u8; PAGE]);
    write_page(&f, 8, &page_bytes(8));
    drop(f);
    std::fs::write(p("dirty"), "7\n8\n").unwrap();

    go(run_on(
        vec!["layer-create", "--memory", &mem0, "--tag", "base"],
        &host_a,
    ))
    .await
    .unwrap();
    let dirty = p("dirty");
    go(run_on(
        vec![
            "layer-create",
            "--memory",
            &mem1,
            "--parent",
            "base",
            "--dirty",
            &dirty,
            "--tag",
            "top",
        ],
        &host_a,
    ))
    .await
    .unwrap();
    go(run_on(vec!["push", "top"], &host_a)).await.unwrap();
    go(run_on(vec!["pull", "top"], &host_b)).await.unwrap();
    let b = LocalCache::open(&host_b).unwrap();
    let head = b.get_tag("top").unwrap();
    assert_same_file(&b.image_path(&head), std::path::Path::new(&mem1));
    let table = images_table(&b).unwrap();
    assert!(
        table.contains("top") && table.contains("depth 1") && table.contains("depth 0"),
        "{table}"
    );
    go(run_on(vec!["images", "--remote"], &host_b))
        .await
        .unwrap();

    let key = p("key");
    go(vec!["keygen".into(), key.clone()]).await.unwrap();
    let pack = p("top.tpack");
    go(run_on(
        vec!["pack", "top", "-o", &pack, "--sign", &key],
        &host_b,
    ))
    .await
    .unwrap();
    let pubkey = format!("{key}.pub");
    go(run_on(vec!["unpack", &pack, "--verify", &pubkey], &host_c))
        .await
        .unwrap();
    let c = LocalCache::open(&host_c).unwrap();
    assert_same_file(
        &assemble(&c, &c.get_tag("top").unwrap()).unwrap(),
        std::path::Path::new(&mem1),
    );

    // A different key is refused with a clear message.
    let other = p("other");
    go(vec!["keygen".into(), other.clone()]).await.unwrap();
    let err = go(run_on(
        vec!["unpack", &pack, "--verify", &format!("{other}.pub")],
        &p("d"),
    ))
    .await
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("not the trusted key"),
        "{err:#}"
    );

    go(run_on(vec!["gc", "--min-age-secs", "0"], &host_a))
        .await
        .unwrap();
    let err = go(run_on(vec!["push", "../etc"], &host_a))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("invalid tag"), "{err:#}");
    let err = go(run_on(vec!["pull", "nosuchtag"], &host_a))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("unknown tag"), "{err:#}");
}
