//! Generates the `ferrovol.v1` protobuf and gRPC code from proto/ferrovol.proto.

fn main() {
    // A protoc shipped as a crate, so a fresh machine needs no system package.
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    // SAFETY: build scripts are single-threaded, so no other thread reads the
    // environment while it changes.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc)
    };
    println!("cargo:rerun-if-changed=proto/ferrovol.proto");
    tonic_prost_build::configure()
        .compile_protos(&["proto/ferrovol.proto"], &["proto"])
        .expect("compile ferrovol.proto");
}
