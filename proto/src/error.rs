//! Error codes on the wire and decoding errors.

/// Why a request failed, as carried in a response. Stable numbers: never reuse one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorCode {
    /// The request is malformed.
    BadRequest = 1,
    /// The operation code is unknown.
    UnknownOp = 2,
    /// Key empty or longer than [`crate::limits::MAX_KEY`].
    KeySize = 3,
    /// Value longer than [`crate::limits::MAX_VALUE`].
    ValueTooLarge = 4,
    /// More operations than the limits allow.
    TooManyOps = 5,
    /// `insert` of a present key.
    KeyExists = 6,
    /// `update` of an absent key.
    KeyNotFound = 7,
    /// An atomic on a value that is not an array of the element type (`add_text`: not a
    /// decimal 64-bit integer).
    TypeMismatch = 8,
    /// The request's region epoch is stale: refresh the region map and retry.
    StaleEpoch = 9,
    /// The key is not in a region this node serves.
    WrongRegion = 10,
    /// Temporarily unavailable (host restarting, failing over): retry.
    Unavailable = 11,
    /// Too busy: retry later.
    Overloaded = 12,
    /// A server-side failure.
    Internal = 13,
    /// Valid but not supported by this server.
    Unsupported = 14,
    /// The scan continuation token is malformed.
    BadToken = 15,
    /// The frame exceeds [`crate::limits::MAX_FRAME`].
    FrameTooLarge = 16,
    /// A retried exactly-once write is too old for the server to tell whether it was applied
    /// (its session entry was dropped): its outcome is unknown; do not retry it.
    SessionExpired = 17,
    /// The write was sent on (to the host) but no reply came back (the host died, or its log
    /// failed): it may or may not be applied. Retry only with the same exactly-once session tag.
    OutcomeUnknown = 18,
    /// The request needs a valid bearer token first (`auth`; a gateway with tokens configured).
    Unauthorized = 19,
    /// The token does not grant this operation on this key or range.
    Forbidden = 20,
    /// A read aimed at a hot-key replica (a device that is not the key's primary) found no copy
    /// fresh enough for the request's consistency: read it from the primary (docs/hot-keys.md).
    NotReplicated = 21,
}

impl ErrorCode {
    /// The code for byte `b`, if known.
    pub fn from_u8(b: u8) -> Option<ErrorCode> {
        use ErrorCode::*;
        Some(match b {
            1 => BadRequest,
            2 => UnknownOp,
            3 => KeySize,
            4 => ValueTooLarge,
            5 => TooManyOps,
            6 => KeyExists,
            7 => KeyNotFound,
            8 => TypeMismatch,
            9 => StaleEpoch,
            10 => WrongRegion,
            11 => Unavailable,
            12 => Overloaded,
            13 => Internal,
            14 => Unsupported,
            15 => BadToken,
            16 => FrameTooLarge,
            17 => SessionExpired,
            18 => OutcomeUnknown,
            19 => Unauthorized,
            20 => Forbidden,
            21 => NotReplicated,
            _ => return None,
        })
    }

    /// Whether the same request may succeed if retried later, and retrying cannot apply it twice
    /// (see [`ErrorCode::OutcomeUnknown`] for the one code that is retryable only with a session).
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorCode::StaleEpoch | ErrorCode::Unavailable | ErrorCode::Overloaded)
    }

    /// A stable name.
    pub fn name(self) -> &'static str {
        use ErrorCode::*;
        match self {
            BadRequest => "bad_request",
            UnknownOp => "unknown_op",
            KeySize => "key_size",
            ValueTooLarge => "value_too_large",
            TooManyOps => "too_many_ops",
            KeyExists => "key_exists",
            KeyNotFound => "key_not_found",
            TypeMismatch => "type_mismatch",
            StaleEpoch => "stale_epoch",
            WrongRegion => "wrong_region",
            Unavailable => "unavailable",
            Overloaded => "overloaded",
            Internal => "internal",
            Unsupported => "unsupported",
            BadToken => "bad_token",
            FrameTooLarge => "frame_too_large",
            SessionExpired => "session_expired",
            OutcomeUnknown => "outcome_unknown",
            Unauthorized => "unauthorized",
            Forbidden => "forbidden",
            NotReplicated => "not_replicated",
        }
    }
}

/// A frame that cannot be decoded. Small and cheap: it is returned on a hot path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// More bytes are needed for a complete frame.
    #[error("incomplete frame")]
    Incomplete,
    /// The frame declares a length beyond the limit (the connection must be closed).
    #[error("frame of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// Wrong protocol version.
    #[error("unsupported protocol version {0}")]
    Version(u8),
    /// The frame's structure is broken (the connection must be closed).
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
}
