//! Helpers shared by the executor's integration tests: one step's setup, and the comparison of
//! two tensors.
#![allow(dead_code)] // each test crate uses a part

use flatpipe_executor::AdamW;
use flatpipe_executor::data::LossReduction;
use flatpipe_executor::runner::Setup;
use flatpipe_profiles::{LengthDistribution, ModelSpec, StepSize, Workload};
use flatpipe_simulator::batching::policy::{Policy, PolicyParams};
use flatpipe_simulator::run::config::{Capacity, RunConfig, ScheduleSource};
use flatpipe_simulator::run::plan::even_split;
use std::sync::Arc;

/// A workload of log-normal sequence lengths of this median, between 1 and `max` tokens.
pub fn workload(median: f64, max: u32) -> Workload {
    let mut w = Workload::empirical("t".into(), "t".into(), vec![1]);
    w.lengths = LengthDistribution::Lognormal {
        median,
        sigma: 0.8,
        min: 1,
        max,
    };
    w
}

/// One step of `model` split evenly into `pp * v` stages, cut into exactly `m` microbatches of
/// `3 m` sequences from `workload`: fixed seeds, per-token loss, AdamW with clipping at 1.
pub fn setup(
    model: ModelSpec,
    workload: Workload,
    source: ScheduleSource,
    (pp, v, m): (u32, u32, u32),
) -> Setup {
    let stages = even_split(model.layers().len(), (pp * v) as usize).unwrap();
    let mut config = RunConfig::new(
        source,
        pp,
        v,
        stages,
        Policy::FlatBalanced,
        Capacity::Dynamic,
    );
    config.params = PolicyParams {
        microbatches: Some(m),
        ..PolicyParams::default()
    };
    Setup {
        model,
        config,
        workload,
        step_size: StepSize::Seqs(3 * m),
        seed: 11,
        init_seed: 5,
        ep: 1,
        reduction: LossReduction::PerToken,
        adamw: AdamW::default(),
        max_grad_norm: Some(1.0),
        balance: Arc::new(|t, a| t as f64 + a as f64 / 64.0),
        profile: None,
    }
}

/// `max |a - b| / max(max |b|, floor)`; infinite when a value is not finite (a NaN must not
/// compare as equal).
pub fn rel(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    if a.iter().chain(b).any(|x| !x.is_finite()) {
        return f32::INFINITY;
    }
    let scale = b.iter().fold(floor, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
