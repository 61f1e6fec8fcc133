//! Compiles the vendored kubelet APIs (proto/api.proto, the device-plugin
//! API; proto/podresources.proto, the pod-resources API) into Rust with
//! prost and tonic.
//!
//! Compiled at build time rather than committed as generated code: the
//! generated code then can never drift from the .proto beside it, and no
//! regenerate-and-compare test is needed. What makes that possible without
//! asking users to install `protoc` is protox, a protobuf compiler written
//! in Rust: it turns the .proto into a FileDescriptorSet, which
//! tonic-prost-build turns into code without running protoc.

fn main() {
    // The device-plugin API (package v1beta1) and the pod-resources API
    // (package v1), whose List tells the plugin which pod holds which
    // devices.
    let protos = ["proto/api.proto", "proto/podresources.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])
        .unwrap_or_else(|e| panic!("{protos:?} do not compile: {e}"));
    tonic_prost_build::configure()
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("generating Rust from {protos:?}: {e}"));
}
