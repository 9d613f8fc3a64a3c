//! Parameters: a value with its gradient and AdamW moments, and how it is initialised.

use crate::Result;
use rand::rngs::ChaCha8Rng;

/// A parameter with its gradient and AdamW moments (allocated at the first optimizer step, so
/// a stage that is only timed never holds them).
#[derive(Debug)]
pub(crate) struct Param<T> {
    pub(crate) name: String,
    pub(crate) shape: (usize, usize),
    pub(crate) value: T,
    pub(crate) grad: T,
    pub(crate) moments: Option<(T, T)>,
}

/// How a parameter is initialised: normal with a standard deviation, or ones (norm weights).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamInit {
    /// `N(0, std²)`.
    Normal(f32),
    /// All ones.
    Ones,
}

/// Makes a parameter's value from its name, shape `[rows, cols]`, initialisation and the
/// layer's random generator ([`build_layers`]).
pub(crate) type MakeParam<'a, T> =
    dyn FnMut(&str, (usize, usize), ParamInit, &mut ChaCha8Rng) -> Result<T> + 'a;
