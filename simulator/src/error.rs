//! Errors of the simulator crate.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong while building, checking or simulating a schedule.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- inputs ----
    /// A profile, model, hardware or workload problem.
    #[error(transparent)]
    Profiles(#[from] flatpipe_profiles::Error),
    /// An argument or plan field is out of range.
    #[error("{field} = {value} is invalid: {allowed}")]
    InvalidArgument {
        /// The option or field (e.g. `--pp`, `stages[2]`).
        field: String,
        /// The offending value.
        value: String,
        /// The allowed range, in words, with the numbers involved.
        allowed: String,
    },

    /// A schedule cannot be built within the per-rank memory limit (zb-auto, which is built
    /// under it). The caller says where the limit came from.
    #[error("{schedule} cannot be built within the per-rank memory limit of {limit}: {reason}")]
    MemoryLimit {
        /// The schedule.
        schedule: String,
        /// The limit, with its unit (e.g. `136.40 GiB`).
        limit: String,
        /// What needs more, with the numbers.
        reason: String,
    },

    // ---- schedules ----
    /// An action string such as `0F1` does not parse.
    #[error(
        "`{text}` is not an action: {reason} (expected e.g. 0F1, 3I0, 3W0, 2B1, 1Fo0 or (0F3;1B2)OVERLAP_F_B)"
    )]
    ParseAction {
        /// The text.
        text: String,
        /// Why.
        reason: String,
    },
    /// A schedule breaks a validity rule.
    #[error("invalid schedule {schedule}: {reason}")]
    InvalidSchedule {
        /// Schedule name.
        schedule: String,
        /// The rule broken, naming the rank, position and action.
        reason: String,
    },
    /// The schedule deadlocks: its dependencies form a cycle.
    #[error("schedule {schedule} deadlocks: {} wait on each other in a cycle ({})", cycle.len(), cycle.join(" -> "))]
    Deadlock {
        /// Schedule name.
        schedule: String,
        /// The ops on one dependency cycle, e.g. `rank 0: 0B1`.
        cycle: Vec<String>,
    },
    /// A lowered schedule hangs: every stream with work left waits on another (a receive
    /// posted before a send it waits behind, or a compute action whose input never arrives).
    #[error("schedule {schedule} hangs under its communication lowering: every stream with work left waits ({}); receives posted ahead on per-peer streams (the default lowering) hang only where the schedule itself deadlocks", waiting.join("; "))]
    StreamsHang {
        /// Schedule name.
        schedule: String,
        /// Each waiting stream and the action at its head, e.g. `rank 1 p2p: 1RECV_F2`.
        waiting: Vec<String>,
    },

    /// Two ranks' lowered programs post one direction's transfers in different orders: NCCL and
    /// gloo match a rank pair's point-to-point operations in posting order, so a receive would
    /// get another transfer's bytes.
    #[error(
        "schedule {schedule} cannot run under its communication lowering: rank {from} posts its sends to rank {to} in another order than rank {to} posts their receives (send {index} is {sent}, receive {index} is {received}); NCCL and gloo match a pair's point-to-point operations in posting order, so a receive would get another transfer's bytes (gloo: a size error; NCCL: wrong data or a hang): post receives ahead (PyTorch's _add_send_recv)"
    )]
    PairOrder {
        /// Schedule name.
        schedule: String,
        /// Sending rank.
        from: u32,
        /// Receiving rank.
        to: u32,
        /// First position where the two orders differ, 0-based.
        index: usize,
        /// The sender's action there (`-` when it has none).
        sent: String,
        /// The receiver's action there (`-` when it has none).
        received: String,
    },

    // ---- outputs ----
    /// A chart could not be drawn or written.
    #[error("{path}: cannot draw chart: {message}")]
    Plot {
        /// Output file.
        path: String,
        /// What failed.
        message: String,
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
