//! Property tests over every generator: validity, dependencies in the timeline, the lower
//! bound, IR round trips.

use flatpipe::simulator::ir::pytorch_csv::{read_pytorch_csv, write_pytorch_csv};
use flatpipe::simulator::ir::{Action, ActionKind, ComputeAction};
use flatpipe::simulator::replay::dag::Dag;
use flatpipe::simulator::{ScheduleKind, UniformCostSpec, UniformCosts, simulate};
use proptest::prelude::*;
use std::collections::HashMap;

fn kind() -> impl Strategy<Value = ScheduleKind> {
    prop::sample::select(ScheduleKind::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_generator_is_valid_and_respects_dependencies(
        kind in kind(), p in 1u32..=12, v in 1u32..=4, m in 1u32..=48,
        f in 1u32..5, b in 1u32..5, w in 0u32..4, comm in 0u32..3,
    ) {
        let v = if kind.stages_per_rank(Some(v)).is_ok() { kind.stages_per_rank(Some(v)).unwrap() } else { 2 };
        let schedule = kind.generate(p, v, m).unwrap();
        // Each (stage, microbatch) has exactly one F and one backward, counted independently of
        // the validator.
        let mut count: HashMap<(u32, u32, ActionKind), u32> = HashMap::new();
        for a in schedule.ranks.iter().flatten().flat_map(|a| a.parts().collect::<Vec<_>>()) {
            *count.entry((a.stage.0, a.microbatch.0, a.kind)).or_default() += 1;
        }
        for s in 0..schedule.num_stages() {
            for mb in 0..m {
                prop_assert_eq!(count.get(&(s, mb, ActionKind::F)).copied(), Some(1));
                let b = count.get(&(s, mb, ActionKind::B)).copied().unwrap_or(0);
                let i = count.get(&(s, mb, ActionKind::I)).copied().unwrap_or(0);
                let wc = count.get(&(s, mb, ActionKind::W)).copied().unwrap_or(0);
                prop_assert!((b, i, wc) == (1, 0, 0) || (b, i, wc) == (0, 1, 1));
            }
        }
        let spec = UniformCostSpec { f: f as f64, b: b as f64, w: w as f64, comm: comm as f64, fb: None, fo: None, fsdp: Default::default() };
        let costs = UniformCosts::new(&spec, v);
        let sim = simulate(&schedule, &costs).unwrap();
        // Ops of one rank never overlap; every dependency ends before its dependant starts.
        let mut end: HashMap<(u32, u32, ActionKind), (u64, u64, u32)> = HashMap::new();
        for (r, ops) in sim.timeline.compute.iter().enumerate() {
            for pair in ops.windows(2) {
                prop_assert!(pair[0].end_ns <= pair[1].start_ns);
            }
            for op in ops {
                for a in op.action.parts() {
                    end.insert((a.stage.0, a.microbatch.0, a.kind), (op.start_ns, op.end_ns, r as u32));
                }
            }
        }
        let comm_ns = comm as u64 * 1_000_000_000;
        let last = schedule.num_stages() - 1;
        for (&(s, mb, k), &(start, _, r)) in &end {
            let dep = |s2: u32, k2: ActionKind| {
                let (_, e, r2) = end[&(s2, mb, k2)];
                e + if r2 != r { comm_ns } else { 0 }
            };
            let bwd = |s2: u32| if end.contains_key(&(s2, mb, ActionKind::B)) { ActionKind::B } else { ActionKind::I };
            match k {
                ActionKind::F if s > 0 => prop_assert!(start >= dep(s - 1, ActionKind::F)),
                ActionKind::B | ActionKind::I => {
                    prop_assert!(start >= dep(s, ActionKind::F));
                    if s < last { prop_assert!(start >= dep(s + 1, bwd(s + 1))); }
                }
                ActionKind::W => prop_assert!(start >= dep(s, ActionKind::I)),
                _ => {}
            }
        }
        // Makespan >= lower bound; the petgraph DAG agrees with the replay.
        prop_assert!(sim.metrics.makespan_s >= sim.metrics.lower_bound_s - 1e-9);
        let dag = Dag::build(&schedule).replay_makespan_ns(&costs).unwrap();
        prop_assert_eq!(dag, sim.timeline.makespan_ns());
        // PyTorch CSV round trip.
        let text = write_pytorch_csv(&schedule, false).unwrap();
        prop_assert_eq!(read_pytorch_csv(&text, "t").unwrap().ranks, schedule.ranks.clone());
    }

    #[test]
    fn action_strings_round_trip(stage in 0u32..1000, mb in 0u32..100_000, k in 0usize..5, stage2 in 0u32..1000, mb2 in 0u32..1000, pair in any::<bool>()) {
        let kinds = [ActionKind::F, ActionKind::I, ActionKind::W, ActionKind::B, ActionKind::Fo];
        let a = ComputeAction::new(stage, kinds[k], mb);
        let action = if pair {
            Action::Overlap(ComputeAction::new(stage, ActionKind::F, mb), ComputeAction::new(stage2, ActionKind::B, mb2))
        } else {
            Action::Compute(a)
        };
        let text = action.to_string();
        prop_assert_eq!(text.parse::<Action>().unwrap(), action);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Issue 24: chunks of one or two sequences, cut anywhere in the step, in every kind: the
    /// reordered schedule is valid, its timeline keeps each stage's forwards in chunk order and
    /// backwards in reverse chunk order, the DAG agrees with the replay and the lower bound
    /// holds.
    #[test]
    fn chunk_dependencies_hold_in_every_schedule(
        kind in kind(), p in 1u32..=6, v in 1u32..=3, m in 2u32..=16,
        first in 0u32..16, len in 2u32..=8, second in prop::option::of(2u32..=4),
        f in 1u32..4, b in 1u32..4, w in 0u32..3, comm in 0u32..2,
    ) {
        use flatpipe::simulator::schedules::chunks::order_chunks;
        use flatpipe::simulator::ir::MicrobatchId;
        let v = kind.stages_per_rank(Some(v)).unwrap_or(2);
        let first = first % m;
        let len = len.min(m - first);
        prop_assume!(len >= 2);
        let mut chains = vec![(first..first + len).map(MicrobatchId).collect::<Vec<_>>()];
        // A second sequence's chunks after the first, where they fit.
        if let Some(n) = second && first + len + n <= m {
            chains.push((first + len..first + len + n).map(MicrobatchId).collect());
        }
        let spec = UniformCostSpec { f: f as f64, b: b as f64, w: w as f64, comm: comm as f64, fb: None, fo: None, fsdp: Default::default() };
        let costs = UniformCosts::new(&spec, v);
        let schedule = kind.build(p, v, m, &costs, (2 * p * v) as f64).unwrap();
        // Every kind orders every case (the second attempt gathers a chain's forwards for the
        // interleaved cases the first leaves in a cycle).
        let ordered = match order_chunks(&schedule, &chains) {
            Ok(s) => s,
            Err(e) => return Err(TestCaseError::fail(format!("{kind} p={p} v={v} m={m} {chains:?}: {e}"))),
        };
        ordered.validate().unwrap();
        let sim = simulate(&ordered, &costs).unwrap();
        prop_assert_eq!(Dag::build(&ordered).replay_makespan_ns(&costs), Some(sim.timeline.makespan_ns()));
        // The lower bound (its chunk-chain term included) never exceeds the makespan.
        let lb = flatpipe::simulator::replay::metrics::lower_bound_ns(&ordered, &costs);
        prop_assert!(lb <= sim.timeline.makespan_ns(), "bound {} > makespan {}", lb, sim.timeline.makespan_ns());
        // (stage, mb) -> (F start, F end, backward start, backward end), from the timeline.
        let mut at: HashMap<(u32, u32), [u64; 4]> = HashMap::new();
        for op in sim.timeline.compute.iter().flatten() {
            for a in op.action.parts() {
                let e = at.entry((a.stage.0, a.microbatch.0)).or_default();
                match a.kind {
                    ActionKind::F => { e[0] = op.start_ns; e[1] = op.end_ns; }
                    ActionKind::I | ActionKind::B => { e[2] = op.start_ns; e[3] = op.end_ns; }
                    _ => {}
                }
            }
        }
        for chain in &chains {
            for pair in chain.windows(2) {
                for s in 0..ordered.num_stages() {
                    let (a, b) = (at[&(s, pair[0].0)], at[&(s, pair[1].0)]);
                    prop_assert!(a[1] <= b[0], "stage {} F{} ends {} after F{} starts {}", s, pair[0], a[1], pair[1], b[0]);
                    prop_assert!(b[3] <= a[2], "stage {} backward {} ends {} after backward {} starts {}", s, pair[1], b[3], pair[0], a[2]);
                }
            }
        }
    }
}
