//! The HTTP/JSON front end (axum): `GET/PUT/DELETE /v1/kv/{key}`, `GET /v1/scan`, `POST
//! /v1/batch`, `POST /v1/atomic`, `/healthz`, `/readyz`, `/metrics` and `/v1/openapi.json`
//! (generated from the handlers and the types of `api`). Errors are JSON `{"code", "message"}`
//! with the status their code implies (docs/gateway.md).
//!
//! Bounds: connections are capped (more are closed at once); a connection must send a
//! request's headers within `idle_timeout` — when it opens, and between requests when kept
//! alive — or it is closed (hyper's header-read timeout), so idle or slow clients cannot hold
//! the connections; a request body may hold at most `max_body` bytes; a `/v1/` request reserves
//! its body and its largest reply from the gateway's memory budget only once its token is
//! checked (an unauthenticated request reserves nothing), and gives them back when answered;
//! each request, its wait for the budget included, must be answered within `request_timeout`.
//! HTTP/1 runs one request at a time per connection, so a connection holds at most one
//! request's reservation. Unknown bearer tokens count as failed authentications of the peer's
//! address (`crate::throttle`): past its allowance, `429 too_many_attempts`.
//!
//! # Layout
//! - `api`: the JSON types.
//! - this module: routes, handlers, errors, limits.

pub mod api;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dpukv_client::ClientError;
use dpukv_net::conn::Budget;
use dpukv_proto::{ErrorCode, Reply, WriteOp};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use utoipa::OpenApi;

use crate::auth::{self, Access, Principal};
use crate::metrics::Metrics;
use crate::scan::ScanRequest;
use crate::throttle::AuthThrottle;
use crate::upstream::Upstream;
use api::*;

/// The front end's limits.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections open at once (more are closed at once).
    pub max_connections: usize,
    /// Most bytes of a request body.
    pub max_body: usize,
    /// A request must be answered within this.
    pub request_timeout: Duration,
    /// A connection must send a request's headers within this (when it opens, and between
    /// requests).
    pub idle_timeout: Duration,
}

/// What every request shares.
#[derive(Clone)]
pub struct HttpState {
    /// The cluster.
    pub up: Arc<Upstream>,
    /// Who may do what.
    pub access: Access,
    /// Failed authentications per peer address.
    pub throttle: Arc<AuthThrottle>,
    /// Limits.
    pub limits: HttpLimits,
    /// The process's memory budget.
    pub budget: Budget,
    /// Whether the budget has stayed spent (`/readyz`).
    pub starvation: Arc<crate::budget::Starvation>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The web console (None: off).
    pub console: Option<Arc<crate::console::Console>>,
}

/// How long the memory budget may stay spent before `/readyz` says the gateway is not ready.
pub const STARVED_NOT_READY: Duration = Duration::from_secs(5);

/// An error answer: a status and a JSON body with a stable code.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &str, message: impl Into<String>) -> ApiError {
        ApiError { status, body: ErrorBody { code: code.into(), message: message.into() } }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    fn bad_encoding(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_encoding", message)
    }
}

/// The HTTP status of a protocol error code.
pub fn status_of(code: ErrorCode) -> StatusCode {
    use ErrorCode::*;
    match code {
        BadRequest | UnknownOp | KeySize | TooManyOps | BadToken => StatusCode::BAD_REQUEST,
        ValueTooLarge | FrameTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        KeyExists | TypeMismatch | SessionExpired => StatusCode::CONFLICT,
        KeyNotFound => StatusCode::NOT_FOUND,
        StaleEpoch | WrongRegion | Unavailable | NotReplicated => StatusCode::SERVICE_UNAVAILABLE,
        Overloaded => StatusCode::TOO_MANY_REQUESTS,
        Unsupported => StatusCode::BAD_REQUEST,
        OutcomeUnknown => StatusCode::GATEWAY_TIMEOUT,
        Internal => StatusCode::INTERNAL_SERVER_ERROR,
        Unauthorized => StatusCode::UNAUTHORIZED,
        Forbidden => StatusCode::FORBIDDEN,
    }
}

impl From<ClientError> for ApiError {
    fn from(e: ClientError) -> ApiError {
        // A write's failure that may have left it applied is outcome_unknown; the client
        // library says so whatever the operation, and reads never are.
        let r = e.into_reply(true);
        ApiError { status: status_of(r.code), body: ErrorBody { code: r.code.name().into(), message: r.message } }
    }
}

