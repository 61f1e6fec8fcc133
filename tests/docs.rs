//! The documents a newcomer reads: every relative link in README.md,
//! CONTRIBUTING.md, SECURITY.md and docs/*.md leads, from the file that
//! holds it, to a file of the repository (and, for `#anchor`, to a heading
//! there), none leads outside it, and the README's configuration table
//! names every variable the shim reads, as the code spells them. And
//! references that rot: the files named in those documents and in the
//! code's comments exist, and so do the modules and items named as
//! `module::name` in a crate's comments.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn root() -> &'static Path {
    Path::new(ROOT)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// README.md, CONTRIBUTING.md, SECURITY.md and docs/*.md, relative to the
/// repository.
fn documents() -> Vec<String> {
    let mut docs: Vec<String> = ["README.md", "CONTRIBUTING.md", "SECURITY.md"]
        .map(String::from)
        .into();
    let mut more: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

/// Lines outside fenced code blocks, with their numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        match fence {
            Some(f) if t.starts_with(f) => fence = None,
            Some(_) => {}
            None if t.starts_with("```") => fence = Some("```"),
            None if t.starts_with("~~~") => fence = Some("~~~"),
            None => out.push((i + 1, line)),
        }
    }
    out
}

/// A line without its inline code spans, which may hold brackets that are
/// no link.
fn without_code(line: &str) -> String {
    let mut out = String::new();
    for (i, part) in line.split('`').enumerate() {
        if i % 2 == 0 {
            out.push_str(part);
        } else {
            out.push_str(&" ".repeat(part.len() + 2));
        }
    }
    out
}

struct Link {
    line: usize,
    target: String,
}

/// Inline links `[text](target "title")` and reference definitions
/// `[name]: target`.
fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    for (n, line) in prose(text) {
        let line = without_code(line);
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push(Link {
                line: n,
                target: target.trim_matches(['<', '>']).to_owned(),
            });
            rest = &after[end..];
        }
        let t = line.trim_start();
        if t.starts_with('[')
            && let Some((_, target)) = t.split_once("]: ")
        {
            out.push(Link {
                line: n,
                target: target.split_whitespace().next().unwrap_or("").to_owned(),
            });
        }
    }
    out
}

/// The anchors GitHub gives a document's headings: lower case, only
/// letters, digits, `-`, `_` and spaces kept, spaces made `-`, a repeated
/// one numbered.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    for (_, line) in prose(text) {
        let t = line.trim_start();
        let level = t.chars().take_while(|&c| c == '#').count();
        if level == 0 || level > 6 || !t[level..].starts_with(' ') {
            continue;
        }
        let title = t[level..].trim().trim_end_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut unique = slug.clone();
        let mut k = 0;
        while !seen.insert(unique.clone()) {
            k += 1;
            unique = format!("{slug}-{k}");
        }
    }
    seen
}

