//! Where a run's inputs come from: plan files, profiles (a file, a built-in, or a model's analytic
//! profile on hardware) and schedule names.

use super::*;

/// Reads a plan file, if one was given.
pub(super) fn read_plan(path: Option<&Path>) -> Result<Option<Plan>> {
    path.map(|p| {
        Ok(Plan::from_yaml(
            &profiles::read_to_string(p)?,
            &p.display().to_string(),
        )?)
    })
    .transpose()
}

pub(super) fn builtin_profile_names() -> Vec<String> {
    builtins::MODELS
        .iter()
        .flat_map(|(m, _)| {
            builtins::HARDWARE
                .iter()
                .map(move |(h, _)| format!("{m}@{h}"))
        })
        .collect()
}

/// Resolves `--profile` (file or `model@hardware`) or `--model` + `--hardware` to a profile.
pub(super) fn resolve_profile(
    profile: Option<&str>,
    model: Option<&str>,
    hardware: Option<&str>,
) -> Result<Profile> {
    if let Some(p) = profile {
        let path = Path::new(p);
        let prof = if path.is_file() {
            Profile::from_yaml(&profiles::read_to_string(path)?, p)?
        } else if let Some((m, h)) = p.split_once('@') {
            analytic(m, h)?
        } else {
            bail!(
                "unknown profile `{p}`: no such file and no such built-in (built-ins: {})",
                builtin_profile_names().join(", ")
            );
        };
        if let Some(m) = model {
            let spec = builtins::model(m)?;
            if spec.name != prof.model || spec.layers().len() != prof.layers.len() {
                bail!(
                    "--model {m} is model {} with {} layers; the profile {p} is of model {} with {} layers: give the model the profile was made for, or leave out --model",
                    spec.name,
                    spec.layers().len(),
                    prof.model,
                    prof.layers.len()
                );
            }
        }
        return Ok(prof);
    }
    analytic(
        model.unwrap_or(builtins::DEFAULT_MODEL),
        hardware.unwrap_or(builtins::DEFAULT_HARDWARE),
    )
}

pub(super) fn analytic(model: &str, hardware: &str) -> Result<Profile> {
    let m = builtins::model(model)?;
    let h = builtins::hardware(hardware)?;
    Ok(profiles::analytic_profile(
        &m,
        &h,
        &AnalyticOptions::default(),
    )?)
}

/// The schedule kinds `names` asks for; none or `all`: every kind, combined 1F1B only where
/// `expert_parallel` (it overlaps expert-parallel all-to-alls; without them it is interleaved
/// 1F1B with one more microbatch in flight).
pub(super) fn parse_kinds(names: &[String], expert_parallel: bool) -> Result<Vec<ScheduleKind>> {
    if names.is_empty() || names.iter().any(|n| n.trim() == "all") {
        return Ok(ScheduleKind::ALL
            .iter()
            .copied()
            .filter(|&k| expert_parallel || k != ScheduleKind::Combined1F1B)
            .collect());
    }
    let mut kinds = Vec::new();
    for n in names {
        // These commands also take `all`.
        let k: ScheduleKind = n.parse().map_err(|e| match e {
            sim::Error::InvalidArgument { value, allowed, .. } => {
                anyhow::anyhow!("--schedule = {value} is invalid: {allowed}, or all")
            }
            e => e.into(),
        })?;
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    }
    Ok(kinds)
}
