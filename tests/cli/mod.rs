//! End-to-end tests of the `flatpipe` command: one module per subcommand, `output` for what the
//! commands share on the way out, and `errors` for refusals of bad input. Every test runs the
//! binary through `common::flatpipe` (or `common::flatpipe_json` where it reads JSON).

mod builtins;
mod calibrate;
mod common;
mod communication;
mod drift;
mod errors;
mod execute;
mod export;
mod import_trace;
mod output;
mod plan;
mod profile;
mod schedule;
mod simulate;
mod simulate_costs;
