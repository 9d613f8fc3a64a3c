//! Errors of the planner.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong while planning.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- inputs ----
    /// A simulator (or profile) error.
    #[error(transparent)]
    Simulator(#[from] flatpipe_simulator::Error),
    /// An argument is out of range.
    #[error("{field} = {value} is invalid: {allowed}")]
    InvalidArgument {
        /// The option.
        field: String,
        /// The value.
        value: String,
        /// The allowed range.
        allowed: String,
    },

    // ---- planning ----
    /// No layer partition fits the memory limit.
    #[error(
        "no split of {layers} layers into {stages} stages fits {limit_gib:.1} GiB per rank: {explanation}"
    )]
    InfeasibleMemory {
        /// Layers.
        layers: usize,
        /// Stages.
        stages: usize,
        /// The limit, GiB.
        limit_gib: f64,
        /// The heaviest rank of the least memory-hungry split, with its breakdown.
        explanation: String,
    },
    /// The MILP solver failed.
    #[error("MILP solver: {0}")]
    Solver(String),
    /// No candidate plan fits.
    #[error("no plan fits: {0}")]
    NoFeasiblePlan(String),
    /// A plan cannot be expressed in an export format.
    #[error("cannot export to {format}: {reason}")]
    Export {
        /// The format.
        format: &'static str,
        /// Why.
        reason: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(
        field: impl Into<String>,
        value: impl ToString,
        allowed: impl Into<String>,
    ) -> Self {
        Error::InvalidArgument {
            field: field.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}
