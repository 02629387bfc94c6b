//! What a backup is in the object store (docs/backup.md §3): content-named objects
//! (`objects/<sha256>`) and, written last, the backup's manifest
//! (`backups/<id>/manifest.json`) naming every object of every region's part.
//!
//! A backup exists only once its manifest does: an upload that stopped halfway leaves objects
//! no manifest names (retention deletes them) and nothing that lists or restores.

use serde::{Deserialize, Serialize};

/// The manifest format this code writes and reads.
pub const FORMAT: u32 = 1;
/// The largest manifest read (a bound on what a corrupt or hostile store can make us hold).
pub const MAX_MANIFEST: u64 = 64 << 20;

/// One object: its SHA-256 (lowercase hex; also its name) and length.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ObjectRef {
    /// SHA-256 of its bytes, lowercase hex.
    pub sha256: String,
    /// Its length in bytes.
    pub len: u64,
}

impl ObjectRef {
    /// Where it is stored, under the backup location.
    pub fn path(&self) -> String {
        object_path(&self.sha256)
    }
}

/// Where an object named by `sha256` is stored.
pub fn object_path(sha256: &str) -> String {
    format!("objects/{sha256}")
}

/// Where backup `id`'s manifest is stored.
pub fn manifest_path(id: &str) -> String {
    format!("backups/{id}/manifest.json")
}

/// Prefix of every backup's manifest.
pub const BACKUPS_PREFIX: &str = "backups";
/// Prefix of every object.
pub const OBJECTS_PREFIX: &str = "objects";

/// One log segment of a region's part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogObject {
    /// The segment's id.
    pub id: u64,
    /// Its bytes: the whole segment, or the cut's segment up to the cut.
    pub object: ObjectRef,
    /// The segment file's size (a restored segment is zero-filled to it).
    pub size: u64,
}

/// One level segment of a region's part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LevelObject {
    /// The segment's id.
    pub id: u64,
    /// Its bytes.
    pub object: ObjectRef,
}

/// The durable index of a region's part (absent: the region was never compacted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexObjects {
    /// The manifest file's bytes.
    pub manifest: ObjectRef,
    /// The sessions snapshot's bytes.
    pub sessions: ObjectRef,
    /// The level segments.
    pub levels: Vec<LevelObject>,
}

/// A region's part of a backup: what it held at the cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionPart {
    /// The region's id in the backed-up cluster.
    pub id: u32,
    /// Its first key, hex.
    pub start: String,
    /// The first key after it, hex (None: the last region).
    pub end: Option<String>,
    /// Its epoch at the cut.
    pub epoch: u64,
    /// The cut: its log up to here.
    pub cut: u64,
    /// Its index at the cut.
    pub index: Option<IndexObjects>,
    /// Its log segments up to the cut's.
    pub log: Vec<LogObject>,
}

impl RegionPart {
    /// Every object it names.
    pub fn objects(&self) -> impl Iterator<Item = &ObjectRef> {
        let index = self
            .index
            .iter()
            .flat_map(|i| [&i.manifest, &i.sessions].into_iter().chain(i.levels.iter().map(|l| &l.object)));
        index.chain(self.log.iter().map(|l| &l.object))
    }

    /// Bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.objects().map(|o| o.len).sum()
    }
}

/// A backup's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupManifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The backup's id (sortable by time: `YYYYMMDDTHHMMSSZ-<fence id>`).
    pub id: String,
    /// The cluster it was taken of.
    pub cluster: String,
    /// When its cut was committed (Unix milliseconds).
    pub taken_at_ms: u64,
    /// The fence that gave the cut.
    pub fence: u64,
    /// The cluster's replication factor then.
    pub replication: usize,
    /// Every region's part, in key order.
    pub regions: Vec<RegionPart>,
    /// Bytes this backup uploaded (objects the store did not hold yet).
    pub uploaded_bytes: u64,
}

