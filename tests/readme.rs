//! The README's commands run: every `flatpipe …` line of its `sh` blocks is run, in order, in
//! one temporary directory, against the binary Cargo built, and must exit 0.
//!
//! Conventions the README follows for this test:
//! - only lines starting with `flatpipe` run (the set-up commands, `cargo …` and
//!   `scripts/test.sh`, and other programs such as `.venv/bin/python` do not);
//! - a line ending in `\` continues on the next;
//! - a trailing `# comment` is dropped; a comment starting `# untested:` (with the reason: a
//!   GPU, torch, minutes of work) skips the command;
//! - `> FILE` sends stdout to FILE in the temporary directory;
//! - arguments under `examples/` or `tests/data/` name this repository's files; every other
//!   relative path is the temporary directory's, so commands see the files earlier ones wrote;
//! - no quotes, variables, pipes or `;`: a line with one fails this test, naming it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `flatpipe` binary Cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_flatpipe");

/// The prefix of a comment that keeps a README command out of this test.
const UNTESTED: &str = "untested:";

/// One `flatpipe` command of the README.
#[derive(Debug, PartialEq)]
struct ReadmeCommand {
    /// The logical line as the README writes it (continuations joined, comment dropped).
    line: String,
    /// The arguments after `flatpipe`, split on whitespace, redirection removed.
    args: Vec<String>,
    /// The file `> FILE` sends stdout to, if any.
    stdout_to: Option<String>,
    /// Why the README keeps it out of this test (`# untested: <reason>`), if it does.
    untested: Option<String>,
}

/// The lines of every fenced block opened with ```` ```sh ```` or ```` ```bash ````, with
/// continuation lines (ending in `\`) joined.
fn shell_lines(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in markdown.lines() {
        let trimmed = line.trim();
        if !in_block {
            in_block = trimmed == "```sh" || trimmed == "```bash";
            continue;
        }
        if trimmed.starts_with("```") {
            in_block = false;
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                pending.push_str(head);
                pending.push(' ');
            }
            None => {
                pending.push_str(trimmed);
                out.push(std::mem::take(&mut pending));
            }
        }
    }
    out
}

/// The README's `flatpipe` commands, in order.
///
/// # Panics
/// On a command this harness cannot run as written (quotes, variables, pipes, `;`, `&`, a
/// `>` without a file), naming the line.
fn readme_commands(markdown: &str) -> Vec<ReadmeCommand> {
    shell_lines(markdown)
        .into_iter()
        .filter(|l| l == "flatpipe" || l.starts_with("flatpipe "))
        .map(|l| parse_command(&l))
        .collect()
}

/// One logical `flatpipe` line as a command.
fn parse_command(line: &str) -> ReadmeCommand {
    let (code, comment) = match line.find(" #") {
        Some(i) => (line[..i].trim(), Some(line[i + 2..].trim())),
        None => (line.trim(), None),
    };
    let untested = comment
        .and_then(|c| c.strip_prefix(UNTESTED))
        .map(|why| why.trim().to_string());
    assert!(
        !code.contains(['"', '\'', '$', '|', ';', '&', '`', '<']),
        "README command {line:?}: tests/readme.rs runs plain words only (no quotes, variables, \
         pipes, `;`, `&` or `<`)"
    );
    let mut words = code.split_whitespace().skip(1).map(str::to_string);
    let mut args = Vec::new();
    let mut stdout_to = None;
    while let Some(w) = words.next() {
        if w == ">" {
            let file = words.next();
            assert!(
                file.is_some(),
                "README command {line:?}: `>` without a file"
            );
            stdout_to = file;
        } else {
            args.push(w);
        }
    }
    ReadmeCommand {
        line: code.split_whitespace().collect::<Vec<_>>().join(" "),
        args,
        stdout_to,
        untested,
    }
}

/// `arg` with a path under `examples/` or `tests/data/` made absolute in this repository.
fn repo_path(arg: &str) -> String {
    if arg.starts_with("examples/") || arg.starts_with("tests/data/") {
        let p: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join(arg);
        p.display().to_string()
    } else {
        arg.to_string()
    }
}

#[test]
fn the_readme_commands_parse_as_the_readme_writes_them() {
    let md = "text\n```sh\nflatpipe plan --pp 4 \\\n    -o p.yaml   # a plan\n\
              cargo run --release -- plan\nflatpipe profile --quick   # untested: minutes\n```\n\
              ```text\nflatpipe not a command\n```\n```sh\nflatpipe plan --export pytorch-csv > s.csv\n```\n";
    let cmds = readme_commands(md);
    assert_eq!(
        cmds,
        vec![
            ReadmeCommand {
                line: "flatpipe plan --pp 4 -o p.yaml".into(),
                args: vec!["plan", "--pp", "4", "-o", "p.yaml"]
                    .into_iter()
                    .map(String::from)
                    .collect(),
                stdout_to: None,
                untested: None,
            },
            ReadmeCommand {
                line: "flatpipe profile --quick".into(),
                args: vec!["profile".into(), "--quick".into()],
                stdout_to: None,
                untested: Some("minutes".into()),
            },
            ReadmeCommand {
                line: "flatpipe plan --export pytorch-csv > s.csv".into(),
                args: vec!["plan".into(), "--export".into(), "pytorch-csv".into()],
                stdout_to: Some("s.csv".into()),
                untested: None,
            },
        ]
    );
    assert_eq!(repo_path("order.csv"), "order.csv");
    assert!(repo_path("examples/plan.yaml").ends_with("/examples/plan.yaml"));
}

/// Every `flatpipe` command of README.md's `sh` blocks exits 0, run in order in one temporary
/// directory; the set-up commands stay the two CI relies on (`.ci/run` runs
/// `scripts/test.sh`, the README's test command).
#[test]
fn every_readme_command_runs() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let setup = shell_lines(&readme);
    assert!(
        setup
            .first()
            .is_some_and(|l| l.starts_with("cargo run --release -- plan"))
            && setup
                .get(1)
                .is_some_and(|l| l.starts_with("scripts/test.sh")),
        "the README's first shell block is the two set-up commands: {setup:?}"
    );
    let cmds = readme_commands(&readme);
    let (skipped, run): (Vec<_>, Vec<_>) = cmds.iter().partition(|c| c.untested.is_some());
    assert!(
        run.len() >= 10 && run.len() > 2 * skipped.len(),
        "most README commands run: {} run, {} marked untested",
        run.len(),
        skipped.len()
    );
    let dir = tempfile::tempdir().unwrap();
    for c in run {
        let args: Vec<String> = c.args.iter().map(|a| repo_path(a)).collect();
        let o = Command::new(BIN)
            .args(&args)
            .current_dir(dir.path())
            .output()
            .expect("run flatpipe");
        assert!(
            o.status.success(),
            "README command `{}` exited {:?}:\n{}",
            c.line,
            o.status.code(),
            String::from_utf8_lossy(&o.stderr)
        );
        if let Some(file) = &c.stdout_to {
            std::fs::write(dir.path().join(file), &o.stdout).unwrap();
        }
    }
}
