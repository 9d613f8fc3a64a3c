//! Variable-length workloads: policies, capacity, Monte Carlo, accounting.

use flatpipe::profiles::{AnalyticOptions, StepSize, analytic_profile, builtins};
use flatpipe::simulator::batching::policy::{Policy, PolicyParams};
use flatpipe::simulator::run::plan::even_split;
use flatpipe::simulator::run::{
    config::{Capacity, RunConfig, ScheduleSource},
    montecarlo::{self, Quantiles},
};
use flatpipe::simulator::{
    Microbatch, ScheduleKind, TableCosts, batching::microbatch::Shape, costs::CostModel,
};

fn profile() -> flatpipe::profiles::Profile {
    let m = builtins::model("llama3.1-8b").unwrap();
    let h = builtins::hardware("h200").unwrap();
    analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap()
}

/// A T = 8192 microbatch of 8 documents of 1,024 tokens has 8 * 1024 * 1025 / 2 = 4,198,400
/// attention pairs, 1025/8193 of one 8,192-token document; the linear terms are identical.
/// Model FLOPs (and so MFU) follow the true pairs.
#[test]
fn flops_follow_true_tokens_and_pairs() {
    let p = profile();
    let docs = Microbatch::flat(vec![1024; 8]);
    let one = Microbatch::flat(vec![8192]);
    assert_eq!(docs.attn_pairs(), 4_198_400);
    let linear = p.model_flops(8192.0, 0.0);
    let attn_docs = p.model_flops(8192.0, docs.attn_pairs() as f64) - linear;
    let attn_one = p.model_flops(8192.0, one.attn_pairs() as f64) - linear;
    assert!((attn_docs / attn_one - 1025.0 / 8193.0).abs() < 1e-12);
    // 12 h L FLOPs per pair (Narayanan et al. 2021): 12 * 4096 * 32.
    assert!((attn_one / one.attn_pairs() as f64 - 12.0 * 4096.0 * 32.0).abs() < 1e-6);
}

/// What a padded microbatch costs is what its [B, S] shape computes: the profile's
/// c0 + c_tok * B*S + c_attn * B*S(S+1)/2, summed by hand over one stage's layers.
#[test]
fn padded_costs_count_padding() {
    let p = profile();
    let stages = even_split(p.layers.len(), 2).unwrap();
    let placement = flatpipe::simulator::Placement::looped(2, 1);
    let mb = Microbatch {
        chunk: None,
        seq_lens: vec![100, 1000],
        shape: Shape::Padded {
            rows: 2,
            seq_len: 1000,
        },
    };
    let costs =
        TableCosts::from_profile(&p, &stages, &placement, std::slice::from_ref(&mb), &[]).unwrap();
    let f = costs.compute_ns(flatpipe::simulator::ComputeAction::new(
        1,
        flatpipe::simulator::ActionKind::F,
        0,
    ));
    let (t, a) = (2000.0, 2.0 * 1000.0 * 1001.0 / 2.0);
    let want: f64 = p.layers[stages[1].clone()]
        .iter()
        .map(|l| l.f.c0_s + l.f.c_tok_s * t + l.f.c_attn_s * a)
        .sum();
    assert_eq!(f, (want * 1e9).round() as u64);
}

fn combos(
    p: u32,
    policies: &[Policy],
    capacities: &[Capacity],
    kind: ScheduleKind,
) -> Vec<RunConfig> {
    let prof = profile();
    let v = kind.stages_per_rank(None).unwrap();
    let stages = even_split(prof.layers.len(), (p * v) as usize).unwrap();
    let mut out = Vec::new();
    for &policy in policies {
        for &capacity in capacities {
            out.push(RunConfig::new(
                ScheduleSource::Kind(kind),
                p,
                v,
                stages.clone(),
                policy,
                capacity,
            ));
        }
    }
    out
}

/// flat-balanced beats padded on both shipped ShareGPT workloads (1F1B, p = 4): padding every
/// sequence to the step's longest computes many times the true tokens and pairs.
#[test]
fn flat_balanced_beats_padded_on_sharegpt() {
    let prof = profile();
    for name in ["sharegpt-v3", "sharegpt-v3-merged"] {
        let w = builtins::workload(name).unwrap();
        let c = combos(
            4,
            &[Policy::Padded, Policy::FlatBalanced],
            &[Capacity::Dynamic],
            ScheduleKind::OneFOneB,
        );
        let mc = montecarlo::run(&prof, &w, 0, StepSize::Seqs(128), 60, &c, &|| {}).unwrap();
        let mean = |i: usize| {
            montecarlo::summarize(&mc.outcomes[i], 4, prof.hardware.peak_flops)
                .step_time_s
                .mean
        };
        assert!(
            mean(1) < mean(0),
            "{name}: flat-balanced {} vs padded {}",
            mean(1),
            mean(0)
        );
        let padded = montecarlo::summarize(&mc.outcomes[0], 4, prof.hardware.peak_flops);
        assert!(
            padded.padding_fraction > 0.5,
            "{name}: {}",
            padded.padding_fraction
        );
    }
}

