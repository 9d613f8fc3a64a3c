//! What every command shares on the way out: charts, exports on stdout, closed pipes, progress
//! bars, and the README's copies of the output.

use crate::cli::common::{BIN, Run, flatpipe};

/// `--gantt none` switches the chart off in `simulate` and `plan`.
#[test]
fn gantt_none_switches_the_chart_off() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--gantt", "none"]);
    assert!(o.status.success(), "{}", o.stderr);
    assert!(!dir.path().join("flatpipe-gantt.png").exists());
    assert!(!o.stdout.contains("Gantt chart"));
    let o = flatpipe(dir.path(), &["plan", "--gantt", "none", "--steps", "4"]);
    assert!(o.status.success(), "{}", o.stderr);
    assert!(!dir.path().join("flatpipe-plan.png").exists());
}

/// `plan --export pytorch-csv > schedule.csv` without `-o` is a usable file: the export alone
/// on stdout, the table and notes on stderr (they were mixed, and `simulate --schedule-csv`
/// refused the table's first line as an action).
#[test]
fn an_export_without_output_file_is_alone_on_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--pp",
            "4",
            "--schedule",
            "1f1b",
            "--steps",
            "2",
            "--export",
            "pytorch-csv",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    assert!(o.stderr.contains("chosen: 1f1b"), "{}", o.stderr);
    let csv = o.stdout.clone();
    assert!(!csv.contains("chosen"), "{csv}");
    std::fs::write(dir.path().join("s.csv"), &csv).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--schedule-csv",
            "s.csv",
            "--costs",
            "f=1,b=1,w=1",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}\n{csv}", o.stderr);
}

/// A reader that stops early (`flatpipe schedule --format json | head -1`) ends the command
/// quietly with exit 0, not a panic (exit 101) on the closed pipe.
#[test]
fn closed_stdout_is_not_a_panic() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    // Far more than a pipe's 64 KiB buffer.
    let mut child = Command::new(BIN)
        .args([
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "8",
            "--microbatches",
            "2048",
            "--format",
            "json",
        ])
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with('{'), "{first}");
    // The read end is dropped here: the rest of the output meets a closed pipe.
    let out = Run::from(child.wait_with_output().unwrap());
    let err = &out.stderr;
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
}

/// On a terminal, work longer than a second shows a progress bar on stderr; into a pipe, no
/// bar (no carriage returns, no escape codes) but plain progress lines.
/// The terminal is a pseudo-terminal from util-linux's `script` (on every Debian machine);
/// where `script` is missing the test says so and returns.
#[test]
fn progress_bars_show_on_a_terminal_only() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = format!("{BIN} simulate --steps 20000 --gantt none");
    let Ok(o) = std::process::Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .current_dir(dir.path())
        .output()
    else {
        eprintln!("skipped: util-linux `script` (a pseudo-terminal) is not installed");
        return;
    };
    let tty = String::from_utf8_lossy(&o.stdout);
    assert!(
        tty.contains("/20000 steps"),
        "no progress bar on the terminal: {tty}"
    );
    let piped = flatpipe(
        dir.path(),
        &["simulate", "--steps", "20000", "--gantt", "none"],
    );
    assert!(piped.status.success());
    let e = &piped.stderr;
    assert!(!e.contains('\r') && !e.contains("\x1b["), "{e}");
    assert!(
        e.lines()
            .any(|l| l.starts_with("progress: ") && l.contains("/20000 steps at ")),
        "{e}"
    );
}

/// The README's first two outputs are what `plan` and `simulate` print on the embedded
/// defaults, line for line (the chart lines aside): plain columns a user can copy, no box
/// borders (the commands drew them, the README did not).
#[test]
fn the_readme_shows_what_plan_and_simulate_print() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let mut blocks = readme.split("```text\n").skip(1).map(|b| {
        b.split("\n```")
            .next()
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with("Gantt chart"))
            .map(|l| l.trim_end().to_string())
            .collect::<Vec<_>>()
    });
    let dir = tempfile::tempdir().unwrap();
    for cmd in ["plan", "simulate"] {
        let want = blocks.next().expect("a text block per command");
        let o = flatpipe(dir.path(), &[cmd, "--gantt", "none"]);
        assert!(o.status.success(), "{cmd}: {}", o.stderr);
        let stdout = &o.stdout;
        assert!(
            !stdout.lines().any(|l| l.ends_with(' ')),
            "{cmd}: trailing spaces"
        );
        let got: Vec<String> = stdout.lines().map(str::to_string).collect();
        assert_eq!(got, want, "{cmd}");
    }
}
