//! `flatpipe import-trace`: a Kineto trace of a pipeline run, read back as a measurement.

use crate::cli::common::{flatpipe, repo_file};

#[test]
fn import_trace_reads_a_hand_written_kineto_trace() {
    // tests/data/pp_trace_1f1b_p2_m3.json: 1F1B, p = 2, m = 3, F = 10 us, B = 20 us, 2 us between
    // ranks, times laid out by hand: rank 0 runs 0F0 0F1 0B0 0F2 0B1 0B2, rank 1 1F0 1B0 1F1 1B1
    // 1F2 1B2; the last op, 0B2, ends at 128 us. Both ranks are busy 90 us: bubble 1 - 90/128.
    // GPU-side annotations are used; the CPU-side copies (other times) are ignored.
    let dir = tempfile::tempdir().unwrap();
    let trace = repo_file("tests/data/pp_trace_1f1b_p2_m3.json");
    let o = flatpipe(
        dir.path(),
        &[
            "import-trace",
            &trace,
            "--gantt",
            "trace.svg",
            "--format",
            "json",
        ],
    );
    let v = o.json();
    assert_eq!(v["ranks"], 2);
    assert_eq!(v["stages"], 2);
    assert_eq!(v["microbatches"], 3);
    assert!((v["measured_makespan_s"].as_f64().unwrap() - 128e-6).abs() < 1e-12);
    for r in v["per_rank"].as_array().unwrap() {
        let b = r["measured_bubble_ratio"].as_f64().unwrap();
        assert!((b - (1.0 - 90.0 / 128.0)).abs() < 1e-9, "{b}");
        assert_eq!(r["actions"], 6);
    }
    assert!(v.get("predicted_makespan_s").is_none());
    assert!(
        std::fs::read_to_string(dir.path().join("trace.svg"))
            .unwrap()
            .contains("imported trace")
    );
    // With a profile: flatpipe's prediction of the schedule the trace ran.
    let o = flatpipe(
        dir.path(),
        &[
            "import-trace",
            &trace,
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--tokens-per-microbatch",
            "256",
            "--format",
            "json",
        ],
    );
    let v = o.json();
    let p = v["predicted_makespan_s"].as_f64().unwrap();
    assert!(p > 0.0);
    let m = v["measured_makespan_s"].as_f64().unwrap();
    assert!((v["rel_error"].as_f64().unwrap() - (p - m) / m).abs() < 1e-9);
    assert!(
        v["per_rank"][0]["predicted_bubble_ratio"]
            .as_f64()
            .is_some()
    );
}

#[test]
fn pytorchs_traces_show_their_comm_lanes_and_posting_order() {
    // torch 2.15's ScheduleInterleaved1F1B (tests/data/traces, scripts/traces/make_traces.py)
    // posts in _add_send_recv's order: flatpipe's ahead lowering of the imported schedule.
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<String> = (0..2)
        .map(|r| {
            repo_file(&format!(
                "tests/data/traces/torch-interleaved-1f1b.rank{r}.json.gz"
            ))
        })
        .collect();
    let o = flatpipe(
        dir.path(),
        &[
            "import-trace",
            &files[0],
            &files[1],
            "--gantt",
            "trace.svg",
            "--format",
            "json",
        ],
    );
    let v = o.json();
    assert_eq!(v["posting_order"], "ahead");
    let svg = std::fs::read_to_string(dir.path().join("trace.svg")).unwrap();
    let texts: Vec<&str> = svg.lines().map(str::trim).collect();
    for name in ["send", "recv", "wait", "FSDP"] {
        assert!(texts.contains(&name), "legend lacks {name}");
    }
    // flatpipe's runtime posts the core's lowered program: the same order.
    let files: Vec<String> = (0..2)
        .map(|r| repo_file(&format!("tests/data/traces/flatpipe-zb-v.rank{r}.json.gz")))
        .collect();
    let v = flatpipe(
        dir.path(),
        &["import-trace", &files[0], &files[1], "--format", "json"],
    )
    .json();
    assert_eq!(v["posting_order"], "ahead");
}
