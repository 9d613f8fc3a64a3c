//! Sequence chunks (issue 24): a sequence longer than the token budget cut along the token
//! dimension and pipelined (TeraPipe, Seq1F1B).

use flatpipe::profiles::{AnalyticOptions, analytic_profile, builtins};
use flatpipe::simulator::batching::policy::{Policy, PolicyParams};
use flatpipe::simulator::run::config::{Capacity, RunConfig, ScheduleSource};
use flatpipe::simulator::run::plan::even_split;
use flatpipe::simulator::run::step::{cut_step, plan_step};
use flatpipe::simulator::{
    ActionKind, ComputeAction, CostModel, Microbatch, ScheduleKind, TableCosts,
};

fn profile() -> flatpipe::profiles::Profile {
    let m = builtins::model("llama3.1-8b").unwrap();
    let h = builtins::hardware("h200").unwrap();
    analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap()
}

fn config(kind: ScheduleKind, p: u32, chunk_tokens: Option<u64>) -> RunConfig {
    let prof = profile();
    let v = kind.stages_per_rank(None).unwrap();
    let stages = even_split(prof.layers.len(), (p * v) as usize).unwrap();
    let mut c = RunConfig::new(
        ScheduleSource::Kind(kind),
        p,
        v,
        stages,
        Policy::FlatFfd,
        Capacity::Dynamic,
    );
    c.params = PolicyParams {
        token_budget: 16_384,
        chunk_tokens,
        ..PolicyParams::default()
    };
    c
}

/// The chunks' forward costs sum to the unsplit sequence's plus one fixed cost per extra
/// chunk: the linear terms add up over the tokens and the attention pairs
/// `c (c + 1) / 2 + c o` add up to `s (s + 1) / 2` (so the pairs are priced, not only tokens).
#[test]
fn chunk_costs_add_up_to_the_unsplit_sequence() {
    let prof = profile();
    let stages = even_split(prof.layers.len(), 4).unwrap();
    let placement = flatpipe::simulator::Placement::looped(4, 1);
    let s = 131_072u32;
    let chunks = Microbatch::chunks(0, s, 16_384).unwrap();
    assert_eq!(chunks.len(), 8);
    let pairs: u64 = chunks.iter().map(Microbatch::attn_pairs).sum();
    assert_eq!(pairs, s as u64 * (s as u64 + 1) / 2);
    let whole = [Microbatch::flat(vec![s])];
    let split = TableCosts::from_profile(&prof, &stages, &placement, &chunks, &[]).unwrap();
    let one = TableCosts::from_profile(&prof, &stages, &placement, &whole, &[]).unwrap();
    for stage in 0..4u32 {
        let sum: u64 = (0..8)
            .map(|k| split.compute_ns(ComputeAction::new(stage, ActionKind::F, k)))
            .sum();
        let c0: f64 = prof.layers[stages[stage as usize].clone()]
            .iter()
            .map(|l| l.f.c0_s)
            .sum();
        let want =
            one.compute_ns(ComputeAction::new(stage, ActionKind::F, 0)) as f64 + 7.0 * c0 * 1e9;
        // Each of the 9 costs is rounded to the nanosecond.
        assert!(
            (sum as f64 - want).abs() <= 9.0,
            "stage {stage}: {sum} vs {want}"
        );
        // A later chunk attends to more keys: it costs more than the first.
        let first = split.compute_ns(ComputeAction::new(stage, ActionKind::F, 0));
        let last = split.compute_ns(ComputeAction::new(stage, ActionKind::F, 7));
        assert!(last > first);
    }
}

/// The torchtitan #947 case: one 131,072-token sequence, budget 16,384, pp = 4. Unsplit it is
/// one microbatch (m = 1 < p); in chunks of 16,384 it is 8 microbatches whose step time is
/// within 1% of the lower bound for 1F1B and ZB-H1 (the chunk chain's critical path) and within
/// 10% for looped BFS (v = 2), and under the unsplit step's own lower bound.
#[test]
fn a_long_sequence_pipelines_in_chunks() {
    let seqs = [131_072u32];
    let prof = profile();
    for (kind, gap) in [
        (ScheduleKind::OneFOneB, 0.01),
        (ScheduleKind::ZbH1, 0.01),
        (ScheduleKind::LoopedBfs, 0.10),
    ] {
        let whole = config(kind, 4, None);
        let cut = cut_step(&whole, &seqs, &|t, _| t as f64).unwrap();
        assert_eq!(cut[0].microbatches.len(), 1);
        let unsplit = plan_step(&whole, Some(&prof), 0, &cut).unwrap();
        let unsplit_lb = unsplit.replicas[0].rounds[0]
            .prediction
            .as_ref()
            .unwrap()
            .simulation
            .metrics
            .lower_bound_s;
        let chunked = config(kind, 4, Some(16_384));
        let cut = cut_step(&chunked, &seqs, &|t, _| t as f64).unwrap();
        assert!(cut[0].microbatches.len() >= 8);
        assert!(cut[0].microbatches.iter().all(|m| m.tokens() <= 16_384));
        let plan = plan_step(&chunked, Some(&prof), 0, &cut).unwrap();
        let round = &plan.replicas[0].rounds[0];
        assert_eq!(round.schedule.chunks.len(), 1);
        assert_eq!(round.schedule.chunks[0].len(), 8);
        let m = &round.prediction.as_ref().unwrap().simulation.metrics;
        assert!(
            m.makespan_s <= m.lower_bound_s * (1.0 + gap),
            "{kind}: {} s against the bound {} s",
            m.makespan_s,
            m.lower_bound_s
        );
        assert!(
            m.makespan_s < unsplit_lb,
            "{kind}: chunked {} s, unsplit bound {} s",
            m.makespan_s,
            unsplit_lb
        );
    }
}

/// A fixed capacity that would put a sequence's chunks in two rounds is refused with the
/// reason (the later round's backward would have to run before the earlier round's).
#[test]
fn chunks_split_across_rounds_are_refused() {
    let mut c = config(ScheduleKind::OneFOneB, 2, Some(16_384));
    c.capacity = Capacity::Fixed(4);
    let cut = cut_step(&c, &[131_072], &|t, _| t as f64).unwrap();
    let e = plan_step(&c, Some(&profile()), 0, &cut)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 of 8") && e.contains("one round"), "{e}");
}
