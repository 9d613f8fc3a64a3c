//! `flatpipe execute`'s refusals: what the executor does not run, and steps too small for it.

use crate::cli::common::{flatpipe, repo_file};

#[test]
fn execute_refuses_too_many_stages_or_microbatches_and_padded_plans() {
    let dir = tempfile::tempdir().unwrap();
    // tiny has 10 layers: 12 stages cannot each hold one.
    let o = flatpipe(dir.path(), &["execute", "--pp", "12", "--steps", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("12"), "{}", o.stderr);
    // More microbatches than sequences.
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--microbatches",
            "9",
            "--seqs-per-step",
            "4",
            "--steps",
            "1",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("--microbatches"), "{}", o.stderr);
    // A padded plan: the executor runs flat microbatches only.
    let plan = std::fs::read_to_string(repo_file("examples/cpu-tiny/plan.yaml"))
        .unwrap()
        .replace("policy: flat-ffd", "policy: padded");
    std::fs::write(dir.path().join("p.yaml"), plan).unwrap();
    let o = flatpipe(dir.path(), &["execute", "--plan", "p.yaml", "--steps", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("flat"), "{}", o.stderr);
}

/// The executor's replicas hold full state: a plan sharded over dp > 1 replicas is refused with
/// the reason (sharding is priced and planned, not executed) and nothing runs.
#[test]
fn execute_refuses_a_sharded_plan() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo_file("examples/cpu-tiny/plan.yaml")).unwrap();
    let sharded = text
        .replace("dp: 1\n", "dp: 2\nsharding: fsdp\n")
        .replace("predicted:", "predicted_unused:");
    let sharded = sharded
        .split("predicted_unused:")
        .next()
        .unwrap()
        .to_string();
    std::fs::write(dir.path().join("s.yaml"), sharded).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute", "--plan", "s.yaml", "--steps", "1", "--gantt", "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    let err = &o.stderr;
    assert!(
        err.contains("sharding fsdp") && err.contains("not executed"),
        "{err}"
    );
}

/// Too few sequences for the replicas is said as such.
#[test]
fn too_few_sequences_for_the_replicas_is_said_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--workload",
            "tiny-chat",
            "--dp",
            "4",
            "--seqs-per-step",
            "2",
            "--steps",
            "1",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = &o.stderr;
    assert!(err.contains("too few for dp = 4"), "{err}");
}

/// `--fit-profile` scales a profile measured on the backend by the steps' measured over
/// predicted time: without such a profile there is no prediction, and it is refused before
/// any step runs, nothing written.
#[test]
fn fit_profile_without_a_measured_profile_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &["execute", "--steps", "1", "--fit-profile", "fitted.yaml"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(
        o.stderr.contains("--fit-profile fitted.yaml") && o.stderr.contains("flatpipe profile"),
        "{}",
        o.stderr
    );
    assert!(!dir.path().join("fitted.yaml").exists());
}

/// A forgetting factor outside (0, 1] is refused by name before any step runs.
#[test]
fn a_forgetting_factor_outside_zero_to_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["0", "1.5", "-0.2"] {
        let o = flatpipe(
            dir.path(),
            &["execute", "--steps", "1", "--forgetting", bad],
        );
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", o.stderr);
        assert!(
            o.stderr.contains("--forgetting") && o.stderr.contains("(0, 1]"),
            "{}",
            o.stderr
        );
    }
}
