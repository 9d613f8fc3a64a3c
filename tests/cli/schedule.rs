//! `flatpipe schedule`: the action grid and PyTorch's schedule CSV.

use crate::cli::common::{flatpipe, flatpipe_json};

#[test]
fn schedule_command_prints_the_grid_and_writes_csv() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "3",
            "-o",
            "order.csv",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
    // 1F1B, p = 2, m = 3 by hand: rank 0 warms up with one forward.
    assert!(out.contains("rank  0: 0F0 0F1 0B0 0F2 0B1 0B2"), "{out}");
    assert!(out.contains("rank  1: 1F0 1B0 1F1 1B1 1F2 1B2"), "{out}");
    let csv = std::fs::read_to_string(dir.path().join("order.csv")).unwrap();
    assert_eq!(csv, "0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n");
    // The CSV simulates like the generated schedule: (m + p - 1)(f + b + w) = 4 * 3.
    let v = flatpipe_json(
        dir.path(),
        &[
            "simulate",
            "--schedule-csv",
            "order.csv",
            "--costs",
            "f=1,b=1,w=1",
            "--format",
            "json",
        ],
    );
    assert_eq!(v[0]["makespan_s"], 12.0);
    assert_eq!(v[0]["microbatches"], 3);
    // A CSV with a profile: the step is cut into the file's microbatch count.
    let v = flatpipe_json(
        dir.path(),
        &[
            "simulate",
            "--schedule-csv",
            "order.csv",
            "--format",
            "json",
        ],
    );
    assert_eq!(v[0]["microbatches"], 3);
    assert!(v[0]["ranks"][0]["static_bytes"].as_f64().unwrap() > 1e9);
}

#[test]
fn schedule_csv_writes_forward_only_actions_only_with_fo_extension() {
    let dir = tempfile::tempdir().unwrap();
    // Fo is refused in PyTorch's CSV unless asked for.
    let o = flatpipe(
        dir.path(),
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--fo-microbatches",
            "2",
            "-o",
            "s.csv",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("--fo-extension"), "{}", o.stderr);
    let o = flatpipe(
        dir.path(),
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--fo-microbatches",
            "2",
            "--fo-extension",
            "-o",
            "s.csv",
        ],
    );
    assert!(o.status.success());
    assert!(
        std::fs::read_to_string(dir.path().join("s.csv"))
            .unwrap()
            .contains("1Fo1")
    );
}