impl From<dpukv_proto::ErrorReply> for ApiError {
    fn from(r: dpukv_proto::ErrorReply) -> ApiError {
        ApiError { status: status_of(r.code), body: ErrorBody { code: r.code.name().into(), message: r.message } }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> ApiError {
        ApiError::bad_request(r.body_text())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body)).into_response();
        resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        resp
    }
}

type ApiResult<T> = Result<axum::Json<T>, ApiError>;

/// Who made the request (set by `authenticate`; `None` when the gateway is open).
#[derive(Clone, Default)]
pub struct Caller(Option<Arc<Principal>>);

impl Caller {
    /// The token's holder (None: an open gateway).
    pub(crate) fn principal(&self) -> Option<&Principal> {
        self.0.as_deref()
    }

    /// How the caller's gets are served: the request's `consistency`, else the token's service
    /// level, else linearizable; `400 bad_request` if the request's is not one.
    fn consistency(&self, asked: Option<&str>) -> Result<dpukv_proto::Consistency, ApiError> {
        match asked {
            Some(a) => dpukv_proto::Consistency::parse(a).ok_or_else(|| {
                ApiError::bad_request(format!("consistency {a:?} is not {}", dpukv_proto::Consistency::SPELLINGS))
            }),
            None => Ok(self.0.as_ref().and_then(|p| p.consistency).unwrap_or_default()),
        }
    }

    /// `Ok` if the caller may run `op` (everyone may on an open gateway); else `403 forbidden`.
    fn check(&self, op: &dpukv_proto::Op) -> Result<(), ApiError> {
        match &self.0 {
            Some(p) => p.check(op).map_err(ApiError::from),
            None => Ok(()),
        }
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _: &S) -> Result<Caller, Self::Rejection> {
        Ok(parts.extensions.get::<Caller>().cloned().unwrap_or_default())
    }
}

/// The address a request came from (set for every request by `serve`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peer(pub(crate) std::net::IpAddr);

/// Whether a request is one of the API's (`/v1/` but the OpenAPI document): these need a token
/// and reserve from the memory budget.
fn is_api(req: &Request) -> bool {
    let path = req.uri().path();
    path.starts_with("/v1/") && path != "/v1/openapi.json"
}

/// Checks the bearer token of every API request (`401 unauthorized` when one is needed and
/// missing or unknown; `429 too_many_attempts` while the peer's failed attempts are throttled)
/// and records who made it.
async fn authenticate(State(s): State<HttpState>, mut req: Request, next: Next) -> Response {
    if s.access.required() && is_api(&req) {
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        let peer = req.extensions().get::<Peer>().map(|p| p.0);
        if token.is_some()
            && let Some(ip) = peer
            && let Err(wait) = s.throttle.check(ip)
        {
            let message =
                format!("too many failed authentications from this address: retry in {} s", wait.as_secs().max(1));
            let mut resp = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_attempts", message).into_response();
            if let Ok(v) = HeaderValue::from_str(&wait.as_secs().max(1).to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
            return resp;
        }
        match token.and_then(|t| s.access.authenticate(t.as_bytes())) {
            Some(p) => {
                req.extensions_mut().insert(Caller(Some(p)));
            }
            None => {
                if token.is_some()
                    && let Some(ip) = peer
                {
                    s.throttle.failed(ip);
                }
                let mut resp = ApiError::from(auth::unauthorized()).into_response();
                resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return resp;
            }
        }
    }
    next.run(req).await
}

/// Reserves an API request's body and largest reply from the memory budget — after its token
/// was checked, inside its time limit — until it is answered.
async fn reserve(State(s): State<HttpState>, req: Request, next: Next) -> Response {
    if !is_api(&req) {
        return next.run(req).await;
    }
    let body = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(s.limits.max_body)
        .min(s.limits.max_body);
    let reply = match op_of(&req) {
        "scan" => 3 * dpukv_proto::limits::MAX_SCAN_BYTES as usize,
        "get" => 2 * dpukv_proto::limits::MAX_VALUE,
        _ => 4096,
    };
    let _held = s.budget.hold(body + reply).await;
    next.run(req).await
}

/// A JSON request body, whatever its `Content-Type` says (`curl -d` sends a form type): read
/// within the body limit, parsed strictly (unknown fields refused).
pub struct JsonBody<T>(pub T);

impl<T: serde::de::DeserializeOwned, S: Send + Sync> axum::extract::FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "frame_too_large", "the request body is too large")
            } else {
                ApiError::bad_request(e.body_text())
            }
        })?;
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| ApiError::bad_request(format!("the JSON body: {e}")))
    }
}

