//! Step 4, evaluate: one candidate's split, its screen ([`super::screen`]) and, where the
//! screen passes it, the Monte Carlo of every replica on the sampled steps; the simulated peak
//! memory of every rank (static + activations, largest over steps) must fit the limit.

use super::Context;
use super::candidate::run_config;
use super::enumerate::Pending;
use super::screen::{Screen, Screens, first_over, over_limit_reason, peak_memory, screen};
use super::split::plan_candidate;
use super::{expert_state_bytes, state_bytes};
use crate::partition::Partition;
use crate::{Error, Result};
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::costs::sharding::StateBytes;
use flatpipe_simulator::run::config::RunConfig;
use flatpipe_simulator::run::montecarlo;
use flatpipe_simulator::run::step::StepOutcome;

/// What evaluating one candidate came to.
pub(super) enum Evaluation {
    /// It fits (boxed: a run is large beside the other variants).
    Fits(Box<Fitted>),
    /// Pruned by its screen: no better than the keep-th best (not a rejection).
    Screened,
    /// Rejected, with the reason.
    Rejected(String),
}

/// A candidate that fits.
pub(super) struct Fitted {
    /// The run it was simulated as (the candidate keeps it).
    pub run: RunConfig,
    /// Its split, whose stages and recomputation `run` holds.
    pub split: Partition,
    /// Its simulated steps.
    pub outcomes: Vec<StepOutcome>,
    /// Each pipeline rank's peak memory (largest over steps), bytes.
    pub peak: Vec<f64>,
}

/// What the full Monte Carlo of a screened candidate came to.
enum Full {
    /// Its steps and each rank's peak memory, bytes, within the limit.
    Fits(Vec<StepOutcome>, Vec<f64>),
    /// Rank `.0`'s simulated peak, `.1` bytes, is over the limit.
    OverLimit(usize, f64),
    /// The simulator could not run it: rejected with the reason.
    Failed(String),
}

/// Evaluates candidate `c`: its split (`first`, solved ahead in parallel, or solved here), the
/// screen against `bar` (the keep-th best's score; `None`: fewer ranked), then every replica.
/// Activations are reserved for microbatches of the token budget; a sequence longer than the
/// budget makes a larger microbatch of its own. When the simulated peak then exceeds the
/// limit, the split is solved once more reserving the longest sampled microbatch for every
/// in-flight one (conservative), which may choose more recomputation. `evaluated` counts the
/// splits simulated.
///
/// # Errors
/// The split's but [`Error::InfeasibleMemory`] (a rejection), and the simulator's but
/// zb-auto's and chunk ordering's (rejections too).
pub(super) fn evaluate(
    ctx: &Context<'_>,
    c: &Pending,
    first: Option<Result<Partition>>,
    bar: Option<f64>,
    (screens, evaluated): (&mut Screens, &mut usize),
) -> Result<Evaluation> {
    let config = &ctx.config;
    let profile = &ctx.profiles[c.tpi].1;
    let (mut act_tokens, state) = split_inputs(ctx, c);
    let stats = &ctx.stats[c.stats];
    let mut solved = first;
    loop {
        let split = match solved.take() {
            Some(s) => s,
            None => plan_candidate(
                profile,
                ctx.space,
                config,
                stats,
                (c.pp, c.v, c.kind, act_tokens),
                state,
                &ctx.inflight,
            ),
        };
        let partition = match split {
            Ok(p) => p,
            Err(Error::InfeasibleMemory { explanation, .. }) => {
                return Ok(Evaluation::Rejected(explanation));
            }
            Err(e) => return Err(e),
        };
        *evaluated += 1;
        // zb-auto builds each step's schedule under the same memory limit; a candidate that fits
        // keeps this run.
        let mut run = run_config(
            (c.kind, c.dp, c.pp, c.v, c.budget),
            c.chunk,
            c.sharding,
            &partition,
            ctx.space.policy,
            config,
        );
        run.context_parallel = c.cp;
        let over = match screen(ctx, (c, profile), &partition, &run, bar, screens)? {
            Screen::OverLimit(r, m) => Some((r, m)),
            Screen::Pruned => return Ok(Evaluation::Screened),
            Screen::Failed(reason) => return Ok(Evaluation::Rejected(reason)),
            Screen::Passed => match full(ctx, c, &run)? {
                Full::Fits(outcomes, peak) => {
                    return Ok(Evaluation::Fits(Box::new(Fitted {
                        run,
                        split: partition,
                        outcomes,
                        peak,
                    })));
                }
                Full::OverLimit(r, m) => Some((r, m)),
                Full::Failed(reason) => return Ok(Evaluation::Rejected(reason)),
            },
        };
        if let Some((r, m)) = over {
            let longest = gpu_tokens(c, stats.max_tokens);
            if longest > act_tokens {
                act_tokens = longest;
                continue;
            }
            return Ok(Evaluation::Rejected(over_limit_reason(
                r,
                m,
                config.memory_limit_bytes,
            )));
        }
    }
}

