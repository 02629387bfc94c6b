//! Invariant-checking workloads shared by the `dpukv-arena` tool, the tests, the fuzz targets
//! and the demo.
//!
//! # Layout
//! - `powerloss`: a region under a simulated power loss ([`powerloss::run`]).
//! - this module: the bank.
//!
//! The **bank**: `accounts` keys hold u64 balances; the writer moves amounts between two accounts
//! in one atomic batch (and inserts or deletes filler keys between accounts, so leaves split and
//! merge under the readers). Any snapshot must see every account and exactly the initial total.
//! With `pad`, each balance is followed by bytes derived from it, which readers check: values
//! past the arena's inline threshold live in blobs, and a blob reclaimed under a reader shows up
//! as padding that does not match its balance.

pub mod powerloss;

use crate::btree::{BatchOp, Snapshot, Writer};
use crate::error::Error;

/// A violated invariant, or an engine error.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] Error),
    /// A snapshot saw an inconsistent state.
    #[error("invariant violated: {0}")]
    Violation(String),
}

/// The bank workload's parameters.
#[derive(Debug, Clone, Copy)]
pub struct Bank {
    /// Number of accounts.
    pub accounts: u32,
    /// Initial balance of each account.
    pub initial: u64,
    /// Bytes after each balance, derived from it (0: 8-byte values, stored inline).
    pub pad: usize,
}

/// What one successful check saw.
#[derive(Debug, Clone, Copy)]
pub struct BankCheck {
    /// The snapshot's read version.
    pub version: u64,
    /// Items scanned (accounts and fillers).
    pub items: usize,
}

const ACCT_LEN: usize = 11;

impl Bank {
    /// Key of account `i`: `acct/NNNNNN`.
    pub fn account_key(i: u32) -> Vec<u8> {
        format!("acct/{i:06}").into_bytes()
    }

    /// A filler key sorting right after account `i`.
    pub fn filler_key(i: u32, n: u32) -> Vec<u8> {
        format!("acct/{i:06}/{n:08}").into_bytes()
    }

    /// The invariant total.
    pub fn total(&self) -> u64 {
        self.accounts as u64 * self.initial
    }

    /// Writes every account with its initial balance in one batch.
    pub fn init(&self, w: &mut Writer) -> Result<u64, Error> {
        let keys: Vec<Vec<u8>> = (0..self.accounts).map(Bank::account_key).collect();
        let val = self.value(self.initial);
        let ops: Vec<BatchOp> = keys.iter().map(|k| BatchOp::Put(k, &val)).collect();
        w.write_batch(&ops)
    }

    fn pad_byte(balance: u64, i: usize) -> u8 {
        (balance.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 7) >> 5) as u8
    }

    /// The stored form of `balance`.
    pub fn value(&self, balance: u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(8 + self.pad);
        v.extend_from_slice(&balance.to_le_bytes());
        v.extend((0..self.pad).map(|i| Bank::pad_byte(balance, i)));
        v
    }

    /// The balance a stored value holds, checking its length and padding.
    fn balance(&self, v: &[u8]) -> Result<u64, CheckError> {
        if v.len() != 8 + self.pad {
            return Err(CheckError::Violation(format!("balance of {} bytes, expected {}", v.len(), 8 + self.pad)));
        }
        let b = u64::from_le_bytes(v[..8].try_into().expect("8 bytes"));
        if let Some(i) = (0..self.pad).find(|&i| v[8 + i] != Bank::pad_byte(b, i)) {
            return Err(CheckError::Violation(format!(
                "the bytes of balance {b} do not match it at byte {} (memory changed under a reader?)",
                8 + i
            )));
        }
        Ok(b)
    }

    /// Moves up to `amount` from account `from` to `to`, and puts or deletes `filler`, in one
    /// batch. Returns the write version.
    pub fn transfer(
        &self,
        w: &mut Writer,
        from: u32,
        to: u32,
        amount: u64,
        filler: Option<(&[u8], bool)>,
    ) -> Result<u64, CheckError> {
        let (fk, tk) = (Bank::account_key(from), Bank::account_key(to));
        let fb = self.balance(w.get(&fk)?.ok_or_else(|| CheckError::Violation("account missing".into()))?)?;
        let tb = self.balance(w.get(&tk)?.ok_or_else(|| CheckError::Violation("account missing".into()))?)?;
        let amount = if from == to { 0 } else { amount.min(fb) };
        let (fv, tv) = (self.value(fb - amount), self.value(tb + amount));
        let mut ops = vec![BatchOp::Put(&fk, &fv), BatchOp::Put(&tk, &tv)];
        if let Some((k, put)) = filler {
            ops.push(if put { BatchOp::Put(k, b"filler-value") } else { BatchOp::Delete(k) });
        }
        Ok(w.write_batch(&ops)?)
    }

    /// Checks a full scan of the account range (as a region reader returns it).
    pub fn check_pairs(&self, items: &[(Vec<u8>, Vec<u8>)]) -> Result<(), CheckError> {
        let mut sum = 0u64;
        let mut next = 0u32;
        for (k, v) in items.iter().filter(|(k, _)| k.len() == ACCT_LEN) {
            if k.as_slice() != Bank::account_key(next).as_slice() {
                return Err(CheckError::Violation(format!(
                    "expected account {next}, found {:?}",
                    String::from_utf8_lossy(k)
                )));
            }
            sum += self.balance(v)?;
            next += 1;
        }
        if next != self.accounts || sum != self.total() {
            return Err(CheckError::Violation(format!(
                "{next} accounts summing to {sum}, expected {} summing to {}",
                self.accounts,
                self.total()
            )));
        }
        Ok(())
    }

    /// Checks one snapshot: every account present once, in order, balances summing to the total;
    /// a point read of `probe` agrees with the scan.
    pub fn check(&self, snap: &Snapshot<'_>, probe: u32) -> Result<BankCheck, CheckError> {
        let mut sum = 0u64;
        let mut next = 0u32;
        let mut items = 0usize;
        let mut probe_val = None;
        let mut bad: Option<String> = None;
        snap.scan_with(b"acct/", b"acct/\xff", usize::MAX, |k, v| {
            items += 1;
            if bad.is_some() || k.len() != ACCT_LEN {
                return;
            }
            if k != Bank::account_key(next).as_slice() {
                bad = Some(format!("expected account {next}, found key {:?}", String::from_utf8_lossy(k)));
                return;
            }
            match self.balance(v) {
                Ok(b) => sum += b,
                Err(e) => bad = Some(e.to_string()),
            }
            if next == probe {
                probe_val = Some(v.to_vec());
            }
            next += 1;
        })?;
        let v = snap.version();
        if let Some(b) = bad {
            return Err(CheckError::Violation(format!("at version {v}: {b}")));
        }
        if next != self.accounts || sum != self.total() {
            return Err(CheckError::Violation(format!(
                "at version {v}: {next} accounts summing to {sum}, expected {} summing to {}",
                self.accounts,
                self.total()
            )));
        }
        let got = snap.get(&Bank::account_key(probe))?.map(|b| b.to_vec());
        if got != probe_val {
            return Err(CheckError::Violation(format!(
                "at version {v}: get of account {probe} disagrees with the scan"
            )));
        }
        Ok(BankCheck { version: v, items })
    }
}
