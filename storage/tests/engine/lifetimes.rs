//! Issue 8, item 1.1: values, keys and entries read through a `Snapshot` borrow the snapshot, not
//! the `Reader`, so they cannot outlive the pin that keeps their memory from being reused. These
//! programs compiled before (the values borrowed the reader) and must not compile now.

#[test]
fn values_cannot_outlive_their_snapshot() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/engine/compile_fail/*.rs");
}
