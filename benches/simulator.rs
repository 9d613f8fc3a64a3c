//! Simulator throughput: build and replay the DAG of one 1F1B step with p = 64, m = 4096
//! (524,288 compute ops and 516,096 transfers), reported as simulated ops per second; and the
//! other costs of a simulated step (every schedule, packing, planned microbatches, sampled
//! steps, zb-auto, chunk ordering).

use criterion::{Criterion, Throughput, criterion_group};
use flatpipe::profiles::{AnalyticOptions, StepSize, analytic_profile, builtins};
use flatpipe::simulator::batching::policy::{Policy, PolicyParams, batch};
use flatpipe::simulator::ir::comm::StreamLayout;
use flatpipe::simulator::ir::lowering::{self, Lowering, RecvPosting};
use flatpipe::simulator::run::plan::even_split;
use flatpipe::simulator::run::{
    config::{Capacity, RunConfig, ScheduleSource},
    montecarlo,
};
use flatpipe::simulator::{
    ScheduleKind, UniformCostSpec, UniformCosts, replay, replay::metrics, replay::summary,
};
use std::hint::black_box;

/// The allocator the `flatpipe` binary runs with (src/main.rs): mimalloc, keeping freed memory,
/// so a replay's buffers are reused instead of faulted in afresh each time (with glibc's
/// allocator ~40% of a p = 64, m = 4096 replay went to page faults).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn bench_1f1b(c: &mut Criterion) {
    let (p, m) = (64u32, 4096u32);
    let costs = UniformCosts::new(
        &UniformCostSpec {
            f: 1.0,
            b: 2.0,
            w: 1.0,
            comm: 0.1,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        },
        1,
    );
    let schedule = ScheduleKind::OneFOneB.generate(p, 1, m).unwrap();
    let t = replay::replay(&schedule, &costs).unwrap();
    let ops = schedule.num_compute_actions() + t.transfers.len();
    assert_eq!(ops, 524_288 + 516_096);
    let mut g = c.benchmark_group("1f1b_p64_m4096");
    g.throughput(Throughput::Elements(ops as u64));
    g.sample_size(20);
    g.bench_function("generate+validate+replay", |b| {
        b.iter(|| {
            let s = ScheduleKind::OneFOneB
                .generate(black_box(p), 1, black_box(m))
                .unwrap();
            s.validate().unwrap();
            replay::replay(&s, &costs).unwrap()
        })
    });
    g.bench_function("replay", |b| {
        b.iter(|| replay::replay(black_box(&schedule), &costs).unwrap())
    });
    g.bench_function("replay without timeline (summary)", |b| {
        b.iter(|| summary::replay_summary(black_box(&schedule), &costs).unwrap())
    });
    let deferred = Lowering {
        posting: RecvPosting::Deferred,
        streams: StreamLayout::PerPeer,
        fsdp: None,
        fsdp_defer_wait: false,
    };
    g.bench_function("lowered replay without timeline (deferred receives)", |b| {
        b.iter(|| summary::lowered_summary(black_box(&schedule), deferred, &costs).unwrap())
    });
    g.bench_function("lowering (deferred receives)", |b| {
        b.iter(|| lowering::lower(black_box(&schedule), deferred).unwrap())
    });
    g.bench_function("replay+metrics", |b| {
        b.iter(|| {
            let t = replay::replay(black_box(&schedule), &costs).unwrap();
            metrics::metrics(&schedule, &costs, &t)
        })
    });
    g.finish();
}

/// Generating, validating and replaying every handcrafted schedule at p = 32, v = 2 (1 where
/// the kind has one stage per rank), m = 256.
fn bench_every_schedule(c: &mut Criterion) {
    let (p, m) = (32u32, 256u32);
    let spec = UniformCostSpec {
        f: 1.0,
        b: 2.0,
        w: 1.0,
        comm: 0.1,
        fb: None,
        fo: None,
        fsdp: Default::default(),
    };
    let mut g = c.benchmark_group("generate+simulate_p32_v2_m256");
    g.sample_size(20);
    for &kind in ScheduleKind::ALL {
        let v = kind.stages_per_rank(Some(2)).unwrap_or(2);
        let costs = UniformCosts::new(&spec, v);
        g.bench_function(kind.name(), |b| {
            b.iter(|| {
                let s = kind.generate(black_box(p), v, black_box(m)).unwrap();
                flatpipe::simulator::simulate(&s, &costs).unwrap()
            })
        });
    }
    g.finish();
}

