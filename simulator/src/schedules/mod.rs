//! Schedules: what each rank runs, in which order. The generators of every family
//! (GPipe, 1F1B, interleaved 1F1B, looped BFS, ZB-H1, ZB-H2, ZB-V, DualPipeV), the automatic
//! zero-bubble scheduler with its greedy and the Zero Bubble authors' wave construction, the
//! exact solver (branch and bound) for small instances, the chunk ordering of sequences longer
//! than the token budget, and forward-only (`Fo`) work placed as a pass or into the bubbles.

pub mod chunks;
pub mod exact;
pub mod forward_only;
pub mod generators;
pub mod zb_auto;