#[test]
fn every_relative_link_resolves_and_none_leaves_the_repository() {
    let repo = root().canonicalize().unwrap();
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = read(&doc);
        let dir = Path::new(&doc).parent().unwrap_or(Path::new(""));
        for l in links(&text) {
            let at = format!("{doc}:{}: ({})", l.line, l.target);
            let t = l.target.as_str();
            if t.contains("://") || t.starts_with("mailto:") || t.starts_with("//") {
                problems.push(format!(
                    "{at} leads outside the repository: the documents stand on their own"
                ));
                continue;
            }
            let (path, anchor) = match t.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (t, None),
            };
            let rel: PathBuf = if path.is_empty() {
                PathBuf::from(&doc)
            } else {
                dir.join(path)
            };
            let full = root().join(&rel);
            let Ok(real) = full.canonicalize() else {
                problems.push(format!("{at}: there is no {}", normalize(&rel)));
                continue;
            };
            if !real.starts_with(&repo) {
                problems.push(format!("{at} leads outside the repository"));
                continue;
            }
            checked += 1;
            if let Some(a) = anchor
                && real.extension().is_some_and(|e| e == "md")
            {
                let target = std::fs::read_to_string(&real).unwrap();
                if !anchors(&target).contains(a) {
                    problems.push(format!(
                        "{at}: {} has no heading whose anchor is #{a}",
                        normalize(&rel)
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The README alone links to a dozen documents: a parser that found
    // nothing would pass vacuously.
    assert!(checked > 30, "only {checked} links found");
}

/// `docs/../README.md` as `README.md`.
fn normalize(p: &Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            _ => {}
        }
    }
    parts.join("/")
}

/// The README's `## Configuration` section.
fn configuration_section() -> String {
    let readme = read("README.md");
    let start = readme
        .find("\n## Configuration\n")
        .expect("README.md has a ## Configuration section");
    let rest = &readme[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |e| e + 3);
    rest[..end].to_owned()
}

/// The values of `pub const VAR_…: &str = "…";` in a source file.
fn var_constants(rel: &str) -> Vec<String> {
    read(rel)
        .lines()
        .filter_map(|l| {
            let l = l.trim().strip_prefix("pub const VAR_")?;
            let (_, value) = l.split_once(": &str = \"")?;
            Some(value.strip_suffix("\";")?.to_owned())
        })
        .collect()
}

/// String literals that are a variable name of gpufrac's (`"GPU_…"`,
/// `"GPUFRAC_…"`) in a source file, its test module left out.
fn variable_literals(text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
    let mut out = Vec::new();
    for (i, piece) in code.split('"').enumerate() {
        if i % 2 == 1
            && (piece.starts_with("GPU_") || piece.starts_with("GPUFRAC_"))
            && piece
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        {
            out.push(piece.to_owned());
        }
    }
    out
}

#[test]
fn the_configuration_table_names_every_variable_the_shim_reads() {
    let section = configuration_section();
    let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
    let shim_vars = var_constants("common/src/config.rs");
    assert!(
        shim_vars.len() >= 10 && shim_vars.iter().any(|v| v == "GPUFRAC_JOB"),
        "{shim_vars:?}"
    );
    for var in &shim_vars {
        // `GPU_MEM_LIMIT_` is a prefix: its row is `GPU_MEM_LIMIT_<N>`.
        let row = if var.ends_with('_') {
            format!("| `{var}")
        } else {
            format!("| `{var}` |")
        };
        assert!(
            rows.iter().any(|r| r.starts_with(&row)),
            "README.md's configuration table has no row for {var}"
        );
    }
    // What `gpufrac` itself reads besides.
    for var in var_constants("src/inject.rs") {
        assert!(
            section.contains(&format!("`{var}`")),
            "README.md's Configuration does not mention {var}"
        );
    }
}

#[test]
fn every_variable_named_in_the_code_is_documented() {
    // Users' variables in the README's Configuration, the simulated
    // driver's in docs/simulator.md, test hooks in CONTRIBUTING.md.
    let documented =
        configuration_section() + &read("docs/simulator.md") + &read("CONTRIBUTING.md");
    let mut sources = Vec::new();
    let mut dirs: Vec<_> = ["shim/src", "common/src", "src", "sim/src"]
        .iter()
        .map(|d| root().join(d))
        .collect();
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                sources.push(p);
            }
        }
    }
    let mut missing = Vec::new();
    for p in &sources {
        let text = std::fs::read_to_string(p).unwrap();
        for var in variable_literals(&text) {
            let prefix = var.ends_with('_');
            if !(documented.contains(&format!("`{var}")) && (prefix || documented.contains(&var))) {
                missing.push(format!("{var} ({})", p.display()));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(missing.is_empty(), "undocumented: {}", missing.join(", "));
}

/// Every `.rs` file of the repository's crates (build output, caches and
/// fixtures' generated trees left out), relative to the repository.
fn sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if p.is_dir() {
                if !matches!(name.as_ref(), "target" | ".git" | "node_modules" | "dist")
                    && !name.starts_with('.')
                {
                    walk(&p, out);
                }
            } else if name.ends_with(".rs") {
                out.push(p.strip_prefix(root()).unwrap().to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(root(), &mut out);
    out.sort();
    out
}

/// The comment text of a Rust source (`//`, `///`, `//!`), line by line.
fn comments(text: &str) -> Vec<(usize, String)> {
    text.lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let at = l.find("//")?;
            // `"http://…"` and the like: a `//` inside a string literal.
            if l[..at].matches('"').count() % 2 == 1 {
                return None;
            }
            Some((i + 1, l[at..].trim_start_matches('/').to_owned()))
        })
        .collect()
}

/// Words that name a file of the repository: a relative path with a
/// directory (`broker/src/server.rs`, `tests/attacks.rs`) or a bare
/// Rust file name (`mig.rs`).
fn named_files(text: &str) -> Vec<String> {
    const EXTS: &[&str] = &[".rs", ".md", ".sh", ".toml", ".py", ".yaml", ".h"];
    let mut out = Vec::new();
    let is_word = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/');
    for word in text.split(|c: char| !is_word(c)) {
        let word = word.trim_end_matches('.');
        let Some(ext) = EXTS.iter().find(|e| word.ends_with(*e)) else {
            continue;
        };
        let stem = &word[..word.len() - ext.len()];
        // Absolute paths are the machine's, not the repository's; `..`
        // and placeholders (`PREFIX/…`) are not names; a bare name counts
        // only for Rust files.
        if stem.is_empty()
            || word.starts_with('/')
            || word
                .split('/')
                .any(|seg| seg.len() > 1 && seg.bytes().all(|b| b.is_ascii_uppercase()))
            || word.starts_with('.')
            || word.contains("..")
            || (!word.contains('/') && *ext != ".rs")
        {
            continue;
        }
        out.push(word.to_owned());
    }
    out
}

/// Whether a file named in `from` exists. A path: relative to the
/// repository, to the naming file's directory, or to a crate's directory,
/// `src/` or `tests/` (documents name `hooks/vmm.rs` for the shim's). A
/// bare Rust file name: in the naming file's own crate when a crate's
/// source names it, anywhere among the sources when a document does.
fn file_exists(from: &Path, named: &str, sources: &[PathBuf]) -> bool {
    let dir = from.parent().unwrap_or(Path::new(""));
    let crate_of = |p: &Path| -> Option<PathBuf> {
        let mut d = p.parent();
        while let Some(x) = d {
            if root().join(x).join("Cargo.toml").is_file() {
                return Some(x.to_path_buf());
            }
            d = x.parent();
        }
        None
    };
    if !named.contains('/') {
        let own = if from.extension().is_some_and(|e| e == "rs") {
            crate_of(from)
        } else {
            None
        };
        return sources.iter().any(|s| {
            s.file_name().is_some_and(|n| n == named)
                && own.as_ref().is_none_or(|c| crate_of(s).as_ref() == Some(c))
        });
    }
    let mut bases = vec![PathBuf::new(), dir.to_path_buf()];
    let mut crates = HashSet::new();
    for s in sources {
        if let Some(c) = crate_of(s)
            && crates.insert(c.clone())
        {
            bases.push(c.join("src"));
            bases.push(c.join("tests"));
            bases.push(c);
        }
    }
    bases.iter().any(|b| root().join(b).join(named).exists())
}

/// `a::b` in a crate's comments, where `a` is a module of that crate with
/// a directory of its own: `b` is one of its modules or an item it
/// declares. (`proto::budget` outlived the module it named.)
fn module_paths(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    for word in text.split(|c: char| !is_word(c)) {
        let parts: Vec<&str> = word.split("::").collect();
        if parts.len() >= 2
            && parts[..2]
                .iter()
                .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        {
            out.push((parts[0].to_owned(), parts[1].to_owned()));
        }
    }
    out
}

fn declares(dir: &Path, name: &str) -> bool {
    let kinds = [
        "fn", "struct", "enum", "const", "static", "mod", "type", "trait",
    ];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for l in text.lines() {
                    let l = l.trim_start().trim_start_matches("pub(crate) ");
                    let l = l
                        .trim_start_matches("pub(super) ")
                        .trim_start_matches("pub ");
                    if kinds.iter().any(|k| {
                        l.strip_prefix(k)
                            .and_then(|r| r.strip_prefix(' '))
                            .is_some_and(|r| {
                                r.strip_prefix(name).is_some_and(|after| {
                                    !after.starts_with(|c: char| c.is_alphanumeric() || c == '_')
                                })
                            })
                    }) {
                        return true;
                    }
                }
            }
        }
    }
    false
}