fn key_of(encoding: Encoding, key: &str) -> Result<Vec<u8>, ApiError> {
    encoding.decode(key).map_err(|e| ApiError::bad_encoding(format!("key: {e}")))
}

fn text_of(encoding: Encoding, b: &[u8], what: &str) -> Result<String, ApiError> {
    encoding
        .encode(b)
        .ok_or_else(|| ApiError::bad_encoding(format!("the {what} is not UTF-8: ask with encoding=base64")))
}

/// Reads a value.
#[utoipa::path(get, path = "/v1/kv/{key}", params(("key" = String, Path, description = "The key, in `encoding`"), KeyQuery),
    responses((status = 200, body = ValueReply), (status = 404, body = ErrorBody, description = "`key_not_found`"),
              (status = 400, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn get_kv(
    State(s): State<HttpState>,
    caller: Caller,
    Path(key): Path<String>,
    q: Result<Query<KeyQuery>, QueryRejection>,
) -> ApiResult<ValueReply> {
    let q = q?.0;
    let enc = q.encoding.unwrap_or_default();
    let consistency = caller.consistency(q.consistency.as_deref())?;
    let k = key_of(enc, &key)?;
    caller.check(&dpukv_proto::Op::Get { key: k.clone() })?;
    let client = s.up.client().clone().with_consistency(consistency);
    // Answered at once by the device in this process if it can (an embedded front door), else
    // through the client's full path.
    let mut value = Vec::new();
    let (reply, version) = match client.get_now_into(&k, &mut value) {
        Some(Ok(Some(version))) => (Reply::Value(Some(value)), version),
        Some(Ok(None)) => (Reply::Value(None), 0),
        Some(Err(e)) => return Err(e.into()),
        None => client.call(dpukv_proto::Op::Get { key: k.clone() }).await?,
    };
    match reply {
        Reply::Value(Some(v)) => Ok(axum::Json(ValueReply {
            key: text_of(enc, &k, "key")?,
            value: text_of(enc, &v, "value")?,
            encoding: enc,
            version,
        })),
        Reply::Value(None) => Err(ApiError::new(StatusCode::NOT_FOUND, "key_not_found", "no value for the key")),
        _ => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "unexpected reply")),
    }
}

/// Writes a value.
#[utoipa::path(put, path = "/v1/kv/{key}", params(("key" = String, Path, description = "The key, in `encoding`"), KeyQuery),
    request_body = PutBody,
    responses((status = 200, body = WriteReply), (status = 409, body = ErrorBody, description = "`key_exists` (insert)"),
              (status = 404, body = ErrorBody, description = "`key_not_found` (update)"), (status = 400, body = ErrorBody),
              (status = 413, body = ErrorBody), (status = 503, body = ErrorBody), (status = 504, body = ErrorBody)))]
async fn put_kv(
    State(s): State<HttpState>,
    caller: Caller,
    Path(key): Path<String>,
    q: Result<Query<KeyQuery>, QueryRejection>,
    body: Result<JsonBody<PutBody>, ApiError>,
) -> ApiResult<WriteReply> {
    let enc = q?.0.encoding.unwrap_or_default();
    let body = body?.0;
    let k = key_of(enc, &key)?;
    let v =
        body.encoding.unwrap_or(enc).decode(&body.value).map_err(|e| ApiError::bad_encoding(format!("value: {e}")))?;
    let mode = body.mode.unwrap_or_default();
    caller.check(&dpukv_proto::Op::Put { key: k.clone(), value: Vec::new() })?;
    if mode != PutMode::Put {
        // Insert and update answer whether the key existed: reading too.
        caller.check(&dpukv_proto::Op::Get { key: k.clone() })?;
    }
    let c = s.up.client();
    let version = match mode {
        PutMode::Put => c.put(&k, &v).await?,
        PutMode::Insert => c.insert(&k, &v).await?,
        PutMode::Update => c.update(&k, &v).await?,
    };
    Ok(axum::Json(WriteReply { version }))
}

