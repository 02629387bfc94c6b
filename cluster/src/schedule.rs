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

/// Where and when the master takes backups, and which it keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupSchedule {
    /// The location's URL.
    pub to: String,
    /// A backup every this long (at least [`MIN_EVERY`]); with `cron`, unused.
    pub every: Duration,
    /// A backup at each time this 5-field cron expression names (UTC), instead of `every`.
    pub cron: Option<Cron>,
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
    /// `to=`, `every_ms=`, and `cron=`, `keep_last=`, `keep_within_ms=` when set.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = field("to", &self.to) + &field("every_ms", self.every.as_millis());
        if let Some(c) = &self.cron {
            s += &field("cron", &c.text);
        }
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
        let (mut to, mut every, mut keep_last, mut keep_within, mut cron) = (None, None, None, None, None);
        for (k, v) in lines(v, "backup schedule")? {
            let ms = || v.parse().map(Duration::from_millis).map_err(|_| bad(&k));
            match k.as_str() {
                "to" => to = Some(v.clone()),
                "every_ms" => every = Some(ms()?),
                "keep_last" => keep_last = Some(v.parse().map_err(|_| bad("keep_last"))?),
                "keep_within_ms" => keep_within = Some(ms()?),
                "cron" => cron = Some(Cron::parse(&v).map_err(|e| bad(&e))?),
                _ => {}
            }
        }
        let every = match (every, &cron) {
            (Some(e), _) => e,
            (None, Some(_)) => MIN_EVERY,
            (None, None) => return Err(bad("every_ms or cron")),
        };
        let Some(to) = to else { return Err(bad("to")) };
        let s = BackupSchedule { to, every, cron, keep_last, keep_within };
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

    /// Whether a backup is due at `now_ms` when the last one's cut committed at `last_ms` (0:
    /// none yet): an interval since it, or a cron time after it.
    pub fn due(&self, last_ms: u64, now_ms: u64) -> bool {
        match &self.cron {
            None => now_ms >= last_ms.saturating_add(self.every.as_millis() as u64),
            Some(c) => c.latest_at_or_before(now_ms).is_some_and(|t| last_ms < t),
        }
    }
}

/// A 5-field cron expression (minute hour day-of-month month day-of-week, UTC): each field `*`,
/// a number, a range `a-b`, a step `*/n` or `a-b/n`, or a comma-separated list of those; day
/// of week 0–7 (0 and 7: Sunday). As cron does, when both day fields are restricted a day
/// matching either is taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    /// The expression as written.
    pub text: String,
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    any_day: bool,
    any_weekday: bool,
}

impl Cron {
    /// Parses `text` (a message saying what is wrong otherwise).
    pub fn parse(text: &str) -> Result<Cron, String> {
        let f: Vec<&str> = text.split_whitespace().collect();
        if f.len() != 5 {
            return Err(format!("cron {text:?}: five fields (minute hour day month weekday)"));
        }
        let field = |s: &str, lo: u32, hi: u32, what: &str| -> Result<u64, String> {
            let mut bits = 0u64;
            for part in s.split(',') {
                let (range, step) = match part.split_once('/') {
                    Some((r, n)) => {
                        (r, n.parse::<u32>().ok().filter(|&n| n > 0).ok_or(format!("cron {what}: step {n:?}"))?)
                    }
                    None => (part, 1),
                };
                let num = |x: &str| {
                    x.parse::<u32>()
                        .ok()
                        .filter(|v| (lo..=hi).contains(v))
                        .ok_or(format!("cron {what}: {x:?} is not in {lo}..={hi}"))
                };
                let (a, b) = match range {
                    "*" => (lo, hi),
                    r => match r.split_once('-') {
                        Some((a, b)) => (num(a)?, num(b)?),
                        None if step > 1 => (num(r)?, hi),
                        None => (num(r)?, num(r)?),
                    },
                };
                if a > b {
                    return Err(format!("cron {what}: {range:?} runs backwards"));
                }
                for v in (a..=b).step_by(step as usize) {
                    bits |= 1 << v;
                }
            }
            Ok(bits)
        };
        let mut weekdays = field(f[4], 0, 7, "weekday")?;
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1;
        }
        Ok(Cron {
            text: f.join(" "),
            minutes: field(f[0], 0, 59, "minute")?,
            hours: field(f[1], 0, 23, "hour")?,
            days: field(f[2], 1, 31, "day")?,
            months: field(f[3], 1, 12, "month")?,
            weekdays,
            any_day: f[2] == "*",
            any_weekday: f[4] == "*",
        })
    }

    fn matches(&self, unix_min: u64) -> bool {
        let (min, hour) = (unix_min % 60, unix_min / 60 % 24);
        let days = (unix_min / 1440) as i64;
        let (_, month, day) = civil(days);
        let weekday = (days + 4).rem_euclid(7) as u32; // 1970-01-01 was a Thursday
        let day_ok = match (self.any_day, self.any_weekday) {
            (true, true) => true,
            (false, true) => self.days & (1 << day) != 0,
            (true, false) => self.weekdays & (1 << weekday) != 0,
            (false, false) => self.days & (1 << day) != 0 || self.weekdays & (1 << weekday) != 0,
        };
        self.minutes & (1 << min) != 0 && self.hours & (1 << hour) != 0 && self.months & (1 << month) != 0 && day_ok
    }

    /// The latest time it names at or before `ms` (Unix milliseconds), looking back at most
    /// ~four years (a 29 February); None if none.
    pub fn latest_at_or_before(&self, ms: u64) -> Option<u64> {
        let now = ms / 60_000;
        (0..=4 * 366 * 1440).map_while(|back| now.checked_sub(back)).find(|&m| self.matches(m)).map(|m| m * 60_000)
    }
}

