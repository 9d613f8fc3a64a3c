//! How the command reports errors: library fields mapped to the flags a user typed, error chains
//! rendered, a closed stdout.

use super::*;

/// The reader of stdout went away (a pipe into `head`): not an error of the command.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct StdoutClosed;

/// The command-line flag of a library field: the libraries name what they check in their own
/// words (a plan file's keys, `token_budget`, `forward_only.mode`), the command line maps them
/// to the flags a user typed. `None` for a field with no flag (e.g. `stages[2]`).
pub(super) fn flag_of(field: &str) -> Option<String> {
    // `costs f`: a key of --costs.
    let (head, rest) = field.split_once(' ').unwrap_or((field, ""));
    let flag = match head {
        "forward_only.microbatches" => "--fo-microbatches",
        "forward_only.mode" => "--fo-mode",
        "forward_only.loss_dependency" => "--fo-loss-dependency",
        "token_budget" => "--token-budget",
        "microbatches" => "--microbatches",
        "pack_len" => "--pack-len",
        "max_seq_len" => "--max-seq-len",
        "pp" => "--pp",
        "vpp" => "--vpp",
        "dp" => "--dp",
        "schedule" => "--schedule",
        "capacity" => "--capacity",
        "policy" => "--policy",
        "costs" => "--costs",
        "ranks" => "--ranks",
        "steps" => "--steps",
        "gpus" => "--gpus",
        "precision" => "--precision",
        "init_on_device" => "--init-on-device",
        "tp" => "--tp",
        "sharding" => "--sharding",
        _ => return None,
    };
    Some(if rest.is_empty() {
        flag.to_string()
    } else {
        format!("{flag} {rest}")
    })
}

/// The message of one error of a chain, a library's out-of-range field named by its flag.
pub(super) fn render_one(e: &(dyn std::error::Error + 'static)) -> String {
    let invalid = |field: &str, value: &str, allowed: &str| {
        flag_of(field).map(|flag| format!("{flag} = {value} is invalid: {allowed}"))
    };
    let sim_invalid = |e: &sim::Error| match e {
        sim::Error::InvalidArgument {
            field,
            value,
            allowed,
        } => invalid(field, value, allowed),
        _ => None,
    };
    let mapped = if let Some(e) = e.downcast_ref::<sim::Error>() {
        sim_invalid(e)
    } else if let Some(e) = e.downcast_ref::<planner::Error>() {
        match e {
            planner::Error::InvalidArgument {
                field,
                value,
                allowed,
            } => invalid(field, value, allowed),
            planner::Error::Simulator(e) => sim_invalid(e),
            _ => None,
        }
    } else if let Some(profiles::Error::Invalid {
        path,
        field,
        value,
        allowed,
    }) = e.downcast_ref::<profiles::Error>()
    {
        invalid(field, value, allowed).map(|m| format!("{path}: {m}"))
    } else if let Some(e) = e.downcast_ref::<executor::Error>() {
        match e {
            executor::Error::InvalidArgument {
                field,
                value,
                allowed,
            } => invalid(field, value, allowed),
            executor::Error::Simulator(e) => sim_invalid(e),
            _ => None,
        }
    } else {
        None
    };
    mapped.unwrap_or_else(|| e.to_string())
}

/// Renders an error and its causes as `{:#}` does (`outer: inner: root`), with the libraries'
/// field names mapped to the command line's flags ([`flag_of`]).
pub fn render_error(e: &anyhow::Error) -> String {
    e.chain().map(render_one).collect::<Vec<_>>().join(": ")
}

/// Maps a stdout write error: a broken pipe becomes [`StdoutClosed`].
pub(crate) fn stdout_error(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        anyhow::Error::new(StdoutClosed)
    } else {
        anyhow::Error::new(e).context("writing to stdout")
    }
}
