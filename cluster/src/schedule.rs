//! The cluster's backup schedule and the record of its last backup, as stored
//! (docs/backup.md §4, §7): `backup-schedule` says where and how often the master takes a
//! backup (each one a restore point) and which to keep; `last-backup` says what the last backup
//! that finished was — every node exports it as metrics, whichever node took it, and the
//! schedule's next run is due from it, whichever node is master.

use std::time::Duration;

use crate::meta::MetaError;

/// The shortest interval a schedule takes.
pub const MIN_EVERY: Duration = Duration::from_secs(1);
/// The longest location URL stored.
pub const MAX_TO: usize = 1000;

/// Where and how often the master takes backups, and which it keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupSchedule {
    /// The location's URL.
    pub to: String,
    /// A backup every this long (at least [`MIN_EVERY`]).
    pub every: Duration,
    /// Keep the newest this many (with `keep_within`: those kept by either).
    pub keep_last: Option<usize>,
    /// Keep those taken within this long.
    pub keep_within: Option<Duration>,
}

fn field(k: &str, v: impl std::fmt::Display) -> String {
    format!("{k}={v}\n")
}

fn lines(v: &[u8], what: &str) -> Result<Vec<(String, String)>, MetaError> {
    let text = std::str::from_utf8(v).map_err(|_| MetaError::Invalid(format!("{what}: not UTF-8")))?;
    Ok(text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

impl BackupSchedule {
    /// `to=`, `every_ms=`, and `keep_last=`, `keep_within_ms=` when set.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = field("to", &self.to) + &field("every_ms", self.every.as_millis());
        if let Some(n) = self.keep_last {
            s += &field("keep_last", n);
        }
        if let Some(d) = self.keep_within {
            s += &field("keep_within_ms", d.as_millis());
        }
        s.into_bytes()
    }

    /// Parses [`BackupSchedule::encode`]'s form, checking it ([`BackupSchedule::check`]).
    pub fn decode(v: &[u8]) -> Result<BackupSchedule, MetaError> {
        let bad = |m: &str| MetaError::Invalid(format!("backup schedule: {m}"));
        let (mut to, mut every, mut keep_last, mut keep_within) = (None, None, None, None);
        for (k, v) in lines(v, "backup schedule")? {
            let ms = || v.parse().map(Duration::from_millis).map_err(|_| bad(&k));
            match k.as_str() {
                "to" => to = Some(v.clone()),
                "every_ms" => every = Some(ms()?),
                "keep_last" => keep_last = Some(v.parse().map_err(|_| bad("keep_last"))?),
                "keep_within_ms" => keep_within = Some(ms()?),
                _ => {}
            }
        }
        let (Some(to), Some(every)) = (to, every) else { return Err(bad("to and every_ms")) };
        let s = BackupSchedule { to, every, keep_last, keep_within };
        s.check().map_err(|m| bad(&m))?;
        Ok(s)
    }

    /// Whether it can be kept: a location of 1..=[`MAX_TO`] bytes on one line, an interval of at
    /// least [`MIN_EVERY`].
    pub fn check(&self) -> Result<(), String> {
        if self.to.is_empty() || self.to.len() > MAX_TO || self.to.contains(['\n', '\r']) {
            return Err("the location must be 1 to 1000 bytes on one line".into());
        }
        if self.every < MIN_EVERY {
            return Err(format!("a backup at most every {MIN_EVERY:?}"));
        }
        Ok(())
    }
}

/// The last backup that finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastBackup {
    /// Its id.
    pub id: String,
    /// Its location.
    pub to: String,
    /// When its cut committed (Unix milliseconds).
    pub at_ms: u64,
    /// Bytes it holds.
    pub bytes: u64,
    /// Bytes it uploaded.
    pub uploaded: u64,
    /// How long it took, cut to manifest (ms).
    pub took_ms: u64,
}

impl LastBackup {
    /// `id=`, `to=`, `at_ms=`, `bytes=`, `uploaded=`, `took_ms=` lines.
    pub fn encode(&self) -> Vec<u8> {
        (field("id", &self.id)
            + &field("to", &self.to)
            + &field("at_ms", self.at_ms)
            + &field("bytes", self.bytes)
            + &field("uploaded", self.uploaded)
            + &field("took_ms", self.took_ms))
            .into_bytes()
    }

    /// Parses [`LastBackup::encode`]'s form.
    pub fn decode(v: &[u8]) -> Result<LastBackup, MetaError> {
        let bad = |m: &str| MetaError::Invalid(format!("last backup: {m}"));
        let mut b = LastBackup { id: String::new(), to: String::new(), at_ms: 0, bytes: 0, uploaded: 0, took_ms: 0 };
        for (k, v) in lines(v, "last backup")? {
            let n = || v.parse::<u64>().map_err(|_| bad(&k));
            match k.as_str() {
                "id" => b.id = v.clone(),
                "to" => b.to = v.clone(),
                "at_ms" => b.at_ms = n()?,
                "bytes" => b.bytes = n()?,
                "uploaded" => b.uploaded = n()?,
                "took_ms" => b.took_ms = n()?,
                _ => {}
            }
        }
        if b.id.is_empty() || b.to.is_empty() {
            return Err(bad("id and to"));
        }
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_and_last_backups_read_back_and_bad_ones_are_refused() {
        let s = BackupSchedule {
            to: "s3://b/p".into(),
            every: Duration::from_secs(10),
            keep_last: Some(3),
            keep_within: Some(Duration::from_secs(3600)),
        };
        assert_eq!(BackupSchedule::decode(&s.encode()), Ok(s.clone()));
        let bare = BackupSchedule { keep_last: None, keep_within: None, ..s };
        assert_eq!(BackupSchedule::decode(&bare.encode()), Ok(bare.clone()));
        let fast = BackupSchedule { every: Duration::from_millis(999), ..bare.clone() };
        assert!(BackupSchedule::decode(&fast.encode()).is_err());
        assert!(BackupSchedule::decode(b"to=x\n").is_err());
        let last = LastBackup { id: "i".into(), to: "file:///x".into(), at_ms: 5, bytes: 6, uploaded: 7, took_ms: 8 };
        assert_eq!(LastBackup::decode(&last.encode()), Ok(last));
        assert!(LastBackup::decode(b"at_ms=x\n").is_err());
    }
}
