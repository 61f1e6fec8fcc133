//! The function pointers `cuGetProcAddress` hands out must be this library's
//! own definitions even when an LD_PRELOADed shim exports the same names.
//! Without `-Bsymbolic` the address of an exported function taken inside the
//! library goes through the GOT and resolves to the interposer.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rerun-if-changed=build.rs");
}
