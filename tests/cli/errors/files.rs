//! Refusals of bad input and output files: exit 2, naming the file and the field, before any
//! output is written.

use crate::cli::common::{PLAN, flatpipe, flatpipe_json};

// Input files.

#[test]
fn malformed_files_name_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("m.yaml"),
        "name: x\ndtype: bf16\nlayers: [\n",
    )
    .unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--model", "m.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("m.yaml: invalid YAML"), "{}", o.stderr);
    std::fs::write(dir.path().join("h.yaml"), "name: x\nmemory_bytes: 1\npeak_flops: -5\nhbm_bytes_per_s: 1\ngpus_per_node: 8\nintra_node: {alpha_s: 0, beta_bytes_per_s: 1}\ninter_node: {alpha_s: 0, beta_bytes_per_s: 1}\n").unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--hardware", "h.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("h.yaml: field `peak_flops` = -5"),
        "{}",
        o.stderr
    );
    std::fs::write(dir.path().join("k.yaml"), "name: x\nmemory_bytes: 1\npeak_flops: 1\nhbm_bytes_per_s: 1\ngpus_per_node: 8\nintra_node: {alpha_s: 0, beta_bytes_per_s: 1}\ninter_node: {alpha_s: 0, beta_bytes_per_s: 1}\ncollective_interference: -0.5\n").unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--hardware", "k.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr
            .contains("k.yaml: field `collective_interference` = -0.5")
            && o.stderr.contains("0 to 10"),
        "{}",
        o.stderr
    );
    std::fs::write(dir.path().join("w.csv"), "tokens\n100\n-3\n").unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--workload", "w.csv"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("w.csv") && o.stderr.contains("row 3"),
        "{}",
        o.stderr
    );
}

/// A model of 100,000,000 decoder layers (a typo) is refused when read, naming the field and
/// the most it may be (4,096 layers in all); it grew to 24 GB before anything refused it.
#[test]
fn a_model_with_absurdly_many_layers_is_refused_when_read() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("deep.yaml"),
        "name: deep\ndtype: bf16\nlayers:\n  - {kind: embedding, vocab: 1000, hidden: 64}\n  \
         - {kind: decoder, count: 100000000, hidden: 64, ffn: 256, heads: 4, kv_heads: 4}\n  \
         - {kind: head, vocab: 1000, hidden: 64}\n",
    )
    .unwrap();
    let o = flatpipe(
        dir.path(),
        &["simulate", "--model", "deep.yaml", "--gantt", "none"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(
        o.stderr
            .contains("deep.yaml: field `layers[1].count` = 100000000")
            && o.stderr.contains("at most 4095 here: 4096 layers in all"),
        "{}",
        o.stderr
    );
}

/// A workload's format is read from its text, not its name: a CSV called `.txt` is read as a
/// CSV (its error names the header, not a dump of the file as YAML), a `tokens` column works
/// under any name, and an empty file (`/dev/null`, which used to be "no such file") says it
/// is empty.
#[test]
fn a_workload_is_read_by_its_content() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("w.txt"), "a,b\n1,2\n").unwrap();
    let o = flatpipe(
        dir.path(),
        &["simulate", "--workload", "w.txt", "--gantt", "none"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr
            .contains("w.txt: invalid CSV: no `tokens` column (header: a,b)"),
        "{}",
        o.stderr
    );
    std::fs::write(dir.path().join("t.txt"), "tokens\n100\n200\n").unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--workload",
            "t.txt",
            "--steps",
            "2",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    let o = flatpipe(
        dir.path(),
        &["simulate", "--workload", "/dev/null", "--gantt", "none"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("/dev/null") && o.stderr.contains("empty"),
        "{}",
        o.stderr
    );
}

/// Absurd sequence lengths are refused at the workload, naming the field and the range (a
/// 4e9-token sequence used to run, wrapping the attention-pair sums and printing nonsense
/// MFU); 2^24 tokens is the cap.
#[test]
fn absurd_sequence_lengths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("huge.yaml"),
        "name: huge\nlengths:\n  kind: fixed\n  tokens: 4000000000\nseqs_per_step: 4\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("huge.csv"), "tokens\n12\n16777217\n").unwrap();
    for (file, field) in [("huge.yaml", "lengths.tokens"), ("huge.csv", "row 3")] {
        let o = flatpipe(
            dir.path(),
            &[
                "simulate",
                "--workload",
                file,
                "--steps",
                "2",
                "--gantt",
                "none",
            ],
        );
        assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
        let err = &o.stderr;
        assert!(err.contains(field) && err.contains("16777216"), "{err}");
    }
}

