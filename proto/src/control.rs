//! The host's control API routes (`/cluster/*`, docs/operations.md "Control API"): one parser
//! for the server and one printer for its callers (`dpukv cluster`, the test harness), so both
//! agree on every path. A route is a method and a path, nothing else: no query, no encoded
//! characters, no trailing slash. Parsing is checked and fuzzed (`fuzz/fuzz_targets/control_route.rs`).
//!
//! | method | path | what |
//! |---|---|---|
//! | POST, GET, DELETE | `/cluster/drain/{node}` | drain a node; its progress; stop |
//! | POST, GET, DELETE | `/cluster/step-down/{node}` | move its primaries away; progress; stop |
//! | POST | `/cluster/split/{region}/{hex key}` | split a region at a key (1..=1024 bytes) |
//! | POST | `/cluster/merge/{region}` | merge a region into its left neighbour |
//! | GET | `/cluster/summary` | the cluster at a glance |
//! | POST | `/cluster/backups/{hex location URL}` | start a backup to that location (docs/backup.md) |
//! | GET | `/cluster/backups/{job}` | a backup's progress, by the job id its start answered |
//! | POST | `/cluster/restore/{hex location URL}[/{backup id}]` | restore a backup (the latest if no id) into the empty cluster |
//! | GET, DELETE | `/cluster/restore` | the restore under way: its progress; abandon it |
//! | POST | `/cluster/backup-schedule/{hex schedule}` | set the cluster's backup schedule (restore points) |
//! | GET, DELETE | `/cluster/backup-schedule` | the schedule and the last backup; stop it |

use crate::limits::MAX_KEY;

/// What a request to a node's drain or step-down does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `POST`: ask for it.
    Request,
    /// `GET`: how far it is.
    Progress,
    /// `DELETE`: stop it.
    Cancel,
}

impl Action {
    fn method(self) -> &'static str {
        match self {
            Action::Request => "POST",
            Action::Progress => "GET",
            Action::Cancel => "DELETE",
        }
    }

    fn parse(method: &str) -> Option<Action> {
        Some(match method {
            "POST" => Action::Request,
            "GET" => Action::Progress,
            "DELETE" => Action::Cancel,
            _ => return None,
        })
    }
}

/// One control API request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlRoute {
    /// `/cluster/drain/{node}`.
    Drain {
        /// The node.
        node: u32,
        /// Ask, look, or stop.
        action: Action,
    },
    /// `/cluster/step-down/{node}`.
    StepDown {
        /// The node.
        node: u32,
        /// Ask, look, or stop.
        action: Action,
    },
    /// `POST /cluster/split/{region}/{hex key}`.
    Split {
        /// The region.
        region: u32,
        /// Where the new region starts (1..=[`MAX_KEY`] bytes).
        key: Vec<u8>,
    },
    /// `POST /cluster/merge/{region}`.
    Merge {
        /// The region merged into its left neighbour.
        region: u32,
    },
    /// `GET /cluster/summary`.
    Summary,
    /// `GET /cluster/events`: the cluster's event log (the master's, newest last).
    Events,
    /// `GET /cluster/loads`: the regions' reported sizes and write rates.
    Loads,
    /// `GET /cluster/host`: the host serving the API (its CPU, memory, uptime, lease age).
    Host,
    /// `POST /cluster/kubernetes/{hex JSON}`: the operator mirrors the custom resource's status
    /// (phase, conditions) for the console (1..=[`MAX_K8S_STATUS`] bytes of JSON).
    Kubernetes {
        /// The status, as JSON.
        status: Vec<u8>,
    },
    /// `POST /cluster/backups/{hex location}`.
    Backup {
        /// The location's URL (1..=[`MAX_LOCATION`] bytes of UTF-8).
        to: String,
    },
    /// `GET /cluster/backups/{job}`.
    BackupStatus {
        /// The job (a decimal number).
        job: u64,
    },
    /// `POST /cluster/restore/{hex location}[/{backup}]`.
    Restore {
        /// The location's URL (1..=[`MAX_LOCATION`] bytes of UTF-8).
        from: String,
        /// The backup's id (None: the latest there); 1..=[`MAX_BACKUP_ID`] of `A-Z a-z 0-9 -`.
        backup: Option<String>,
    },
    /// `/cluster/restore`: GET its progress, DELETE abandons it.
    RestoreStatus {
        /// Progress or Cancel.
        action: Action,
    },
    /// `POST /cluster/backup-schedule/{hex schedule}`.
    SetBackupSchedule {
        /// The schedule as the cluster stores it (`key=value` lines; the node checks it),
        /// 1..=[`MAX_SCHEDULE`] bytes.
        spec: Vec<u8>,
    },
    /// `/cluster/backup-schedule`: GET it (and the last backup), DELETE stops it.
    BackupSchedule {
        /// Progress or Cancel.
        action: Action,
    },
}

