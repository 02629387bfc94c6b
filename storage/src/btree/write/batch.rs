//! The write path: [`BatchOp`], the single-operation shorthands, and [`Writer::write_batch_at`],
//! which checks limits and preconditions and takes all the space a batch may need before it
//! applies the first operation, so a batch is applied whole or not at all.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::Writer;
use crate::arena::SB_WRITE_VERSION;
use crate::btree::node::{BLOB_HDR, Val, ValRef};
use crate::config::MAX_VALUE_LEN;
use crate::error::{Error, Result};

/// One operation of a [`Writer::write_batch`].
#[derive(Debug, Clone, Copy)]
pub enum BatchOp<'a> {
    /// Upsert.
    Put(&'a [u8], &'a [u8]),
    /// Insert; the whole batch fails with [`Error::KeyExists`] if the key is present.
    Insert(&'a [u8], &'a [u8]),
    /// Update; the whole batch fails with [`Error::KeyNotFound`] if the key is absent.
    Update(&'a [u8], &'a [u8]),
    /// Delete (absent keys are fine). In an arena with `keep_tombstones` it always leaves a
    /// tombstone, which hides the key in older levels.
    Delete(&'a [u8]),
    /// Upsert a value that lives elsewhere (a value-log record): `len` bytes at `ptr`.
    PutPointer(&'a [u8], u64, u32),
}

impl<'a> BatchOp<'a> {
    fn key(&self) -> &'a [u8] {
        match *self {
            BatchOp::Put(k, _)
            | BatchOp::Insert(k, _)
            | BatchOp::Update(k, _)
            | BatchOp::Delete(k)
            | BatchOp::PutPointer(k, ..) => k,
        }
    }
    fn value(&self) -> Option<&'a [u8]> {
        match *self {
            BatchOp::Put(_, v) | BatchOp::Insert(_, v) | BatchOp::Update(_, v) => Some(v),
            BatchOp::Delete(_) | BatchOp::PutPointer(..) => None,
        }
    }
    /// The new stored value: inline bytes (a blob is substituted later), a pointer, a tombstone.
    fn new_value(&self) -> ValRef<'a> {
        match *self {
            BatchOp::Put(_, v) | BatchOp::Insert(_, v) | BatchOp::Update(_, v) => ValRef::Inline(v),
            BatchOp::PutPointer(_, ptr, len) => ValRef::Ext { ptr, len },
            BatchOp::Delete(_) => ValRef::Tombstone,
        }
    }
}

