//! Compiles the vendored kubelet device-plugin API (proto/api.proto) into
//! Rust with prost and tonic.
//!
//! Compiled at build time rather than committed as generated code: the
//! generated code then can never drift from the .proto beside it, and no
//! regenerate-and-compare test is needed. What makes that possible without
//! asking users to install `protoc` is protox, a protobuf compiler written
//! in Rust: it turns the .proto into a FileDescriptorSet, which
//! tonic-prost-build turns into code without running protoc.

fn main() {
    let proto = "proto/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])
        .unwrap_or_else(|e| panic!("{proto} does not compile: {e}"));
    tonic_prost_build::configure()
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("generating Rust from {proto}: {e}"));
}
