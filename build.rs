//! Compiles the C test fixtures (a `-lcuda` program and a second preloaded
//! interposer) that the integration tests run under the shim. They are
//! tiny; a machine without a C compiler still builds gpufrac itself, and the
//! tests that need a fixture say what is missing.

use std::path::{Path, PathBuf};

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let fx = Path::new("tests/fixtures");
    println!("cargo:rerun-if-changed=tests/fixtures");
    println!("cargo:rerun-if-changed=include/gpufrac.h");
    println!("cargo:rustc-env=GPUFRAC_FIXTURES={}", out.display());
    let cc = cc::Build::new().cargo_metadata(false).get_compiler();
    let run = |args: &[&str]| {
        let mut cmd = cc.to_command();
        cmd.args(args);
        match cmd.status() {
            Ok(s) if s.success() => true,
            _ => {
                println!("cargo:warning=could not compile test fixture: {args:?}");
                false
            }
        }
    };
    let o = |name: &str| out.join(name).display().to_string();
    let f = |name: &str| fx.join(name).display().to_string();
    std::fs::create_dir_all(out.join("stub")).unwrap();
    let stub = out.join("stub/libcuda.so").display().to_string();
    let _ = run(&[
        "-shared",
        "-fPIC",
        "-Wl,-soname,libcuda.so.1",
        "-o",
        &stub,
        &f("lcuda_stub.c"),
    ]) && run(&[
        "-o",
        &o("lcuda_app"),
        &f("lcuda_app.c"),
        &format!("-L{}", out.join("stub").display()),
        "-lcuda",
    ]);
    let _ = run(&[
        "-shared",
        "-fPIC",
        "-o",
        &o("librtldnext.so"),
        &f("rtld_next_preload.c"),
        "-ldl",
    ]);
    let _ = run(&["-o", &o("hello"), &f("hello.c")]);
    let _ = run(&[
        "-shared",
        "-fPIC",
        "-o",
        &o("libfakecudart.so"),
        &f("fake_cudart.c"),
        "-ldl",
    ]);
    let _ = run(&["-Iinclude", "-o", &o("api_app"), &f("api_app.c"), "-ldl"]);
}