/// The longest backup schedule a route takes.
pub const MAX_SCHEDULE: usize = 1100;
/// The longest Kubernetes status mirrored (JSON bytes).
pub const MAX_K8S_STATUS: usize = 4096;

/// The longest backup id a route takes.
pub const MAX_BACKUP_ID: usize = 64;

fn backup_id(s: &str) -> Option<String> {
    let ok = !s.is_empty() && s.len() <= MAX_BACKUP_ID && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    ok.then(|| s.to_string())
}

/// The longest backup location URL a route takes.
pub const MAX_LOCATION: usize = 1000;

/// Why a method and path are not a control route: HTTP 404, 405 or 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No such path (404).
    #[error("no such control route")]
    NotFound,
    /// The path exists, not with this method (405).
    #[error("the method is not allowed on this route")]
    MethodNotAllowed,
    /// The path's shape is right but a part is not (400).
    #[error("{0}")]
    BadRequest(&'static str),
}

impl RouteError {
    /// The HTTP status it is answered with.
    pub fn status(self) -> u16 {
        match self {
            RouteError::NotFound => 404,
            RouteError::MethodNotAllowed => 405,
            RouteError::BadRequest(_) => 400,
        }
    }

    /// A stable code naming it.
    pub fn code(self) -> &'static str {
        match self {
            RouteError::NotFound => "not_found",
            RouteError::MethodNotAllowed => "method_not_allowed",
            RouteError::BadRequest(_) => "bad_request",
        }
    }
}

/// The longest path looked at (a mirrored status's hex is the longest route).
pub const MAX_PATH: usize = 64 + 2 * max(max(MAX_SCHEDULE, MAX_KEY), MAX_K8S_STATUS);

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

/// A decimal u32 without sign or leading zeros (so a route prints back to the same path).
fn number(s: &str, what: &'static str) -> Result<u32, RouteError> {
    let plain =
        !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    if !plain {
        return Err(RouteError::BadRequest(what));
    }
    s.parse().map_err(|_| RouteError::BadRequest(what))
}

/// Bytes to lower-case hex (what paths carry keys, locations and documents in).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Lower- or upper-case hex, even length, to bytes.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let digit = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    };
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

