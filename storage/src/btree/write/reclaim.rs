//! Reclamation: what a write replaced (node buffers, blobs, node ids) is retired at that write's
//! version and freed once no live reader, in any process, may still use a version before it
//! (epoch-based, with the reader slots in the arena; dead readers' slots are cleared on the way).

use std::sync::atomic::Ordering;

use super::Writer;
use crate::arena::{PT_RETIRED, SB_READ_VERSION};
use crate::error::Result;

/// Something retired, waiting for readers to move past the version that retired it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Garbage {
    /// A node buffer (one page) at this offset.
    Buffer(u64),
    /// A blob: its offset and its number of pages.
    Blob(u64, u64),
    /// A node id (its page-table entry is cleared when it is freed).
    Lid(u64),
}

impl Writer {
    /// Retires `g` at write version `w`.
    pub(super) fn retire(&mut self, w: u64, g: Garbage) {
        if let Garbage::Lid(lid) = g
            && let Ok(e) = self.arena.page_entry(lid, Ordering::Relaxed)
        {
            // Before `w` is published: a reader that can see `w` sees the mark (start hints).
            // Failing only for a LID outside the table, which no retired node has.
            let _ = self.map_lid(lid, e | PT_RETIRED);
        }
        self.garbage_pages += match g {
            Garbage::Buffer(_) => 1,
            Garbage::Blob(_, n) => n,
            Garbage::Lid(_) => 0,
        };
        self.garbage.push_back((w, g));
    }

    /// How long a reader in another pid namespace may hold a pin without a heartbeat before it is
    /// judged dead and its slot taken (default 30 s; the reader then gets `ReaderRevoked`).
    pub fn set_reader_lease(&mut self, lease: std::time::Duration) {
        self.watch.lease = lease;
    }

    /// The oldest read version any live reader of this arena (in any process) may be using:
    /// something unreachable from versions at or after it can be discarded. Dead readers' slots
    /// are cleared on the way.
    pub fn oldest_reader_version(&mut self) -> Result<u64> {
        let current = self.arena.load(SB_READ_VERSION, Ordering::SeqCst);
        self.watch.min_pinned(&self.arena.slots(), current, self.version)
    }

    /// Frees everything retired at versions no live reader can still see. Called automatically
    /// every few commits and when space runs low.
    pub fn reclaim(&mut self) -> Result<()> {
        self.commits_since_reclaim = 0;
        if let Some(&(wanted, _)) = self.garbage.front() {
            let current = self.arena.load(SB_READ_VERSION, Ordering::SeqCst);
            let min = self.watch.min_pinned(&self.arena.slots(), current, wanted)?;
            while let Some(&(v, g)) = self.garbage.front() {
                if v > min {
                    break;
                }
                self.garbage.pop_front();
                match g {
                    Garbage::Buffer(off) => {
                        self.pages.release(off, 1);
                        self.garbage_pages -= 1;
                    }
                    Garbage::Blob(off, n) => {
                        self.pages.release(off, n);
                        self.garbage_pages -= n;
                    }
                    Garbage::Lid(lid) => {
                        self.map_lid(lid, 0)?;
                        self.lids.release(lid);
                    }
                }
            }
        }
        self.publish_stats();
        Ok(())
    }

    /// Reclaims; an error (a corrupt reader slot) only means nothing more was freed this time.
    pub(super) fn reclaim_quietly(&mut self) {
        if self.reclaim().is_err() {
            self.reclaim_errors += 1;
        }
    }
}
