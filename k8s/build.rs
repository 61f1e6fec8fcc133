//! Compiles the kubelet APIs in proto/ into Rust with prost and tonic: the
//! device-plugin API (api.proto) and the pod-resources API
//! (podresources.proto), vendored; the DRA plugin API (dra_v1.proto,
//! dra_v1beta1.proto) and plugin registration (pluginregistration.proto),
//! declared from the upstream definitions (each file says whence).
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
    // devices; the DRA plugin's API in both versions kubelets speak, and
    // the registration with the kubelet's plugin watcher.
    let protos = [
        "proto/api.proto",
        "proto/podresources.proto",
        "proto/dra_v1.proto",
        "proto/dra_v1beta1.proto",
        "proto/pluginregistration.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])
        .unwrap_or_else(|e| panic!("{protos:?} do not compile: {e}"));
    tonic_prost_build::configure()
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("generating Rust from {protos:?}: {e}"));
}
