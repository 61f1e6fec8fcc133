//! `cargo xtask wheel`: the Python package, a manylinux_2_28 wheel that
//! `pip install` turns into the release's prefix layout inside the
//! environment: `bin/gpufrac` (a script, so it lands on the venv's PATH),
//! `lib/libgpufrac.so` (where `gpufrac run` looks, `../lib` from its binary),
//! `include/gpufrac.h`, and the pure-Python package `gpufrac` with its
//! pytest plugin.
//!
//! The binaries are the release tarball's, byte for byte: this task takes
//! them from the release tree that `dist` packs (`release_tree`), built once
//! against glibc 2.28, so a wheel after a tarball (or the other way round)
//! costs seconds, not a second release build. The package metadata comes
//! from python/pyproject.toml.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use base64::Engine;
use sha2::{Digest, Sha256};

use super::{GLIBC, TARGET, release_tree, workspace};

/// The Python project: pyproject.toml and the package beside it.
const PY_DIR: &str = "python";
const PACKAGE: &str = "gpufrac";

pub fn wheel(out_dir: Option<PathBuf>) -> Result<(), String> {
    let ws = workspace()?;
    let out_dir = out_dir.unwrap_or_else(|| ws.target.join("wheels"));
    let version = pep440(&ws.version)?;
    let meta = Metadata::read(&ws.root.join(PY_DIR).join("pyproject.toml"), &ws.root)?;

    let tree = release_tree(&ws)?;

    let name = meta.name.replace('-', "_");
    let data = format!("{name}-{version}.data");
    let info = format!("{name}-{version}.dist-info");
    let mut files: Vec<(String, Vec<u8>, u32)> = Vec::new();
    for (rel, mode) in package_files(&ws.root.join(PY_DIR).join(PACKAGE))? {
        let bytes = read(&ws.root.join(PY_DIR).join(PACKAGE).join(&rel))?;
        files.push((format!("{PACKAGE}/{rel}"), bytes, mode));
    }
    for (from, to, mode) in [
        ("bin/gpufrac", "scripts/gpufrac", 0o755),
        ("lib/libgpufrac.so", "data/lib/libgpufrac.so", 0o755),
        ("include/gpufrac.h", "data/include/gpufrac.h", 0o644),
    ] {
        files.push((format!("{data}/{to}"), read(&tree.join(from))?, mode));
    }
    let tag = tag();
    files.push((
        format!("{info}/METADATA"),
        meta.metadata(&version).into_bytes(),
        0o644,
    ));
    files.push((
        format!("{info}/WHEEL"),
        format!(
            "Wheel-Version: 1.0\nGenerator: gpufrac-xtask {}\nRoot-Is-Purelib: false\nTag: {tag}\n",
            ws.version
        )
        .into_bytes(),
        0o644,
    ));
    if !meta.entry_points.is_empty() {
        files.push((
            format!("{info}/entry_points.txt"),
            meta.entry_points_txt().into_bytes(),
            0o644,
        ));
    }
    files.push((
        format!("{info}/LICENSE"),
        read(&tree.join("LICENSE"))?,
        0o644,
    ));

    fs::create_dir_all(&out_dir)
        .map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let out = out_dir.join(format!("{name}-{version}-{tag}.whl"));
    write_wheel(&out, &files, &format!("{info}/RECORD"))?;
    println!("{}", out.display());
    Ok(())
}

/// `py3-none-manylinux_2_28_x86_64`: any Python 3 (the package is pure
/// Python; the binaries do not link it), the glibc floor of the release.
fn tag() -> String {
    let arch = TARGET.split('-').next().unwrap_or("x86_64");
    format!("py3-none-manylinux_{}_{arch}", GLIBC.replace('.', "_"))
}

/// The crate's version as Python writes it; only plain releases (1.2.3)
/// are the same in both.
fn pep440(v: &str) -> Result<String, String> {
    if !v.is_empty()
        && v.split('.')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        Ok(v.to_owned())
    } else {
        Err(format!(
            "wheel: the version {v:?} is not a plain release such as 1.2.3, and would need \
             translating into Python's version scheme (PEP 440) by hand"
        ))
    }
}

fn read(p: &Path) -> Result<Vec<u8>, String> {
    fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))
}

