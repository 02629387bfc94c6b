//! The HTTP API's JSON types (their OpenAPI schemas are derived from them: `/v1/openapi.json`).
//! Keys and values travel as text in an explicit encoding: `utf8` (the default) or `base64`
//! (standard or URL-safe alphabet, padding optional).

use base64::Engine;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

/// How keys and values are written in requests and replies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text (a stored value that is not UTF-8 cannot be returned this way).
    #[default]
    Utf8,
    /// Base64 (requests: standard or URL-safe alphabet, padding optional; replies: standard,
    /// padded).
    Base64,
}

impl Encoding {
    /// Bytes from text in this encoding.
    pub fn decode(self, s: &str) -> Result<Vec<u8>, String> {
        match self {
            Encoding::Utf8 => Ok(s.as_bytes().to_vec()),
            Encoding::Base64 => {
                let cleaned: String = s
                    .trim_end_matches('=')
                    .chars()
                    .map(|c| match c {
                        '-' => '+',
                        '_' => '/',
                        c => c,
                    })
                    .collect();
                base64::engine::general_purpose::STANDARD_NO_PAD
                    .decode(cleaned.as_bytes())
                    .map_err(|e| format!("not base64: {e}"))
            }
        }
    }

    /// Text in this encoding (None: the bytes are not UTF-8 and the encoding is `utf8`).
    pub fn encode(self, b: &[u8]) -> Option<String> {
        match self {
            Encoding::Utf8 => std::str::from_utf8(b).ok().map(str::to_owned),
            Encoding::Base64 => Some(base64::engine::general_purpose::STANDARD.encode(b)),
        }
    }
}

/// The query of the key routes.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct KeyQuery {
    /// How the key in the path (and a value in the reply) is written. Default `utf8`.
    pub encoding: Option<Encoding>,
    /// How a read may be served (hot-key replicas, docs/hot-keys.md): `linearizable` (the
    /// default, or the token's service level), `bounded:MS`, `extended`, `interleaved`.
    pub consistency: Option<String>,
}

/// A value read.
#[derive(Debug, Serialize, ToSchema)]
pub struct ValueReply {
    /// The key, in the reply's encoding.
    pub key: String,
    /// The value, in the reply's encoding.
    pub value: String,
    /// The encoding of `key` and `value`.
    pub encoding: Encoding,
    /// The version of the write that stored the value.
    pub version: u64,
}

/// How `PUT` writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PutMode {
    /// Create or replace (the default).
    #[default]
    Put,
    /// Create only: `409 key_exists` if the key exists.
    Insert,
    /// Replace only: `404 key_not_found` if the key does not exist.
    Update,
}

/// The body of `PUT /v1/kv/{key}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutBody {
    /// The value, in `encoding`.
    pub value: String,
    /// How `value` is written (default: the query's `encoding`, else `utf8`).
    pub encoding: Option<Encoding>,
    /// Create or replace (default), create only, or replace only.
    pub mode: Option<PutMode>,
}

/// A write applied.
#[derive(Debug, Serialize, ToSchema)]
pub struct WriteReply {
    /// The write's version.
    pub version: u64,
}

/// The query of `GET /v1/scan`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ScanQuery {
    /// First key (inclusive; absent or empty: the start of the key space).
    pub start: Option<String>,
    /// Last key (inclusive; absent or empty: the end of the key space).
    pub end: Option<String>,
    /// Most items (1 to 10,000; default 1,000).
    pub limit: Option<u32>,
    /// Most bytes of keys and values (default and maximum 4 MiB).
    pub max_bytes: Option<u32>,
    /// The `token` of the previous page, to continue.
    pub token: Option<String>,
    /// How `start`, `end` and the items are written. Default `utf8`.
    pub encoding: Option<Encoding>,
}

/// A key and its value.
#[derive(Debug, Serialize, ToSchema)]
pub struct Item {
    /// The key.
    pub key: String,
    /// The value.
    pub value: String,
}

/// A page of a scan.
#[derive(Debug, Serialize, ToSchema)]
pub struct ScanReply {
    /// The items, in key order.
    pub items: Vec<Item>,
    /// Send it back (with the same `start` and `end`) for the next page; absent when the range
    /// is done. Valid across splits and failovers.
    pub token: Option<String>,
    /// The encoding of the items.
    pub encoding: Encoding,
}

/// One write of a batch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchOp {
    /// `put`, `insert`, `update` or `delete`.
    pub op: BatchKind,
    /// The key.
    pub key: String,
    /// The value (not for `delete`).
    pub value: Option<String>,
}

/// A batch write's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BatchKind {
    /// Create or replace.
    Put,
    /// Create only.
    Insert,
    /// Replace only.
    Update,
    /// Remove.
    Delete,
}

/// The body of `POST /v1/batch`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    /// The writes (1 to 1,024), applied in order.
    pub ops: Vec<BatchOp>,
    /// How keys and values are written. Default `utf8`.
    pub encoding: Option<Encoding>,
    /// All or nothing (the default): the keys must lie in one region (`400 unsupported`
    /// otherwise). `false`: split by region, each region's share atomic, shares applied
    /// independently.
    pub atomic: Option<bool>,
}

/// The body of `POST /v1/atomic`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AtomicBody {
    /// `fetch_add` or `compare_and_swap`.
    pub op: AtomicKind,
    /// The key.
    pub key: String,
    /// `fetch_add`: what to add (wrapping) to the value, a u64 stored as 8 little-endian bytes
    /// (an absent key counts as 0).
    pub delta: Option<u64>,
    /// `compare_and_swap`: the value expected (absent or null: the key must not exist).
    pub expected: Option<String>,
    /// `compare_and_swap`: the value to store if the expectation holds.
    pub new: Option<String>,
    /// How the key and values are written. Default `utf8`.
    pub encoding: Option<Encoding>,
}

/// An atomic operation's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AtomicKind {
    /// Add to a u64 counter; answers the old value.
    FetchAdd,
    /// Replace a value if it is the one expected.
    CompareAndSwap,
}

/// What an atomic operation did.
#[derive(Debug, Serialize, ToSchema)]
pub struct AtomicReply {
    /// `fetch_add`: the value before the addition.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old: Option<u64>,
    /// `compare_and_swap`: whether the value was replaced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swapped: Option<bool>,
    /// `compare_and_swap`: the value found (null: the key did not exist), in the request's
    /// encoding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current: Option<Option<String>>,
    /// The write's version (0 when nothing was written).
    pub version: u64,
}

/// Every error's body.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// A stable code: the protocol's (`key_not_found`, `value_too_large`, `unavailable`, ...;
    /// docs/protocol.md §8) or the HTTP front end's own (`bad_encoding`, `not_found`,
    /// `method_not_allowed`, `unauthorized`, `forbidden`).
    pub code: String,
    /// What went wrong, for people.
    pub message: String,
}
