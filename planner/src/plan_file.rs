//! From a ranked candidate to a plan file ([`flatpipe_simulator::Plan`]) with its prediction and
//! provenance: what `flatpipe plan -o` writes and `simulate --plan` / `execute --plan` read.

use crate::search::{Candidate, SearchConfig};
use crate::{Error, Result};
use flatpipe_profiles::{LengthDistribution, Profile, Workload};
pub use flatpipe_simulator::run::plan::PlanInputs;
use flatpipe_simulator::run::plan::{Plan, PlanProvenance, Predicted};

/// The plan file of candidate `c`, searched under `config` on `profile` and `workload`: the
/// run it was evaluated with ([`Candidate::run`]), what the search
/// predicted (over `config.steps` sampled steps, under `config.memory_limit_bytes`), and the
/// SHA-256 hashes of the profile and workload it was planned on.
///
/// # Errors
/// [`Error::Export`] when the profile or workload cannot be serialized for hashing.
pub fn candidate_plan(
    c: &Candidate,
    inputs: &PlanInputs,
    profile: &Profile,
    workload: &Workload,
    config: &SearchConfig,
) -> Result<Plan> {
    // The run the search evaluated, as a plan file holds it: dynamic capacity, the state
    // layout of the sharding mode (a file has no field for another).
    let mut run = c.run.clone();
    run.state_bytes = None;
    Ok(Plan {
        inputs: inputs.clone(),
        run,
        tp: c.tp,
        sequence_parallel: c.tp == 1 || c.sequence_parallel,
        ep: c.ep,
        predicted: Some(Predicted {
            step_time_mean_s: c.summary.step_time_s.mean,
            step_time_p90_s: c.summary.step_time_s.p90,
            bubble_ratio: c.summary.bubble_ratio_mean,
            lower_bound_s: c.lower_bound_s,
            peak_memory_bytes: c.peak_memory_bytes.clone(),
            memory_limit_bytes: config.memory_limit_bytes,
            steps: config.steps,
        }),
        provenance: Some(PlanProvenance {
            profile_sha256: profile_hash(profile)?,
            workload_sha256: workload_hash(workload)?,
            flatpipe_version: env!("CARGO_PKG_VERSION").to_string(),
        }),
    })
}

/// SHA-256 of `bytes`, lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SHA-256 of a profile as YAML (a plan's provenance).
///
/// # Errors
/// [`Error::Export`] when the profile cannot be serialized.
pub fn profile_hash(profile: &Profile) -> Result<String> {
    let text = profile.to_yaml().map_err(|e| Error::Export {
        format: "plan",
        reason: e.to_string(),
    })?;
    Ok(sha256_hex(text.as_bytes()))
}

/// SHA-256 of a workload's definition and, for an empirical one, its samples (a plan's
/// provenance).
///
/// # Errors
/// [`Error::Export`] when the workload cannot be serialized.
pub fn workload_hash(w: &Workload) -> Result<String> {
    let mut bytes = serde_yaml::to_string(w)
        .map_err(|e| Error::Export {
            format: "plan",
            reason: e.to_string(),
        })?
        .into_bytes();
    if let LengthDistribution::Empirical { samples, .. } = &w.lengths {
        for s in samples.iter() {
            bytes.extend_from_slice(&s.to_le_bytes());
        }
    }
    Ok(sha256_hex(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatpipe_profiles::builtins;

    /// The hashes tell inputs apart: the same workload hashes the same, another length
    /// distribution or another keep probability differently; SHA-256 of "abc" is the FIPS
    /// 180-2 test vector.
    #[test]
    fn provenance_hashes_tell_inputs_apart() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let a = builtins::workload("sharegpt-v3").unwrap();
        let b = builtins::workload("sharegpt-v3-merged").unwrap();
        assert_eq!(
            workload_hash(&a).unwrap(),
            workload_hash(&a.clone()).unwrap()
        );
        assert_ne!(workload_hash(&a).unwrap(), workload_hash(&b).unwrap());
        let mut c = a.clone();
        c.keep_probability = Some(0.5);
        assert_ne!(workload_hash(&a).unwrap(), workload_hash(&c).unwrap());
    }
}
