//! dpukv-backup: where dpukv's backups live and what they are (docs/backup.md) — the backup
//! location (an object store opened from a URL), the content-named objects and the manifest
//! written last, checked reads, listing, deletion, and the sweep of objects no backup names.
//!
//! Where it sits: below the node (whose primaries upload their regions' parts and whose restore
//! fetches them) and the `dpukv` command (`backup list|describe|delete|verify`); it knows
//! nothing of regions' files (the node turns a `storage::region::RegionSnapshot` into objects)
//! and depends on no other dpukv crate.
//!
//! Invariants: an object's name is the SHA-256 of its bytes, and it is never overwritten; every
//! read is checked against its digest; a backup exists only once its manifest is written, and
//! the manifest is written last; a manifest is never overwritten; every store request has a
//! deadline; memory holds at most one object (a log segment, at most 64 MiB) per upload.
//!
//! - [`manifest`]: the manifest's format, object names, backup ids.
//! - [`job`]: what the coordinator and the primaries say to each other through etcd.
//! - [`store`]: the location: put/get of objects and manifests, list, delete, sweep.
//! - [`throttle`]: the bandwidth cap uploads share.

pub mod job;
pub mod manifest;
pub mod store;
pub mod throttle;

pub use manifest::{BackupManifest, ObjectRef, RegionPart};
pub use store::{Hashed, Location, Retention};

/// Why a backup operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// A location URL that cannot be used.
    #[error("backup location {0}")]
    Url(String),
    /// The object store failed (unreachable, refused, timed out).
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    /// No backup of that id (no manifest).
    #[error("no backup {0}")]
    NotFound(String),
    /// A backup of that id exists already.
    #[error("backup {0} exists already")]
    Exists(String),
    /// An object a manifest names is not there.
    #[error("object {object} is missing")]
    Missing {
        /// The object's path.
        object: String,
    },
    /// An object or manifest is not what its name says.
    #[error("{object} is corrupt: {why}")]
    Corrupt {
        /// Its path.
        object: String,
        /// What is wrong.
        why: String,
    },
    /// A manifest that cannot be read.
    #[error(transparent)]
    Manifest(#[from] manifest::ManifestError),
    /// A local file operation failed.
    #[error("{0}")]
    Io(String),
}

impl BackupError {
    /// A stable code naming the error.
    pub fn code(&self) -> &'static str {
        match self {
            BackupError::Url(_) => "backup_bad_location",
            BackupError::Store(_) => "backup_store_failed",
            BackupError::NotFound(_) => "backup_not_found",
            BackupError::Exists(_) => "backup_exists",
            BackupError::Missing { .. } => "backup_object_missing",
            BackupError::Corrupt { .. } => "backup_object_corrupt",
            BackupError::Manifest(_) => "backup_manifest_invalid",
            BackupError::Io(_) => "backup_io",
        }
    }
}
