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
    /// Another process (or handle) has the region's directory open: one owner per region.
    #[error("region directory {0} is in use by another process")]
    RegionBusy(PathBuf),
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
    /// The arena has no room left even after reclaiming garbage (or its memory could not be
    /// reserved). Nothing was changed.
    #[error("arena full: {needed} bytes needed, {free} free")]
    ArenaFull {
        /// Bytes the operation could need at worst.
        needed: u64,
        /// Bytes free.
        free: u64,
    },
    /// The disk is full (ENOSPC). Nothing was written; retry once space is freed.
    #[error("no space left on the device for {path}")]
    NoSpace {
        /// The file that could not be created or grown.
        path: PathBuf,
    },
    /// The value log failed (a write or sync failed) and repairs itself; until it has, writes are
    /// refused. A write reported with this error has an unknown outcome: it may become durable
    /// after the repair.
    #[error("value log {dir} failed and is being repaired: {reason}")]
    LogFailed {
        /// The log's directory.
        dir: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A batch whose records do not fit in one log segment.
    #[error("batch of {bytes} log bytes exceeds the {max} bytes one log segment holds")]
    BatchTooLarge {
        /// Bytes the batch's records take.
        bytes: usize,
        /// Most bytes a batch may take.
        max: usize,
    },
    /// A reader's pin was revoked while it read (it stalled past its lease and the reclaimer
    /// judged it dead): what it read is discarded; retry (the next snapshot re-pins).
    #[error("the reader's pin was revoked while it read; retry")]
    ReaderRevoked,
    /// The region failed (its log, or its writer after a corrupt arena) and takes no writes
    /// until it has recovered.
    #[error("region unavailable: {0}")]
    Unavailable(String),
}

impl Error {
    /// Whether retrying the same operation later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::ArenaFull { .. }
                | Error::WriterBusy(_)
                | Error::NoReaderSlot(_)
                | Error::NoSpace { .. }
                | Error::LogFailed { .. }
                | Error::Unavailable(_)
                | Error::ReaderRevoked
        )
    }

    /// Whether a write that got this error may still have been applied (or may be applied after a
    /// repair or a restart): its outcome is unknown, unlike every other error, which means the
    /// write changed nothing.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, Error::LogFailed { .. } | Error::Io { .. })
    }

    /// A stable, machine-readable code for the error.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Corrupt { .. } | Error::CorruptFile { .. } => "corrupt",
            Error::Config(_) => "config",
            Error::WriterBusy(_) => "writer_busy",
            Error::RegionBusy(_) => "region_busy",
            Error::NoReaderSlot(_) => "no_reader_slot",
            Error::KeySize { .. } => "key_size",
            Error::ValueTooLarge { .. } => "value_too_large",
            Error::KeyExists => "key_exists",
            Error::KeyNotFound => "key_not_found",
            Error::ArenaFull { .. } => "arena_full",
            Error::NoSpace { .. } => "no_space",
            Error::LogFailed { .. } => "log_failed",
            Error::BatchTooLarge { .. } => "batch_too_large",
            Error::Unavailable(_) => "unavailable",
            Error::ReaderRevoked => "reader_revoked",
        }
    }

    /// A copy of this error (for reporting one failure to several callers; an I/O error keeps
    /// its kind and message).
    pub fn duplicate(&self) -> Error {
        match self {
            Error::Io { path, source } => {
                Error::Io { path: path.clone(), source: std::io::Error::new(source.kind(), source.to_string()) }
            }
            Error::Corrupt { offset, what } => Error::Corrupt { offset: *offset, what },
            Error::CorruptFile { path, offset, what } => {
                Error::CorruptFile { path: path.clone(), offset: *offset, what }
            }
            Error::Config(s) => Error::Config(s.clone()),
            Error::WriterBusy(p) => Error::WriterBusy(p.clone()),
            Error::RegionBusy(p) => Error::RegionBusy(p.clone()),
            Error::NoReaderSlot(n) => Error::NoReaderSlot(*n),
            Error::KeySize { len, max } => Error::KeySize { len: *len, max: *max },
            Error::ValueTooLarge { len, max } => Error::ValueTooLarge { len: *len, max: *max },
            Error::KeyExists => Error::KeyExists,
            Error::KeyNotFound => Error::KeyNotFound,
            Error::ArenaFull { needed, free } => Error::ArenaFull { needed: *needed, free: *free },
            Error::NoSpace { path } => Error::NoSpace { path: path.clone() },
            Error::LogFailed { dir, reason } => Error::LogFailed { dir: dir.clone(), reason: reason.clone() },
            Error::BatchTooLarge { bytes, max } => Error::BatchTooLarge { bytes: *bytes, max: *max },
            Error::Unavailable(s) => Error::Unavailable(s.clone()),
            Error::ReaderRevoked => Error::ReaderRevoked,
        }
    }

    pub(crate) fn corrupt(offset: u64, what: &'static str) -> Error {
        Error::Corrupt { offset, what }
    }

    pub(crate) fn corrupt_file(path: &std::path::Path, offset: u64, what: &'static str) -> Error {
        Error::CorruptFile { path: path.to_path_buf(), offset, what }
    }

    /// An I/O error on `path`; a full disk becomes [`Error::NoSpace`].
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Error {
        if crate::fs::is_no_space(&source) {
            return Error::NoSpace { path: path.to_path_buf() };
        }
        Error::Io { path: path.to_path_buf(), source }
    }
}
