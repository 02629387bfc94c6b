//! Compiles the libfabric shim (shim/dkf.c) against the system's libfabric headers, with the
//! `libfabric` feature. Nothing is linked: the shim loads libfabric when first used. Without the
//! headers (Debian `libfabric-dev`) the crate builds its stand-in instead, and says so: every
//! fabric call then answers `FabricError::NotBuilt`.

fn main() {
    println!("cargo:rerun-if-changed=shim/dkf.c");
    println!("cargo::rustc-check-cfg=cfg(dkf_built)");
    if std::env::var_os("CARGO_FEATURE_LIBFABRIC").is_none() {
        return;
    }
    let dirs = ["/usr/include", "/usr/local/include"];
    if !dirs.iter().any(|d| std::path::Path::new(d).join("rdma/fabric.h").exists()) {
        println!(
            "cargo:warning=libfabric's headers (rdma/fabric.h) are not installed: dpukv is built without fabric endpoints (apt-get install libfabric-dev)"
        );
        return;
    }
    #[cfg(feature = "libfabric")]
    cc::Build::new().file("shim/dkf.c").flag_if_supported("-std=gnu11").warnings(true).compile("dkf");
    println!("cargo:rustc-cfg=dkf_built");
}