/// Deletes a key (deleting an absent key succeeds).
#[utoipa::path(delete, path = "/v1/kv/{key}", params(("key" = String, Path, description = "The key, in `encoding`"), KeyQuery),
    responses((status = 200, body = WriteReply), (status = 400, body = ErrorBody), (status = 503, body = ErrorBody),
              (status = 504, body = ErrorBody)))]
async fn delete_kv(
    State(s): State<HttpState>,
    caller: Caller,
    Path(key): Path<String>,
    q: Result<Query<KeyQuery>, QueryRejection>,
) -> ApiResult<WriteReply> {
    let enc = q?.0.encoding.unwrap_or_default();
    let k = key_of(enc, &key)?;
    caller.check(&dpukv_proto::Op::Delete { key: k.clone() })?;
    Ok(axum::Json(WriteReply { version: s.up.client().delete(&k).await? }))
}

/// A page of the keys in `[start, end]`, in key order, across regions.
#[utoipa::path(get, path = "/v1/scan", params(ScanQuery),
    responses((status = 200, body = ScanReply), (status = 400, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn scan(
    State(s): State<HttpState>,
    caller: Caller,
    q: Result<Query<ScanQuery>, QueryRejection>,
) -> ApiResult<ScanReply> {
    let q = q?.0;
    let enc = q.encoding.unwrap_or_default();
    let bound = |b: &Option<String>, what: &str| -> Result<Vec<u8>, ApiError> {
        b.as_deref()
            .map_or(Ok(Vec::new()), |b| enc.decode(b).map_err(|e| ApiError::bad_encoding(format!("{what}: {e}"))))
    };
    let token = match &q.token {
        None => Vec::new(),
        Some(t) => Encoding::Base64
            .decode(t)
            .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "bad_token", "malformed token"))?,
    };
    let limit = q.limit.unwrap_or(1000);
    if limit == 0 {
        return Err(ApiError::bad_request("limit must be 1 to 10000"));
    }
    let req = ScanRequest {
        lo: bound(&q.start, "start")?,
        hi: bound(&q.end, "end")?,
        limit,
        max_bytes: q.max_bytes.unwrap_or(0),
        token,
        floor: false,
        floor_min: Vec::new(),
    };
    caller.check(&dpukv_proto::Op::Scan {
        lo: req.lo.clone(),
        hi: req.hi.clone(),
        limit: 0,
        max_bytes: 0,
        token: Vec::new(),
    })?;
    match crate::scan::run(&s.up, req).await? {
        Reply::Items { items, token } => {
            let items = items
                .iter()
                .map(|(k, v)| Ok(Item { key: text_of(enc, k, "key")?, value: text_of(enc, v, "value")? }))
                .collect::<Result<Vec<_>, ApiError>>()?;
            let token = (!token.is_empty()).then(|| {
                use base64::Engine;
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&token)
            });
            Ok(axum::Json(ScanReply { items, token, encoding: enc }))
        }
        _ => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "unexpected reply")),
    }
}

/// Writes several keys: atomically within one region (the default), or split by region.
#[utoipa::path(post, path = "/v1/batch", request_body = BatchBody,
    responses((status = 200, body = WriteReply), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 413, body = ErrorBody), (status = 503, body = ErrorBody),
              (status = 504, body = ErrorBody)))]
async fn batch(
    State(s): State<HttpState>,
    caller: Caller,
    body: Result<JsonBody<BatchBody>, ApiError>,
) -> ApiResult<WriteReply> {
    let body = body?.0;
    let ops = body.ops()?;
    let checked = dpukv_proto::Op::Batch { ops };
    caller.check(&checked)?;
    let dpukv_proto::Op::Batch { ops } = checked else { unreachable!("built above") };
    let c = s.up.client();
    let version = if body.atomic.unwrap_or(true) {
        match c.batch(ops).await {
            Err(e) if e.code() == Some(ErrorCode::WrongRegion) => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "unsupported",
                    "an atomic batch must stay within one region, and these keys span regions: send \"atomic\": false",
                ));
            }
            r => r?,
        }
    } else {
        c.batch_across_regions(ops).await?
    };
    Ok(axum::Json(WriteReply { version }))
}