/// What the split of candidate `c` is solved under: the tokens whose activations a GPU holds
/// per microbatch in flight (the budget; a fixed cp group's GPU holds 1/cp of them, a dynamic
/// one may run a microbatch of short sequences on one GPU), and the bytes per parameter of the
/// dense and expert state, sharded over dp x cp (every GPU of a cp group holds the whole
/// stage).
pub(super) fn split_inputs(ctx: &Context<'_>, c: &Pending) -> (f64, (StateBytes, StateBytes)) {
    let profile = &ctx.profiles[c.tpi].1;
    let grad_replicas = c.dp * c.cp_gpus();
    let state = (
        state_bytes(profile, &ctx.config, c.sharding, c.pp, grad_replicas),
        expert_state_bytes(profile, &ctx.config, c.sharding, c.pp, grad_replicas),
    );
    let act_tokens = gpu_tokens(c, c.budget as f64);
    (act_tokens, state)
}

/// The tokens of a microbatch of `tokens` whose activations one GPU of candidate `c`'s rank
/// holds: all of them without cp, 1/cp with a fixed group; with a dynamic group (at most `t`
/// tokens of a sequence per GPU) a microbatch of short sequences runs on one GPU (up to the
/// budget), a long one on the fewest GPUs that hold it (up to `2 t` each), the longest over
/// all `cp` of them.
fn gpu_tokens(c: &Pending, tokens: f64) -> f64 {
    match c.cp {
        None => tokens,
        Some(cp) => {
            let spread = tokens / f64::from(cp.cp.max(1));
            match cp.max_seqlen_per_rank {
                None => spread,
                Some(t) => tokens.min(spread.max(c.budget as f64).max(2.0 * t as f64)),
            }
        }
    }
}

/// The Monte Carlo of every replica of candidate `c` run as `run` on the sampled steps, and
/// each rank's peak memory against the limit.
///
/// # Errors
/// The simulator's, but zb-auto's (no schedule under the limit on some step) and chunk
/// ordering's, which are a [`Full::Failed`].
fn full(ctx: &Context<'_>, c: &Pending, run: &RunConfig) -> Result<Full> {
    let config = &ctx.config;
    let mut mc = match montecarlo::run(
        &ctx.profiles[c.tpi].1,
        ctx.workload,
        config.seed,
        config.size,
        config.steps,
        std::slice::from_ref(run),
        &|| {},
    ) {
        Ok(mc) => mc,
        // zb-auto finds no schedule under the limit on some step: a rejected candidate.
        // A schedule that cannot order a step's chunks: a rejected candidate too.
        Err(e) if c.kind == ScheduleKind::ZbAuto || c.chunk.is_some() => {
            return Ok(Full::Failed(e.to_string()));
        }
        Err(e) => return Err(e.into()),
    };
    let outcomes = mc.outcomes.swap_remove(0);
    let peak = peak_memory(outcomes.iter().map(|o| &o.rank_memory_bytes), c.pp);
    Ok(match first_over(&peak, config.memory_limit_bytes) {
        None => Full::Fits(outcomes, peak),
        Some((r, m)) => Full::OverLimit(r, m),
    })
}
