//! YAML reading with file-named errors, and atomic writes.

use crate::{Error, Result};
use serde::{Serialize, de::DeserializeOwned};
use std::io::Write;
use std::path::Path;

/// Reads a whole file to a string.
///
/// # Errors
/// [`Error::Io`] naming the file.
pub fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Parses YAML text from `origin` (a file path or built-in name, used in errors).
pub(crate) fn parse<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T> {
    serde_yaml::from_str(text).map_err(|e| Error::Yaml {
        path: origin.to_string(),
        message: e.to_string(),
    })
}

/// Serializes a value to YAML text.
pub(crate) fn to_yaml<T: Serialize>(value: &T, origin: &str) -> Result<String> {
    serde_yaml::to_string(value).map_err(|e| Error::Yaml {
        path: origin.to_string(),
        message: e.to_string(),
    })
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed and
/// then renamed over the target, so a reader never sees a half-written file and a failed write
/// leaves any previous file intact.
///
/// # Errors
/// [`Error::Io`] naming the target file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}