impl BatchBody {
    /// The writes the body asks for (checked: 1 to 1,024 of them, each with a value but
    /// deletes, keys and values in the body's encoding).
    pub fn ops(&self) -> Result<Vec<WriteOp>, ApiError> {
        let enc = self.encoding.unwrap_or_default();
        if self.ops.is_empty() || self.ops.len() > dpukv_proto::limits::MAX_BATCH_OPS {
            return Err(ApiError::new(StatusCode::BAD_REQUEST, "too_many_ops", "a batch holds 1 to 1024 writes"));
        }
        let mut ops = Vec::with_capacity(self.ops.len());
        for (i, op) in self.ops.iter().enumerate() {
            let key = key_of(enc, &op.key)?;
            let value = |v: &Option<String>| -> Result<Vec<u8>, ApiError> {
                let v = v.as_deref().ok_or_else(|| ApiError::bad_request(format!("ops[{i}]: a value is needed")))?;
                enc.decode(v).map_err(|e| ApiError::bad_encoding(format!("ops[{i}].value: {e}")))
            };
            ops.push(match op.op {
                BatchKind::Put => WriteOp::Put { key, value: value(&op.value)? },
                BatchKind::Insert => WriteOp::Insert { key, value: value(&op.value)? },
                BatchKind::Update => WriteOp::Update { key, value: value(&op.value)? },
                BatchKind::Delete if op.value.is_some() => {
                    return Err(ApiError::bad_request(format!("ops[{i}]: a delete takes no value")));
                }
                BatchKind::Delete => WriteOp::Delete { key },
            });
        }
        Ok(ops)
    }
}

impl AtomicBody {
    /// The operation the body asks for (checked: `fetch_add` takes a delta only,
    /// `compare_and_swap` `new` and maybe `expected`, in the body's encoding).
    pub fn op(&self) -> Result<dpukv_proto::Op, ApiError> {
        let enc = self.encoding.unwrap_or_default();
        let key = key_of(enc, &self.key)?;
        match self.op {
            AtomicKind::FetchAdd => {
                if self.expected.is_some() || self.new.is_some() {
                    return Err(ApiError::bad_request("fetch_add takes a delta, not expected or new"));
                }
                let delta = self.delta.ok_or_else(|| ApiError::bad_request("fetch_add needs a delta"))?;
                Ok(dpukv_proto::Op::FetchAdd { key, delta })
            }
            AtomicKind::CompareAndSwap => {
                if self.delta.is_some() {
                    return Err(ApiError::bad_request("compare_and_swap takes expected and new, not a delta"));
                }
                let new = self.new.as_deref().ok_or_else(|| ApiError::bad_request("compare_and_swap needs new"))?;
                let new = enc.decode(new).map_err(|e| ApiError::bad_encoding(format!("new: {e}")))?;
                let expected = self
                    .expected
                    .as_deref()
                    .map(|e| enc.decode(e).map_err(|e| ApiError::bad_encoding(format!("expected: {e}"))))
                    .transpose()?;
                Ok(dpukv_proto::Op::CompareAndSwap { key, expected, new })
            }
        }
    }
}

impl ApiError {
    /// The stable code (`bad_request`, `too_many_ops`, ...).
    pub fn code(&self) -> &str {
        &self.body.code
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

/// `fetch_add` or `compare_and_swap`.
#[utoipa::path(post, path = "/v1/atomic", request_body = AtomicBody,
    responses((status = 200, body = AtomicReply), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody),
              (status = 503, body = ErrorBody), (status = 504, body = ErrorBody)))]
async fn atomic(
    State(s): State<HttpState>,
    caller: Caller,
    body: Result<JsonBody<AtomicBody>, ApiError>,
) -> ApiResult<AtomicReply> {
    let b = body?.0;
    let enc = b.encoding.unwrap_or_default();
    let op = b.op()?;
    caller.check(&op)?;
    let (reply, version) = s.up.client().call(op).await?;
    match reply {
        Reply::Scalar(old) => {
            Ok(axum::Json(AtomicReply { old: Some(u64::from_le_bytes(old)), swapped: None, current: None, version }))
        }
        Reply::Cas { swapped, current } => {
            let current = current.map(|v| text_of(enc, &v, "value")).transpose()?;
            Ok(axum::Json(AtomicReply { old: None, swapped: Some(swapped), current: Some(current), version }))
        }
        _ => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "unexpected reply")),
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "dpukv HTTP API", description = "The gateway's HTTP/JSON front end (docs/gateway.md)"),
    paths(
        get_kv,
        put_kv,
        delete_kv,
        scan,
        batch,
        atomic,
        crate::console::overview,
        crate::console::regions,
        crate::console::reads,
        crate::console::events,
        crate::console::drain,
        crate::console::step_down,
        crate::console::split
    ),
    components(schemas(
        Encoding,
        ValueReply,
        PutMode,
        PutBody,
        WriteReply,
        Item,
        ScanReply,
        BatchOp,
        BatchKind,
        BatchBody,
        AtomicKind,
        AtomicBody,
        AtomicReply,
        ErrorBody
    ))
)]
struct ApiDoc;

