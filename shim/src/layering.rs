//! The layering of lib.rs, checked on the sources: every path a module
//! names in the crate (`crate::x`, `$crate::x`, a submodule's `super::x`)
//! must lead to its own layer or one below, and the graph of those uses
//! must have no circle. A new module must be placed in `LAYERS` first.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Bottom to top, as lib.rs describes them.
const LAYERS: &[&[&str]] = &[
    &["log", "boundary", "hooklist", "driver"],
    &["view", "estimate", "watch", "session", "session::tests"],
    &["config", "ledger", "devices", "contexts"],
    &[
        "charge",
        "inflight",
        "client",
        "client::compute",
        "client::connect",
        "client::drain",
        "client::gate",
        "client::gate::tests",
        "client::lanes",
        "client::notes",
        "client::registration",
    ],
    &[
        "hooks",
        "hooks::ctx",
        "hooks::graphmem",
        "hooks::info",
        "hooks::init",
        "hooks::launch",
        "hooks::mem",
        "hooks::nvml",
        "hooks::process",
        "hooks::vmm",
    ],
    &["exports", "dlsym", "api"],
];

/// Not part of the library: the crate root only declares, and this test.
const OUTSIDE: &[&str] = &["lib", "layering"];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// Every module's source, by module path (`hooks/mem.rs` is `hooks::mem`).
fn sources() -> BTreeMap<String, String> {
    fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            let stem = p.file_stem().unwrap().to_str().unwrap().to_owned();
            if p.is_dir() {
                walk(&p, &format!("{prefix}{stem}::"), out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let name = if stem == "mod" {
                    prefix.trim_end_matches("::").to_owned()
                } else {
                    format!("{prefix}{stem}")
                };
                out.insert(name, std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        "",
        &mut out,
    );
    out
}

/// The paths a `use` tree or a path expression names, from the text right
/// after `crate::`: `a::b`, or `{a, b::{c, d}}`, each as its segments.
fn paths(text: &str) -> Vec<Vec<String>> {
    fn ident(s: &[u8], i: &mut usize) -> String {
        let start = *i;
        while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == b'_') {
            *i += 1;
        }
        String::from_utf8_lossy(&s[start..*i]).into_owned()
    }
    fn skip_ws(s: &[u8], i: &mut usize) {
        while *i < s.len() && s[*i].is_ascii_whitespace() {
            *i += 1;
        }
    }
    fn tree(s: &[u8], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
        skip_ws(s, i);
        if s.get(*i) == Some(&b'{') {
            *i += 1;
            loop {
                skip_ws(s, i);
                match s.get(*i) {
                    Some(b'}') | None => {
                        *i += 1;
                        return;
                    }
                    Some(b',') => *i += 1,
                    _ => {
                        let before = *i;
                        tree(s, i, prefix, out);
                        if *i == before {
                            // Something this parser does not know (`*`,
                            // `self`): skip it.
                            *i += 1;
                        }
                    }
                }
            }
        }
        let seg = ident(s, i);
        if seg.is_empty() {
            return;
        }
        let mut path = prefix.to_vec();
        path.push(seg);
        if s[*i..].starts_with(b"::") {
            *i += 2;
            tree(s, i, &path, out);
        } else {
            out.push(path);
        }
    }
    let mut out = Vec::new();
    tree(text.as_bytes(), &mut 0, &[], &mut out);
    out
}

/// The modules `module`'s source names, among `known`.
fn uses(module: &str, src: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let parent = module.rsplit_once("::").map(|(p, _)| p);
    let mut found = BTreeSet::new();
    for line in src.lines().filter(|l| !l.trim_start().starts_with("//")) {
        let mut roots: Vec<(&str, Vec<String>)> = Vec::new();
        for (at, _) in line.match_indices("crate::") {
            roots.push((&line[at + "crate::".len()..], Vec::new()));
        }
        if let Some(parent) = parent {
            for (at, _) in line.match_indices("super::") {
                let base = parent.split("::").map(str::to_owned).collect();
                roots.push((&line[at + "super::".len()..], base));
            }
        }
        for (text, base) in roots {
            for p in paths(text) {
                let full: Vec<String> = base.iter().cloned().chain(p).collect();
                // The longest prefix that names a module.
                if let Some(m) = (1..=full.len())
                    .rev()
                    .map(|n| full[..n].join("::"))
                    .find(|m| known.contains(m))
                    && m != module
                {
                    found.insert(m);
                }
            }
        }
    }
    found
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = sources();
    let known: BTreeSet<String> = src.keys().cloned().collect();
    src.iter()
        .filter(|(m, _)| !OUTSIDE.contains(&m.as_str()))
        .map(|(m, s)| (m.clone(), uses(m, s, &known)))
        .collect()
}

#[test]
fn the_parser_reads_use_trees() {
    assert_eq!(
        paths("{a, b::{c, d}, e::f};"),
        vec![
            vec!["a".to_string()],
            vec!["b".into(), "c".into()],
            vec!["b".into(), "d".into()],
            vec!["e".into(), "f".into()],
        ]
    );
    let known = ["gate", "hooks", "hooks::mem", "hooks::vmm", "ledger"]
        .map(String::from)
        .into();
    let u = uses(
        "hooks::mem",
        "use crate::gate::{Gate, gate};\n// crate::ledger in a comment\n\
         let x = super::vmm::create(); crate::hooks::mem::f();",
        &known,
    );
    assert_eq!(
        u,
        ["gate", "hooks::vmm"].map(String::from).into(),
        "self-uses and comments do not count"
    );
}

#[test]
fn every_module_is_in_a_layer() {
    for m in sources().keys() {
        assert!(
            OUTSIDE.contains(&m.as_str()) || layer_of(m).is_some(),
            "module {m} is in no layer: place it in LAYERS (layering.rs) and lib.rs's list"
        );
    }
    let all = sources();
    for m in LAYERS.iter().flat_map(|l| l.iter()) {
        assert!(all.contains_key(*m), "LAYERS names {m}, which has no file");
    }
}

#[test]
fn modules_use_only_their_layer_and_below() {
    let g = graph();
    let mut wrong = Vec::new();
    for (m, deps) in &g {
        let Some(lm) = layer_of(m) else { continue };
        for d in deps {
            if layer_of(d).is_some_and(|ld| ld > lm) {
                wrong.push(format!(
                    "{m} (layer {lm}) uses {d} (layer {:?})",
                    layer_of(d)
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The check sees real uses: the hooks reach the charge and the books.
    assert!(g["hooks::mem"].contains("charge") && g["charge"].contains("ledger"));
}

#[test]
fn the_module_graph_has_no_circle() {
    let g = graph();
    // Depth-first, with the path so far: a module met again on it closes a
    // circle.
    fn visit(
        m: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Result<(), String> {
        if let Some(at) = path.iter().position(|p| p == m) {
            return Err(format!("{} -> {m}", path[at..].join(" -> ")));
        }
        if done.contains(m) {
            return Ok(());
        }
        path.push(m.to_owned());
        for d in g.get(m).into_iter().flatten() {
            visit(d, g, path, done)?;
        }
        path.pop();
        done.insert(m.to_owned());
        Ok(())
    }
    let mut done = BTreeSet::new();
    for m in g.keys() {
        if let Err(circle) = visit(m, &g, &mut Vec::new(), &mut done) {
            panic!("the modules use each other in a circle: {circle}");
        }
    }
}

/// The export layer is not compiled into this test binary: were it, this
/// binary's own calls of `dlsym` would bind to the shim's `dlsym` export
/// rather than to the C library's.
#[test]
fn this_test_binary_has_no_exports() {
    fn object_of(addr: *const std::ffi::c_void) -> usize {
        // SAFETY: dladdr fills a struct we own.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        assert_ne!(unsafe { libc::dladdr(addr, &mut info) }, 0);
        info.dli_fbase as usize
    }
    let dlsym = object_of(libc::dlsym as *const std::ffi::c_void);
    let here = object_of(this_test_binary_has_no_exports as *const std::ffi::c_void);
    assert_ne!(dlsym, here, "dlsym binds to this binary's own");
}
