//! What a backup's coordinator and the primaries say to each other through the cluster's
//! metadata (docs/backup.md §3): the job a fence's commit starts (`backup-jobs/<fence>`: where
//! to upload), and each primary's report of its region's part (`backup-jobs/<fence>/<region>`).
//! Both are bounded in size when read: input from the store is checked like any input.

use serde::{Deserialize, Serialize};

use crate::manifest::RegionPart;

/// The largest job or report read.
pub const MAX_JOB_VALUE: usize = 1 << 20;

/// A backup job: where the primaries upload their regions' parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The backup location's URL.
    pub to: String,
}

/// A primary's report of its region's part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartReport {
    /// Uploaded.
    Done {
        /// The part.
        part: RegionPart,
        /// Bytes put (objects the location did not hold yet).
        uploaded: u64,
    },
    /// Not uploaded, and why.
    Failed {
        /// What went wrong.
        error: String,
    },
}

fn decode<T: for<'de> Deserialize<'de>>(v: &[u8], what: &str) -> Result<T, String> {
    if v.len() > MAX_JOB_VALUE {
        return Err(format!("{what}: {} bytes, more than {MAX_JOB_VALUE}", v.len()));
    }
    serde_json::from_slice(v).map_err(|e| format!("{what}: {e}"))
}

impl JobSpec {
    /// Its JSON.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a job serializes")
    }

    /// Parses one.
    pub fn decode(v: &[u8]) -> Result<JobSpec, String> {
        decode(v, "backup job")
    }
}

impl PartReport {
    /// Its JSON.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a report serializes")
    }

    /// Parses one.
    pub fn decode(v: &[u8]) -> Result<PartReport, String> {
        decode(v, "backup part report")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_and_reports_round_trip_and_oversized_ones_are_refused() {
        let job = JobSpec { to: "s3://b/p".into() };
        assert_eq!(JobSpec::decode(&job.encode()), Ok(job));
        let failed = PartReport::Failed { error: "disk".into() };
        assert_eq!(PartReport::decode(&failed.encode()), Ok(failed));
        assert!(PartReport::decode(b"{\"nope\": 1}").is_err());
        let big = vec![b' '; MAX_JOB_VALUE + 1];
        assert!(JobSpec::decode(&big).expect_err("too big").contains("more than"));
    }
}
