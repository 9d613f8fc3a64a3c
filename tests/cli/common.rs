//! The one way the CLI tests run the `flatpipe` binary, and the inputs several of them share.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, ExitStatus, Output};

/// The `flatpipe` binary Cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_flatpipe");

/// One finished run of the binary: its exit status and its output as text.
#[derive(Debug)]
pub struct Run {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(o: Output) -> Self {
        Run {
            status: o.status,
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

impl Run {
    /// The JSON document on stdout, after asserting that the run succeeded.
    pub fn json(&self) -> Value {
        assert!(
            self.status.success(),
            "exit {:?}: {}",
            self.status.code(),
            self.stderr
        );
        serde_json::from_str(&self.stdout).expect("JSON on stdout")
    }
}

/// Runs `flatpipe args...` in `dir` and waits for it.
pub fn flatpipe(dir: &Path, args: &[&str]) -> Run {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run flatpipe")
        .into()
}

/// Runs `flatpipe args...` in `dir`, asserts that it succeeded and parses its stdout as JSON.
pub fn flatpipe_json(dir: &Path, args: &[&str]) -> Value {
    flatpipe(dir, args).json()
}

/// A file of this repository, by its path from the repository root.
pub fn repo_file(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(rel)
        .display()
        .to_string()
}

/// A plan file for llama3.1-8b on h200: 1F1B over two looped stages.
pub const PLAN: &str = "model: llama3.1-8b
hardware: h200
workload: sharegpt-v3
pp: 2
placement: loop
schedule: 1f1b
stages:
  - {start: 0, end: 18}
  - {start: 18, end: 34}
microbatches: 8
seqs_per_step: 64
seed: 3
";

/// A model small enough to profile in a test.
pub const SMALL_MODEL: &str = "name: small\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 64, hidden: 32}\n  - {kind: decoder, count: 4, hidden: 32, ffn: 64, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 64, hidden: 32}\n";
