//! Errors of the profiles crate.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while reading or deriving profiles, models, hardware and
/// workloads. Every variant names the file (or built-in) it came from.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- input / output ----
    /// A file could not be read or written.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error (in the message, not repeated as a source).
        cause: std::io::Error,
    },
    /// A YAML file did not parse or did not match the expected structure.
    #[error("{path}: invalid YAML: {message}")]
    Yaml {
        /// The file.
        path: String,
        /// The parser's message, with line and column where known.
        message: String,
    },
    /// A CSV file did not parse.
    #[error("{path}: invalid CSV: {message}")]
    Csv {
        /// The file.
        path: String,
        /// What is wrong, with the row where known.
        message: String,
    },

    // ---- validation ----
    /// A field holds a value outside its allowed range.
    #[error("{path}: field `{field}` = {value} is invalid: {allowed}")]
    Invalid {
        /// The file (or built-in name).
        path: String,
        /// The field, as a path such as `layers[1].ffn`.
        field: String,
        /// The offending value.
        value: String,
        /// The allowed range, in words.
        allowed: String,
    },
    /// A name is neither an existing file nor a built-in.
    #[error("unknown {what} `{name}`: no such file and no such built-in (built-ins: {builtins})")]
    Unknown {
        /// What kind of thing was asked for (`model`, `hardware`, ...).
        what: &'static str,
        /// The name given.
        name: String,
        /// The built-in names of that kind.
        builtins: String,
    },
}

impl Error {
    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(
        path: impl Into<String>,
        field: impl Into<String>,
        value: impl ToString,
        allowed: impl Into<String>,
    ) -> Self {
        Error::Invalid {
            path: path.into(),
            field: field.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }

    /// `Ok` for a finite number of seconds >= 0, else [`Error::Invalid`] naming `field` of
    /// `path` and its value.
    pub(crate) fn check_seconds(path: &str, field: impl Into<String>, v: f64) -> Result<(), Self> {
        if v.is_finite() && v >= 0.0 {
            Ok(())
        } else {
            Err(Error::invalid(
                path,
                field,
                v,
                "a finite number of seconds >= 0",
            ))
        }
    }
}
