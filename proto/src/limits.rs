//! The protocol's limits. A request that exceeds one gets a typed error; a frame that exceeds
//! [`MAX_FRAME`] closes the connection (its length cannot be trusted).

/// Largest frame, header included.
pub const MAX_FRAME: usize = 16 << 20;
/// Largest key.
pub const MAX_KEY: usize = 1024;
/// Largest value.
pub const MAX_VALUE: usize = 1 << 20;
/// Most operations in one frame.
pub const MAX_OPS_PER_FRAME: usize = 1024;
/// Most write operations in one atomic batch.
pub const MAX_BATCH_OPS: usize = 1024;
/// Most increments in one `add_text` (a pipeline's run of `INCR`s on one key).
pub const MAX_ADDS: usize = 1024;
/// Most keys in one `add_texts`: what a write's exactly-once record can replay (each key's value
/// before it, 9 bytes, in a record of at most 255).
pub const MAX_ADD_KEYS: usize = 28;
/// Most items one scan reply returns (a larger limit is answered in pages with a token).
pub const MAX_SCAN_ITEMS: u32 = 10_000;
/// Most key+value bytes one scan reply returns.
pub const MAX_SCAN_BYTES: u32 = 4 << 20;
/// Largest continuation token.
pub const MAX_TOKEN: usize = MAX_KEY + 64;
/// Longest error message.
pub const MAX_MESSAGE: usize = 1024;
/// Largest vector operand of an atomic (the value limit).
pub const MAX_VECTOR: usize = MAX_VALUE;

/// Longest bearer token an `auth` request may carry.
pub const MAX_AUTH_TOKEN: usize = 256;
/// Most keys one `pivots` request may ask for.
pub const MAX_PIVOTS: u16 = 256;

/// Most nodes one `tree_nodes` request may ask to expand.
pub const MAX_EXPAND: usize = 64;
/// Most nodes one `tree_nodes` reply holds (a larger expansion is cut after the last parent whose
/// children all fit).
pub const MAX_TREE_NODES: usize = 16384;