/// Why a manifest cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Not JSON of the expected shape.
    #[error("backup manifest: {0}")]
    Malformed(String),
    /// A format this code does not read.
    #[error("backup manifest format {0} (this version reads {FORMAT})")]
    Format(u32),
    /// The regions do not cover every key once, in order.
    #[error("backup manifest: the regions do not cover the key space: {0}")]
    Coverage(String),
}

impl BackupManifest {
    /// Bytes the backup holds.
    pub fn bytes(&self) -> u64 {
        self.regions.iter().map(RegionPart::bytes).sum()
    }

    /// Its JSON.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a manifest serializes")
    }

    /// Parses and checks one: the format, and regions that cover the key space in order.
    pub fn decode(bytes: &[u8]) -> Result<BackupManifest, ManifestError> {
        let m: BackupManifest = serde_json::from_slice(bytes).map_err(|e| ManifestError::Malformed(e.to_string()))?;
        if m.format != FORMAT {
            return Err(ManifestError::Format(m.format));
        }
        let mut expect = Some(String::new());
        for r in &m.regions {
            if expect.as_deref() != Some(r.start.as_str()) {
                return Err(ManifestError::Coverage(format!(
                    "region {} starts at {:?}, expected {expect:?}",
                    r.id, r.start
                )));
            }
            expect = r.end.clone();
        }
        if m.regions.is_empty() || expect.is_some() {
            return Err(ManifestError::Coverage("the last region does not reach the end of the key space".into()));
        }
        Ok(m)
    }
}

/// A backup's id for a cut committed at `unix_ms` by fence `fence`: `YYYYMMDDTHHMMSSZ-<hex>`,
/// so ids sort by time.
pub fn backup_id(unix_ms: u64, fence: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z-{:08x}", rest / 3600, rest % 3600 / 60, rest % 60, fence as u32)
}

/// The time a backup's id names (its cut's commit, to the second), in Unix milliseconds.
pub fn id_time_ms(id: &str) -> Option<u64> {
    let t = id.get(..16)?;
    if t.as_bytes()[8] != b'T' || t.as_bytes()[15] != b'Z' || !id.get(16..)?.starts_with('-') {
        return None;
    }
    let n = |r: std::ops::Range<usize>| t.get(r)?.parse::<u32>().ok();
    unix_ms(n(0..4)?, n(4..6)?, n(6..8)?, n(9..11)?, n(11..13)?, n(13..15)?, 0)
}