/// Packing one step of 1,024 ShareGPT sequences into cost-balanced flat microbatches.
fn bench_packing(c: &mut Criterion) {
    let w = builtins::workload("sharegpt-v3").unwrap();
    let seqs = w.sample_step(0, 0, StepSize::Seqs(1024));
    let profile = profile();
    let (tok, pair) = profile
        .layers
        .iter()
        .fold((0.0, 0.0), |a, l| (a.0 + l.f.c_tok_s, a.1 + l.f.c_attn_s));
    let cost = move |t: u64, a: u64| tok * t as f64 + pair * a as f64;
    let params = PolicyParams::default();
    let mut g = c.benchmark_group("pack_1024_sequences");
    for policy in [
        Policy::FlatBalanced,
        Policy::FlatFfd,
        Policy::VerlKk,
        Policy::Packed,
        Policy::Padded,
    ] {
        g.bench_function(policy.name(), |b| {
            b.iter(|| batch(policy, black_box(&seqs), &params, &cost).unwrap())
        });
    }
    g.finish();
}

/// `flat-planned` on one step of 1,024 ShareGPT sequences (sharegpt-v3, seed 0), Llama-3.1-8B
/// on H200 at p = 8, token budget 16,384 with chunks of 16,384: the per-step planner alone
/// (its candidates' schedules and replays), on one core.
fn bench_mb_plan(c: &mut Criterion) {
    let profile = profile();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let seqs = w.sample_step(0, 0, StepSize::Seqs(1024));
    let mut g = c.benchmark_group("flat_planned_1024_sequences_p8");
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbV] {
        let v = kind.stages_per_rank(None).unwrap();
        let stages = even_split(profile.layers.len(), (8 * v) as usize).unwrap();
        let mut config = RunConfig::new(
            ScheduleSource::Kind(kind),
            8,
            v,
            stages,
            Policy::FlatPlanned,
            Capacity::Dynamic,
        );
        config.params.chunk_tokens = Some(config.params.token_budget);
        let cost = flatpipe::simulator::run::config::balance_cost(&profile);
        let cut = flatpipe::simulator::run::step::cut_step(&config, &seqs, &cost).unwrap();
        let mbs = &cut[0].microbatches;
        g.bench_function(kind.name(), |b| {
            b.iter(|| {
                flatpipe::simulator::run::mb_plan::plan(&config, &profile, black_box(mbs), 0)
                    .unwrap()
            })
        });
    }
    g.finish();
}

fn profile() -> flatpipe::profiles::Profile {
    let m = builtins::model("llama3.1-8b").unwrap();
    let h = builtins::hardware("h200").unwrap();
    analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap()
}

/// 1,000 sampled steps of the default workload (sharegpt-v3, 128 sequences, flat-ffd, token
/// budget 16,384) at p = 8, every handcrafted schedule, on all cores (rayon).
fn bench_monte_carlo(c: &mut Criterion) {
    let profile = profile();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let p = 8;
    // Handcrafted only: zb-auto depends on the memory limit (and finds no schedule under the
    // default limit on some of these steps), so it would measure something else.
    let combos: Vec<RunConfig> = ScheduleKind::ALL
        .iter()
        .filter(|&&k| k != ScheduleKind::ZbAuto)
        .map(|&k| {
            let v = k.stages_per_rank(None).unwrap();
            let stages = even_split(profile.layers.len(), (p * v) as usize).unwrap();
            RunConfig::new(
                ScheduleSource::Kind(k),
                p,
                v,
                stages,
                Policy::FlatFfd,
                Capacity::Dynamic,
            )
        })
        .collect();
    let mut g = c.benchmark_group("monte_carlo_1000_steps_p8");
    g.sample_size(10);
    g.bench_function("every_schedule", |b| {
        b.iter(|| {
            montecarlo::run(&profile, &w, 0, StepSize::Seqs(128), 1000, &combos, &|| {}).unwrap()
        })
    });
    g.bench_function("1f1b", |b| {
        b.iter(|| {
            montecarlo::run(
                &profile,
                &w,
                0,
                StepSize::Seqs(128),
                1000,
                &combos[1..2],
                &|| {},
            )
            .unwrap()
        })
    });
    g.finish();
}

