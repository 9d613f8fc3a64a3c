//! Timelines: what ran where and when, predicted by the replay or measured by the executor.

use crate::ir::comm::LoweredAction;
use crate::ir::{Action, ActionKind, MicrobatchId, Rank, StageId};

/// One compute action with its start and end, integer nanoseconds from the step's start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedOp {
    /// The action (or overlapped pair).
    pub action: Action,
    /// Start, ns.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: u64,
}

/// One transfer between two ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedTransfer {
    /// Sending rank.
    pub from: Rank,
    /// Receiving rank.
    pub to: Rank,
    /// The sending stage.
    pub stage: StageId,
    /// The microbatch.
    pub microbatch: MicrobatchId,
    /// The action whose output is sent: F or Fo (activations forward) or I / B (gradient back).
    pub kind: ActionKind,
    /// Start, ns (when the link took it).
    pub start_ns: u64,
    /// End, ns (when the receiver has it).
    pub end_ns: u64,
}

impl TimedTransfer {
    /// PyTorch's name of the send: `0SEND_F1` (forward) or `3SEND_B1` (backward).
    pub fn name(&self) -> String {
        let dir = if matches!(self.kind, ActionKind::F | ActionKind::Fo) {
            "F"
        } else {
            "B"
        };
        format!("{}SEND_{dir}{}", self.stage, self.microbatch)
    }
}

/// One communication action on a rank's comm lane (a send, receive, wait or FSDP action, as
/// PyTorch names it), with its span in integer ns from the step's start: measured (the span of
/// its `PP:` event in a profiler trace) or replayed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedComm {
    /// The action; never [`LoweredAction::Compute`].
    pub action: LoweredAction,
    /// Start, ns.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: u64,
}

/// A step's timeline: per rank its compute ops in order, the transfers on every link, its
/// communication actions where known, and the optimizer step that ends each rank's work.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timeline {
    /// `compute[r]`: rank r's ops in execution order.
    pub compute: Vec<Vec<TimedOp>>,
    /// All transfers, in the order the replay issued them.
    pub transfers: Vec<TimedTransfer>,
    /// `optimizer[r]`: rank r's optimizer step (start, end) in ns, if it has one.
    pub optimizer: Vec<Option<(u64, u64)>>,
    /// `comm[r]`: rank r's communication actions in start order (empty when not recorded:
    /// the replay's transfers are in [`Timeline::transfers`]; an imported trace fills it).
    pub comm: Vec<Vec<TimedComm>>,
}

impl Timeline {
    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.compute.len()
    }

    /// End of the last op (compute, transfer, communication action or optimizer), ns.
    pub fn makespan_ns(&self) -> u64 {
        let c = self
            .compute
            .iter()
            .filter_map(|ops| ops.last())
            .map(|o| o.end_ns)
            .max()
            .unwrap_or(0);
        let t = self
            .transfers
            .iter()
            .map(|t| t.end_ns)
            .chain(self.comm.iter().flatten().map(|c| c.end_ns))
            .max()
            .unwrap_or(0);
        let o = self
            .optimizer
            .iter()
            .flatten()
            .map(|o| o.1)
            .max()
            .unwrap_or(0);
        c.max(t).max(o)
    }

    /// Busy (compute and optimizer) time of rank `r`, ns.
    pub fn busy_ns(&self, r: usize) -> u64 {
        let c: u64 = self.compute[r].iter().map(|o| o.end_ns - o.start_ns).sum();
        c + self
            .optimizer
            .get(r)
            .copied()
            .flatten()
            .map_or(0, |(a, b)| b - a)
    }
}
