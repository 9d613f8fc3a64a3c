//! What the simulator writes and reads besides the IR: Gantt charts (SVG / PNG), Chrome
//! traces, histograms of step times, a run's estimate step by step, and PyTorch profiler (Kineto) traces read back into a
//! measured timeline.

pub mod estimate_chart;
pub mod gantt;
pub mod histogram;
pub mod kineto;
pub mod trace;
