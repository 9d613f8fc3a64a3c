//! Planner speed: the layer partition at 128 layers x 16 stages under per-rank memory limits,
//! the MILP on an interleaved split, and the whole plan search for Llama-3.1-70B on 16 ranks.

use criterion::{Criterion, criterion_group, criterion_main};
use flatpipe::planner::partition::{
    LayerCost, PartitionProblem, StaticBytes, solve, solve_dp, solve_milp,
};
use flatpipe::planner::search::{RankBy, SearchConfig, SearchSpace, search};
use flatpipe::profiles::{
    AnalyticOptions, LayerGroup, LayerKind, ModelSpec, StepSize, analytic_profile, builtins,
};
use flatpipe::simulator::Placement;
use flatpipe::simulator::costs::{Recompute, recompute_effect};
use std::hint::black_box;

/// Layer costs of a Llama-70B-shaped model with `decoders` decoder layers (plus embedding and
/// head) at 16,384-token microbatches of 2,048-token sequences.
fn layer_costs(decoders: u32) -> Vec<LayerCost> {
    let hw = builtins::hardware("h200").unwrap();
    let g = |kind, count, hidden, ffn, heads, kv, vocab| LayerGroup {
        kind,
        count,
        hidden,
        ffn,
        heads,
        kv_heads: kv,
        vocab,
    };
    let model = ModelSpec {
        name: "bench".into(),
        dtype: flatpipe::profiles::Dtype::Bf16,
        layers: vec![
            g(
                LayerKind::Embedding,
                1,
                Some(8192),
                None,
                None,
                None,
                Some(128_256),
            ),
            g(
                LayerKind::Decoder,
                decoders,
                Some(8192),
                Some(28_672),
                Some(64),
                Some(8),
                None,
            ),
            g(
                LayerKind::Head,
                1,
                Some(8192),
                None,
                None,
                None,
                Some(128_256),
            ),
        ],
    };
    let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    let (t, a) = (16_384.0, 8.0 * 2048.0 * 2049.0 / 2.0);
    profile
        .layers
        .iter()
        .map(|l| {
            let mut time_s = [0.0; 3];
            let mut act_bytes = [0.0; 3];
            for (i, &m) in Recompute::ALL.iter().enumerate() {
                let (extra, ai, aw) = recompute_effect(l, m, t, a);
                time_s[i] = l.f.time_s(t, a) + l.i.time_s(t, a) + l.w.time_s(t, a) + extra;
                act_bytes[i] = ai + aw;
            }
            LayerCost {
                time_s,
                act_bytes,
                params: l.param_count,
            }
        })
        .collect()
}

fn bench_partition(c: &mut Criterion) {
    // 126 decoders + embedding + head = 128 layers into 16 stages (1F1B-like in-flight counts).
    let layers = layer_costs(126);
    let mut problem = PartitionProblem {
        layers,
        placement: Placement::looped(16, 1),
        inflight: (0..16).map(|r| (16 - r) as f64).collect(),
        memory_limit_bytes: f64::INFINITY,
        static_bytes: StaticBytes::default(),
        modes: Recompute::ALL.to_vec(),
    };
    // A limit 10% below the unconstrained optimum's heaviest rank, so memory binds.
    let free = solve_dp(&problem, true).unwrap();
    problem.memory_limit_bytes = 0.9 * free.rank_memory_bytes.iter().copied().fold(0.0, f64::max);
    let limited = solve(&problem).unwrap();
    assert!(
        limited.optimal
            && limited
                .rank_memory_bytes
                .iter()
                .all(|&m| m <= problem.memory_limit_bytes)
    );
    let mut g = c.benchmark_group("partition");
    g.bench_function("128_layers_16_stages_memory_limited_dp", |b| {
        b.iter(|| solve(black_box(&problem)).unwrap())
    });
    // The MILP on an interleaved placement (2 stages per rank), plain min-max: 32 layers x 8.
    let milp_problem = PartitionProblem {
        layers: layer_costs(30),
        placement: Placement::looped(4, 2),
        inflight: vec![4.0; 8],
        memory_limit_bytes: f64::INFINITY,
        static_bytes: StaticBytes::default(),
        modes: vec![Recompute::None],
    };
    g.sample_size(10);
    g.bench_function("32_layers_8_stages_milp_highs", |b| {
        b.iter(|| solve_milp(black_box(&milp_problem)).unwrap())
    });
    g.finish();
}

fn bench_search(c: &mut Criterion) {
    let model = builtins::model("llama3.1-70b").unwrap();
    let hw = builtins::hardware("h200").unwrap();
    let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let mut space = SearchSpace::default_for(16);
    space.pp = vec![1, 2, 4, 8, 16];
    space.vpp = vec![1, 2, 4];
    let config = SearchConfig {
        steps: 64,
        seed: 0,
        size: StepSize::Seqs(128),
        memory_limit_bytes: hw.memory_bytes as f64 - 4.0 * (1u64 << 30) as f64,
        static_bytes: StaticBytes::default(),
        rank_by: RankBy::Mean,
        keep: 5,
        exact_split: flatpipe::planner::partition::ExactSplit::Off,
        forward_only: None,
    };
    let mut g = c.benchmark_group("search");
    g.sample_size(10);
    g.bench_function("llama3.1-70b_16_ranks_64_steps", |b| {
        b.iter(|| search(&profile, &w, &space, &config, &|_, _| {}).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench_partition, bench_search);
criterion_main!(benches);
