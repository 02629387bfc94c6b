//! Errors of the storage engine, classified for callers.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the engine can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error on the arena file.
    #[error("arena {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The arena's bytes break an invariant: wrong magic, an offset out of bounds, a malformed node.
    /// Readers return this instead of panicking or reading out of bounds.
    #[error("corrupt arena at offset {offset}: {what}")]
    Corrupt {
        /// Byte offset in the arena where the problem was found.
        offset: u64,
        /// What was wrong.
        what: &'static str,
    },
    /// A file of the durable store (value log, level segment, manifest) is corrupt.
    #[error("corrupt file {path} at offset {offset}: {what}")]
    CorruptFile {
        /// The file.
        path: PathBuf,
        /// Byte offset in the file.
        offset: u64,
        /// What was wrong.
        what: &'static str,
    },
    /// The configuration is inconsistent.
    #[error("invalid arena configuration: {0}")]
    Config(String),
    /// Another writer holds the arena (one writer per tree).
    #[error("arena {0} is already open by another writer")]
    WriterBusy(PathBuf),
    /// Every reader slot in the arena is taken.
    #[error("no free reader slot in the arena ({0} slots)")]
    NoReaderSlot(u32),
    /// A key is empty or longer than the configured maximum.
    #[error("key of {len} bytes is outside 1..={max}")]
    KeySize {
        /// Length given.
        len: usize,
        /// Maximum allowed.
        max: usize,
    },
    /// A value is longer than the maximum.
    #[error("value of {len} bytes exceeds the maximum of {max}")]
    ValueTooLarge {
        /// Length given.
        len: usize,
        /// Maximum allowed.
        max: usize,
    },
    /// `insert` of a key that is present.
    #[error("key already exists")]
    KeyExists,
    /// `update` of a key that is absent.
    #[error("key not found")]
    KeyNotFound,
    /// The arena has no room left even after reclaiming garbage. Nothing was changed.
    #[error("arena full: {needed} bytes needed, {free} free")]
    ArenaFull {
        /// Bytes the operation could need at worst.
        needed: u64,
        /// Bytes free.
        free: u64,
    },
}

impl Error {
    /// Whether retrying the same operation later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::ArenaFull { .. } | Error::WriterBusy(_) | Error::NoReaderSlot(_))
    }

    /// A stable, machine-readable code for the error.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Corrupt { .. } | Error::CorruptFile { .. } => "corrupt",
            Error::Config(_) => "config",
            Error::WriterBusy(_) => "writer_busy",
            Error::NoReaderSlot(_) => "no_reader_slot",
            Error::KeySize { .. } => "key_size",
            Error::ValueTooLarge { .. } => "value_too_large",
            Error::KeyExists => "key_exists",
            Error::KeyNotFound => "key_not_found",
            Error::ArenaFull { .. } => "arena_full",
        }
    }

    pub(crate) fn corrupt(offset: u64, what: &'static str) -> Error {
        Error::Corrupt { offset, what }
    }

    pub(crate) fn corrupt_file(path: &std::path::Path, offset: u64, what: &'static str) -> Error {
        Error::CorruptFile { path: path.to_path_buf(), offset, what }
    }

    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Error {
        Error::Io { path: path.to_path_buf(), source }
    }
}
