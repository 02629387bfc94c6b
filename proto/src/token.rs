//! The scan continuation token: where a scan that hit a limit resumes.
//!
//! `u8 token version (1) | u64 read version | last key returned`. The server resumes strictly
//! after the key; the read version lets it read the next page at the same version while it can.

/// A decoded continuation token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanToken {
    /// The version the first page was read at.
    pub read_version: u64,
    /// The last key returned; the next page starts after it.
    pub after: Vec<u8>,
}

impl ScanToken {
    /// Encodes the token.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(9 + self.after.len());
        b.push(1);
        b.extend_from_slice(&self.read_version.to_le_bytes());
        b.extend_from_slice(&self.after);
        b
    }

    /// Decodes a token (None if malformed).
    pub fn decode(b: &[u8]) -> Option<ScanToken> {
        if b.len() < 10 || b[0] != 1 || b.len() > crate::limits::MAX_TOKEN {
            return None;
        }
        Some(ScanToken { read_version: u64::from_le_bytes(b[1..9].try_into().ok()?), after: b[9..].to_vec() })
    }
}