/// The OpenAPI document of the API (JSON).
pub fn openapi_json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_else(|_| "{}".into())
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi_json()).into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<HttpState>) -> Response {
    if let Some(d) = s.starvation.spent_for().filter(|d| *d >= STARVED_NOT_READY) {
        let message =
            format!("the memory budget has been spent for {} s: requests are waiting for memory", d.as_secs());
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message).into_response();
    }
    match s.up.client().current_map().await {
        Ok(m) if !m.regions.is_empty() => (StatusCode::OK, "ready\n").into_response(),
        Ok(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the cluster has no regions yet")
            .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn metrics(State(s): State<HttpState>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.encode())
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route (see /v1/openapi.json)")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not take that method")
}

/// The metric label of a request.
fn op_of(req: &Request) -> &'static str {
    let path = req.uri().path();
    match (req.method().as_str(), path) {
        ("GET", p) if p.starts_with("/v1/kv/") => "get",
        ("PUT", p) if p.starts_with("/v1/kv/") => "put",
        ("DELETE", p) if p.starts_with("/v1/kv/") => "delete",
        (_, "/v1/scan") => "scan",
        (_, "/v1/batch") => "batch",
        (_, "/v1/atomic") => "atomic",
        _ => "other",
    }
}

/// Bounds a request's time (its token check and its wait for the budget included) and counts
/// it.
async fn bounded(State(s): State<HttpState>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let op = op_of(&req);
    // A span joined to the caller's trace (`traceparent`), or a new trace; the cluster's
    // requests for it carry it.
    let parent = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(dpukv_proto::TraceContext::from_traceparent);
    let traced = if op == "other" {
        None
    } else {
        dpukv_net::telemetry::request_span("gateway http", op, parent.as_ref(), true)
    };
    let (span, ctx) = traced.map_or((None, None), |(s, c)| (Some(s), Some(c)));
    let run = dpukv_client::trace::scope(ctx, next.run(req));
    let mut resp = match tokio::time::timeout(s.limits.request_timeout, run).await {
        Ok(r) => r,
        Err(_) => ApiError::new(StatusCode::GATEWAY_TIMEOUT, "timeout", "the request took too long").into_response(),
    };
    drop(span);
    // The caller learns the trace it belongs to.
    if let Some(c) = ctx
        && let Ok(v) = header::HeaderValue::from_str(&c.traceparent())
    {
        resp.headers_mut().insert("traceresponse", v);
    }
    if !resp.status().is_success() && op != "other" {
        let code = match resp.status() {
            StatusCode::NOT_FOUND => "key_not_found",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            StatusCode::GATEWAY_TIMEOUT => "outcome_unknown",
            StatusCode::CONFLICT => "conflict",
            StatusCode::UNAUTHORIZED => "unauthorized",
            StatusCode::FORBIDDEN => "forbidden",
            StatusCode::TOO_MANY_REQUESTS => "too_many_attempts",
            _ => "bad_request",
        };
        s.metrics.error("http", code);
    }
    s.metrics.observe("http", op, started);
    resp
}

/// The router.
pub fn router(state: HttpState) -> Router {
    Router::new()
        // The rest of the path is the key: keys may hold slashes (`/v1/kv/app/a` is `app/a`).
        .route("/v1/kv/{*key}", get(get_kv).put(put_kv).delete(delete_kv))
        .route("/v1/scan", get(scan))
        .route("/v1/batch", post(batch))
        .route("/v1/atomic", post(atomic))
        .route("/v1/openapi.json", get(openapi))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(crate::console::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Innermost last: time and counts, then the token, then the reservation.
        .layer(axum::middleware::from_fn_with_state(state.clone(), reserve))
        .layer(axum::middleware::from_fn_with_state(state.clone(), authenticate))
        .layer(axum::middleware::from_fn_with_state(state.clone(), bounded))
        .layer(DefaultBodyLimit::max(state.limits.max_body))
        .with_state(state)
}

/// The admin endpoint's router: `/healthz`, `/readyz`, `/metrics` (also on the HTTP front end).
pub fn admin_router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
}

