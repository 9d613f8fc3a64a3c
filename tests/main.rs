//! flatpipe's integration tests: one binary, modules by topic.

mod architecture;
mod chunks;
mod cli;
mod closed_forms;
mod exact;
mod microbatch_planning;
mod moe;
mod planner;
mod properties;
mod readme;
mod schedules;
mod sharding;
mod summary;
mod tensor_parallel;
mod traces;
mod variable_length;
mod zb_parity;
