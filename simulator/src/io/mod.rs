//! What the simulator writes and reads besides the IR: Gantt charts (SVG / PNG), Chrome
//! traces, histograms of step times, and PyTorch profiler (Kineto) traces read back into a
//! measured timeline.

pub mod gantt;
pub mod histogram;
pub mod kineto;
pub mod trace;
