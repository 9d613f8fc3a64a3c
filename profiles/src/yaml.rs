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
    std::fs::read_to_string(path).map_err(|cause| Error::Io {
        path: path.display().to_string(),
        cause,
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

/// Checks that `path` can be written later (its directory exists and it is not a directory),
/// so long work does not end in a failed write.
///
/// # Errors
/// [`Error::Io`] naming the path.
pub fn check_writable(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let bad = |msg: String| Error::Io {
        path: path.display().to_string(),
        cause: std::io::Error::other(msg),
    };
    if !dir.is_dir() {
        return Err(bad(format!(
            "the directory {} does not exist",
            dir.display()
        )));
    }
    if path.is_dir() {
        return Err(bad("is a directory; give a file name".into()));
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed and
/// then renamed over the target, so a reader never sees a half-written file and a failed write
/// leaves any previous file intact.
///
/// # Errors
/// [`Error::Io`] naming the target file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |cause: std::io::Error| Error::Io {
        path: path.display().to_string(),
        // The temporary file's name would only confuse: name the target.
        cause: match cause.raw_os_error() {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::new(cause.kind(), cause.kind().to_string()),
        },
    };
    // A symbolic link is written through (its target replaced atomically, the link kept);
    // a path that exists and is not a regular file (a device such as /dev/stdout or /dev/full,
    // a pipe) is written in place, so that its errors (no space left) are reported and the
    // device is never replaced by a file.
    let resolved;
    let path = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            resolved = std::fs::canonicalize(path).map_err(io)?;
            resolved.as_path()
        }
        _ => path,
    };
    if let Ok(m) = std::fs::metadata(path)
        && !m.is_file()
        && !m.is_dir()
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io)?;
        return f.write_all(bytes).and_then(|()| f.flush()).map_err(io);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(Error::Io {
            path: path.display().to_string(),
            cause: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("the directory {} does not exist", dir.display()),
            ),
        });
    }
    let mut builder = tempfile::Builder::new();
    builder.prefix(".flatpipe-");
    // A temporary file is created private (0600); outputs are ordinary files (0644).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    let mut tmp = builder.tempfile_in(dir).map_err(io)?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A symbolic link is written through: the link stays, its target gets the bytes (the link
    /// used to be replaced by a plain file and the target left stale).
    #[cfg(unix)]
    #[test]
    fn writes_through_symbolic_links() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("real")).unwrap();
        let target = dir.path().join("real/target.csv");
        std::fs::write(&target, "old").unwrap();
        let link = dir.path().join("link.csv");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "new");
    }

    /// A device is written in place and its errors reported: /dev/full says no space left (it
    /// used to be replaced by a regular file, silently, when run as root).
    #[cfg(target_os = "linux")]
    #[test]
    fn devices_are_written_in_place_and_their_errors_reported() {
        let full = Path::new("/dev/full");
        let Ok(m) = std::fs::metadata(full) else {
            eprintln!("skipped: no /dev/full here");
            return;
        };
        if m.is_file() {
            eprintln!("skipped: /dev/full is a regular file on this machine");
            return;
        }
        let err = write_atomic(full, b"x").unwrap_err().to_string();
        assert!(err.contains("/dev/full") && err.contains("space"), "{err}");
        assert!(!std::fs::metadata(full).unwrap().is_file());
    }
}