/// The package's files relative to its directory, sorted, with their
/// modes: byte code and editor leftovers are not part of it.
fn package_files(dir: &Path) -> Result<Vec<(String, u32)>, String> {
    let mut out = Vec::new();
    let mut dirs = vec![PathBuf::new()];
    while let Some(rel) = dirs.pop() {
        let entries = fs::read_dir(dir.join(&rel))
            .map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        for e in entries {
            let e = e.map_err(|e| e.to_string())?;
            let name = e.file_name().to_string_lossy().into_owned();
            let path = rel.join(&name);
            if e.file_type().map_err(|e| e.to_string())?.is_dir() {
                if name != "__pycache__" {
                    dirs.push(path);
                }
            } else if name.ends_with(".py") || name == "py.typed" {
                out.push((path.display().to_string(), 0o644));
            }
        }
    }
    out.sort();
    if !out.iter().any(|(p, _)| p == "__init__.py") {
        return Err(format!("{} has no __init__.py", dir.display()));
    }
    Ok(out)
}

/// Writes the zip with RECORD last (what installers expect), through a
/// temporary file. Time stamps are all the same, so that the same inputs
/// give the same wheel.
fn write_wheel(out: &Path, files: &[(String, Vec<u8>, u32)], record: &str) -> Result<(), String> {
    let tmp = out.with_extension("tmp");
    let f = fs::File::create(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut zip = zip::ZipWriter::new(f);
    let err = |e: &dyn std::fmt::Display| format!("writing {}: {e}", tmp.display());
    let mut lines = String::new();
    for (name, bytes, mode) in files {
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated)
            .last_modified_time(zip::DateTime::default())
            .unix_permissions(*mode);
        zip.start_file(name.as_str(), opts).map_err(|e| err(&e))?;
        zip.write_all(bytes).map_err(|e| err(&e))?;
        let digest = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(bytes));
        lines.push_str(&format!("{name},sha256={digest},{}\n", bytes.len()));
    }
    lines.push_str(&format!("{record},,\n"));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .last_modified_time(zip::DateTime::default())
        .unix_permissions(0o644);
    zip.start_file(record, opts).map_err(|e| err(&e))?;
    zip.write_all(lines.as_bytes()).map_err(|e| err(&e))?;
    zip.finish().map_err(|e| err(&e))?;
    fs::rename(&tmp, out).map_err(|e| format!("cannot rename {}: {e}", tmp.display()))
}

/// What the wheel says about the package, from pyproject.toml's
/// `[project]` table (PEP 621). Keys this writer does not carry into the
/// metadata are refused rather than dropped.
struct Metadata {
    name: String,
    summary: String,
    license: Option<String>,
    requires_python: Option<String>,
    keywords: Vec<String>,
    classifiers: Vec<String>,
    dependencies: Vec<String>,
    readme: Option<String>,
    /// group -> name -> object reference
    entry_points: BTreeMap<String, BTreeMap<String, String>>,
}