/// zb-auto at p = 16, m = 64 (it is rebuilt for every step in the Monte Carlo and the planner):
/// uniform costs under p and 2p units, and Llama-3.1-8B's profile on one sampled ShareGPT step
/// cut into 64 microbatches (costs differ by microbatch) under 1F1B's memory.
fn bench_zb_auto(c: &mut Criterion) {
    use flatpipe::simulator::schedules::zb_auto::placement;
    let (p, m) = (16u32, 64u32);
    let uniform = UniformCosts::new(
        &UniformCostSpec {
            f: 1.0,
            b: 1.0,
            w: 1.0,
            comm: 0.05,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        },
        1,
    );
    let mut g = c.benchmark_group("zb_auto_p16_m64");
    g.sample_size(20);
    for units in [p as f64, 2.0 * p as f64] {
        g.bench_function(format!("uniform, {units} units"), |b| {
            b.iter(|| {
                ScheduleKind::ZbAuto
                    .build(p, 1, m, &uniform, black_box(units))
                    .unwrap()
            })
        });
    }
    let profile = analytic_profile(
        &builtins::model("llama3.1-8b").unwrap(),
        &builtins::hardware("h200").unwrap(),
        &AnalyticOptions::default(),
    )
    .unwrap();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let seqs = w.sample_step(0, 0, StepSize::Seqs(512));
    let params = PolicyParams {
        microbatches: Some(m),
        ..PolicyParams::default()
    };
    let mbs = batch(Policy::FlatBalanced, &seqs, &params, &|t, a| {
        t as f64 + a as f64 / 4096.0
    })
    .unwrap()
    .microbatches;
    let pl = placement(p, 1).unwrap();
    let stages = even_split(profile.layers.len(), p as usize).unwrap();
    let costs =
        flatpipe::simulator::TableCosts::from_profile(&profile, &stages, &pl, &mbs, &[]).unwrap();
    // 1F1B's peak activation memory on this step is the limit.
    let one = ScheduleKind::OneFOneB.generate(p, 1, m).unwrap();
    let sim = flatpipe::simulator::simulate(&one, &costs).unwrap();
    let limit = sim
        .metrics
        .ranks
        .iter()
        .filter_map(|r| r.peak_activation_bytes)
        .fold(0.0, f64::max);
    g.bench_function("llama3.1-8b sharegpt step, 1F1B memory", |b| {
        b.iter(|| {
            ScheduleKind::ZbAuto
                .build(p, 1, m, &costs, black_box(limit))
                .unwrap()
        })
    });
    g.finish();
}

/// One 16,777,216-token sequence (the longest a workload may hold) cut into 4,096 chunks of
/// 4,096 tokens, ordered into 1F1B at p = 8: every backward of the chain waits for the later
/// chunks' forwards, so each rank hoists thousands of forwards ahead of its first backward.
fn bench_chunks(c: &mut Criterion) {
    use flatpipe::simulator::ir::MicrobatchId;
    use flatpipe::simulator::schedules::chunks::order_chunks;
    let (p, m) = (8u32, 4096u32);
    let schedule = ScheduleKind::OneFOneB.generate(p, 1, m).unwrap();
    let chain: Vec<MicrobatchId> = (0..m).map(MicrobatchId).collect();
    let mut g = c.benchmark_group("order_chunks");
    g.sample_size(10);
    g.bench_function("1f1b_p8_one_sequence_in_4096_chunks", |b| {
        b.iter(|| order_chunks(black_box(&schedule), std::slice::from_ref(&chain)).unwrap())
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_chunks,
    bench_zb_auto,
    bench_1f1b,
    bench_every_schedule,
    bench_packing,
    bench_mb_plan,
    bench_monte_carlo
);
fn main() {
    // As the binary's `main` does, before any thread starts.
    flatpipe::executor::alloc::keep_freed_memory();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
