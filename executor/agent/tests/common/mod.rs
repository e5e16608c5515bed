//! Starts the real agent binary on a Unix socket in a temp dir.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tine_agent::client::{AgentClient, Connector};

pub struct TestAgent {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    child: Child,
}

impl TestAgent {
    pub fn start() -> Self {
        Self::with_config("")
    }

    pub fn with_config(config: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let cfg = dir.path().join("agent.conf");
        std::fs::write(&cfg, config).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tine-agent"))
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let agent = Self { dir, socket, child };
        // Wait until the socket accepts (readiness itself is tested separately).
        let client = agent.client();
        let mut last = None;
        for _ in 0..1000 {
            match client.ping() {
                Ok(_) => return agent,
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("agent never answered: {last:?}");
    }

    pub fn client(&self) -> AgentClient {
        AgentClient::new(Connector::Unix(self.socket.clone()))
    }

    /// A guest path inside this test's temp dir.
    pub fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