impl ControlRoute {
    /// The route `method` and `path` ask for (see the module documentation).
    pub fn parse(method: &str, path: &str) -> Result<ControlRoute, RouteError> {
        if path.len() > MAX_PATH {
            return Err(RouteError::NotFound);
        }
        let Some(rest) = path.strip_prefix("/cluster/") else { return Err(RouteError::NotFound) };
        let parts: Vec<&str> = rest.split('/').collect();
        let node_action = |node: &str| -> Result<(u32, Action), RouteError> {
            let action = Action::parse(method).ok_or(RouteError::MethodNotAllowed)?;
            Ok((number(node, "the node must be a decimal number")?, action))
        };
        let post = || if method == "POST" { Ok(()) } else { Err(RouteError::MethodNotAllowed) };
        match parts[..] {
            ["drain", node] => node_action(node).map(|(node, action)| ControlRoute::Drain { node, action }),
            ["step-down", node] => node_action(node).map(|(node, action)| ControlRoute::StepDown { node, action }),
            ["split", region, key] => {
                post()?;
                let region = number(region, "the region must be a decimal number")?;
                match unhex(key) {
                    Some(key) if !key.is_empty() && key.len() <= MAX_KEY => Ok(ControlRoute::Split { region, key }),
                    _ => Err(RouteError::BadRequest("the key must be 1 to 1024 bytes, in hex")),
                }
            }
            ["merge", region] => {
                post()?;
                Ok(ControlRoute::Merge { region: number(region, "the region must be a decimal number")? })
            }
            ["backups", arg] if method == "POST" => match unhex(arg).map(String::from_utf8) {
                Some(Ok(to)) if !to.is_empty() && to.len() <= MAX_LOCATION => Ok(ControlRoute::Backup { to }),
                _ => Err(RouteError::BadRequest("the location must be a URL of 1 to 1000 bytes, in hex")),
            },
            ["backups", arg] if method == "GET" => {
                let plain = !arg.is_empty()
                    && arg.len() <= 20
                    && arg.bytes().all(|b| b.is_ascii_digit())
                    && (arg == "0" || !arg.starts_with('0'));
                match arg.parse() {
                    Ok(job) if plain => Ok(ControlRoute::BackupStatus { job }),
                    _ => Err(RouteError::BadRequest("the job must be a decimal number")),
                }
            }
            ["backups", _] => Err(RouteError::MethodNotAllowed),
            ["restore"] => match Action::parse(method) {
                Some(action @ (Action::Progress | Action::Cancel)) => Ok(ControlRoute::RestoreStatus { action }),
                _ => Err(RouteError::MethodNotAllowed),
            },
            ["backup-schedule"] => match Action::parse(method) {
                Some(action @ (Action::Progress | Action::Cancel)) => Ok(ControlRoute::BackupSchedule { action }),
                _ => Err(RouteError::MethodNotAllowed),
            },
            ["backup-schedule", arg] => {
                post()?;
                match unhex(arg) {
                    Some(spec) if !spec.is_empty() && spec.len() <= MAX_SCHEDULE => {
                        Ok(ControlRoute::SetBackupSchedule { spec })
                    }
                    _ => Err(RouteError::BadRequest("the schedule must be 1 to 1100 bytes, in hex")),
                }
            }
            ["restore", arg] | ["restore", arg, _] => {
                post()?;
                let from = match unhex(arg).map(String::from_utf8) {
                    Some(Ok(from)) if !from.is_empty() && from.len() <= MAX_LOCATION => from,
                    _ => return Err(RouteError::BadRequest("the location must be a URL of 1 to 1000 bytes, in hex")),
                };
                let backup = match parts.get(2) {
                    None => None,
                    Some(id) => Some(
                        backup_id(id)
                            .ok_or(RouteError::BadRequest("the backup id must be 1 to 64 of A-Z a-z 0-9 -"))?,
                    ),
                };
                Ok(ControlRoute::Restore { from, backup })
            }
            ["kubernetes", arg] => {
                post()?;
                match unhex(arg) {
                    Some(status) if !status.is_empty() && status.len() <= MAX_K8S_STATUS => {
                        Ok(ControlRoute::Kubernetes { status })
                    }
                    _ => Err(RouteError::BadRequest("the status must be 1 to 4096 bytes of JSON, in hex")),
                }
            }
            ["summary"] | ["events"] | ["loads"] | ["host"] => {
                if method != "GET" {
                    return Err(RouteError::MethodNotAllowed);
                }
                Ok(match parts[0] {
                    "summary" => ControlRoute::Summary,
                    "events" => ControlRoute::Events,
                    "host" => ControlRoute::Host,
                    _ => ControlRoute::Loads,
                })
            }
            _ => Err(RouteError::NotFound),
        }
    }

