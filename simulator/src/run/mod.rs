//! Runs: what a run is ([`config::RunConfig`] and its vocabulary), one step planned once
//! ([`step::plan_step`]: the dp shares, the microbatches, the schedule that runs and its
//! prediction), flat-planned's per-step microbatch plan ([`mb_plan`]), many sampled steps
//! ([`montecarlo`]), the plan file ([`plan::Plan`]), how fast a run goes against its profile
//! ([`estimate::SpeedEstimate`]), its layer kinds ([`kind_estimate::KindEstimate`]) and its links
//! ([`link_estimate::LinkEstimate`]),
//! and runs that drift, fixed plans against re-planned ones
//! ([`drift`]).

pub mod config;
pub mod drift;
pub mod estimate;
pub mod kind_estimate;
pub mod link_estimate;
pub mod mb_plan;
pub mod montecarlo;
pub mod plan;
pub mod step;