/// Serves `router` on `listener` (with TLS when `tls` is given) until `stop` (then finishes the
/// requests in progress). At most `max_connections` connections are open (more are closed at
/// once); each runs its handshake and requests in a task of its own (a slow client holds up no
/// one's accepts), and must send each request's headers within `idle_timeout`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    state: &HttpState,
    tls: Option<Arc<dpukv_net::tls::ServerTls>>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let open = Arc::new(Semaphore::new(state.limits.max_connections));
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let Ok((stream, addr)) = accepted else {
            // Out of descriptors, say: give the others a moment.
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (tls, router, metrics, stop) = (tls.clone(), router.clone(), state.metrics.clone(), stop.clone());
        let idle = state.limits.idle_timeout;
        connections.spawn(async move {
            let stream = match dpukv_net::tls::accept(tls.as_deref(), stream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "an HTTP client failed the TLS handshake");
                    return;
                }
            };
            let _counted = metrics.connection("http");
            let peer = Peer(addr.ip());
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let mut req = req.map(axum::body::Body::new);
                req.extensions_mut().insert(peer);
                // A router is always ready.
                tower::Service::call(&mut router.clone(), req)
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(idle).keep_alive(true);
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// JSON-ish text: the fields and values the bodies take, in any order and nesting.
    fn jsonish() -> impl Strategy<Value = String> {
        let atom = proptest::sample::select(vec![
            "{",
            "}",
            "[",
            "]",
            ",",
            ":",
            "\"ops\"",
            "\"op\"",
            "\"key\"",
            "\"value\"",
            "\"put\"",
            "\"insert\"",
            "\"delete\"",
            "\"encoding\"",
            "\"base64\"",
            "\"utf8\"",
            "\"atomic\"",
            "true",
            "null",
            "0",
            "18446744073709551615",
            "\"fetch_add\"",
            "\"compare_and_swap\"",
            "\"delta\"",
            "\"expected\"",
            "\"new\"",
            "\"AA==\"",
            "\"!!\"",
            "\"\"",
        ]);
        proptest::collection::vec(atom, 0..40).prop_map(|v| v.concat())
    }

    proptest! {
        /// Whatever the body, parsing and checking it answers (never panics), and what it
        /// accepts is within the limits. (The fuzz target `http_bodies` is the long form.)
        #[test]
        fn bodies_never_panic(text in jsonish(), bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            for t in [text.as_bytes(), bytes.as_slice()] {
                if let Ok(b) = serde_json::from_slice::<BatchBody>(t)
                    && let Ok(ops) = b.ops()
                {
                    prop_assert!(!ops.is_empty() && ops.len() <= dpukv_proto::limits::MAX_BATCH_OPS);
                }
                if let Ok(a) = serde_json::from_slice::<AtomicBody>(t) {
                    let _ = a.op();
                }
                let _ = serde_json::from_slice::<PutBody>(t);
            }
        }
    }

    #[test]
    fn bodies_are_checked() {
        let b: BatchBody =
            serde_json::from_str(r#"{"ops": [{"op": "delete", "key": "k", "value": "v"}]}"#).expect("parses");
        assert_eq!(b.ops().expect_err("a delete takes no value").code(), "bad_request");
        let b: BatchBody =
            serde_json::from_str(r#"{"ops": [{"op": "put", "key": "AA", "value": "/w"}], "encoding": "base64"}"#)
                .expect("parses");
        assert_eq!(b.ops().expect("valid"), vec![WriteOp::Put { key: vec![0], value: vec![0xff] }]);
        let a: AtomicBody =
            serde_json::from_str(r#"{"op": "fetch_add", "key": "n", "delta": 1, "new": "x"}"#).expect("parses");
        assert_eq!(a.op().expect_err("mixed").status(), StatusCode::BAD_REQUEST);
    }
}
