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
    // devices; the DRA plugin's API (v1) and the registration with the
    // kubelet's plugin watcher.
    let protos = [
        "proto/api.proto",
        "proto/podresources.proto",
        "proto/dra_v1.proto",
        "proto/pluginregistration.proto",
    ];
    // The DRA plugin's API as 1.32 and 1.33 kubelets call it: its service
    // takes v1's messages, which are generated once, where lib.rs includes
    // v1. A pass of its own, first: it may write an empty v1 file, which
    // the main pass then writes whole.
    let v1beta1 = ["proto/dra_v1beta1.proto"];
    for p in protos.iter().chain(&v1beta1) {
        println!("cargo:rerun-if-changed={p}");
    }
    let compile = |files: &[&str]| {
        protox::compile(files, ["proto"])
            .unwrap_or_else(|e| panic!("{files:?} do not compile: {e}"))
    };
    tonic_prost_build::configure()
        .extern_path(".k8s.io.kubelet.pkg.apis.dra.v1", "crate::dra_v1")
        .compile_fds(compile(&v1beta1))
        .unwrap_or_else(|e| panic!("generating Rust from {v1beta1:?}: {e}"));
    tonic_prost_build::configure()
        .compile_fds(compile(&protos))
        .unwrap_or_else(|e| panic!("generating Rust from {protos:?}: {e}"));
}