/// Building each step's schedule for its own microbatch count is never slower than a fixed
/// capacity K on the same steps (empty slots still cost their fixed c0; overflow adds rounds
/// with a flush between them).
#[test]
fn dynamic_capacity_never_slower_than_fixed() {
    let prof = profile();
    let w = builtins::workload("sharegpt-v3-merged").unwrap();
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::GPipe,
        ScheduleKind::ZbH1,
    ] {
        let caps = [
            Capacity::Dynamic,
            Capacity::Fixed(4),
            Capacity::Fixed(8),
            Capacity::Fixed(16),
            Capacity::Fixed(24),
        ];
        let c = combos(4, &[Policy::FlatFfd], &caps, kind);
        let mc = montecarlo::run(&prof, &w, 1, StepSize::Seqs(128), 40, &c, &|| {}).unwrap();
        for (cap, outcomes) in caps.iter().zip(&mc.outcomes).skip(1) {
            for (step, (dynamic, fixed)) in mc.outcomes[0].iter().zip(outcomes).enumerate() {
                assert!(
                    dynamic.step_time_s <= fixed.step_time_s + 1e-9,
                    "{kind} step {step}: dynamic {} > {:?} {}",
                    dynamic.step_time_s,
                    cap,
                    fixed.step_time_s
                );
            }
        }
    }
}

/// A fixed capacity K runs ceil(n / K) rounds; with uniform-size microbatches a round of 1F1B
/// takes (K + p - 1) microbatch times, so two rounds of K = 2 for n = 3 cost twice one round.
#[test]
fn overflow_runs_extra_rounds() {
    let prof = profile();
    let c = combos(
        2,
        &[Policy::FlatFfd],
        &[Capacity::Fixed(2), Capacity::Fixed(3)],
        ScheduleKind::OneFOneB,
    );
    let mbs = vec![Microbatch::flat(vec![512]); 3];
    let (two, _) = montecarlo::simulate_step(&prof, &c[0], &mbs).unwrap();
    let (three, single) = montecarlo::simulate_step(&prof, &c[1], &mbs).unwrap();
    assert_eq!((two.rounds, three.rounds), (2, 1));
    assert!(single.is_some());
    assert!(two.step_time_s > three.step_time_s);
}

#[test]
fn quantiles_by_nearest_rank() {
    let xs: Vec<f64> = (1..=100).map(f64::from).collect();
    let q = Quantiles::of(&xs);
    assert_eq!((q.mean, q.p50, q.p90, q.p99), (50.5, 50.0, 90.0, 99.0));
    let q = Quantiles::of(&[3.0]);
    assert_eq!((q.p50, q.p99), (3.0, 3.0));
}

/// The same seed gives the same steps whatever the thread count.
#[test]
fn monte_carlo_is_deterministic() {
    let prof = profile();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let c = combos(
        4,
        &[Policy::FlatBalanced, Policy::Packed],
        &[Capacity::Dynamic],
        ScheduleKind::ZbV,
    );
    let run = |threads| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| montecarlo::run(&prof, &w, 9, StepSize::Seqs(64), 30, &c, &|| {}).unwrap())
    };
    assert_eq!(run(1).outcomes, run(2).outcomes);
}

/// A sequence longer than the token budget is counted once per step, however many flat
/// policies and data-parallel degrees the comparison holds (it was counted once per policy and
/// per dp degree: a comparison of two flat policies over dp 1 and 2 reported it four times).
#[test]
fn oversize_sequences_counted_once_per_step() {
    let prof = profile();
    let w = builtins::workload("sharegpt-v3-merged").unwrap();
    let budget = 2048;
    let steps = 5;
    let size = StepSize::Seqs(64);
    let mut c = combos(
        2,
        &[Policy::FlatFfd, Policy::FlatBalanced],
        &[Capacity::Dynamic],
        ScheduleKind::OneFOneB,
    );
    for mut extra in c.clone() {
        extra.dp = 2;
        c.push(extra);
    }
    for config in &mut c {
        config.params = PolicyParams {
            token_budget: budget,
            ..PolicyParams::default()
        };
    }
    let mc = montecarlo::run(&prof, &w, 7, size, steps, &c, &|| {}).unwrap();
    let want: usize = (0..steps)
        .map(|i| {
            w.sample_step(7, i as u64, size)
                .iter()
                .filter(|&&l| l as u64 > budget)
                .count()
        })
        .sum();
    assert!(want > 0, "the sample has no sequence over {budget} tokens");
    assert_eq!(mc.oversize_sequences, want);
}

/// Forward-only work keeps a frozen copy of each rank's stages (a reference or teacher model)
/// resident for the whole step: a rank's memory with it is at least its memory without it plus
/// those weights (they were compared with, not added to, the rank's other memory).
#[test]
fn frozen_forward_only_weights_add_to_a_ranks_memory() {
    let prof = profile();
    let mut c = combos(
        2,
        &[Policy::FlatFfd],
        &[Capacity::Dynamic],
        ScheduleKind::OneFOneB,
    );
    let mbs = vec![Microbatch::flat(vec![2048]); 4];
    let (without, _) = montecarlo::simulate_step(&prof, &c[0], &mbs).unwrap();
    c[0].forward_only = Some(flatpipe::simulator::run::config::ForwardOnlySpec {
        microbatches: None,
        mode: flatpipe::simulator::schedules::forward_only::FoMode::Fused,
        loss_dependency: false,
    });
    let (with, _) = montecarlo::simulate_step(&prof, &c[0], &mbs).unwrap();
    for (r, stages) in c[0].stages.iter().enumerate() {
        let frozen: f64 = prof.layers[stages.clone()]
            .iter()
            .map(|l| l.param_bytes as f64)
            .sum();
        assert!(frozen > 0.0);
        assert!(
            with.rank_memory_bytes[r] >= without.rank_memory_bytes[r] + frozen - 1.0,
            "rank {r}: {} with forward-only work, {} without, {frozen} of frozen weights",
            with.rank_memory_bytes[r],
            without.rank_memory_bytes[r]
        );
    }
}
