//! The resolution layer shared by the subcommands (not a subcommand): what the user's flags and
//! files mean, decided once (the per-rank memory limit).

use super::*;

/// The per-rank memory limit, bytes: `--memory-limit` (a number of bytes or a size such as
/// `120GiB`), or the hardware's memory less its reserve
/// ([`montecarlo::default_memory_limit`]). A limit above the device's memory is warned of once.
///
/// # Errors
/// A limit that does not parse or is not positive, naming the flag.
pub(super) fn memory_limit(arg: Option<&str>, profile: &Profile) -> Result<f64> {
    match arg {
        None => Ok(montecarlo::default_memory_limit(profile)),
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