/// The (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
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
            cron: None,
            keep_last: Some(3),
            keep_within: Some(Duration::from_secs(3600)),
        };
        assert_eq!(BackupSchedule::decode(&s.encode()), Ok(s.clone()));
        let bare = BackupSchedule { keep_last: None, keep_within: None, ..s };
        assert_eq!(BackupSchedule::decode(&bare.encode()), Ok(bare.clone()));
        let fast = BackupSchedule { every: Duration::from_millis(999), ..bare.clone() };
        assert!(BackupSchedule::decode(&fast.encode()).is_err());
        assert!(BackupSchedule::decode(b"to=x\n").is_err());
        let cron = BackupSchedule { cron: Some(Cron::parse("0 */6 * * *").expect("cron")), ..bare.clone() };
        assert_eq!(BackupSchedule::decode(&cron.encode()), Ok(cron));
        assert!(BackupSchedule::decode(b"to=x\ncron=61 * * * *\n").is_err());
        let last = LastBackup { id: "i".into(), to: "file:///x".into(), at_ms: 5, bytes: 6, uploaded: 7, took_ms: 8 };
        assert_eq!(LastBackup::decode(&last.encode()), Ok(last));
        assert!(LastBackup::decode(b"at_ms=x\n").is_err());
    }
}

#[cfg(test)]
mod cron_tests {
    use super::*;

    /// 2026-11-27T11:15:23Z, a Friday.
    const NOW: u64 = 1_795_778_123_000;
    const MIN: u64 = 60_000;

    #[test]
    fn cron_times_are_the_latest_matching_minute() {
        let at = |e: &str| Cron::parse(e).expect(e).latest_at_or_before(NOW);
        let minute = NOW / MIN * MIN;
        assert_eq!(at("* * * * *"), Some(minute));
        assert_eq!(at("*/10 * * * *"), Some(minute - 5 * MIN), "11:10");
        assert_eq!(at("0 */6 * * *"), Some(minute - (5 * 60 + 15) * MIN), "06:00");
        assert_eq!(at("30 2 * * *"), Some(minute - (8 * 60 + 45) * MIN), "02:30 today");
        assert_eq!(at("0 0 * * 5"), Some(minute - (11 * 60 + 15) * MIN), "Friday 00:00: today");
        assert_eq!(at("0 0 * * 4"), Some(minute - (35 * 60 + 15) * MIN), "Thursday 00:00: yesterday");
        assert_eq!(at("0 0 * * 7"), at("0 0 * * 0"), "7 is Sunday too");
        assert_eq!(at("0 0 27 11 *"), Some(minute - (11 * 60 + 15) * MIN));
        assert_eq!(at("0 0 1 1 *"), Some(1_767_225_600_000), "2026-01-01");
        assert_eq!(at("0 0 29 2 *"), Some(1_709_164_800_000), "2024-02-29, four years back at most");
        assert_eq!(at("0 0 31 2 *"), None, "never");
        for bad in ["* * * *", "60 * * * *", "* 24 * * *", "*/0 * * * *", "5-1 * * * *", "x * * * *", "* * 0 * *"] {
            assert!(Cron::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_schedule_is_due_an_interval_or_a_cron_time_after_the_last_backup() {
        let every = BackupSchedule {
            to: "file:///b".into(),
            every: Duration::from_secs(10),
            cron: None,
            keep_last: None,
            keep_within: None,
        };
        assert!(every.due(0, NOW));
        assert!(!every.due(NOW - 9_999, NOW) && every.due(NOW - 10_000, NOW));
        let hourly = BackupSchedule { cron: Some(Cron::parse("0 * * * *").expect("cron")), ..every };
        let hour = NOW / 3_600_000 * 3_600_000;
        assert!(hourly.due(hour - 1, NOW), "the last one before 11:00");
        assert!(!hourly.due(hour, NOW), "the last one at 11:00");
    }
}
