//! Checks made before the work: host memory for schedules and Monte Carlo, microbatch counts,
//! output paths.

use super::*;

/// Cores this process may run on (1 when unknown).
pub(super) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Memory this machine has available now (`MemAvailable` of /proc/meminfo), bytes; `None` where
/// it cannot be read.
pub(super) fn available_memory_bytes() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Refuses, before anything is allocated, a request whose schedules would not fit in the
/// memory available: `pairs` (stage, microbatch) pairs over all the schedules built, each
/// [`montecarlo::BYTES_PER_STAGE_MICROBATCH`]. `what` names the request (e.g. `--microbatches
/// 10000000 with --pp 4`).
pub(super) fn check_schedule_memory(what: &str, pairs: f64) -> Result<()> {
    let need = pairs * montecarlo::BYTES_PER_STAGE_MICROBATCH;
    check_memory(
        what,
        need,
        &format!(
            "its schedules hold {pairs:.0} (stage, microbatch) pairs, about {} at ~{:.0} bytes each",
            fmt_bytes(need),
            montecarlo::BYTES_PER_STAGE_MICROBATCH
        ),
        "use fewer microbatches, ranks or schedules",
    )
}

/// Refuses, before anything is allocated, a request estimated to need `need` bytes when this
/// machine has less available; `why` says how the estimate was made and `help` what reduces
/// it.
pub(super) fn check_memory(what: &str, need: f64, why: &str, help: &str) -> Result<()> {
    if let Some(have) = available_memory_bytes()
        && need > have
    {
        bail!(
            "{what} is too large: {why}, more than the {} of memory available; {help}",
            fmt_bytes(have)
        );
    }
    Ok(())
}

/// Refuses, before anything is allocated, a Monte Carlo run estimated
/// ([`montecarlo::estimated_memory_bytes`]) not to fit in the memory available, with
/// `kept_steps` sampled steps held besides (the planner samples every step up front).
#[allow(clippy::too_many_arguments)]
pub(super) fn check_monte_carlo_memory(
    what: &str,
    workload: &Workload,
    seed: u64,
    size: StepSize,
    steps: u32,
    kept_steps: u32,
    configs: &[flatpipe_simulator::run::config::RunConfig],
) -> Result<()> {
    let (seqs, _, _) = montecarlo::estimated_step(workload, seed, size);
    let kept = f64::from(kept_steps) * (seqs * 4.0 + 24.0);
    let need = kept + montecarlo::estimated_memory_bytes(workload, seed, size, steps, configs);
    tracing::info!("{what}: estimated to hold {}", fmt_bytes(need));
    check_memory(
        what,
        need,
        &format!(
            "{steps} step(s) of {size} for {} configuration(s) of up to pp = {} are estimated to hold {}",
            configs.len(),
            configs.iter().map(|c| c.pp).max().unwrap_or(1),
            fmt_bytes(need)
        ),
        "use fewer steps, sequences per step, ranks (a smaller --pp range: the deepest pipeline sets the estimate), schedules or forward-only microbatches, or a larger token budget",
    )
}

/// The default microbatch count of a schedule with `p` ranks and `v` stages per rank: `p·v`,
/// one microbatch per stage, the fewest that fill the pipeline (torchtitan's
/// `pipeline_parallel_microbatch_size` warns below the stage count, pytorch/torchtitan PR #781).
/// Used by `simulate --costs` and inline `execute`.
pub(super) fn default_microbatches(p: u32, v: u32) -> u32 {
    p.saturating_mul(v).max(1)
}

/// Warns when `m` microbatches leave a `p`-rank, `v`-stages-per-rank pipeline under-filled:
/// `m < p` (some ranks never have two microbatches in flight; the bubble ratio of 1F1B is at
/// least `(p - 1) / (m + p - 1)`), or `m < p·v` (an interleaved schedule runs no better than
/// its looped form). `what` names the schedule. Returns the warning (for tests and notes).
pub(super) fn warn_underfilled(what: &str, m: u32, p: u32, v: u32) -> Option<String> {
    let stages = p.saturating_mul(v);
    let msg = if m < p && p > 1 {
        Some(format!(
            "{what}: m = {m} microbatches < pp = {p} ranks: the pipeline never fills, and the bubble ratio is at least (p - 1)/(m + p - 1) = {:.0}%; use m >= {stages} (p·v)",
            100.0 * f64::from(p - 1) / f64::from(m + p - 1)
        ))
    } else if m < stages && v > 1 {
        Some(format!(
            "{what}: m = {m} microbatches < p·v = {stages} stages: the pipeline is under-filled and the interleaving gains little; use m >= {stages}"
        ))
    } else {
        None
    };
    if let Some(w) = &msg {
        tracing::warn!("{w}");
    }
    msg
}

/// The chart path of `--gantt`: the given path, `default` without one, `None` for `none`
/// (the chart switched off).
pub(super) fn chart_path(arg: &Option<PathBuf>, default: &str) -> Option<PathBuf> {
    match arg {
        Some(p) if p.as_os_str() == "none" => None,
        Some(p) => Some(p.clone()),
        None => Some(PathBuf::from(default)),
    }
}

/// Checks, before any work, that every output path can be written (its directory exists and
/// it is not a directory), so that a bad path does not lose the results at the end.
pub(super) fn check_outputs<'a>(paths: impl IntoIterator<Item = &'a PathBuf>) -> Result<()> {
    for p in paths {
        profiles::check_writable(p)?;
    }
    Ok(())
}
