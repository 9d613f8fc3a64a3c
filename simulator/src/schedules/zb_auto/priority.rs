//! The greedy's priority settings (which of a ready I, a ready F and a pending W a rank runs
//! first) and the table of settings that decide alike, by which zb-auto skips a setting that
//! would build an order already built.

use crate::ir::ActionKind;

/// A priority setting of the greedy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Priority {
    /// Prefer a ready I over a ready F.
    pub(super) i_first: bool,
    /// When to run a pending W while F or I could run: never (only in bubbles), when the
    /// headroom is below one microbatch's activations, or always first.
    pub(super) w: WRule,
    /// On V placement: prefer the F of the rank's later stage (drains the V faster).
    pub(super) later_chunk_first: bool,
}

/// When a pending W runs ahead of a ready F or I ([`Priority::w`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WRule {
    /// Only when nothing else is ready (in bubbles).
    BubblesOnly,
    /// Also when an F is held back by the memory limit alone.
    WhenTight,
    /// Always first.
    Eager,
}

/// The greedy's priority settings for `v` stages per rank, in zb-auto's order of preference:
/// 6 on loop placement, 12 on V placement (the stage order too).
pub(super) fn priority_settings(v: u32) -> Vec<Priority> {
    let mut settings = Vec::new();
    for i_first in [true, false] {
        for w in [WRule::BubblesOnly, WRule::WhenTight, WRule::Eager] {
            for later_chunk_first in if v == 2 {
                vec![true, false]
            } else {
                vec![false]
            } {
                settings.push(Priority {
                    i_first,
                    w,
                    later_chunk_first,
                });
            }
        }
    }
    settings
}

/// What a greedy decision depends on besides its priority setting: whether an I is ready, an
/// F is ready under the limit, an F is held back by the limit alone (tight), a W is pending.
/// Bits 0-3 of an index into [`Agreement`]'s table.
pub(super) const HAS_I: usize = 1;
/// See [`HAS_I`].
pub(super) const HAS_F: usize = 2;
/// See [`HAS_I`].
pub(super) const TIGHT: usize = 4;
/// See [`HAS_I`].
pub(super) const HAS_W: usize = 8;

impl Priority {
    /// The kind of action this setting takes in decision `state` (bits [`HAS_I`] ..
    /// [`HAS_W`]); `None`: it idles. Which I or F is fixed by the rank's state and its stage
    /// order alone ([`Priority::later_chunk_first`]).
    #[inline]
    pub(super) fn decide(self, state: usize) -> Option<ActionKind> {
        let (has_i, has_f) = (state & HAS_I != 0, state & HAS_F != 0);
        let (tight, has_w) = (state & TIGHT != 0, state & HAS_W != 0);
        let w_first = has_w
            && match self.w {
                WRule::Eager => true,
                WRule::WhenTight => tight,
                WRule::BubblesOnly => false,
            };
        if w_first {
            Some(ActionKind::W)
        } else if has_i && (self.i_first || !has_f) {
            Some(ActionKind::I)
        } else if has_f {
            Some(ActionKind::F)
        } else if has_w {
            Some(ActionKind::W)
        } else {
            None
        }
    }
}

/// Per decision state, the settings (bits, by their index among zb-auto's settings) that
/// decide as a given one does. A greedy run ANDs the entries of the states it meets: the
/// settings left decided alike at every step, so they build the same order (the state that
/// follows a decision is the same), and zb-auto need not build them.
pub(super) struct Agreement([u32; 16]);

impl Agreement {
    /// The table of the settings among `settings` that decide as `me` does.
    pub(super) fn new(settings: &[Priority], me: Priority) -> Self {
        let mut table = [0u32; 16];
        for (state, t) in table.iter_mut().enumerate() {
            for (k, other) in settings.iter().enumerate() {
                // Another stage order picks other I and F: never counted as alike.
                if other.later_chunk_first == me.later_chunk_first
                    && other.decide(state) == me.decide(state)
                {
                    *t |= 1 << k;
                }
            }
        }
        Agreement(table)
    }

    /// The settings that decide as this one in decision `state` (bits [`HAS_I`] ..
    /// [`HAS_W`]).
    #[inline]
    pub(super) fn alike_in(&self, state: usize) -> u32 {
        self.0[state]
    }
}
