//! The documents a newcomer reads: every relative link in README.md,
//! CONTRIBUTING.md, SECURITY.md and docs/*.md leads to a file of the
//! repository (and, for `#anchor`, to a heading there), none leads outside
//! it, and the README's configuration table names every variable the shim
//! reads, as the code spells them.

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
    /// Inside a `<!-- README section -->` block, whose links are written
    /// relative to the repository root because the block is meant to move
    /// into README.md.
    from_root: bool,
}

/// Inline links `[text](target "title")` and reference definitions
/// `[name]: target`.
fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    let mut from_root = false;
    for (n, line) in prose(text) {
        if line.contains("<!-- README section") {
            from_root = true;
        }
        if line.contains("<!-- /README section") {
            from_root = false;
        }
        let line = without_code(line);
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push(Link {
                line: n,
                target: target.trim_matches(['<', '>']).to_owned(),
                from_root,
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
                from_root,
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
            } else if l.from_root {
                PathBuf::from(path)
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
