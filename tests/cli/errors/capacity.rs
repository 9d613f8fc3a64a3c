//! Refusals of work that cannot fit: in memory, on the cluster, or on the host, said up front
//! with the numbers.

use crate::cli::common::{flatpipe, repo_file};

// Too large to hold in memory.

/// A request whose schedules cannot fit in memory is refused before anything is allocated,
/// with the estimate: 4,000,000,000 microbatches on 4 ranks are 1.6e10 (stage, microbatch)
/// pairs for 1F1B alone, terabytes at ~1.2 kB each.
#[test]
fn schedules_too_large_for_memory_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "4000000000",
        ][..],
        &[
            "simulate",
            "--costs",
            "f=1,b=2",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "4000000000",
        ][..],
        &[
            "simulate",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "4000000000",
        ][..],
    ] {
        let o = flatpipe(dir.path(), args);
        let err = &o.stderr;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("too large") && err.contains("16000000000 (stage, microbatch) pairs"),
            "{args:?}: {err}"
        );
    }
}

/// A Monte Carlo or plan search too large for memory is refused before it samples anything,
/// with an estimate no smaller than a closed-form floor: 4e9 steps of 9 schedules on 4 ranks
/// keep at least 4e9 x 9 x 4 x 8 bytes of per-rank memory figures (1,073 GiB); the planner
/// keeps 4e9 sampled steps of 128 four-byte lengths (1,907 GiB); one step of 4e9 sequences
/// holds at least its 4e9 four-byte lengths (14.9 GiB); 1e9 forward-only microbatches on 4
/// ranks are at least 4e9 (stage, microbatch) pairs of one byte (3.7 GiB). Each ran until
/// killed before.
#[test]
fn monte_carlo_runs_too_large_for_memory_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    for (args, floor_gib) in [
        (
            &[
                "simulate",
                "--fo-microbatches",
                "1000000000",
                "--gantt",
                "none",
            ][..],
            4e9 / 2f64.powi(30),
        ),
        (
            &["simulate", "--steps", "4000000000", "--gantt", "none"][..],
            4e9 * 9.0 * 4.0 * 8.0 / 2f64.powi(30),
        ),
        (
            &["plan", "--steps", "4000000000", "--gantt", "none"][..],
            4e9 * 128.0 * 4.0 / 2f64.powi(30),
        ),
        (
            &[
                "simulate",
                "--seqs-per-step",
                "4000000000",
                "--steps",
                "1",
                "--gantt",
                "none",
            ][..],
            4e9 * 4.0 / 2f64.powi(30),
        ),
    ] {
        let o = flatpipe(dir.path(), args);
        let err = &o.stderr;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        let gib: f64 = err
            .split("estimated to hold ")
            .nth(1)
            .and_then(|t| t.split(" GiB").next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{args:?}: {err}"));
        assert!(
            err.contains("too large") && gib >= floor_gib,
            "{args:?}: {err}"
        );
    }
}

// Does not fit the device.

#[test]
fn zb_auto_with_too_little_memory_is_refused_with_the_numbers() {
    let dir = tempfile::tempdir().unwrap();
    // Too little memory: a clear error with the numbers.
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=1,w=1,comm=0",
            "--schedule",
            "zb-auto",
            "--max-activation-units",
            "0.5",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("0.50 units") && o.stderr.contains("at least 1.00 units"),
        "{}",
        o.stderr
    );
}

