//! `flatpipe builtins` and `--help`: what the binary knows and how it says so.

use crate::cli::common::{flatpipe, flatpipe_json};

#[test]
fn builtins_lists_every_name() {
    let dir = tempfile::tempdir().unwrap();
    let v = flatpipe_json(dir.path(), &["builtins", "--format", "json"]);
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for n in [
        "llama3.1-8b",
        "llama3.1-70b",
        "h200",
        "sharegpt-v3",
        "sharegpt-v3-merged",
        "llama3.1-8b@h200",
    ] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
}

#[test]
fn every_subcommand_has_help() {
    let dir = tempfile::tempdir().unwrap();
    for sub in [
        vec!["--help"],
        vec!["simulate", "--help"],
        vec!["builtins", "--help"],
    ] {
        let o = flatpipe(dir.path(), &sub);
        assert!(o.status.success());
        assert!(o.stdout.contains("Usage"));
    }
}
