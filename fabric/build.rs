//! Compiles the libfabric shim (shim/dkf.c) against the system's libfabric headers, with the
//! `libfabric` feature. Nothing is linked: the shim loads libfabric when first used.

fn main() {
    println!("cargo:rerun-if-changed=shim/dkf.c");
    if std::env::var_os("CARGO_FEATURE_LIBFABRIC").is_none() {
        return;
    }
    #[cfg(feature = "libfabric")]
    cc::Build::new().file("shim/dkf.c").flag_if_supported("-std=gnu11").warnings(true).compile("dkf");
}
