//! Boots the real nested lab (QEMU/TCG, ~10-60 s). Ignored by default; run with
//! `cargo test -p tine-lab -- --ignored`.

use tine_lab::{Lab, LabCommand, LabConfig};

#[test]
#[ignore = "boots QEMU/TCG; run explicitly with --ignored"]
fn runs_a_command_with_kvm_and_returns_its_status() {
    let share = tempfile::tempdir().unwrap();
    let lab = Lab::prepare(LabConfig {
        shares: vec![share.path().to_path_buf()],
        ..LabConfig::default()
    })
    .unwrap();
    let script = r#"
        test -c /dev/kvm && echo "kvm-ok nested=$(cat /sys/module/kvm_amd/parameters/nested)"
        printf '[%s]' "$@"; echo
        echo "$TINE_LAB_TEST" > result.txt
        exit 7
    "#;
    let cmd = LabCommand::new(["sh", "-c", script, "sh", "a b", "it's $HOME"])
        .cwd(share.path())
        .env("TINE_LAB_TEST", "from the host");
    let mut out = Vec::new();
    let outcome = lab.run(&cmd, &mut out).unwrap();
    let out = String::from_utf8_lossy(&out);

    assert_eq!(outcome.exit_code, 7, "output:\n{out}");
    assert!(out.contains("kvm-ok nested=1"), "output:\n{out}");
    assert!(out.contains("[a b][it's $HOME]"), "output:\n{out}");
    assert!(!out.contains("TINE-LAB-"), "markers leaked:\n{out}");
    assert!(outcome.l1_init.is_some() && outcome.l1_ready.is_some());
    assert_eq!(
        std::fs::read_to_string(share.path().join("result.txt")).unwrap(),
        "from the host\n"
    );
}