/// References that rot: file paths named in the documents and in the
/// code's comments lead to files that exist, and `module::name` in a
/// crate's comments to a module or item of that crate.
#[test]
fn files_and_modules_named_in_documents_and_comments_exist() {
    let srcs = sources();
    let mut problems = Vec::new();
    let mut checked = 0;
    let mut texts: Vec<(PathBuf, Vec<(usize, String)>)> = documents()
        .into_iter()
        .map(|d| {
            let text = read(&d);
            let lines = prose(&text)
                .into_iter()
                .map(|(n, l)| (n, l.to_owned()))
                .collect();
            (PathBuf::from(d), lines)
        })
        .collect();
    for s in &srcs {
        let text = std::fs::read_to_string(root().join(s)).unwrap();
        texts.push((s.clone(), comments(&text)));
    }
    for (file, lines) in &texts {
        for (n, line) in lines {
            for named in named_files(line) {
                checked += 1;
                if !file_exists(file, &named, &srcs) {
                    problems.push(format!(
                        "{}:{n}: names {named}, which does not exist",
                        file.display()
                    ));
                }
            }
        }
    }
    // Module paths, in the comments of each crate's own sources.
    for s in &srcs {
        let Some(src_at) = s.components().position(|c| c.as_os_str() == "src") else {
            continue;
        };
        let src_dir: PathBuf = s.components().take(src_at + 1).collect();
        let text = std::fs::read_to_string(root().join(s)).unwrap();
        for (n, line) in comments(&text) {
            for (m, item) in module_paths(&line) {
                let mdir = root().join(&src_dir).join(&m);
                if !mdir.is_dir() {
                    continue;
                }
                checked += 1;
                let ok = mdir.join(format!("{item}.rs")).is_file()
                    || mdir.join(&item).is_dir()
                    || declares(&mdir, &item);
                if !ok {
                    problems.push(format!(
                        "{}:{n}: names {m}::{item}, which {} does not have",
                        s.display(),
                        src_dir.join(&m).display()
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(checked > 200, "only {checked} references found");
}
