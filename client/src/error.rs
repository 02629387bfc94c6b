//! Client errors.

use dpukv_proto::{DecodeError, ErrorCode, ErrorReply, Reply};

/// What can go wrong talking to dpukv.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting or writing failed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// The connection closed with the request in flight (it may or may not have executed).
    #[error("connection closed with the request in flight")]
    Disconnected,
    /// TLS failed in a way retrying will not fix: the server did not trust this client's
    /// certificate (or wanted one), this client did not trust the server's, or one end speaks
    /// TLS and the other does not. Nothing was executed.
    #[error("TLS: {0}")]
    Tls(String),
    /// A `fabric://` endpoint this process cannot use (a bad address, libfabric not built in or
    /// not installed). Nothing was sent.
    #[error("fabric: {0}")]
    Fabric(String),
    /// The server sent bytes that are not protocol v1.
    #[error("protocol: {0}")]
    Protocol(DecodeError),
    /// The server answered with an error.
    #[error("{}: {}", .0.code.name(), .0.message)]
    Server(ErrorReply),
    /// The request is outside the protocol's limits.
    #[error("invalid request: {}", .0.name())]
    Invalid(ErrorCode),
    /// A reply of an unexpected kind.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    /// No response within the attempt timeout (a write may or may not have executed).
    #[error("no response within the attempt timeout")]
    TimedOut,
    /// A write may or may not have been applied, and the client could not find out (it has no
    /// exactly-once session, or ran out of time retrying). Holds the last attempt's error.
    #[error("the write's outcome is unknown: {0}")]
    OutcomeUnknown(Box<ClientError>),
}

impl ClientError {
    /// Whether retrying may succeed and cannot apply anything twice (for a read, also
    /// [`ClientError::outcome_unknown`] errors are safe to retry).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Io(_) => true,
            ClientError::Server(e) => e.code.is_retryable(),
            _ => false,
        }
    }

    /// Whether the request may have executed: the connection broke or the attempt timed out
    /// with it in flight, or the server could not tell. A write failing this way is retried only
    /// with its exactly-once tag.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            ClientError::Disconnected | ClientError::TimedOut | ClientError::OutcomeUnknown(_) => true,
            ClientError::Server(e) => e.code == ErrorCode::OutcomeUnknown,
            _ => false,
        }
    }

    /// The server's error code, if the server answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server(e) => Some(e.code),
            ClientError::Invalid(c) => Some(*c),
            _ => None,
        }
    }

    /// The error as a protocol error reply (what a gateway answers its own client): the
    /// server's reply as it is; for a `write`, a failure that may have left it applied is
    /// `outcome_unknown`; anything else that kept the request from the cluster is
    /// `unavailable` (retryable: nothing was applied).
    pub fn into_reply(self, write: bool) -> ErrorReply {
        let code = match &self {
            ClientError::Server(e) => return e.clone(),
            ClientError::Invalid(c) => *c,
            ClientError::Protocol(_) | ClientError::Unexpected(_) => ErrorCode::Internal,
            e if write && e.outcome_unknown() => ErrorCode::OutcomeUnknown,
            _ => ErrorCode::Unavailable,
        };
        match dpukv_proto::Response::error(0, code, self.to_string()).result {
            Err(e) => e,
            Ok(_) => ErrorReply { code, message: String::new() },
        }
    }

    pub(crate) fn unexpected(r: &Reply) -> ClientError {
        ClientError::Unexpected(format!("{r:?}").chars().take(100).collect())
    }
}