impl Writer {
    /// Upserts `key`; returns the write version.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write_batch(&[BatchOp::Put(key, value)])
    }

    /// Inserts `key`, failing with [`Error::KeyExists`] if present.
    pub fn insert(&mut self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write_batch(&[BatchOp::Insert(key, value)])
    }

    /// Updates `key`, failing with [`Error::KeyNotFound`] if absent.
    pub fn update(&mut self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write_batch(&[BatchOp::Update(key, value)])
    }

    /// Deletes `key`; returns the write version, or None if the key was absent and nothing was
    /// written (with `keep_tombstones` a tombstone is always written).
    pub fn delete(&mut self, key: &[u8]) -> Result<Option<u64>> {
        self.check_key(key)?;
        if !self.keep_tombstones && self.get(key)?.is_none() {
            return Ok(None);
        }
        self.write_batch(&[BatchOp::Delete(key)]).map(Some)
    }

    /// Keys are non-empty and at most the arena's `max_key_len`.
    fn check_key(&self, key: &[u8]) -> Result<()> {
        let max = self.arena.layout.max_key_len as usize;
        if key.is_empty() || key.len() > max {
            return Err(Error::KeySize { len: key.len(), max });
        }
        Ok(())
    }

    /// Applies `ops` atomically under one write version: readers see all of them or none. Either
    /// every precondition holds and everything is applied, or nothing is.
    pub fn write_batch(&mut self, ops: &[BatchOp<'_>]) -> Result<u64> {
        self.write_batch_at(self.version + 1, ops)
    }

    /// Like [`Writer::write_batch`] under a given version, which must be above every version
    /// written so far (versions may skip: a region never reuses a version its log has seen).
    ///
    /// A batch that fails changes nothing a reader can see and leaks nothing: limits,
    /// preconditions, heap pages, blob runs and node ids are all checked or taken before the first
    /// operation is applied. Only a corrupt arena can stop a batch half-way; the writer then
    /// refuses every later batch.
    pub fn write_batch_at(&mut self, w: u64, ops: &[BatchOp<'_>]) -> Result<u64> {
        if let Some(why) = &self.poisoned {
            return Err(Error::Unavailable(why.clone()));
        }
        if w <= self.version {
            return Err(Error::Config(format!("version {w} is not above the writer's {}", self.version)));
        }
        let ns = self.arena.layout.node_size as u64;
        let inline = self.arena.layout.inline_threshold as usize;
        let mut blob_pages = 0u64;
        for op in ops {
            self.check_key(op.key())?;
            if let BatchOp::PutPointer(_, _, len) = op
                && *len as usize > MAX_VALUE_LEN
            {
                return Err(Error::ValueTooLarge { len: *len as usize, max: MAX_VALUE_LEN });
            }
            if let Some(v) = op.value() {
                if v.len() > MAX_VALUE_LEN {
                    return Err(Error::ValueTooLarge { len: v.len(), max: MAX_VALUE_LEN });
                }
                if v.len() > inline {
                    blob_pages += (BLOB_HDR + v.len() as u64).div_ceil(ns);
                }
            }
        }
        self.check_preconditions(ops)?;
        let (needed, lids) = self.worst_case(ops.len() as u64, blob_pages);
        if self.pages.free() < needed || self.lids.free() < lids {
            self.reclaim_quietly();
            if self.pages.free() < needed || self.lids.free() < lids {
                return Err(Error::ArenaFull { needed: needed * ns, free: self.pages.free() * ns });
            }
        }
        self.reserve(needed)?;
        // Blobs need contiguous runs, which a fragmented heap may lack: take them all first.
        let mut blobs: Vec<Option<Val>> = Vec::with_capacity(ops.len());
        for op in ops {
            let blob = match op.value() {
                Some(v) if v.len() > inline => match self.write_blob(v) {
                    Ok(b) => Some(b),
                    Err(e) => {
                        for b in blobs.into_iter().flatten() {
                            self.free_blob(&b);
                        }
                        return Err(e);
                    }
                },
                _ => None,
            };
            blobs.push(blob);
        }
        self.arena.sb(SB_WRITE_VERSION).store(w, Ordering::Relaxed);
        for (op, blob) in ops.iter().zip(&blobs) {
            let value = match blob {
                Some(b) => b.as_ref(),
                None => op.new_value(),
            };
            if let Err(e) = self.apply(op.key(), value, w) {
                self.poisoned = Some(format!("a batch failed half-applied: {e}"));
                return Err(e);
            }
        }
        self.commit(w);
        Ok(w)
    }

    /// Checks the batch's inserts and updates against the tree as the batch's earlier operations
    /// leave it.
    fn check_preconditions(&self, ops: &[BatchOp<'_>]) -> Result<()> {
        let mut overlay: HashMap<&[u8], bool> = HashMap::new();
        for op in ops {
            let (need, after) = match op {
                BatchOp::Put(..) | BatchOp::PutPointer(..) => (None, true),
                BatchOp::Insert(..) => (Some(false), true),
                BatchOp::Update(..) => (Some(true), true),
                BatchOp::Delete(_) => (None, false),
            };
            if let Some(need) = need {
                let exists = match overlay.get(op.key()) {
                    Some(&e) => e,
                    None => self.get(op.key())?.is_some(),
                };
                if exists != need {
                    return Err(if need { Error::KeyNotFound } else { Error::KeyExists });
                }
            }
            if ops.len() > 1 {
                overlay.insert(op.key(), after);
            }
        }
        Ok(())
    }
}