    /// The HTTP method.
    pub fn method(&self) -> &'static str {
        match self {
            ControlRoute::Drain { action, .. } | ControlRoute::StepDown { action, .. } => action.method(),
            ControlRoute::RestoreStatus { action } | ControlRoute::BackupSchedule { action } => action.method(),
            ControlRoute::Split { .. }
            | ControlRoute::Merge { .. }
            | ControlRoute::Backup { .. }
            | ControlRoute::Restore { .. }
            | ControlRoute::SetBackupSchedule { .. }
            | ControlRoute::Kubernetes { .. } => "POST",
            ControlRoute::Summary
            | ControlRoute::Events
            | ControlRoute::Loads
            | ControlRoute::Host
            | ControlRoute::BackupStatus { .. } => "GET",
        }
    }

    /// The path (keys in lower-case hex).
    pub fn path(&self) -> String {
        match self {
            ControlRoute::Drain { node, .. } => format!("/cluster/drain/{node}"),
            ControlRoute::StepDown { node, .. } => format!("/cluster/step-down/{node}"),
            ControlRoute::Split { region, key } => format!("/cluster/split/{region}/{}", hex(key)),
            ControlRoute::Merge { region } => format!("/cluster/merge/{region}"),
            ControlRoute::Summary => "/cluster/summary".into(),
            ControlRoute::Events => "/cluster/events".into(),
            ControlRoute::Loads => "/cluster/loads".into(),
            ControlRoute::Host => "/cluster/host".into(),
            ControlRoute::Backup { to } => format!("/cluster/backups/{}", hex(to.as_bytes())),
            ControlRoute::BackupStatus { job } => format!("/cluster/backups/{job}"),
            ControlRoute::Restore { from, backup } => match backup {
                Some(id) => format!("/cluster/restore/{}/{id}", hex(from.as_bytes())),
                None => format!("/cluster/restore/{}", hex(from.as_bytes())),
            },
            ControlRoute::RestoreStatus { .. } => "/cluster/restore".into(),
            ControlRoute::SetBackupSchedule { spec } => format!("/cluster/backup-schedule/{}", hex(spec)),
            ControlRoute::BackupSchedule { .. } => "/cluster/backup-schedule".into(),
            ControlRoute::Kubernetes { status } => format!("/cluster/kubernetes/{}", hex(status)),
        }
    }

    /// Whether it changes the cluster (everything but progress and the summary).
    pub fn mutates(&self) -> bool {
        match self {
            ControlRoute::Drain { action, .. } | ControlRoute::StepDown { action, .. } => *action != Action::Progress,
            ControlRoute::RestoreStatus { action } | ControlRoute::BackupSchedule { action } => {
                *action != Action::Progress
            }
            ControlRoute::Split { .. }
            | ControlRoute::Merge { .. }
            | ControlRoute::Backup { .. }
            | ControlRoute::Restore { .. }
            | ControlRoute::SetBackupSchedule { .. }
            | ControlRoute::Kubernetes { .. } => true,
            ControlRoute::Summary
            | ControlRoute::Events
            | ControlRoute::Loads
            | ControlRoute::Host
            | ControlRoute::BackupStatus { .. } => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn routes_parse_and_print_back() {
        let r = |m: &str, p: &str| ControlRoute::parse(m, p);
        assert_eq!(r("POST", "/cluster/drain/3"), Ok(ControlRoute::Drain { node: 3, action: Action::Request }));
        assert_eq!(r("DELETE", "/cluster/step-down/2"), Ok(ControlRoute::StepDown { node: 2, action: Action::Cancel }));
        assert_eq!(r("POST", "/cluster/split/1/6d"), Ok(ControlRoute::Split { region: 1, key: b"m".to_vec() }));
        assert_eq!(r("POST", "/cluster/split/1/6D"), Ok(ControlRoute::Split { region: 1, key: b"m".to_vec() }));
        assert_eq!(r("POST", "/cluster/merge/4"), Ok(ControlRoute::Merge { region: 4 }));
        assert_eq!(r("GET", "/cluster/summary"), Ok(ControlRoute::Summary));
        assert_eq!(r("GET", "/cluster/events"), Ok(ControlRoute::Events));
        assert_eq!(r("GET", "/cluster/loads"), Ok(ControlRoute::Loads));
        assert_eq!(r("GET", "/cluster/host"), Ok(ControlRoute::Host));
        let k = ControlRoute::Kubernetes { status: br#"{"phase":"Running"}"#.to_vec() };
        assert_eq!(r("POST", &k.path()), Ok(k.clone()));
        assert!(k.mutates());
        assert_eq!(r("GET", &k.path()), Err(RouteError::MethodNotAllowed));
        assert!(r("POST", &format!("/cluster/kubernetes/{}", "00".repeat(MAX_K8S_STATUS + 1))).is_err());
        let big = ControlRoute::Kubernetes { status: vec![b'x'; MAX_K8S_STATUS] };
        assert_eq!(r("POST", &big.path()), Ok(big), "the longest status fits the path limit");
        assert_eq!(r("POST", "/cluster/events"), Err(RouteError::MethodNotAllowed));
        assert_eq!(r("POST", "/cluster/summary"), Err(RouteError::MethodNotAllowed));
        assert_eq!(r("GET", "/cluster/split/1/6d"), Err(RouteError::MethodNotAllowed));
        assert_eq!(r("PUT", "/cluster/drain/1"), Err(RouteError::MethodNotAllowed));
        for bad in ["/cluster/drain/+1", "/cluster/drain/01", "/cluster/drain/4294967296", "/cluster/drain/"] {
            assert!(matches!(r("POST", bad), Err(RouteError::BadRequest(_))), "{bad}");
        }
        for bad in ["/cluster/split/1/", "/cluster/split/1/6", "/cluster/split/1/+a", "/cluster/split/1/zz"] {
            assert!(matches!(r("POST", bad), Err(RouteError::BadRequest(_))), "{bad}");
        }
        let long = format!("/cluster/split/1/{}", "61".repeat(MAX_KEY + 1));
        assert!(matches!(r("POST", &long), Err(RouteError::BadRequest(_))));
        for missing in
            ["/metrics", "/cluster", "/cluster/", "/cluster/drain/1/", "/cluster/summary?x", "/x/cluster/summary"]
        {
            assert_eq!(r("GET", missing), Err(RouteError::NotFound), "{missing}");
        }
        let to = "s3://bucket/prefix".to_string();
        let backup = ControlRoute::Backup { to: to.clone() };
        assert_eq!(r("POST", &backup.path()), Ok(backup.clone()));
        assert_eq!(
            backup.path(),
            format!("/cluster/backups/{}", to.bytes().map(|b| format!("{b:02x}")).collect::<String>())
        );
        assert_eq!(r("GET", "/cluster/backups/77"), Ok(ControlRoute::BackupStatus { job: 77 }));
        assert_eq!(r("DELETE", "/cluster/backups/77"), Err(RouteError::MethodNotAllowed));
        for bad in ["/cluster/backups/", "/cluster/backups/zz", "/cluster/backups/ff"] {
            assert!(matches!(r("POST", bad), Err(RouteError::BadRequest(_))), "{bad}");
        }
        for bad in ["/cluster/backups/07", "/cluster/backups/x", "/cluster/backups/18446744073709551616"] {
            assert!(matches!(r("GET", bad), Err(RouteError::BadRequest(_))), "{bad}");
        }
        assert!(backup.mutates() && !ControlRoute::BackupStatus { job: 1 }.mutates());
        let id = "20261127T101500Z-00000000deadbeef".to_string();
        for restore in [
            ControlRoute::Restore { from: to.clone(), backup: None },
            ControlRoute::Restore { from: to.clone(), backup: Some(id.clone()) },
        ] {
            assert_eq!(r("POST", &restore.path()), Ok(restore.clone()));
            assert!(restore.mutates());
            assert_eq!(r("GET", &restore.path()), Err(RouteError::MethodNotAllowed));
        }
        assert_eq!(r("GET", "/cluster/restore"), Ok(ControlRoute::RestoreStatus { action: Action::Progress }));
        assert_eq!(r("DELETE", "/cluster/restore"), Ok(ControlRoute::RestoreStatus { action: Action::Cancel }));
        assert_eq!(r("POST", "/cluster/restore"), Err(RouteError::MethodNotAllowed));
        let schedule = ControlRoute::SetBackupSchedule { spec: b"to=file:///x\nevery_ms=1000\n".to_vec() };
        assert_eq!(r("POST", &schedule.path()), Ok(schedule.clone()));
        assert!(schedule.mutates());
        assert_eq!(r("GET", "/cluster/backup-schedule"), Ok(ControlRoute::BackupSchedule { action: Action::Progress }));
        assert_eq!(
            r("DELETE", "/cluster/backup-schedule"),
            Ok(ControlRoute::BackupSchedule { action: Action::Cancel })
        );
        assert!(matches!(r("POST", "/cluster/backup-schedule/zz"), Err(RouteError::BadRequest(_))));
        assert_eq!(r("GET", &schedule.path()), Err(RouteError::MethodNotAllowed));
        for bad in ["/cluster/restore/zz", "/cluster/restore/", "/cluster/restore/6161/a.b", "/cluster/restore/6161/"] {
            assert!(matches!(r("POST", bad), Err(RouteError::BadRequest(_))), "{bad}");
        }
        assert!(!ControlRoute::Summary.mutates());
        assert!(!ControlRoute::Drain { node: 1, action: Action::Progress }.mutates());
        assert!(ControlRoute::Drain { node: 1, action: Action::Cancel }.mutates());
    }

    proptest! {
        /// Any method and path: no panic; what parses prints back to a path that parses the same.
        #[test]
        fn any_request_parses_or_is_refused_and_routes_print_back(m in "[A-Z]{0,8}", p in "/cluster/[a-z0-9/+-]{0,40}") {
            if let Ok(route) = ControlRoute::parse(&m, &p) {
                prop_assert_eq!(route.method(), m.as_str());
                prop_assert_eq!(ControlRoute::parse(route.method(), &route.path()), Ok(route));
            }
        }
    }
}
