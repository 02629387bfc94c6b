//! Generates the kubelet's device plugin API (v1beta1) from the vendored .proto (needs `protoc`:
//! scripts/setup.sh installs Debian's protobuf-compiler).

fn main() -> std::io::Result<()> {
    println!("cargo:rerun-if-changed=proto/v1beta1/api.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/v1beta1/api.proto"], &["proto"])
}
