//! Bearer tokens and what they grant (docs/gateway.md, "Tokens"). With no tokens configured the
//! gateway is open; with tokens, every request needs one — the binary protocol's `auth` request
//! on the connection's first frame, HTTP's `Authorization: Bearer`, RESP's `AUTH` — and runs with
//! its grants: per key prefix, `read`, `write` or `admin` (both). A request is checked before
//! anything is read or written for it, and a scan's whole range must be granted.
//!
//! Tokens come from a JSON document (a file, re-read when it changes, or the `DPUKV_TOKENS`
//! environment variable). Secrets are kept only as SHA-256 digests and looked up by digest (no
//! comparison of secrets, so no timing to measure); a token is never logged or printed — only
//! its name. A secret given in clear must be at least [`MIN_TOKEN`] bytes. When the document
//! changes, connections holding a token learn it ([`Access::changed`]): a token no longer in
//! the document ends its sessions, a token whose grants changed runs with the new ones.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use dpukv_proto::{ErrorCode, ErrorReply, Op, WriteOp};
use serde::Deserialize;

/// The shortest secret accepted in clear (`token`): 16 bytes. Shorter ones can be guessed by
/// trying; a document holding one does not load. (`token_sha256` cannot be checked: give the
/// digest of a long random secret.)
pub const MIN_TOKEN: usize = 16;

/// What a grant allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Perm {
    /// Reads: get, scan, reduce, filter.
    Read,
    /// Writes: put, insert, update, delete, batches, vector updates.
    Write,
    /// Both (and administrative requests, as they come).
    Admin,
}

/// The token document.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    tokens: Vec<TokenSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenSpec {
    /// Who holds it (logged instead of the token).
    name: String,
    /// The secret, in clear.
    token: Option<String>,
    /// Or its SHA-256 digest, in hex.
    token_sha256: Option<String>,
    grants: Vec<GrantSpec>,
    /// Service level (hKVS §4.4): how this token's gets may be served when a request does not
    /// say (`linearizable`, `bounded:MS`, `extended`, `interleaved`).
    #[serde(default)]
    consistency: Option<String>,
}

impl std::fmt::Debug for TokenSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSpec").field("name", &self.name).finish_non_exhaustive()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantSpec {
    /// Keys starting with this (UTF-8; `prefix_base64` for other bytes). Empty: every key.
    #[serde(default)]
    prefix: String,
    /// The prefix in base64 instead.
    prefix_base64: Option<String>,
    allow: Vec<Perm>,
}

/// Permissions on the keys starting with a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The prefix.
    pub prefix: Vec<u8>,
    read: bool,
    write: bool,
}

impl Grant {
    fn allows(&self, p: Perm) -> bool {
        match p {
            Perm::Read => self.read,
            Perm::Write => self.write,
            Perm::Admin => self.read && self.write,
        }
    }

    /// Whether every key of `[lo, hi]` (empty `hi`: to the end of the key space) starts with
    /// the prefix.
    fn covers_range(&self, lo: &[u8], hi: &[u8]) -> bool {
        if self.prefix.is_empty() {
            return true;
        }
        lo.starts_with(&self.prefix) && !hi.is_empty() && hi.starts_with(&self.prefix)
    }
}

/// Who a token belongs to, and what it may do.
#[derive(Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's name.
    pub name: String,
    /// Its grants.
    pub grants: Vec<Grant>,
    /// Its service level: how its gets may be served when a request does not say.
    pub consistency: Option<dpukv_proto::Consistency>,
    /// The digest of its secret (how a reloaded document is searched for it).
    digest: [u8; 32],
}

impl std::fmt::Debug for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Principal")
            .field("name", &self.name)
            .field("grants", &self.grants)
            .field("consistency", &self.consistency)
            .finish_non_exhaustive()
    }
}

fn forbidden(what: &str) -> ErrorReply {
    ErrorReply { code: ErrorCode::Forbidden, message: format!("this token may not {what}") }
}

