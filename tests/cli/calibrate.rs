//! `flatpipe calibrate`: profile, predict and measure in one command.

use crate::cli::common::{SMALL_MODEL, flatpipe};

#[test]
fn calibrate_compares_predicted_and_measured_makespans_per_schedule() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("small.yaml"), SMALL_MODEL).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "calibrate",
            "--model",
            "small.yaml",
            "--quick",
            "--pp",
            "2",
            "--schedule",
            "1f1b,zb-v",
            "--steps",
            "2",
            "--format",
            "json",
        ],
    );
    let v = o.json();
    let rows = v["schedules"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        let (p, m) = (
            r["predicted_makespan_s"].as_f64().unwrap(),
            r["measured_makespan_s"].as_f64().unwrap(),
        );
        assert!(p > 0.0 && m > 0.0);
        assert!((r["rel_error"].as_f64().unwrap() - (p - m) / m).abs() < 1e-9);
        assert_eq!(r["measured_bubble_per_rank"].as_array().unwrap().len(), 2);
    }
    assert_eq!(rows[1]["schedule"], "zb-v");
    assert!(v["median_abs_rel_error"].as_f64().unwrap() >= 0.0);
}
