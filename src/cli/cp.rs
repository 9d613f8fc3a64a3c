//! The context-parallel options `simulate` and `plan` share: how a cp group exchanges and
//! splits, and dynamic cp's tokens per GPU.

use anyhow::{Context, Result};
use clap::Args;
use flatpipe_profiles::context_parallel::{ContextParallel, CpBalance, CpComm};

/// How a cp group (`--cp`) runs.
#[derive(Debug, Args)]
pub(super) struct CpArgs {
    /// How a cp group exchanges keys and values: p2p (ring attention, the default), a2a
    /// (Ulysses), allgather, or a2a+p2p:N (Ulysses over N GPUs of a node, the ring across).
    #[arg(long, requires = "cp")]
    cp_comm: Option<String>,
    /// How a sequence is cut over a cp group: zigzag (2 cp chunks, balanced; the default) or
    /// contiguous.
    #[arg(long, requires = "cp")]
    cp_balance: Option<String>,
    /// Dynamic cp: each microbatch runs on the fewest GPUs of its group (a power of two, at
    /// most --cp) that hold its longest sequence at this many tokens per GPU; the others idle
    /// for it.
    #[arg(long, requires = "cp")]
    dynamic_cp: Option<u64>,
}

impl CpArgs {
    /// The group of `cp` GPUs these options describe, dynamic when `dynamic` and
    /// `--dynamic-cp` is given (ring and zigzag by default).
    ///
    /// # Errors
    /// A communication or balance name that is not one.
    pub(super) fn group(&self, cp: u32, dynamic: bool) -> Result<ContextParallel> {
        let comm = match &self.cp_comm {
            Some(c) => c
                .parse::<CpComm>()
                .with_context(|| format!("--cp-comm {c}"))?,
            None => CpComm::Ring,
        };
        let balance = match &self.cp_balance {
            Some(b) => b
                .parse::<CpBalance>()
                .with_context(|| format!("--cp-balance {b}"))?,
            None => CpBalance::Zigzag,
        };
        Ok(ContextParallel {
            cp,
            comm,
            balance,
            max_seqlen_per_rank: self.dynamic_cp.filter(|_| dynamic),
        })
    }

    /// Whether `--dynamic-cp` is given.
    pub(super) fn dynamic(&self) -> bool {
        self.dynamic_cp.is_some()
    }
}