impl Principal {
    /// Whether it may `p` on `key`.
    pub fn may(&self, p: Perm, key: &[u8]) -> bool {
        self.grants.iter().any(|g| key.starts_with(&g.prefix) && g.allows(p))
    }

    /// Whether it may `p` on every key of `[lo, hi]`.
    pub fn may_range(&self, p: Perm, lo: &[u8], hi: &[u8]) -> bool {
        self.grants.iter().any(|g| g.allows(p) && g.covers_range(lo, hi))
    }

    /// The prefix of a grant covering `key` for `p` (the shortest), if any.
    pub fn granted_prefix(&self, p: Perm, key: &[u8]) -> Option<&[u8]> {
        self.grants
            .iter()
            .filter(|g| key.starts_with(&g.prefix) && g.allows(p))
            .map(|g| g.prefix.as_slice())
            .min_by_key(|p| p.len())
    }

    /// Checks a binary-protocol operation: `Ok` or a `forbidden` answer.
    pub fn check(&self, op: &Op) -> Result<(), ErrorReply> {
        let key = |p: Perm, k: &[u8], what: &str| if self.may(p, k) { Ok(()) } else { Err(forbidden(what)) };
        match op {
            Op::Get { key: k } | Op::Reduce { key: k, .. } | Op::Filter { key: k, .. } => {
                key(Perm::Read, k, "read this key")
            }
            Op::Put { key: k, .. }
            | Op::Delete { key: k }
            | Op::VectorScalar { key: k, .. }
            | Op::VectorVector { key: k, .. } => key(Perm::Write, k, "write this key"),
            // These answer what they found (whether the key existed, its old value): reading
            // too.
            Op::FetchAdd { key: k, .. }
            | Op::AddText { key: k, .. }
            | Op::CompareAndSwap { key: k, .. }
            | Op::Insert { key: k, .. }
            | Op::Update { key: k, .. } => {
                key(Perm::Write, k, "write this key")?;
                key(Perm::Read, k, "read this key (the operation tells whether it existed)")
            }
            Op::AddTexts { adds } => adds.iter().try_for_each(|(k, _)| {
                key(Perm::Write, k, "write every key of this add_texts")?;
                key(Perm::Read, k, "read every key of this add_texts (it answers their values)")
            }),
            Op::Batch { ops } => ops.iter().try_for_each(|o| {
                key(Perm::Write, WriteOp::key(o), "write every key of this batch")?;
                match o {
                    WriteOp::Insert { key: k, .. } | WriteOp::Update { key: k, .. } => key(
                        Perm::Read,
                        k,
                        "read the keys this batch inserts or updates (it tells whether they existed)",
                    ),
                    _ => Ok(()),
                }
            }),
            Op::Scan { lo, hi, .. } | Op::FloorScan { lo, hi, .. } | Op::Pivots { lo, hi, .. } => {
                if self.may_range(Perm::Read, lo, hi) {
                    Ok(())
                } else {
                    Err(forbidden("read the whole range (a scan must stay within a granted prefix)"))
                }
            }
            // A device's statistics: the console gathers them (and shows a token what it may read);
            // the gateway answers `unsupported` to anyone who asks it for them.
            Op::RegionMap | Op::Auth { .. } | Op::Stats => Ok(()),
            // Fences are keys of the whole region: only a token that may read everything.
            Op::TreeNodes { .. } => {
                if self.may_range(Perm::Read, &[], &[]) {
                    Ok(())
                } else {
                    Err(forbidden("read the tree's top (its fences are keys of the whole region)"))
                }
            }
            // Device to device only: a client may never write replicas' copies.
            Op::ReplicaSync { .. } => Err(forbidden("send replica syncs (devices send them to each other)")),
        }
    }
}

