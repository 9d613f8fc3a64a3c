//! The resolution layer shared by the subcommands (not a subcommand): what the user's flags and
//! files mean, decided once (the per-rank memory limit, the step size).

use super::*;

/// The per-rank memory limit, bytes: `--memory-limit` (a number of bytes or a size such as
/// `120GiB`), or the hardware's memory less its reserve
/// ([`flatpipe_simulator::run::config::default_memory_limit`]). A limit above the device's memory is warned of once.
///
/// # Errors
/// A limit that does not parse or is not positive, naming the flag.
pub(super) fn memory_limit(arg: Option<&str>, profile: &Profile) -> Result<f64> {
    match arg {
        None => Ok(flatpipe_simulator::run::config::default_memory_limit(
            profile,
        )),
        Some(text) => {
            let bytes = match text.trim().parse::<f64>() {
                Ok(b) => b,
                Err(_) => text
                    .trim()
                    .parse::<bytesize::ByteSize>()
                    .map_err(|e| anyhow::anyhow!("--memory-limit `{text}` is invalid: {e} (e.g. 120GiB, 80GB or a number of bytes)"))?
                    .as_u64() as f64,
            };
            if !(bytes.is_finite() && bytes > 0.0) {
                bail!("--memory-limit `{text}` is invalid: a positive amount of memory");
            }
            let device = profile.hardware.memory_bytes as f64;
            if bytes > device {
                // Said once per run (several configurations resolve the same limit).
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "--memory-limit {text} is more than {}'s {} of memory: plans under it may not fit the device",
                        profile.hardware.name,
                        fmt_bytes(device)
                    )
                });
            }
            Ok(bytes)
        }
    }
}

/// The step size: `--seqs-per-step` or `--tokens-per-step` as given, else the plan file's, else
/// the workload's default (one rule for `simulate`, `plan` and `execute`).
///
/// # Errors
/// A zero size, naming the flag.
pub(super) fn step_size(
    seqs: Option<u32>,
    tokens: Option<u64>,
    plan: Option<&Plan>,
    w: &Workload,
) -> Result<StepSize> {
    Ok(match (seqs, tokens) {
        (Some(0), _) => bail!("--seqs-per-step = 0 is invalid: >= 1 sequence"),
        (_, Some(0)) => bail!("--tokens-per-step = 0 is invalid: >= 1 token"),
        (Some(n), _) => StepSize::Seqs(n),
        (None, Some(t)) => StepSize::Tokens(t),
        (None, None) => match plan.map(|p| (p.seqs_per_step, p.tokens_per_step)) {
            Some((Some(0), _)) => bail!("the plan's seqs_per_step = 0 is invalid: >= 1 sequence"),
            Some((_, Some(0))) => bail!("the plan's tokens_per_step = 0 is invalid: >= 1 token"),
            Some((Some(n), _)) => StepSize::Seqs(n),
            Some((_, Some(t))) => StepSize::Tokens(t),
            _ => w.default_step_size(),
        },
    })
}