impl Metadata {
    fn read(pyproject: &Path, root: &Path) -> Result<Metadata, String> {
        let text = fs::read_to_string(pyproject)
            .map_err(|e| format!("cannot read {}: {e}", pyproject.display()))?;
        let doc: toml::Table = text
            .parse()
            .map_err(|e| format!("{}: {e}", pyproject.display()))?;
        let bad = |what: String| format!("{}: {what}", pyproject.display());
        let project = doc
            .get("project")
            .and_then(toml::Value::as_table)
            .ok_or_else(|| bad("no [project] table".into()))?;
        let string = |key: &str| -> Result<Option<String>, String> {
            match project.get(key) {
                None => Ok(None),
                Some(toml::Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(bad(format!("project.{key} must be a string"))),
            }
        };
        let strings = |key: &str| -> Result<Vec<String>, String> {
            match project.get(key) {
                None => Ok(Vec::new()),
                Some(toml::Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| bad(format!("project.{key} must list strings")))
                    })
                    .collect(),
                Some(_) => Err(bad(format!("project.{key} must be an array of strings"))),
            }
        };
        const KNOWN: [&str; 11] = [
            "name",
            "dynamic",
            "description",
            "license",
            "requires-python",
            "keywords",
            "classifiers",
            "dependencies",
            "readme",
            "entry-points",
            "scripts",
        ];
        if let Some(k) = project.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(bad(format!(
                "project.{k} is not written into the wheel by xtask/src/wheel.rs; \
                 teach it there, or leave the key out (known: {})",
                KNOWN.join(", ")
            )));
        }
        if strings("dynamic")? != ["version"] {
            return Err(bad(
                "project.dynamic must be [\"version\"]: the version is the workspace's, from Cargo.toml"
                    .into(),
            ));
        }
        let readme = match string("readme")? {
            Some(f) => {
                let p = pyproject.parent().unwrap_or(root).join(&f);
                Some(
                    fs::read_to_string(&p)
                        .map_err(|e| bad(format!("project.readme {}: {e}", p.display())))?,
                )
            }
            None => None,
        };
        let mut entry_points = BTreeMap::new();
        let mut group = |g: &str, t: &toml::Value| -> Result<(), String> {
            let t = t
                .as_table()
                .ok_or_else(|| bad(format!("entry point group {g} must be a table")))?;
            let mut m = BTreeMap::new();
            for (k, v) in t {
                let v = v
                    .as_str()
                    .ok_or_else(|| bad(format!("entry point {g}.{k} must be a string")))?;
                m.insert(k.clone(), v.to_owned());
            }
            entry_points.insert(g.to_owned(), m);
            Ok(())
        };
        if let Some(s) = project.get("scripts") {
            group("console_scripts", s)?;
        }
        if let Some(eps) = project.get("entry-points") {
            let eps = eps
                .as_table()
                .ok_or_else(|| bad("project.entry-points must be a table".into()))?;
            for (g, t) in eps {
                group(g, t)?;
            }
        }
        Ok(Metadata {
            name: string("name")?.ok_or_else(|| bad("project.name is missing".into()))?,
            summary: string("description")?.unwrap_or_default(),
            license: string("license")?,
            requires_python: string("requires-python")?,
            keywords: strings("keywords")?,
            classifiers: strings("classifiers")?,
            dependencies: strings("dependencies")?,
            readme,
            entry_points,
        })
    }

    /// The core metadata file (version 2.1: what every installer in use
    /// reads).
    fn metadata(&self, version: &str) -> String {
        let mut m = format!(
            "Metadata-Version: 2.1\nName: {}\nVersion: {version}\n",
            self.name
        );
        if !self.summary.is_empty() {
            m.push_str(&format!("Summary: {}\n", self.summary));
        }
        if let Some(l) = &self.license {
            m.push_str(&format!("License: {l}\n"));
        }
        if !self.keywords.is_empty() {
            m.push_str(&format!("Keywords: {}\n", self.keywords.join(",")));
        }
        for c in &self.classifiers {
            m.push_str(&format!("Classifier: {c}\n"));
        }
        if let Some(r) = &self.requires_python {
            m.push_str(&format!("Requires-Python: {r}\n"));
        }
        for d in &self.dependencies {
            m.push_str(&format!("Requires-Dist: {d}\n"));
        }
        if let Some(readme) = &self.readme {
            m.push_str("Description-Content-Type: text/markdown\n\n");
            m.push_str(readme);
        }
        m
    }

    fn entry_points_txt(&self) -> String {
        let mut s = String::new();
        for (g, m) in &self.entry_points {
            s.push_str(&format!("[{g}]\n"));
            for (k, v) in m {
                s.push_str(&format!("{k} = {v}\n"));
            }
            s.push('\n');
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_and_versions() {
        assert_eq!(tag(), "py3-none-manylinux_2_28_x86_64");
        assert_eq!(pep440("0.1.0").unwrap(), "0.1.0");
        assert!(pep440("0.2.0-rc.1").is_err());
        assert!(pep440("1..2").is_err());
    }

    #[test]
    fn the_projects_pyproject_is_read_whole() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let m = Metadata::read(&root.join(PY_DIR).join("pyproject.toml"), root).unwrap();
        assert_eq!(m.name, PACKAGE);
        assert_eq!(
            m.entry_points["pytest11"]
                .get("gpufrac")
                .map(String::as_str),
            Some("gpufrac.pytest_plugin")
        );
        let text = m.metadata("0.1.0");
        assert!(text.starts_with("Metadata-Version: 2.1\nName: gpufrac\nVersion: 0.1.0\n"));
        assert!(text.contains("\nRequires-Python: >=3.8\n"), "{text}");
        assert!(
            m.entry_points_txt()
                .contains("[pytest11]\ngpufrac = gpufrac.pytest_plugin\n")
        );
    }
}