/// SHA-256 of a secret.
fn digest(secret: &[u8]) -> [u8; 32] {
    ring::digest::digest(&ring::digest::SHA256, secret).as_ref().try_into().expect("SHA-256 is 32 bytes")
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The tokens in force, by the digest of their secret.
#[derive(Debug, Default)]
pub struct Tokens {
    by_digest: HashMap<[u8; 32], Arc<Principal>>,
}

impl Tokens {
    /// Parses a token document (JSON; see docs/gateway.md).
    pub fn parse(text: &str) -> Result<Tokens, String> {
        use base64::Engine;
        let doc: Document = serde_json::from_str(text).map_err(|e| format!("the token document: {e}"))?;
        let mut by_digest = HashMap::new();
        for t in doc.tokens {
            let d = match (&t.token, &t.token_sha256) {
                // The message names the token, never its secret (nor the secret's length).
                (Some(secret), None) if secret.len() < MIN_TOKEN => {
                    return Err(format!(
                        "token {:?}: the secret is shorter than {MIN_TOKEN} bytes (use a long random one)",
                        t.name
                    ));
                }
                (Some(secret), None) if secret.len() <= dpukv_proto::limits::MAX_AUTH_TOKEN => {
                    digest(secret.as_bytes())
                }
                (None, Some(hex)) => {
                    unhex32(hex).ok_or_else(|| format!("token {:?}: token_sha256 is not 64 hex digits", t.name))?
                }
                _ => {
                    return Err(format!(
                        "token {:?}: give exactly one of token ({MIN_TOKEN} to {} bytes) and token_sha256",
                        t.name,
                        dpukv_proto::limits::MAX_AUTH_TOKEN
                    ));
                }
            };
            let mut grants = Vec::new();
            for g in t.grants {
                let prefix = match g.prefix_base64 {
                    Some(b) if g.prefix.is_empty() => base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .map_err(|e| format!("token {:?}: prefix_base64: {e}", t.name))?,
                    Some(_) => return Err(format!("token {:?}: give prefix or prefix_base64, not both", t.name)),
                    None => g.prefix.into_bytes(),
                };
                let has = |p: Perm| g.allow.contains(&p) || g.allow.contains(&Perm::Admin);
                grants.push(Grant { prefix, read: has(Perm::Read), write: has(Perm::Write) });
            }
            let consistency = match &t.consistency {
                Some(c) => Some(dpukv_proto::Consistency::parse(c).ok_or_else(|| {
                    format!("token {:?}: consistency {c:?} is not {}", t.name, dpukv_proto::Consistency::SPELLINGS)
                })?),
                None => None,
            };
            let principal = Principal { name: t.name.clone(), grants, consistency, digest: d };
            if by_digest.insert(d, Arc::new(principal)).is_some() {
                return Err(format!("token {:?}: the same secret is given twice", t.name));
            }
        }
        Ok(Tokens { by_digest })
    }

    /// Who `secret` belongs to, if anyone.
    pub fn authenticate(&self, secret: &[u8]) -> Option<Arc<Principal>> {
        self.by_digest.get(&digest(secret)).cloned()
    }

    /// The principal of the same secret as `p` in this document, if it is still there.
    pub fn current(&self, p: &Principal) -> Option<Arc<Principal>> {
        self.by_digest.get(&p.digest).cloned()
    }

    /// How many tokens.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }
}

/// Where the gateway's tokens come from.
#[derive(Clone)]
pub enum TokenSource {
    /// No tokens: the gateway is open.
    None,
    /// A file, re-read when its modification time changes.
    File(PathBuf),
    /// A document given at start (the `DPUKV_TOKENS` environment variable).
    Inline(String),
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::None => f.write_str("None"),
            TokenSource::File(p) => f.debug_tuple("File").field(p).finish(),
            // The document holds secrets: never printed.
            TokenSource::Inline(_) => f.write_str("Inline(..)"),
        }
    }
}