#[test]
fn plan_files_with_a_layer_gap_or_a_conflicting_flag_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("plan.yaml"), PLAN).unwrap();
    // A gap in the layer ranges.
    std::fs::write(
        dir.path().join("bad.yaml"),
        PLAN.replace("{start: 18, end: 34}", "{start: 19, end: 34}"),
    )
    .unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--plan", "bad.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("bad.yaml: stages[1]") && o.stderr.contains("must start at 18"),
        "{}",
        o.stderr
    );
    // --plan excludes the options it sets.
    let o = flatpipe(
        dir.path(),
        &["simulate", "--plan", "plan.yaml", "--pp", "4"],
    );
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn v_schedules_refuse_loop_placement_in_plans() {
    let dir = tempfile::tempdir().unwrap();
    let plan = PLAN.replace("schedule: 1f1b", "schedule: zb-v").replace(
        "  - {start: 0, end: 18}\n  - {start: 18, end: 34}\n",
        "  - {start: 0, end: 9}\n  - {start: 9, end: 18}\n  - {start: 18, end: 26}\n  - {start: 26, end: 34}\n",
    );
    std::fs::write(dir.path().join("v.yaml"), &plan).unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--plan", "v.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("placement") && o.stderr.contains("zb-v uses v placement"),
        "{}",
        o.stderr
    );
    std::fs::write(
        dir.path().join("v.yaml"),
        plan.replace("placement: loop", "placement: v"),
    )
    .unwrap();
    let v = flatpipe_json(
        dir.path(),
        &["simulate", "--plan", "v.yaml", "--format", "json"],
    );
    assert_eq!(v[0]["vpp"], 2);
    // --vpp other than 2 for a V schedule is refused.
    let o = flatpipe(
        dir.path(),
        &["simulate", "--schedule", "dualpipev", "--vpp", "3"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("exactly 2 stages per rank"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_broken_schedule_csv_names_the_row_and_cell() {
    let dir = tempfile::tempdir().unwrap();
    // A broken file names the row and cell.
    std::fs::write(dir.path().join("bad.csv"), "0F0,0B0\n1F0,1Q0\n").unwrap();
    let o = flatpipe(
        dir.path(),
        &["simulate", "--schedule-csv", "bad.csv", "--costs", "f=1"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("row 2, cell 2"), "{}", o.stderr);
}

#[test]
fn import_trace_refuses_a_file_without_pp_annotations() {
    let dir = tempfile::tempdir().unwrap();
    // Not a trace: a clear error naming the file.
    std::fs::write(dir.path().join("bad.json"), "{\"traceEvents\": []}").unwrap();
    let o = flatpipe(dir.path(), &["import-trace", "bad.json"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("bad.json") && o.stderr.contains("PP:"),
        "{}",
        o.stderr
    );
}

// Output files.

/// A bad output path is refused before the work starts (no plan half-written, exit 2 naming
/// the path).
#[test]
fn a_bad_output_path_is_refused_before_the_work_starts() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--gantt",
            "missing/g.png",
            "-o",
            "plan.yaml",
            "--steps",
            "4",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("missing/g.png"), "{}", o.stderr);
    assert!(!dir.path().join("plan.yaml").exists());
    assert!(o.stdout.is_empty());
}

/// A bad chart format is found before the work: nothing is written (plan used to write the plan
/// and its exports, then fail on the chart's extension).
#[test]
fn a_bad_chart_format_fails_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "-o",
            "p.yaml",
            "--export",
            "torchtitan",
            "--gantt",
            "g.jpg",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("jpg"), "{}", o.stderr);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--gantt",
            "g.png",
            "--memory",
            "m.csv",
            "--histogram",
            "noext",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    let o = flatpipe(dir.path(), &["plan", "--vpp", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

/// A chart that cannot be written (a full device) no longer discards the finished run: the
/// table is printed, then the error, and the exit status says it failed.
#[cfg(target_os = "linux")]
#[test]
fn a_chart_that_cannot_be_written_keeps_the_table() {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink("/dev/full", dir.path().join("full.png")).unwrap();
    let o = flatpipe(
        dir.path(),
        &["simulate", "--costs", "f=1,b=1,w=1", "--gantt", "full.png"],
    );
    assert_ne!(o.status.code(), Some(0), "{}", o.stderr);
    assert!(
        o.stdout.lines().any(|l| l.starts_with("1f1b ")),
        "{}",
        o.stdout
    );
    assert!(o.stderr.contains("No space left"), "{}", o.stderr);
}
