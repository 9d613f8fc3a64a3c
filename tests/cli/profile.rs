//! `flatpipe profile`: a measured profile, and what it drives.

use crate::cli::common::{SMALL_MODEL, flatpipe};

#[test]
fn a_profile_written_by_the_profiler_drives_simulate_plan_and_execute() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("small.yaml"), SMALL_MODEL).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "-v",
            "profile",
            "--model",
            "small.yaml",
            "--quick",
            "-o",
            "p.yaml",
            "--format",
            "json",
        ],
    );
    let v = o.json();
    // Not on a terminal (the bar draws nothing there): one progress line per measurement, 33 of
    // them: 3 layer kinds x 5 token counts x 2 compositions, the link, the optimizer, and the
    // GEMMs split 2 ways (2 divides the 2 key/value heads, 4 does not).
    let err = &o.stderr;
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("profiling "))
        .collect();
    assert_eq!(lines.len(), 33, "{err}");
    // With -v, each grid point's medians: 3 kinds x 5 token counts x 2 compositions.
    assert_eq!(err.matches("ms per layer").count(), 30, "{err}");
    for (k, l) in lines.iter().enumerate() {
        assert!(l.starts_with(&format!("profiling {}/33 at ", k + 1)), "{l}");
    }
    // F, I, W, Fo for each of the three layer kinds, all non-negative, W without attention.
    let fits = v["fits"].as_array().unwrap();
    assert_eq!(fits.len(), 12);
    for f in fits {
        for k in ["c0_s", "c_tok_s", "c_attn_s"] {
            assert!(f[k].as_f64().unwrap() >= 0.0, "{f}");
        }
        if f["phase"] == "W" {
            assert_eq!(f["c_attn_s"].as_f64().unwrap(), 0.0);
        }
    }
    let text = std::fs::read_to_string(dir.path().join("p.yaml")).unwrap();
    let p = flatpipe::profiles::Profile::from_yaml(&text, "p.yaml").unwrap();
    assert_eq!(
        p.provenance.source,
        flatpipe::profiles::ProfileSource::Measured
    );
    assert!(
        p.provenance.device.starts_with("cpu"),
        "{}",
        p.provenance.device
    );
    assert!(p.provenance.date.is_some() && p.provenance.grid.is_some());
    assert_eq!(p.provenance.fits.len(), 12);
    assert_eq!(p.layers.len(), 6);
    // The GEMMs split the ways tensor parallelism may split them: 4 heads and 2 key-value
    // heads allow tp = 2 only; measured at the grid's largest T, and applied by the split.
    let grid = flatpipe::executor::profiler::ProfileConfig::quick().tokens;
    assert_eq!(p.gemm_split.len(), 1, "{:?}", p.gemm_split);
    let g = p.gemm_split[0];
    assert_eq!((g.tp, g.tokens), (2, *grid.iter().max().unwrap() as u64));
    assert!(g.relative_throughput > 0.0 && g.relative_throughput <= 2.0);
    let tp2 = p.tensor_parallel(2, true).unwrap();
    assert!(
        tp2.provenance
            .notes
            .contains("of the unsplit throughput (measured")
    );
    // FLOPs (and MFU) come from true tokens and pairs: the model's counts, not the timings.
    let small = flatpipe::profiles::ModelSpec::from_yaml(SMALL_MODEL, "small").unwrap();
    let analytic = flatpipe::profiles::analytic_profile(
        &small,
        &flatpipe::profiles::builtins::hardware("cpu").unwrap(),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(
        p.model_flops(1000.0, 5000.0),
        analytic.model_flops(1000.0, 5000.0)
    );
    // It drives simulate and plan ...
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--profile",
            "p.yaml",
            "--workload",
            "tiny-chat",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--token-budget",
            "512",
            "--format",
            "json",
        ],
    );
    let s = o.json();
    assert!(s[0]["step_time_s"]["mean"].as_f64().unwrap() > 0.0, "{s}");
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--profile",
            "p.yaml",
            "--workload",
            "tiny-chat",
            "--ranks",
            "2",
            "--recompute",
            "none",
            "--steps",
            "4",
            "--token-budgets",
            "512",
            // The executor runs unsharded replicas: plan what it runs.
            "--sharding",
            "ddp",
            "-o",
            "plan.yaml",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    // ... and execute predicts with it (measured on this backend): the plan names the profile,
    // whose model is a file, so give the architecture with the plan's model field.
    let plan = std::fs::read_to_string(dir.path().join("plan.yaml"))
        .unwrap()
        .replace("profile: p.yaml", "profile: p.yaml\nmodel: small.yaml");
    std::fs::write(dir.path().join("plan.yaml"), plan).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--plan",
            "plan.yaml",
            "--steps",
            "2",
            "--seqs-per-step",
            "8",
            "--format",
            "json",
        ],
    );
    let v = o.json();
    assert!(v["median_abs_rel_error"].as_f64().is_some(), "{v}");
    // The profile was measured with one thread busy; the plan runs two ranks at once where
    // there are two cores: said before the prediction is trusted.
    assert_eq!(p.provenance.concurrency, Some(1));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let warned = v["profile_warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|w| {
            w.as_str()
                .unwrap_or_default()
                .contains("measured with 1 thread(s) busy at once, this run keeps 2 busy")
        });
    assert_eq!(warned, cores >= 2, "{v}");
}

/// `profile` on the CPU backend measures the optimizer on the whole model (16 bytes per
/// parameter of fp32 state): Llama-3.1-405B needs about 6.3 TB, refused before anything is
/// allocated (it allocated for minutes before), naming what it needs and what the machine has;
/// no file is written.
#[test]
fn profile_refuses_a_model_the_host_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "profile",
            "--model",
            "llama3.1-405b",
            "--quick",
            "-o",
            "p.yaml",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    let e = &o.stderr;
    assert!(
        e.contains("available") && e.contains("analytic profile"),
        "{e}"
    );
    // "... for the optimizer's measurement (N parameters x 16 bytes) ...": N is the model's
    // 405 billion parameters (Meta's published size, within 1%), and the state is 16 N bytes.
    let n: f64 = e
        .split(" parameters x 16 bytes")
        .next()
        .and_then(|head| head.rsplit('(').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{e}"));
    assert!((n / 405e9 - 1.0).abs() < 0.01, "{n}");
    let gib = |after: &str| -> f64 {
        let t = e
            .split(after)
            .nth(1)
            .unwrap_or_else(|| panic!("{after}: {e}"));
        t.split_whitespace().next().unwrap().parse().unwrap()
    };
    let state = gib("GiB: ");
    assert!(
        (state * 1024f64.powi(3) / (16.0 * n) - 1.0).abs() < 1e-3,
        "{state} GiB for {n}"
    );
    assert!(gib("needs at least ") > state);
    assert!(!dir.path().join("p.yaml").exists());
}