/// The access rule in force (shared by the front ends; swapped when the token file changes).
#[derive(Debug, Clone)]
pub struct Access {
    tokens: Option<Arc<RwLock<Arc<Tokens>>>>,
    /// Bumped whenever a new document is in force.
    generation: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Access {
    /// No tokens: everything is allowed.
    pub fn open() -> Access {
        Access { tokens: None, generation: Arc::new(tokio::sync::watch::Sender::new(0)) }
    }

    /// Loads the tokens of `source`.
    pub fn load(source: &TokenSource) -> Result<Access, String> {
        let tokens = match source {
            TokenSource::None => return Ok(Access::open()),
            TokenSource::File(p) => read_file(p)?,
            TokenSource::Inline(text) => Tokens::parse(text)?,
        };
        Ok(Access { tokens: Some(Arc::new(RwLock::new(Arc::new(tokens)))), ..Access::open() })
    }

    /// Puts `tokens` in force (what a reload of the file does).
    pub fn replace(&self, tokens: Tokens) {
        let Some(slot) = &self.tokens else { return };
        *slot.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(tokens);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Changes whenever a new token document is in force: a session holding a token then asks
    /// [`Access::current`] whether it still may go on.
    pub fn changed(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// `p` as the document in force has it (its grants may have changed); `None` once its
    /// token is no longer there (revoked: the session must end).
    pub fn current(&self, p: &Principal) -> Option<Arc<Principal>> {
        let t = self.tokens.as_ref()?;
        t.read().unwrap_or_else(|e| e.into_inner()).current(p)
    }

    /// Waits until `p`'s token is no longer in force (returns at once if it is not).
    pub async fn revoked(&self, p: &Principal) {
        let mut changes = self.changed();
        loop {
            if self.tokens.is_some() && self.current(p).is_none() {
                return;
            }
            if changes.changed().await.is_err() {
                // The access rule is gone (shutting down): never revoked.
                return std::future::pending().await;
            }
        }
    }

    /// Whether requests need a token.
    pub fn required(&self) -> bool {
        self.tokens.is_some()
    }

    /// Who `secret` belongs to (with no tokens configured: nobody, and nobody is needed).
    pub fn authenticate(&self, secret: &[u8]) -> Option<Arc<Principal>> {
        let t = self.tokens.as_ref()?;
        t.read().unwrap_or_else(|e| e.into_inner()).authenticate(secret)
    }

    /// Re-reads `path` every `every` while it changes (a bad new document is logged and the
    /// tokens in force are kept), until `stop`.
    pub fn reload_every(&self, path: PathBuf, every: Duration, stop: tokio_util::sync::CancellationToken) {
        if self.tokens.is_none() {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let mut seen = modified(&path);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                let now = modified(&path);
                if now == seen {
                    continue;
                }
                seen = now;
                match read_file(&path) {
                    Ok(t) => {
                        tracing::info!(tokens = t.len(), path = %path.display(), "reloaded the tokens");
                        me.replace(t);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "the token file changed but is not valid; keeping the tokens in force")
                    }
                }
            }
        });
    }
}

/// What tells a changed file: its modification time and length.
fn modified(p: &Path) -> Option<(SystemTime, u64)> {
    std::fs::metadata(p).and_then(|m| Ok((m.modified()?, m.len()))).ok()
}

fn read_file(p: &Path) -> Result<Tokens, String> {
    let text = std::fs::read_to_string(p).map_err(|e| format!("reading the token file {}: {e}", p.display()))?;
    Tokens::parse(&text)
}

