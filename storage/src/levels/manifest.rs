//! The manifest: which levels are live, their segments and roots, and the log position from which
//! recovery replays. Replaced atomically: write a temporary file, fsync, rename, fsync the
//! directory.

use std::path::Path;

use super::LevelMeta;
use super::format::{le32, le64};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"DPUKVMF1";
const VERSION: u32 = 2;
/// The manifest's file name.
pub const MANIFEST: &str = "MANIFEST";

/// The durable description of a region's levels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Manifest {
    /// Bumped on every replacement.
    pub generation: u64,
    /// Live levels, ascending by level number.
    pub levels: Vec<LevelMeta>,
    /// Recovery replays the value log from this position: every earlier record is in a level.
    pub log_start: u64,
    /// The next unused level segment id.
    pub next_segment: u64,
    /// Versions below or at this are in levels; writes continue above the log's newest.
    pub max_version: u64,
}

impl Manifest {
    /// Serializes the manifest (little-endian, CRC32C at the end).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.levels.len() as u32).to_le_bytes());
        for x in [self.generation, self.log_start, self.next_segment, self.max_version] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        for l in &self.levels {
            b.extend_from_slice(&l.level.to_le_bytes());
            b.extend_from_slice(&l.height.to_le_bytes());
            b.extend_from_slice(&l.node_size.to_le_bytes());
            b.extend_from_slice(&(l.segments.len() as u32).to_le_bytes());
            for x in [l.root, l.entries, l.max_version, l.bytes] {
                b.extend_from_slice(&x.to_le_bytes());
            }
            for s in &l.segments {
                b.extend_from_slice(&s.to_le_bytes());
            }
            b.extend_from_slice(&(l.log_refs.len() as u32).to_le_bytes());
            for (seg, bytes) in &l.log_refs {
                b.extend_from_slice(&seg.to_le_bytes());
                b.extend_from_slice(&bytes.to_le_bytes());
            }
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses a manifest; `path` names it in errors.
    pub fn decode(b: &[u8], path: &Path) -> Result<Manifest> {
        let bad = |off: usize, what| Error::corrupt_file(path, off as u64, what);
        if b.len() < 52 || &b[..8] != MAGIC {
            return Err(bad(0, "not a dpukv manifest"));
        }
        let body = b.len() - 4;
        if crc32c::crc32c(&b[..body]) != le32(b, body) {
            return Err(bad(body, "manifest checksum mismatch"));
        }
        if le32(b, 8) != VERSION {
            return Err(bad(8, "unsupported manifest version"));
        }
        let n = le32(b, 12) as usize;
        let mut m = Manifest {
            generation: le64(b, 16),
            log_start: le64(b, 24),
            next_segment: le64(b, 32),
            max_version: le64(b, 40),
            levels: Vec::new(),
        };
        let mut p = 48;
        for _ in 0..n {
            if p + 48 > body {
                return Err(bad(p, "manifest level entry truncated"));
            }
            let segs = le32(b, p + 12) as usize;
            let mut l = LevelMeta {
                level: le32(b, p),
                height: le32(b, p + 4),
                node_size: le32(b, p + 8),
                root: le64(b, p + 16),
                entries: le64(b, p + 24),
                max_version: le64(b, p + 32),
                bytes: le64(b, p + 40),
                segments: Vec::new(),
                log_refs: Vec::new(),
            };
            p += 48;
            if segs > (body - p) / 8 {
                return Err(bad(p, "manifest segment list truncated"));
            }
            l.segments = (0..segs).map(|i| le64(b, p + 8 * i)).collect();
            p += 8 * segs;
            if p + 4 > body {
                return Err(bad(p, "manifest log references truncated"));
            }
            let refs = le32(b, p) as usize;
            p += 4;
            if refs > (body - p) / 16 {
                return Err(bad(p, "manifest log references truncated"));
            }
            l.log_refs = (0..refs).map(|i| (le64(b, p + 16 * i), le64(b, p + 16 * i + 8))).collect();
            p += 16 * refs;
            m.levels.push(l);
        }
        if p != body {
            return Err(bad(p, "trailing bytes in the manifest"));
        }
        Ok(m)
    }

    /// Reads `dir/MANIFEST`, or None if there is none yet.
    pub fn load(dir: &Path) -> Result<Option<Manifest>> {
        let p = dir.join(MANIFEST);
        match std::fs::read(&p) {
            Ok(b) => Manifest::decode(&b, &p).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(&p, e)),
        }
    }

    /// Atomically replaces `dir/MANIFEST` with this manifest, through `fs`.
    pub fn store(&self, fs: &dyn crate::fs::Fs, dir: &Path) -> Result<()> {
        let p = dir.join(MANIFEST);
        crate::fs::write_atomic(fs, &p, &self.encode()).map_err(|e| Error::io(&p, e))
    }
}