/// An RFC 3339 time in UTC (`2026-11-26T10:00:00Z`, with optional fractional seconds; `Z` or
/// `+00:00`) as Unix milliseconds — what `dpukv restore --at` takes.
pub fn parse_utc(s: &str) -> Option<u64> {
    let s = s.strip_suffix('Z').or_else(|| s.strip_suffix("+00:00"))?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-');
    let (y, mo, da) = (d.next()?.parse().ok()?, d.next()?.parse().ok()?, d.next()?.parse().ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.split(':');
    let (h, mi, se) = (t.next()?.parse().ok()?, t.next()?.parse().ok()?, t.next()?.parse().ok()?);
    if d.next().is_some() || t.next().is_some() || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let ms = format!("{frac:0<3}").get(..3)?.parse().ok()?;
    unix_ms(y, mo, da, h, mi, se, ms)
}

fn unix_ms(y: u32, mo: u32, d: u32, h: u32, mi: u32, s: u32, ms: u32) -> Option<u64> {
    if !(1970..=9999).contains(&y) || !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 59 {
        return None;
    }
    let days = days_from_civil(i64::from(y), mo, d);
    if civil_from_days(days) != (i64::from(y), mo, d) {
        return None; // 31 February and the like
    }
    Some(((days as u64 * 86_400 + u64::from(h * 3600 + mi * 60 + s)) * 1000) + u64::from(ms))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of lowercase or uppercase hex `s`, if it is hex.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_back_from_ids_and_rfc3339() {
        let t = 1_795_778_123_456; // 2026-11-27T11:15:23.456Z
        let id = backup_id(t, 0xabc);
        assert_eq!(id, "20261127T111523Z-00000abc");
        assert_eq!(id_time_ms(&id), Some(t / 1000 * 1000));
        assert_eq!(parse_utc("2026-11-27T11:15:23.456Z"), Some(t));
        assert_eq!(parse_utc("2026-11-27T11:15:23Z"), Some(t / 1000 * 1000));
        assert_eq!(parse_utc("2026-11-27T11:15:23.4+00:00"), Some(t / 1000 * 1000 + 400));
        assert_eq!(parse_utc("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_utc("2024-02-29T00:00:00Z"), Some(1_709_164_800_000));
        for bad in ["2026-02-30T00:00:00Z", "2026-11-27T24:00:00Z", "2026-11-27 08:35:23Z", "2026-11-27T11:15:23", "x"]
        {
            assert_eq!(parse_utc(bad), None, "{bad}");
        }
        assert_eq!(id_time_ms("20261127T083523X-1"), None);
    }

    fn part(id: u32, start: &str, end: Option<&str>) -> RegionPart {
        let o = |n: u8| ObjectRef { sha256: hex(&[n; 32]), len: u64::from(n) };
        RegionPart {
            id,
            start: start.into(),
            end: end.map(Into::into),
            epoch: 3,
            cut: 99,
            index: Some(IndexObjects {
                manifest: o(1),
                sessions: o(2),
                levels: vec![LevelObject { id: 1, object: o(3) }],
            }),
            log: vec![LogObject { id: 1, object: o(4), size: 4096 }],
        }
    }

    fn manifest(regions: Vec<RegionPart>) -> BackupManifest {
        BackupManifest {
            format: FORMAT,
            id: backup_id(0, 1),
            cluster: "db.demo".into(),
            taken_at_ms: 0,
            fence: 1,
            replication: 3,
            regions,
            uploaded_bytes: 10,
        }
    }

    #[test]
    fn a_manifest_round_trips_and_counts_its_objects() {
        let m = manifest(vec![part(1, "", Some("6d")), part(2, "6d", None)]);
        let back = BackupManifest::decode(&m.encode()).expect("decode");
        assert_eq!(back, m);
        assert_eq!(m.bytes(), 2 * (1 + 2 + 3 + 4));
        assert_eq!(m.regions[0].objects().count(), 4);
    }

    #[test]
    fn a_manifest_whose_regions_leave_a_gap_or_another_format_is_refused() {
        let gap = manifest(vec![part(1, "", Some("6d")), part(2, "70", None)]);
        assert!(matches!(BackupManifest::decode(&gap.encode()), Err(ManifestError::Coverage(_))));
        let short = manifest(vec![part(1, "", Some("6d"))]);
        assert!(matches!(BackupManifest::decode(&short.encode()), Err(ManifestError::Coverage(_))));
        assert!(matches!(BackupManifest::decode(&manifest(vec![]).encode()), Err(ManifestError::Coverage(_))));
        let mut future = manifest(vec![part(1, "", None)]);
        future.format = 2;
        assert_eq!(BackupManifest::decode(&future.encode()), Err(ManifestError::Format(2)));
        assert!(matches!(BackupManifest::decode(b"{"), Err(ManifestError::Malformed(_))));
    }

    #[test]
    fn ids_sort_by_time_and_name_the_date() {
        // 2026-11-27T13:06:23Z
        let t = 1_795_784_783_000;
        assert_eq!(backup_id(t, 0xabcdef12), "20261127T130623Z-abcdef12");
        assert_eq!(backup_id(0, 1), "19700101T000000Z-00000001");
        assert!(backup_id(t, 0xffff_ffff) < backup_id(t + 1000, 0));
        assert_eq!(backup_id(951_782_400_000, 0), "20000229T000000Z-00000000", "a leap day");
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(unhex(&hex(b"\x00\xffab")).as_deref(), Some(&b"\x00\xffab"[..]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
    }
}