/// The answer to a request made without a valid token.
pub fn unauthorized() -> ErrorReply {
    ErrorReply {
        code: ErrorCode::Unauthorized,
        message: "a valid bearer token is needed (the binary protocol's auth request, HTTP's Authorization: Bearer, RESP's AUTH)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = r#"{"tokens": [
        {"name": "app", "token": "s3cret-app-0123456789", "grants": [{"prefix": "app/", "allow": ["read", "write"]}]},
        {"name": "reader", "token_sha256": "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b",
         "grants": [{"prefix": "", "allow": ["read"]}]},
        {"name": "ops", "token": "root-ops-0123456789", "grants": [{"prefix_base64": "AAE=", "allow": ["admin"]}]}
    ]}"#;

    #[test]
    fn tokens_grant_what_they_say_and_nothing_more() {
        let t = Tokens::parse(DOC).expect("valid");
        assert!(t.authenticate(b"nope").is_none());
        let app = t.authenticate(b"s3cret-app-0123456789").expect("app");
        assert_eq!(app.name, "app");
        assert!(app.check(&Op::Put { key: b"app/x".to_vec(), value: vec![] }).is_ok());
        assert!(app.check(&Op::Get { key: b"app/x".to_vec() }).is_ok());
        let e = app.check(&Op::Put { key: b"other".to_vec(), value: vec![] }).expect_err("outside the prefix");
        assert_eq!(e.code, ErrorCode::Forbidden);
        let scan =
            |lo: &[u8], hi: &[u8]| Op::Scan { lo: lo.to_vec(), hi: hi.to_vec(), limit: 0, max_bytes: 0, token: vec![] };
        assert!(app.check(&scan(b"app/a", b"app/z")).is_ok());
        assert!(app.check(&scan(b"app/a", b"b")).is_err(), "a range reaching past the prefix");
        assert!(app.check(&scan(b"app/a", b"")).is_err(), "an unbounded range");
        let batch = Op::Batch {
            ops: vec![WriteOp::Put { key: b"app/1".to_vec(), value: vec![] }, WriteOp::Delete { key: b"x".to_vec() }],
        };
        assert!(app.check(&batch).is_err(), "every key of a batch");
        let adds = |keys: &[&[u8]]| Op::AddTexts { adds: keys.iter().map(|k| (k.to_vec(), vec![1])).collect() };
        assert!(app.check(&adds(&[b"app/1", b"app/2"])).is_ok());
        assert!(app.check(&adds(&[b"app/1", b"x"])).is_err(), "every key of an add_texts");
        // secret "secret" (its digest is given, not the secret)
        let reader = t.authenticate(b"secret").expect("reader by digest");
        assert!(reader.check(&scan(b"", b"")).is_ok());
        assert!(reader.check(&Op::Delete { key: b"k".to_vec() }).is_err());
        assert!(reader.check(&Op::FetchAdd { key: b"k".to_vec(), delta: 1 }).is_err(), "an atomic also writes");
        assert!(reader.check(&Op::AddText { key: b"k".to_vec(), deltas: vec![1] }).is_err(), "so does INCR's");
        let ops = t.authenticate(b"root-ops-0123456789").expect("ops");
        assert!(ops.check(&Op::FetchAdd { key: vec![0, 1, 2], delta: 1 }).is_ok(), "admin is read and write");
        assert!(ops.check(&Op::Get { key: vec![0, 2] }).is_err());
        assert!(!format!("{:?}", Tokens::parse(DOC).expect("valid")).contains("s3cret"), "secrets are never printed");
        assert_eq!(app.consistency, None, "no service level: the request's mode");
        // Service level: a token's class chooses how its gets are served.
        let doc = r#"{"tokens": [{"name": "batch", "token": "batch-secret-0123456789", "consistency": "bounded:200",
                       "grants": [{"prefix": "", "allow": ["read"]}]}]}"#;
        let batch = Tokens::parse(doc).expect("valid").authenticate(b"batch-secret-0123456789").expect("batch");
        assert_eq!(batch.consistency, Some(dpukv_proto::Consistency::Bounded { max_staleness_ms: 200 }));
        assert!(batch.check(&Op::ReplicaSync { watermark_ms: 1, reset: false, entries: vec![] }).is_err());
        assert!(batch.check(&Op::TreeNodes { key: vec![], nodes: vec![] }).is_ok(), "it may read every key");
        assert!(app.check(&Op::TreeNodes { key: b"app/".to_vec(), nodes: vec![] }).is_err(), "fences are any keys");
    }

    #[test]
    fn bad_documents_are_refused_with_reasons() {
        for bad in [
            r#"{"tokens": [{"name": "a", "grants": []}]}"#,
            r#"{"tokens": [{"name": "a", "token": "x-long-enough-secret", "token_sha256": "00", "grants": []}]}"#,
            r#"{"tokens": [{"name": "a", "token": "x-long-enough-secret", "grants": [{"allow": ["fly"]}]}]}"#,
            r#"{"tokens": [{"name": "a", "token": "x-long-enough-secret", "grants": [], "extra": 1}]}"#,
            r#"{"tokens": [{"name": "a", "token": "x-long-enough-secret", "grants": []}, {"name": "b", "token": "x-long-enough-secret", "grants": []}]}"#,
            r#"{"tokens": [{"name": "a", "token": "x-long-enough-secret", "grants": [], "consistency": "eventual"}]}"#,
            "not json",
        ] {
            assert!(Tokens::parse(bad).is_err(), "{bad}");
        }
    }

    /// A 1-byte secret was accepted: anyone could guess it. Short secrets stop the document
    /// from loading, and the error names the token, never the secret.
    #[test]
    fn short_secrets_are_refused_by_name() {
        let doc = r#"{"tokens": [{"name": "ci-bot", "token": "hunter2", "grants": []}]}"#;
        let e = Tokens::parse(doc).expect_err("a 7-byte secret");
        assert!(e.contains("ci-bot") && e.contains("16"), "{e}");
        assert!(!e.contains("hunter2"), "the secret is never printed: {e}");
        let doc = r#"{"tokens": [{"name": "ok", "token": "sixteen-bytes-ok", "grants": []}]}"#;
        assert!(Tokens::parse(doc).is_ok());
    }

    /// Insert and update tell whether the key existed, so a write-only token could probe keys
    /// it may not read: they need `read` too (docs/gateway.md, "Tokens"), in batches as well.
    #[test]
    fn insert_and_update_need_read_too() {
        let doc = r#"{"tokens": [{"name": "w", "token": "write-only-0123456789",
                      "grants": [{"prefix": "w/", "allow": ["write"]}]}]}"#;
        let w = Tokens::parse(doc).expect("valid").authenticate(b"write-only-0123456789").expect("w");
        let k = b"w/k".to_vec();
        assert!(w.check(&Op::Put { key: k.clone(), value: vec![] }).is_ok());
        assert!(w.check(&Op::Delete { key: k.clone() }).is_ok());
        for op in [Op::Insert { key: k.clone(), value: vec![] }, Op::Update { key: k.clone(), value: vec![] }] {
            assert_eq!(w.check(&op).expect_err("needs read").code, ErrorCode::Forbidden, "{op:?}");
        }
        let batch = |o: WriteOp| Op::Batch { ops: vec![WriteOp::Put { key: k.clone(), value: vec![] }, o] };
        assert!(w.check(&batch(WriteOp::Delete { key: k.clone() })).is_ok());
        assert!(w.check(&batch(WriteOp::Insert { key: k.clone(), value: vec![] })).is_err());
        assert!(w.check(&batch(WriteOp::Update { key: k.clone(), value: vec![] })).is_err());
    }

    /// A reloaded document: a token still there is found again (with its new grants), one
    /// removed is not — its sessions end — and the change is announced.
    #[tokio::test]
    async fn a_reload_revokes_removed_tokens() {
        let access = Access::load(&TokenSource::Inline(DOC.into())).expect("valid");
        let app = access.authenticate(b"s3cret-app-0123456789").expect("app");
        let mut changes = access.changed();
        access.replace(Tokens::parse(&DOC.replace(r#""prefix": "app/""#, r#""prefix": "app2/""#)).expect("valid"));
        changes.changed().await.expect("announced");
        assert_eq!(access.current(&app).expect("still there").grants[0].prefix, b"app2/".to_vec());
        let without = r#"{"tokens": [{"name": "other", "token": "another-secret-0123", "grants": []}]}"#;
        let revoked = access.revoked(&app);
        access.replace(Tokens::parse(without).expect("valid"));
        tokio::time::timeout(Duration::from_secs(5), revoked).await.expect("revoked");
        assert!(access.current(&app).is_none());
    }
}