#[test]
fn plan_that_cannot_fit_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--steps",
            "2",
            "--memory-limit",
            "10GiB",
            "--schedule",
            "1f1b",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let e = &o.stderr;
    assert!(
        e.contains("no plan fits") && e.contains("GiB") && e.contains("limit 10.0 GiB"),
        "{e}"
    );
    let o = flatpipe(dir.path(), &["plan", "--memory-limit", "lots"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("--memory-limit `lots` is invalid"),
        "{}",
        o.stderr
    );
    let o = flatpipe(dir.path(), &["plan", "--ranks", "8", "--pp", "3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("a divisor of ranks (8)"), "{}", o.stderr);
}

/// When no plan fits because the static state alone cannot fit even over the most pipeline
/// ranks, that leads the message, with the closed form: Llama-3.1-70B's parameters (counted
/// from the architecture) x 16 bytes / 2 ranks.
#[test]
fn no_plan_fits_leads_with_the_static_state() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--model",
            "llama3.1-70b",
            "--ranks",
            "2",
            "--gantt",
            "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = &o.stderr;
    let m = flatpipe::profiles::builtins::model("llama3.1-70b").unwrap();
    let params: f64 = m.layers().iter().map(|l| l.param_count() as f64).sum();
    // The least any layout holds: no pipeline, FSDP over both ranks, 16/2 bytes per parameter
    // (fp32 shards of weights, gradients and AdamW's two moments).
    let want = format!("{:.1} GiB", params * 16.0 / 2.0 / 2f64.powi(30));
    assert!(
        err.contains("no plan fits: parameters, gradients and optimizer state alone need at least")
            && err.contains(&want),
        "{want}: {err}"
    );
}

/// A hardware file with a cluster size refuses a run of more GPUs than it has, in `plan` and in
/// `simulate`, with both numbers.
#[test]
fn more_gpus_than_the_cluster_has_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hw = std::fs::read_to_string(repo_file("profiles/data/hardware/h200.yaml")).unwrap()
        + "nodes: 2\n";
    std::fs::write(dir.path().join("hw.yaml"), hw).unwrap();
    for args in [
        &[
            "plan",
            "--hardware",
            "hw.yaml",
            "--ranks",
            "32",
            "--gantt",
            "none",
        ][..],
        &[
            "simulate",
            "--hardware",
            "hw.yaml",
            "--tp",
            "8",
            "--pp",
            "2",
            "--dp",
            "2",
            "--gantt",
            "none",
        ][..],
    ] {
        let o = flatpipe(dir.path(), args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = &o.stderr;
        assert!(
            err.contains("32") && err.contains("at most 2 nodes x 8 GPUs = 16"),
            "{args:?}: {err}"
        );
    }
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--hardware",
            "hw.yaml",
            "--ranks",
            "16",
            "--steps",
            "2",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
}

// Does not fit the host.

/// `execute` refuses, before allocating, a model the host cannot hold, with the numbers: a
/// 70.6-billion-parameter model needs 16 bytes per parameter (fp32 weights, gradients, AdamW's
/// two moments) = 1,051 GiB before any activation, more than any test machine has.
#[test]
fn execute_refuses_a_model_the_host_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let o = flatpipe(
        dir.path(),
        &["execute", "--model", "llama3.1-70b", "--steps", "1"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    let err = &o.stderr;
    // Llama-3.1-70B's parameters from its architecture (Meta's config: 80 layers, hidden 8192,
    // FFN 28672, 64 query and 8 KV heads of 128, vocabulary 128256, untied embedding and head).
    let (h, ffn, kv, vocab) = (8192f64, 28672f64, 1024f64, 128256f64);
    let per_layer = h * (h + 2.0 * kv) + h * h + 3.0 * h * ffn + 2.0 * h;
    let params = 2.0 * vocab * h + h + 80.0 * per_layer;
    let state_gib = params * 16.0 / (1u64 << 30) as f64;
    assert!(
        err.contains(&format!("{state_gib:.2} GiB of fp32 weights")),
        "{err}"
    );
    assert!(err.contains("available"), "{err}");
    // Refused before building the stages (which would take minutes and the machine's memory).
    assert!(started.elapsed().as_secs() < 60);
}

#[test]
fn calibrate_refuses_schedules_side_by_side_the_host_cannot_hold() {
    // Llama-3.1-70B on the CPU backend: 70.6 G parameters x 16 bytes of fp32 weights,
    // gradients and AdamW state is 1.1 TB per executor, and `--order interleaved` builds one
    // per schedule before it runs them step by step. Refused before profiling or allocating.
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "calibrate",
            "--model",
            "llama3.1-70b",
            "--schedule",
            "1f1b,zb-v",
            "--quick",
            "--order",
            "interleaved",
        ],
    );
    assert!(!o.status.success());
    let e = &o.stderr;
    assert!(
        e.contains("calibrate of llama3.1-70b over 2 schedules is too large")
            && e.contains("2 executor(s) at once")
            && e.contains("70553706496 parameters x 16 bytes")
            && e.contains("--schedule"),
        "{e}"
    );
}
