//! `flatpipe drift`: runs that drift, planned once against re-planned each step.

use super::common::{flatpipe, flatpipe_json};
use serde_json::Value;

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().unwrap_or(f64::NAN))
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Stragglers that stay (a fail-slow of a million steps on average, 1.5x, onset 2% per GPU
/// and step) on pp 4 x dp 4: a slowed rank only adds to a plan's replay (every cost at least
/// the profile's), so the plan made once is never faster than the ideal step; re-planning
/// moves work off the slowed replicas once its estimate has seen them, so it is faster on
/// average, and the plan made knowing the true speeds faster still.
#[test]
fn drift_stragglers_replanning_beats_the_plan_made_once() {
    let dir = tempfile::tempdir().unwrap();
    let args = "drift --profile llama3.1-8b@h100 --pp 4 --dp 4 --steps 12 --token-budget 8192 \
                --stragglers --straggler-onset 0.02 --straggler-factor 1.5:1.5 \
                --straggler-steps 1000000 --seed 3 --format json";
    let doc = flatpipe_json(dir.path(), &args.split_whitespace().collect::<Vec<_>>());
    let (ideal, fixed) = (floats(&doc["ideal_s"]), floats(&doc["fixed_s"]));
    let (replanned, oracle) = (floats(&doc["replanned_s"]), floats(&doc["oracle_s"]));
    assert_eq!(ideal.len(), 12);
    for t in 0..12 {
        assert!(fixed[t] >= ideal[t] * (1.0 - 1e-12), "step {t}");
    }
    assert!(mean(&replanned) < mean(&fixed), "{replanned:?} {fixed:?}");
    assert!(mean(&oracle) < mean(&replanned));
    assert_eq!(doc["mean_s"]["fixed"].as_f64().unwrap(), mean(&fixed));
    assert_eq!(doc["run"]["gpus"], 16);
}

/// Growing lengths: the re-planned step is, step by step, the fastest budget that fits.
#[test]
fn drift_grow_replans_the_fastest_budget_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let doc = flatpipe_json(
        dir.path(),
        &[
            "drift",
            "--profile",
            "llama3.1-8b@h200",
            "--pp",
            "4",
            "--steps",
            "6",
            "--grow",
            "2",
            "--budgets",
            "4096,16384,65536",
            "--format",
            "json",
        ],
    );
    let replanned = floats(&doc["replanned_s"]);
    let arms = doc["budgets"].as_array().unwrap();
    assert_eq!(arms.len(), 3);
    for (t, r) in replanned.iter().enumerate() {
        let best = arms
            .iter()
            .filter(|a| a["fits"][t].as_bool().unwrap())
            .map(|a| a["step_s"][t].as_f64().unwrap())
            .fold(f64::INFINITY, f64::min);
        assert_eq!(*r, best, "step {t}");
    }
}

#[test]
fn drift_refuses_bad_input_with_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let run = flatpipe(dir.path(), &["drift", "--grow", "0"]);
    assert!(!run.status.success());
    assert!(run.stderr.contains("--grow 0 is invalid"), "{}", run.stderr);
    let run = flatpipe(
        dir.path(),
        &["drift", "--stragglers", "--straggler-factor", "0.5:1"],
    );
    assert!(run.stderr.contains("--straggler-factor"), "{}", run.stderr);
    let run = flatpipe(dir.path(), &["drift"]);
    assert!(!run.status.success());
    assert!(
        run.stderr.contains("--grow") && run.stderr.contains("--stragglers"),
        "{}",
        run.stderr
    );
    // A step that fits no schedule names the longest sequence and the way out.
    let run = flatpipe(
        dir.path(),
        &"drift --stragglers --steps 2 --memory-limit 41GiB --token-budget 65536"
            .split_whitespace()
            .collect::<Vec<_>>(),
    );
    assert!(
        run.stderr.contains("longest sequence has"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("--max-len"), "{}", run.stderr);
    let run = flatpipe(
        dir.path(),
        &["drift", "--stragglers", "--forgetting", "1.5"],
    );
    assert!(
        run.stderr.contains("--forgetting 1.5 is invalid"),
        "{}",
        run.stderr
    );
}
