//! Helpers shared by the engine tests.

use dpukv_storage::{ArenaConfig, Writer};

/// SplitMix64: a tiny deterministic generator, so failures replay from a printed seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn bytes_upto(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max) as usize;
        self.bytes(n)
    }
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// A writer on a fresh arena in a temp dir (kept alive by the returned guard).
pub fn must_writer(cfg: &ArenaConfig) -> (tempfile::TempDir, std::path::PathBuf, Writer) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.arena");
    let w = Writer::create(&path, cfg).expect("create arena");
    (dir, path, w)
}

pub fn owned(v: Vec<(&[u8], &[u8])>) -> crate::support_model::Pairs {
    v.into_iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
}
