//! Refusals: bad input ends with exit 2 and a message that names what was wrong and the numbers,
//! never a panic.

mod capacity;
mod execute;
mod files;
mod options;
