//! No import circle among the files of any crate of the workspace: each
//! file names (`crate::a::b`, `crate::{a, b}`, `super::x`, `self::x`) only
//! files that do not name it back, directly or through others. Layers
//! import downward; a room that needs something of its caller's gets it
//! handed in, or the thing moves to a room of its own below both. The
//! shim's own test (shim/src/layering.rs) also checks the order of its
//! layers; this one covers every crate, the CLI and the broker included.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Module path (`proto::conn`; the crate root is empty) → file.
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, prefix: &[String], out: &mut BTreeMap<Vec<String>, PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
        entries.sort_by_key(|e| e.path());
        for e in entries {
            let p = e.path();
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            // Test modules may use anything of the module they test.
            if stem == "tests" {
                continue;
            }
            if p.is_dir() {
                let mut next = prefix.to_vec();
                next.push(stem);
                walk(&p, &next, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                // src/bin/*.rs are crate roots of their own.
                if prefix.first().is_some_and(|p| p == "bin") {
                    continue;
                }
                let root = prefix.is_empty() && matches!(stem.as_str(), "lib" | "main");
                let mut name = prefix.to_vec();
                if stem != "mod" && !root {
                    name.push(stem);
                }
                out.insert(name, p);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &[], &mut out);
    out
}

/// The source without comments and without an inline `#[cfg(test)] mod`.
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let l = match line.find("//") {
            Some(at) if line[..at].matches('"').count() % 2 == 0 => &line[..at],
            _ => line,
        };
        out.push_str(l);
        out.push('\n');
    }
    match out.find("#[cfg(test)]\nmod tests {") {
        Some(at) => out[..at].to_owned(),
        None => out,
    }
}

/// Paths named after `prefix` (`crate::`, `super::`): `a::b` or a use tree
/// `{a, b::{c, d}}`, each as its segments.
fn named_after(text: &str, prefix: &str) -> Vec<(usize, Vec<String>)> {
    fn tree(s: &[u8], i: &mut usize, base: &[String], out: &mut Vec<Vec<String>>) {
        while *i < s.len() && s[*i].is_ascii_whitespace() {
            *i += 1;
        }
        if s.get(*i) == Some(&b'{') {
            *i += 1;
            let mut depth = 0;
            loop {
                while *i < s.len() && (s[*i].is_ascii_whitespace() || s[*i] == b',') {
                    *i += 1;
                }
                match s.get(*i) {
                    None => return,
                    Some(b'}') if depth == 0 => {
                        *i += 1;
                        return;
                    }
                    Some(b'}') => {
                        depth -= 1;
                        *i += 1;
                    }
                    _ => {
                        let before = *i;
                        tree(s, i, base, out);
                        if *i == before {
                            *i += 1;
                        }
                    }
                }
            }
        }
        let start = *i;
        while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == b'_') {
            *i += 1;
        }
        if start == *i {
            return;
        }
        let mut path = base.to_vec();
        path.push(String::from_utf8_lossy(&s[start..*i]).into_owned());
        if s[*i..].starts_with(b"::") {
            *i += 2;
            tree(s, i, &path, out);
        } else {
            out.push(path);
        }
    }
    let mut out = Vec::new();
    for (at, _) in text.match_indices(prefix) {
        // `super::` inside `super::super::` is counted by the caller.
        let before = &text[..at];
        if before.ends_with("super::")
            || before.ends_with(|c: char| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let mut ups = 1;
        let mut rest = &text[at + prefix.len()..];
        if prefix == "super::" {
            while let Some(r) = rest.strip_prefix("super::") {
                ups += 1;
                rest = r;
            }
        }
        let mut paths = Vec::new();
        tree(rest.as_bytes(), &mut 0, &[], &mut paths);
        out.extend(paths.into_iter().map(|p| (ups, p)));
    }
    out
}

/// The longest prefix of `path` that is a module.
fn resolve(mods: &BTreeMap<Vec<String>, PathBuf>, path: &[String]) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| mods.contains_key(p))
}

fn edges(mods: &BTreeMap<Vec<String>, PathBuf>) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut e = BTreeMap::new();
    for (m, file) in mods {
        let text = code(&std::fs::read_to_string(file).unwrap());
        // `super::` is the parent of the module, whether the module is a
        // directory's `mod.rs` or a file beside it.
        let parent: Vec<String> = m[..m.len().saturating_sub(1)].to_vec();
        let mut to = BTreeSet::new();
        let mut all: Vec<Vec<String>> = named_after(&text, "crate::")
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        for (ups, p) in named_after(&text, "super::") {
            let keep = parent.len().saturating_sub(ups - 1);
            all.push(parent[..keep].iter().cloned().chain(p).collect());
        }
        for (_, p) in named_after(&text, "self::") {
            all.push(m.iter().cloned().chain(p).collect());
        }
        for p in all {
            if let Some(t) = resolve(mods, &p)
                && &t != m
                && !t.is_empty()
            {
                to.insert(t);
            }
        }
        e.insert(m.clone(), to);
    }
    e
}

/// Strongly connected sets of two or more modules (Tarjan).
fn circles(e: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct S<'a> {
        e: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        idx: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        out: Vec<Vec<Vec<String>>>,
    }
    fn visit<'a>(s: &mut S<'a>, v: &'a Vec<String>) {
        let n = s.idx.len();
        s.idx.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for w in &s.e[v] {
            let Some((w, _)) = s.e.get_key_value(w) else {
                continue;
            };
            if !s.idx.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.idx[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.idx[v] {
            let mut c = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on.remove(w);
                c.push(w.clone());
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                s.out.push(c);
            }
        }
    }
    let mut s = S {
        e,
        idx: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in e.keys() {
        if !s.idx.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn no_crate_of_the_workspace_has_an_import_circle() {
    let root = Path::new(ROOT);
    let crates = [
        "src",
        "broker/src",
        "common/src",
        "shim/src",
        "sim/src",
        "k8s/src",
        "bench/src",
        "xtask/src",
        "redteam/src",
    ];
    let mut found = Vec::new();
    let mut files = 0;
    let mut linked = 0;
    for c in crates {
        let mods = modules(&root.join(c));
        files += mods.len();
        let e = edges(&mods);
        linked += e.values().map(BTreeSet::len).sum::<usize>();
        for circle in circles(&e) {
            let mut names: Vec<String> = circle
                .iter()
                .map(|m| mods[m].strip_prefix(root).unwrap().display().to_string())
                .collect();
            names.sort();
            found.push(format!("{c}: {}", names.join(" → ")));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
    // A parser that saw nothing would pass vacuously.
    assert!(
        files > 100 && linked > 200,
        "{files} files, {linked} imports"
    );
}

/// The checker finds a circle when there is one.
#[test]
fn a_circle_is_found() {
    let dir = std::env::temp_dir().join(format!("gpufrac-circles-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("room")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod room;\n").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::room::b::thing;\n").unwrap();
    std::fs::write(dir.join("room/mod.rs"), "pub mod b;\n").unwrap();
    std::fs::write(
        dir.join("room/b.rs"),
        "pub fn thing() { super::super::a::other(); }\n",
    )
    .unwrap();
    let mods = modules(&dir);
    let found = circles(&edges(&mods));
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].len(), 2);
}
