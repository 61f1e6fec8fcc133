//! The Python package as a CI user gets it: `cargo xtask wheel` builds a
//! manylinux_2_28 wheel (auditwheel agrees); pip installs it into a fresh
//! venv beside pytest, pytest-xdist and NVIDIA's own driver bindings
//! (cuda-bindings) from PyPI; `gpufrac` lands on the venv's PATH and
//! finds its shim; and the pytest suites of tests/fixtures/pytest run under
//! the plugin against the simulated driver, the venv never activated (as CI
//! scripts call `venv/bin/python -m pytest`):
//!
//! - `pytest -n 4 --gpufrac-memory 8G --gpufrac-split worker`: four
//!   workers at 2 GiB each, all
//!   holding memory at once (a file barrier), each refused past its own cap
//!   while the run's budget still has room;
//! - `--gpufrac-split shared`: one worker takes more than half;
//! - `--gpufrac-report` and `--gpufrac-report-json`: exact per-test peaks;
//! - a worker out of memory fails that one test, naming cap and worker;
//! - with a broker the run is one job that waits behind another for its
//!   budget, then runs;
//! - `pytest -n auto --gpufrac-memory SIZE`, the docs' plain recipe;
//! - budgets per test (the default split): declared with
//!   `@pytest.mark.gpu_memory`, learned with `--gpufrac-learn`, reserved in
//!   the run's books in arrival order, each test capped at its reservation
//!   (`gpufrac_mem_limit_set`); a crashed worker's reservation reclaimed;
//!   pools emptied between tests; sizes as the CLI takes them;
//! - a test that outgrew its learned budget run again with the whole
//!   budget; one past its mark told, within 80 columns, what it needs and
//!   which mark would pass; reports never written through a planted link.
//!
//! The wheel shares its release build with tests/release.rs; the venv,
//! pip's cache and the downloads live in the test cache (docs/testing.md).
//! These are engine tests: GPUFRAC_TEST_ENGINES=0 skips them.

#[path = "support/dist.rs"]
mod dist;
mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use dist::{ROOT, out, with_zig, xtask_release};
use support::*;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const WHAT: &str =
    "the wheel tests (cargo xtask wheel with zig, pytest and cuda-bindings from PyPI)";
const WHEEL: &str = concat!(
    "gpufrac-",
    env!("CARGO_PKG_VERSION"),
    "-py3-none-manylinux_2_28_x86_64.whl"
);
/// What the venv gets from PyPI: the test runner, its workers, a real CUDA
/// binding, and auditwheel to check the manylinux claim. Pinned, so that a
/// new release of any of them cannot change what the tests mean.
const FROM_PYPI: [&str; 4] = [
    "pytest==9.2.0",
    "pytest-xdist==3.8.0",
    "cuda-bindings==13.5.0",
    "auditwheel==6.8.2",
];

/// The wheel `cargo xtask wheel` built, and the venv it is installed in.
struct Py {
    wheel: PathBuf,
    venv: PathBuf,
}

impl Py {
    fn python(&self) -> PathBuf {
        self.venv.join("bin/python")
    }
}

/// The wheel, built once per run, installed in the venv; None when its
/// tools could not be had (said loudly).
fn py() -> Option<&'static Py> {
    static P: OnceLock<Option<Py>> = OnceLock::new();
    P.get_or_init(|| {
        // The simulated driver and the debug build the suites need.
        artifacts();
        let t = std::time::Instant::now();
        let o = xtask_release(WHAT, &["wheel"])?;
        assert!(o.status.success(), "cargo xtask wheel failed:\n{}", out(&o));
        let wheel = PathBuf::from(stdout(&o).lines().last().unwrap_or_default().trim());
        assert_eq!(
            wheel,
            target_dir().join("wheels").join(WHEEL),
            "{}",
            out(&o)
        );
        say(&format!(
            "cargo xtask wheel took {:.1} s",
            t.elapsed().as_secs_f64()
        ));
        let venv = venv("wheel-venv", WHAT, &FROM_PYPI, "about 11 MB")?;
        say(&format!(
            "installing {} into {}",
            wheel.display(),
            venv.display()
        ));
        pip(
            &venv,
            &["install", "--no-deps", "--force-reinstall"],
            &[wheel.as_path()],
        );
        Some(Py { wheel, venv })
    })
    .as_ref()
}

fn pip(venv: &Path, args: &[&str], more: &[&Path]) {
    // `pip wheel ./python` runs cargo xtask wheel, with the cache's zig.
    let o = with_zig(&mut support::pip(venv))
        .args(args)
        .args(more)
        .output()
        .expect("running pip");
    assert!(o.status.success(), "pip {args:?} {more:?}:\n{}", out(&o));
}

/// A scratch copy of the suites (so that nothing is written into the
/// source tree) and a directory for what their tests record.
struct Run {
    scratch: Scratch,
}

impl Run {
    fn new(name: &str) -> Run {
        let scratch = Scratch::new(name);
        let suite = scratch.0.join("suite");
        std::fs::create_dir_all(&suite).unwrap();
        std::fs::create_dir_all(scratch.0.join("records")).unwrap();
        let fixtures = Path::new(ROOT).join("tests/fixtures/pytest");
        for e in std::fs::read_dir(&fixtures).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "py") {
                std::fs::copy(&p, suite.join(p.file_name().unwrap())).unwrap();
            }
        }
        Run { scratch }
    }

    fn suite(&self) -> PathBuf {
        self.scratch.0.join("suite")
    }

    /// `venv/bin/python -m pytest ARGS` in the suite against a simulated
    /// 16 GiB GPU of its own, with no broker.
    fn pytest(&self, py: &Py, args: &[&str]) -> Command {
        let mut c = self.command(py.python());
        c.args(["-m", "pytest", "-p", "no:cacheprovider", "-rf"])
            .args(args);
        c
    }

    /// `pytest` with pytest's cache, where --gpufrac-learn keeps what it
    /// learned (.pytest_cache in the suite).
    fn pytest_cached(&self, py: &Py, args: &[&str]) -> Command {
        let mut c = self.command(py.python());
        c.args(["-m", "pytest", "-rfs"]).args(args);
        c
    }

    /// What --gpufrac-learn keeps in pytest's cache.
    fn learned(&self) -> serde_json::Value {
        let p = self.suite().join(".pytest_cache/v/gpufrac/learned");
        serde_json::from_str(
            &std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("nothing learned at {}: {e}", p.display())),
        )
        .unwrap()
    }

    /// `program` in the suite's environment (see `pytest`).
    fn command(&self, program: impl AsRef<Path>) -> Command {
        let mut c = sim_command(program, "16G", false);
        // gpufrac run decides whether the shim looks for a broker.
        c.env_remove("GPUFRAC_BROKER")
            .env("GPUFRAC_SOCKET", self.scratch.0.join("no-broker.sock"))
            .env("GPUFRAC_SIM_STATE", self.scratch.0.join("sim-state"))
            .env("GPUFRAC_TEST_DIR", self.scratch.0.join("records"))
            .env("COLUMNS", "200")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("PYTEST_ADDOPTS")
            .env_remove("PYTHONPATH")
            .current_dir(self.suite());
        c
    }

    /// What the suite's test `name` recorded (gpu.record).
    fn record(&self, name: &str) -> serde_json::Value {
        let p = self.scratch.0.join("records").join(format!("{name}.json"));
        let text = std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("test {name} left no record at {}: {e}", p.display()));
        serde_json::from_str(&text).unwrap()
    }

    fn records(&self) -> usize {
        std::fs::read_dir(self.scratch.0.join("records"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "json"))
            })
            .count()
    }
}

fn passed(o: &Output, summary: &str) {
    assert!(
        o.status.success() && stdout(o).contains(summary),
        "expected {summary:?}:\n{}",
        out(o)
    );
}

#[test]
fn the_wheel_is_manylinux_2_28_and_puts_gpufrac_with_its_shim_in_the_venv() {
    let Some(py) = py() else { return };
    let o = Command::new(py.venv.join("bin/auditwheel"))
        .arg("show")
        .arg(&py.wheel)
        .output()
        .unwrap();
    assert!(o.status.success(), "auditwheel show: {}", out(&o));
    // auditwheel wraps its lines.
    let said = stdout(&o).split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        said.contains(&format!(
            "{WHEEL} is consistent with the following platform tag: \"manylinux_2_28_x86_64\""
        )),
        "{said}"
    );

    let o = Command::new(py.python())
        .args([
            "-c",
            "import sys, zipfile; print('\\n'.join(zipfile.ZipFile(sys.argv[1]).namelist()))",
        ])
        .arg(&py.wheel)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let mut names: Vec<String> = stdout(&o).lines().map(str::to_owned).collect();
    names.sort();
    let v = VERSION;
    let mut want = vec![
        format!("gpufrac-{v}.data/data/include/gpufrac.h"),
        format!("gpufrac-{v}.data/data/lib/libgpufrac.so"),
        format!("gpufrac-{v}.data/scripts/gpufrac"),
        format!("gpufrac-{v}.dist-info/LICENSE"),
        format!("gpufrac-{v}.dist-info/METADATA"),
        format!("gpufrac-{v}.dist-info/RECORD"),
        format!("gpufrac-{v}.dist-info/WHEEL"),
        format!("gpufrac-{v}.dist-info/entry_points.txt"),
        "gpufrac/__init__.py".to_owned(),
        "gpufrac/pytest_plugin.py".to_owned(),
    ];
    want.sort();
    assert_eq!(names, want);

    // pip builds it from the source tree too (pyproject.toml's backend
    // runs cargo xtask wheel), byte for byte the same, on a machine with
    // Rust and Python only: zig and cargo-zigbuild come from PyPI as the
    // build's requirements (pip's cache keeps them), none on PATH and none
    // where xtask would look.
    let built = Scratch::new("wheel-pip");
    let python_dir = Path::new(ROOT).join("python");
    let path = std::env::var("PATH").unwrap_or_default();
    let path: Vec<&str> = path
        .split(':')
        .filter(|d| {
            !Path::new(d).join("zig").exists() && !Path::new(d).join("cargo-zigbuild").exists()
        })
        .collect();
    let o = dist::release_profile(&mut support::pip(&py.venv))
        .args(["wheel", "-v", "--no-deps", "--wheel-dir"])
        .arg(&built.0)
        .arg(&python_dir)
        .env("PATH", path.join(":"))
        .env("GPUFRAC_DIST_TOOLS", built.0.join("no-tools-here"))
        .env_remove("CARGO_ZIGBUILD_PYTHON_PATH")
        .output()
        .expect("running pip");
    // The build requirements come from PyPI: no PyPI here (the venv may be
    // cached from a run that had it) is a machine this part cannot run on,
    // as for the venv's own downloads.
    let text = out(&o);
    if !o.status.success()
        && [
            "No matching distribution found for ziglang",
            "NewConnectionError",
            "Could not fetch URL",
        ]
        .iter()
        .any(|m| text.contains(m))
    {
        cannot(
            "pip wheel ./python (its build requirements from PyPI)",
            &format!("PyPI cannot be reached: {text}"),
        );
        return;
    }
    assert!(o.status.success(), "pip wheel ./python:\n{text}");
    assert!(
        std::fs::read(built.0.join(WHEEL)).unwrap() == std::fs::read(&py.wheel).unwrap(),
        "pip wheel ./python made another wheel than cargo xtask wheel"
    );
    // From the release `cargo xtask wheel` built above: cargo compiles
    // nothing again. (It compiled all of it while cargo-zigbuild ran from
    // where pip installed it, a new environment each time, whose path
    // named the linker cargo was given.)
    let compiled: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("Compiling "))
        .collect();
    assert!(
        compiled.is_empty(),
        "pip's build compiled again what cargo xtask wheel had built:\n{}",
        compiled.join("\n")
    );

    // On the venv's PATH, where an activated venv (or a CI step naming
    // venv/bin) finds it.
    let bin = py.venv.join("bin/gpufrac");
    let o = Command::new(&bin).arg("--version").output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    assert_eq!(stdout(&o).trim(), format!("gpufrac {VERSION}"));

    // gpufrac run preloads the shim the wheel put in the venv.
    let s = Scratch::new("wheel-run");
    let mut c = sim_command(&bin, "16G", false);
    c.env_remove("GPUFRAC_BROKER")
        .args(["run", "--socket"])
        .arg(s.0.join("no-broker.sock"))
        .args(["--gpu-memory", "1G", "--", "sh", "-c"])
        .arg(format!(
            "echo preload=$LD_PRELOAD; exec {} ctx info",
            artifacts().probe.display()
        ));
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let shim = py.venv.join("lib/libgpufrac.so").canonicalize().unwrap();
    assert!(
        stdout(&o).contains(&format!("preload={}\n", shim.display())),
        "{}",
        out(&o)
    );
    assert_eq!(num(&line(&o, "info", 0), "total"), GIB, "{}", out(&o));

    // The package knows where its binary is without PATH, and the plugin
    // is registered by installing it.
    let o = Command::new(py.python())
        .args([
            "-c",
            "import gpufrac, importlib.metadata as m; print(gpufrac.binary()); \
             print([e.value for e in m.entry_points(group='pytest11') if e.name == 'gpufrac'])",
        ])
        .env_remove("PYTHONPATH")
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out(&o));
    assert_eq!(
        stdout(&o),
        format!(
            "{}\n['gpufrac.pytest_plugin']\n",
            bin.canonicalize().unwrap().display()
        )
    );
}

#[test]
fn four_workers_each_capped_at_a_quarter_hold_memory_at_the_same_time() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-quarters");
    // The command docs/ci.md gives.
    let o = r
        .pytest(
            py,
            &[
                "-n",
                "4",
                "--gpufrac-memory",
                "8G",
                "--gpufrac-split",
                "worker",
                "test_quarters.py",
            ],
        )
        .output()
        .unwrap();
    passed(&o, "4 passed");
    assert!(
        stdout(&o).contains(
            "gpufrac: GPU memory budget 8.00 GiB, 4 workers capped at 2.00 GiB each; \
             a gpufrac job without a broker"
        ),
        "{}",
        out(&o)
    );
    let mut workers = BTreeSet::new();
    for n in 0..4 {
        let rec = r.record(&format!("quarter-{n}"));
        workers.insert(rec["worker"].as_str().unwrap().to_owned());
        assert_eq!(rec["cap_env"], (2 * GIB).to_string(), "{rec}");
        // What CUDA tells the worker: its own cap.
        assert_eq!(rec["total"], 2 * GIB, "{rec}");
        // Past the barrier all four held 1.5 GiB: 6 GiB on the device.
        assert_eq!(rec["together"], 6 * GIB, "{rec}");
        // 768 MiB more would fit the run's 8 GiB, not the worker's 2 GiB.
        assert_eq!(rec["refused"], "CUDA_ERROR_OUT_OF_MEMORY", "{rec}");
    }
    assert_eq!(
        workers,
        ["gw0", "gw1", "gw2", "gw3"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
}

#[test]
fn shared_split_lets_one_worker_take_more_than_its_share_of_one_budget() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-shared");
    let args = [
        "-n",
        "2",
        "--gpufrac-memory",
        "2G",
        "--gpufrac-split",
        "shared",
        "test_shared.py",
    ];
    let o = r.pytest(py, &args).output().unwrap();
    passed(&o, "2 passed");
    assert!(
        stdout(&o).contains("gpufrac: GPU memory budget 2.00 GiB, shared by 2 workers"),
        "{}",
        out(&o)
    );
    let (big, small) = (r.record("big"), r.record("small"));
    assert_ne!(big["worker"], small["worker"], "one worker ran both");
    // Each worker may use the whole budget...
    assert_eq!(big["cap_env"], (2 * GIB).to_string());
    // ...which one took 1.5 GiB of: 1 GiB more is refused by the books
    // they share, 512 MiB is not (test_shared.py).
    assert_eq!(small["refused"], "CUDA_ERROR_OUT_OF_MEMORY", "{small}");
}

fn report_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The report's tests of test_report.py, checked for their peaks, largest
/// first.
fn exact_peaks(j: &serde_json::Value) -> &Vec<serde_json::Value> {
    let tests = j["tests"].as_array().unwrap();
    let peaks: Vec<(&str, u64)> = tests
        .iter()
        .map(|t| {
            (
                t["nodeid"].as_str().unwrap(),
                t["peak_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        peaks,
        [
            ("test_report.py::test_256m", 256 * MIB),
            ("test_report.py::test_two_blocks_192m", 192 * MIB),
            ("test_report.py::test_64m", 64 * MIB),
            ("test_report.py::test_nothing", 0),
        ],
        "{j}"
    );
    tests
}

#[test]
fn report_lists_tests_by_peak_and_writes_them_as_json() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-report");
    let json = r.scratch.0.join("gpu-mem.json");
    // No budget: measuring only, to pick one.
    let o = r
        .pytest(
            py,
            &["-n", "2", "--gpufrac-report", "--gpufrac-report-json"],
        )
        .arg(&json)
        .arg("test_report.py")
        .output()
        .unwrap();
    passed(&o, "4 passed");
    let text = stdout(&o);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("test_report.py::"))
        .collect();
    let order: Vec<&str> = lines
        .iter()
        .map(|l| l.split("::").nth(1).unwrap().trim())
        .collect();
    assert_eq!(
        order,
        [
            "test_256m",
            "test_two_blocks_192m",
            "test_64m",
            "test_nothing"
        ],
        "{text}"
    );
    assert!(lines[0].trim_start().starts_with("256.00 MiB"), "{text}");
    assert!(lines[1].trim_start().starts_with("192.00 MiB"), "{text}");

    let j = report_json(&json);
    assert_eq!(j["budget_bytes"], 0, "{j}");
    assert_eq!(j["workers"], 2, "{j}");
    let tests = exact_peaks(&j);
    for t in tests {
        assert_eq!(t["outcome"], "passed", "{t}");
        assert_eq!(t["end_bytes"], 0, "{t}");
        let worker = t["worker"].as_str().unwrap();
        let recorded = match t["nodeid"].as_str().unwrap() {
            "test_report.py::test_256m" => "256m",
            "test_report.py::test_two_blocks_192m" => "192m",
            "test_report.py::test_64m" => "64m",
            _ => "nothing",
        };
        assert_eq!(r.record(recorded)["worker"], worker, "{t}");
    }
    // Each worker's peak is its largest test's.
    let per_worker = j["per_worker"].as_array().unwrap();
    assert_eq!(per_worker.len(), 2, "{j}");
    for w in per_worker {
        let name = w["worker"].as_str().unwrap();
        let most = tests
            .iter()
            .filter(|t| t["worker"] == name)
            .map(|t| t["peak_bytes"].as_u64().unwrap())
            .max()
            .unwrap_or(0);
        assert_eq!(w["peak_bytes"], most, "{w}");
        assert_eq!(w["cap_bytes"], 0, "{w}");
    }

    // Without xdist: the one process, under a cap, its tests' peaks apart
    // although they ran one after the other, largest first; in the text
    // report and in JUnit XML.
    let r = Run::new("wheel-report-one");
    let (junit, json) = (r.scratch.0.join("junit.xml"), r.scratch.0.join("one.json"));
    let o = r
        .pytest(
            py,
            &["--gpufrac-memory", "1G", "--gpufrac-report", "--junitxml"],
        )
        .arg(&junit)
        .arg("--gpufrac-report-json")
        .arg(&json)
        .arg("test_report.py")
        .output()
        .unwrap();
    passed(&o, "4 passed");
    let j = report_json(&json);
    assert!(exact_peaks(&j).iter().all(|t| t["worker"] == "main"), "{j}");
    let xml = std::fs::read_to_string(&junit).unwrap();
    let case = xml
        .split("<testcase ")
        .find(|c| c.contains("name=\"test_256m\""))
        .unwrap_or_else(|| panic!("no test_256m in {xml}"));
    // What a CI system shows beside the test: its peak, its budget and
    // where that came from, its wait for room and the cap's refusals.
    for (name, value) in [
        ("gpufrac_peak_bytes", (256 * MIB).to_string()),
        ("gpufrac_budget_bytes", GIB.to_string()),
        ("gpufrac_budget_source", "whole".into()),
        ("gpufrac_refusals", "0".into()),
        ("gpufrac_worker", "main".into()),
    ] {
        assert!(
            case.contains(&format!("<property name=\"{name}\" value=\"{value}\"")),
            "{name}: {case}"
        );
    }
    assert!(
        case.contains("<property name=\"gpufrac_waited_s\" value=\"0."),
        "{case}"
    );
    let text = stdout(&o);
    assert!(
        text.contains("gpufrac: GPU memory budget 1.00 GiB, one process"),
        "{text}"
    );
    let main = text
        .lines()
        .find(|l| l.starts_with("main "))
        .unwrap_or_else(|| panic!("no per-worker line for the one process:\n{text}"));
    let cols: Vec<&str> = main.split_whitespace().collect();
    assert_eq!(
        cols,
        ["main", "1.00", "GiB", "256.00", "MiB", "4", "0"],
        "{text}"
    );
}

/// Which tests ran out of memory is the shim's count of refusals read
/// around each test, not the failure's text: a refused test is named
/// whatever its error says, one that failed after its allocation succeeded
/// is not, whatever its error says, and one that expected the refusal
/// passes.
#[test]
fn a_worker_out_of_memory_fails_that_test_naming_its_cap_and_worker() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-oom");
    let o = r
        .pytest(
            py,
            &[
                "-n",
                "2",
                "--gpufrac-memory",
                "2G",
                "--gpufrac-split",
                "worker",
                "--gpufrac-report-json",
                "oom.json",
                "--junitxml",
                "oom.xml",
                "test_oom.py",
            ],
        )
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    let text = stdout(&o);
    assert!(text.contains("3 failed, 4 passed"), "{text}");
    let worker = r.record("too-big")["worker"].as_str().unwrap().to_owned();
    assert!(
        text.contains(&format!(
            "FAILED test_oom.py::test_too_big - gpufrac: needs ~1.5 GiB, {worker} cap 1 GiB; \
             gpu.CudaError: CUDA call failed: CUDA_ERROR_OUT_OF_MEMORY"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "This test ran out of GPU memory under worker {worker}'s cap of 1.00 GiB \
             (--gpufrac-memory 2G split 2 ways)."
        )),
        "{text}"
    );
    let other = r.record("did-not-fit")["worker"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains(&format!(
            "FAILED test_oom.py::test_did_not_fit - gpufrac: needs ~1.25 GiB, {other} cap \
             1 GiB; AssertionError: the model did not fit"
        )),
        "refused, though its words say nothing of memory: {text}"
    );
    assert!(
        text.contains(
            "FAILED test_oom.py::test_wrong_answer - AssertionError: expected \
             CUDA_ERROR_OUT_OF_MEMORY: out of memory"
        ),
        "its allocation succeeded: no note, whatever its words: {text}"
    );
    assert_eq!(
        text.matches("This test ran out of GPU memory").count(),
        2,
        "{text}"
    );
    let j = report_json(&r.suite().join("oom.json"));
    let ooms: u64 = j["per_worker"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["out_of_memory"].as_u64().unwrap())
        .sum();
    assert_eq!(ooms, 2, "{j}");
    // The cap's refusals, per test, as JUnit properties.
    let xml = std::fs::read_to_string(r.suite().join("oom.xml")).unwrap();
    for (test, refusals) in [
        ("test_too_big", 1),
        ("test_did_not_fit", 1),
        ("test_refusal_expected", 1),
        ("test_wrong_answer", 0),
    ] {
        let case = xml
            .split("<testcase ")
            .find(|c| c.contains(&format!("name=\"{test}\"")))
            .unwrap_or_else(|| panic!("no {test} in {xml}"));
        assert!(
            case.contains(&format!(
                "<property name=\"gpufrac_refusals\" value=\"{refusals}\""
            )),
            "{test}: {case}"
        );
    }
    for n in 0..3 {
        r.record(&format!("fits-{n}"));
    }
    r.record("wrong-answer");
    r.record("refusal-expected");
}

#[test]
fn with_a_broker_the_run_waits_for_its_budget_behind_another_job_then_runs() {
    let Some(py) = py() else { return };
    let b = Broker::start("8G", &[]);
    let r = Run::new("wheel-queue");
    let d = r.scratch.0.clone();
    // Another CI job on the same GPU: 6 of its 8 GiB, held until told.
    let script = job_script(&d, "a");
    let a = b
        .run_with(
            py.venv.join("bin/gpufrac"),
            &["--gpu-memory", "6G", "--", "sh", "-c", &script],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_started(&d, "a");

    let json = d.join("gpu-mem.json");
    let mut cmd = r.pytest(
        py,
        &[
            "-n",
            "2",
            "--gpufrac-memory",
            "4G",
            "--gpufrac-split",
            "worker",
            "--gpufrac-report-json",
        ],
    );
    let (log_out, log_err) = (d.join("pytest.out"), d.join("pytest.err"));
    cmd.arg(&json)
        .arg("test_report.py")
        .env("GPUFRAC_SOCKET", &b.socket)
        .env("GPUFRAC_SIM_STATE", &b.state)
        .stdout(std::fs::File::create(&log_out).unwrap())
        .stderr(std::fs::File::create(&log_err).unwrap());
    let mut pytest = KillOnDrop(cmd.spawn().unwrap());
    wait_until(60.0, "the test run to queue behind the other job", || {
        b.status()["queue"].as_array().unwrap().len() == 1
    });
    let s = b.status();
    assert_eq!(s["queue"][0]["wants"], "4.00 GiB of GPU memory", "{s:#}");
    // Queued before anything ran: no test has started.
    assert_eq!(r.records(), 0, "tests ran while the run was queued");

    release(&d, "a", a);
    let o = Output {
        status: pytest.0.wait().unwrap(),
        stdout: std::fs::read(&log_out).unwrap(),
        stderr: std::fs::read(&log_err).unwrap(),
    };
    passed(&o, "4 passed");
    assert!(
        stderr(&o).contains("gpufrac: this run is a gpufrac job: it waits in the broker's queue"),
        "{}",
        out(&o)
    );
    assert!(
        stdout(&o).contains(
            "gpufrac: GPU memory budget 4.00 GiB, 2 workers capped at 2.00 GiB each; \
             a gpufrac job with the broker"
        ),
        "{}",
        out(&o)
    );
    let j = report_json(&json);
    assert_eq!(j["broker"], true, "{j}");
    assert_eq!(j["budget_bytes"], 4 * GIB, "{j}");
    assert_eq!(j["cap_bytes"], 2 * GIB, "{j}");
    assert_eq!(j["tests"].as_array().unwrap().len(), 4, "{j}");
    // The lease ended with the run.
    wait_until(20.0, "the run's lease to end", || {
        b.status()["leases"].as_array().is_none_or(|l| l.is_empty())
    });
}

#[test]
fn plain_pytest_n_auto_splits_the_budget_among_as_many_workers_as_xdist_starts() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-auto");
    // docs/ci.md's plain recipe.
    let o = r
        .pytest(
            py,
            &[
                "-n",
                "auto",
                "--gpufrac-memory",
                "6G",
                "--gpufrac-split",
                "worker",
                "test_report.py",
            ],
        )
        .output()
        .unwrap();
    passed(&o, "4 passed");
    let text = stdout(&o);
    let n: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("created: "))
        .and_then(|l| l.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("xdist did not say how many workers it created:\n{text}"));
    // The plugin rounds a share down to whole MiB.
    let cap = (6 * GIB / n) >> 20 << 20;
    let want = format!(
        "{n} workers capped at {} each",
        gpufrac_common::size::format_size(cap)
    );
    assert!(text.contains(&want), "{want:?} missing:\n{text}");
}

#[test]
fn inside_a_gpufrac_run_job_the_plugin_splits_that_jobs_cap_instead_of_starting_another() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-in-job");
    // A CI step that wraps the whole command, asking the plugin for more
    // than the job has.
    let o = r
        .command(py.venv.join("bin/gpufrac"))
        .arg("run")
        .arg("--socket")
        .arg(r.scratch.0.join("no-broker.sock"))
        .args(["--gpu-memory", "4G", "--"])
        .arg(py.python())
        .args(["-m", "pytest", "-p", "no:cacheprovider", "-n", "2"])
        .args(["--gpufrac-memory", "8G", "--gpufrac-split", "worker"])
        .arg("test_report.py")
        .output()
        .unwrap();
    passed(&o, "4 passed");
    assert!(
        stdout(&o).contains(
            "gpufrac: GPU memory budget 4.00 GiB, 2 workers capped at 2.00 GiB each; \
             a gpufrac job without a broker"
        ),
        "{}",
        out(&o)
    );
    for t in ["nothing", "64m", "192m", "256m"] {
        assert_eq!(r.record(t)["cap_env"], (2 * GIB).to_string());
    }
}

/// `cmd`'s output, or a failure naming `what` when it has not ended in
/// `secs`: a test that waits forever for a reservation is a bug to report,
/// not a hang of the suite.
fn output_within(mut cmd: Command, secs: f64, what: &str, dir: &Path) -> Output {
    let (o, e) = (dir.join("pytest.out"), dir.join("pytest.err"));
    cmd.stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap());
    let mut child = KillOnDrop(cmd.spawn().unwrap());
    let mut status = None;
    let mut done = || {
        status = child.0.try_wait().unwrap();
        status.is_some()
    };
    let finished = {
        let t = std::time::Instant::now();
        loop {
            if done() {
                break true;
            }
            if t.elapsed().as_secs_f64() > secs {
                break false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let text = format!(
        "{}{}",
        std::fs::read_to_string(&o).unwrap_or_default(),
        std::fs::read_to_string(&e).unwrap_or_default()
    );
    assert!(finished, "{what}: still running after {secs} s:\n{text}");
    Output {
        status: status.unwrap(),
        stdout: std::fs::read(&o).unwrap(),
        stderr: std::fs::read(&e).unwrap(),
    }
}

fn test_entry<'a>(j: &'a serde_json::Value, nodeid: &str) -> &'a serde_json::Value {
    j["tests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["nodeid"] == nodeid)
        .unwrap_or_else(|| panic!("no {nodeid} in {j}"))
}

/// The suite: a 5 GiB test and twelve 1 GiB tests on four
/// workers under 7 GiB. Reserving each test's declared budget, it passes;
/// split into quarters the big test never fits; sharing one budget, the big
/// test fails whenever three small ones hold memory as it starts (the
/// suite forces that overlap with a barrier).
#[test]
fn tests_reserve_their_declared_budgets_and_pack_where_splitting_by_worker_fails() {
    let Some(py) = py() else { return };
    let seven = 7 * GIB;

    let r = Run::new("wheel-budgets");
    let json = r.scratch.0.join("budgets.json");
    let mut cmd = r.pytest(py, &["-n", "4", "--gpufrac-memory", "7G"]);
    cmd.arg("--gpufrac-report-json")
        .arg(&json)
        .arg("test_budgets.py");
    let o = output_within(cmd, 300.0, "the reserved run", &r.scratch.0);
    passed(&o, "13 passed");
    assert!(
        stdout(&o)
            .contains("gpufrac: GPU memory budget 7.00 GiB, reserved test by test by 4 workers"),
        "{}",
        out(&o)
    );
    assert!(r.record("big")["refused"].is_null());
    // The books kept what the tests held together within the run's budget.
    let mut most = r.record("big")["together"].as_u64().unwrap();
    for n in 0..12 {
        most = most.max(
            r.record(&format!("small-{n}"))["together"]
                .as_u64()
                .unwrap(),
        );
    }
    assert!(most <= seven, "{most} bytes held at once, over 7 GiB");
    let j = report_json(&json);
    let big = test_entry(&j, "test_budgets.py::test_big");
    assert_eq!(big["budget_source"], "declared", "{big}");
    assert_eq!(big["budget_bytes"], 5 * GIB, "{big}");
    assert_eq!(big["declared_bytes"], 5 * GIB, "{big}");
    // Nothing held before it: capped at exactly its reservation.
    assert_eq!(big["cap_bytes"], 5 * GIB, "{big}");
    assert_eq!(big["peak_bytes"], 5 * GIB, "{big}");
    let small = test_entry(&j, "test_budgets.py::test_small[0]");
    assert_eq!(small["budget_bytes"], GIB, "{small}");
    assert_eq!(small["peak_bytes"], GIB, "{small}");

    // A quarter each: the big test never fits its worker.
    let r = Run::new("wheel-budgets-worker");
    let args = [
        "-n",
        "4",
        "--gpufrac-memory",
        "7G",
        "--gpufrac-split",
        "worker",
        "test_budgets.py",
    ];
    let o = output_within(r.pytest(py, &args), 300.0, "the worker split", &r.scratch.0);
    assert!(stdout(&o).contains("1 failed, 12 passed"), "{}", out(&o));
    assert_eq!(
        r.record("big")["refused"],
        "CUDA_ERROR_OUT_OF_MEMORY",
        "{}",
        out(&o)
    );
    assert!(
        stdout(&o).contains("test_budgets.py::test_big - gpufrac: needs ~5 GiB, gw"),
        "{}",
        out(&o)
    );
    assert!(stdout(&o).contains(" cap 1.75 GiB; "), "{}", out(&o));

    // One shared budget: three small tests hold 3 GiB when the big one
    // starts, and 5 GiB more is 1 GiB over.
    let r = Run::new("wheel-budgets-shared");
    let mut cmd = r.pytest(
        py,
        &[
            "-n",
            "4",
            "--gpufrac-memory",
            "7G",
            "--gpufrac-split",
            "shared",
            "test_budgets.py",
        ],
    );
    cmd.env("GPUFRAC_TEST_OVERLAP", "1");
    let o = output_within(cmd, 300.0, "the shared split", &r.scratch.0);
    assert!(stdout(&o).contains("1 failed, 12 passed"), "{}", out(&o));
    let big = r.record("big");
    assert_eq!(big["refused"], "CUDA_ERROR_OUT_OF_MEMORY", "{big}");
    assert_eq!(big["together"], 3 * GIB, "{big}");
}

/// --gpufrac-learn: unknown tests run alone and are measured; the next
/// run packs them by what was learned (two 1 GiB tests, each learned at
/// 1.25 GiB, hold memory at once in 3 GiB, which they could not if either
/// still had the whole budget); a test that outgrows its figure runs again
/// at once with the whole budget, passes, and is learned by what it needs.
#[test]
fn learned_budgets_pack_unmarked_tests_in_later_runs_and_grow_when_outgrown() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-learn");
    // In the suite: a path outside it that exists would move pytest's
    // rootdir, and with it the test ids the figures are kept by.
    let json = r.suite().join("learn.json");
    let args = ["-n", "2", "--gpufrac-memory", "3G", "test_learn.py"];

    let mut cmd = r.pytest_cached(py, &args);
    cmd.arg("--gpufrac-learn")
        .args(["--gpufrac-report-json", "learn.json"]);
    let o = output_within(cmd, 300.0, "the learning run", &r.scratch.0);
    passed(&o, "2 passed");
    for t in ["learn-a", "learn-b"] {
        // Each ran alone: the whole budget was its, and the run says why.
        assert_eq!(r.record(t)["together"], GIB, "{}", out(&o));
        assert!(
            stdout(&o).contains(&format!(
                "test_learn.py::test_{} ran alone: it reserved the whole budget of 3.00 GiB: \
                 it has neither a gpu_memory mark nor a learned figure",
                t.replace('-', "_")
            )),
            "{}",
            out(&o)
        );
    }
    let j = report_json(&json);
    let a = test_entry(&j, "test_learn.py::test_learn_a");
    assert_eq!(a["budget_source"], "whole", "{a}");
    assert_eq!(a["budget_bytes"], 3 * GIB, "{a}");
    let learned = r.learned();
    for t in ["test_learn.py::test_learn_a", "test_learn.py::test_learn_b"] {
        assert_eq!(learned[t]["peak"], GIB, "{learned}");
        assert_eq!(learned[t]["budget"], 1280 * MIB, "{learned}");
    }

    // Packed by what was learned: both hold their 1 GiB at once.
    let mut cmd = r.pytest_cached(py, &args);
    cmd.env("GPUFRAC_TEST_PAIR", "1")
        .arg("--gpufrac-report")
        .args(["--gpufrac-report-json", "learn.json"])
        .args(["--gpufrac-report-md", "learn.md"]);
    let o = output_within(cmd, 300.0, "the packed run", &r.scratch.0);
    passed(&o, "2 passed");
    for t in ["learn-a", "learn-b"] {
        assert_eq!(r.record(t)["together"], 2 * GIB, "{}", out(&o));
    }
    // Which tests ran together, in the terminal, the JSON and the
    // Markdown for a CI step summary; and the run's peak, both at once.
    assert!(
        stdout(&o).contains(
            "2 of 2 tests ran beside others, at most 2 at once: test_learn.py::test_learn_a, \
             test_learn.py::test_learn_b"
        ),
        "{}",
        out(&o)
    );
    assert!(
        stdout(&o).contains("the run's peak: 2.00 GiB of its 3.00 GiB budget"),
        "{}",
        out(&o)
    );
    let j = report_json(&json);
    assert_eq!(j["run_peak_bytes"], 2 * GIB, "{j}");
    assert_eq!(
        j["ran_together"],
        serde_json::json!([["test_learn.py::test_learn_a", "test_learn.py::test_learn_b"]]),
        "{j}"
    );
    assert_eq!(
        test_entry(&j, "test_learn.py::test_learn_b")["ran_with"],
        serde_json::json!(["test_learn.py::test_learn_a"]),
        "{j}"
    );
    let md = std::fs::read_to_string(r.suite().join("learn.md")).unwrap();
    for want in [
        "**The run's peak: 2.00 GiB of its 3.00 GiB budget**",
        "| `test_learn.py::test_learn_a` | passed | 1.00 GiB | 1.25 GiB | learned |",
        "2 of 2 tests ran beside others, at most 2 at once.",
        "- `test_learn.py::test_learn_a`, `test_learn.py::test_learn_b`",
    ] {
        assert!(md.contains(want), "{want:?} not in:\n{md}");
    }
    let a = test_entry(&j, "test_learn.py::test_learn_a");
    assert_eq!(a["budget_source"], "learned", "{a}");
    assert_eq!(a["budget_bytes"], 1280 * MIB, "{a}");
    assert_eq!(a["learned_bytes"], 1280 * MIB, "{a}");
    // Declared, learned and measured side by side.
    let line = stdout(&o)
        .lines()
        .find(|l| l.ends_with("test_learn.py::test_learn_a"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("test_learn_a not in the report:\n{}", out(&o)));
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        cols[..7],
        ["1.00", "GiB", "0", "B", "-", "1.25", "GiB"],
        "{line}"
    );

    // -n auto by what was learned: 3 GiB holds two 1.25 GiB tests, though
    // xdist's auto (told 8 CPUs here) would start eight workers.
    let mut cmd = r.pytest_cached(py, &["-n", "auto", "--gpufrac-memory", "3G"]);
    cmd.env("PYTEST_XDIST_AUTO_NUM_WORKERS", "8")
        .arg("test_learn.py");
    let o = output_within(cmd, 300.0, "the -n auto run", &r.scratch.0);
    passed(&o, "2 passed");
    assert!(
        stdout(&o).contains(
            "gpufrac: -n auto: 2 workers: the budget holds 2 tests of the median learned \
             budget (1.25 GiB) at once, and the CPUs allow 8"
        ),
        "{}",
        out(&o)
    );
    assert!(stdout(&o).contains("created: 2/2 workers"), "{}", out(&o));

    // Outgrown: it takes 2.75 GiB in 256 MiB blocks against its 1.25 GiB,
    // and is refused at 1.5 GiB. It runs again at once, alone, with the
    // run's whole budget: the run passes, and what it needs now is
    // learned, not what it had asked for when refused (learned from that,
    // with its budget doubled, it took two more red runs to pass).
    let grown = ["-n", "2", "--gpufrac-memory", "4G", "test_learn.py"];
    let mut cmd = r.pytest_cached(py, &grown);
    cmd.env("GPUFRAC_TEST_GROW", "steps")
        .arg("--gpufrac-learn")
        .args(["--gpufrac-report-json", "learn.json"]);
    let o = output_within(cmd, 300.0, "the outgrowing run", &r.scratch.0);
    passed(&o, "2 passed");
    assert!(
        stdout(&o).contains(
            "test_learn.py::test_learn_a outgrew its learned budget of 1.25 GiB (it asked for \
             1.50 GiB there): run again alone with the run's whole budget of 4.00 GiB, it \
             passed, peak 2.75 GiB; --gpufrac-learn keeps 3.43 GiB as its budget"
        ),
        "{}",
        out(&o)
    );
    let j = report_json(&json);
    let a = test_entry(&j, "test_learn.py::test_learn_a");
    assert_eq!(a["budget_source"], "retry", "{a}");
    assert_eq!(a["budget_bytes"], 4 * GIB, "{a}");
    assert_eq!(a["peak_bytes"], 2816 * MIB, "{a}");
    assert_eq!(
        a["retried_from"],
        serde_json::json!({
            "budget_bytes": 1280 * MIB,
            "wanted_bytes": 1536 * MIB,
            "peak_bytes": 1280 * MIB
        }),
        "{a}"
    );
    assert_eq!(
        r.learned()["test_learn.py::test_learn_a"]["budget"],
        3520 * MIB,
        "{}",
        out(&o)
    );
    // The next run packs it by that, and passes without running it again.
    let mut cmd = r.pytest_cached(py, &grown);
    cmd.env("GPUFRAC_TEST_GROW", "steps")
        .args(["--gpufrac-report-json", "learn.json"]);
    let o = output_within(cmd, 300.0, "the grown run", &r.scratch.0);
    passed(&o, "2 passed");
    assert!(!stdout(&o).contains("outgrew"), "{}", out(&o));
    let j = report_json(&json);
    let a = test_entry(&j, "test_learn.py::test_learn_a");
    assert_eq!(a["budget_source"], "learned", "{a}");
    assert_eq!(a["budget_bytes"], 3520 * MIB, "{a}");
    assert!(a["retried_from"].is_null(), "{a}");
}

/// A test that outgrew its gpu_memory mark, in a CI log of 80 columns:
/// pytest's short summary cuts each line there, and the note comes first
/// and short (what it needs, what it was marked); its section says which
/// mark would pass, and that mark does. pytest cuts nothing where it
/// believes it runs on CI (`CI` or `BUILD_NUMBER` set): the test clears
/// both, so it sees the cut a terminal of 80 columns gets; on CI the whole
/// line is printed and the note is still its first part.
#[test]
fn a_test_past_its_mark_says_so_within_80_columns_and_which_mark_would_pass() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-mark");
    let args = ["-n", "2", "--gpufrac-memory", "2G", "test_mark.py"];
    let mut cmd = r.pytest(py, &args);
    cmd.env("COLUMNS", "80")
        .env_remove("CI")
        .env_remove("BUILD_NUMBER");
    let o = output_within(cmd, 300.0, "the marked run", &r.scratch.0);
    assert!(stdout(&o).contains("1 failed, 1 passed"), "{}", out(&o));
    let line = stdout(&o)
        .lines()
        .find(|l| l.starts_with("FAILED test_mark.py::test_grown"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no short summary line:\n{}", out(&o)));
    assert!(line.chars().count() <= 80, "{line}");
    assert!(
        line.starts_with("FAILED test_mark.py::test_grown - gpufrac: needs ~768 MiB, marked 512M"),
        "{line}"
    );
    assert!(
        stdout(&o).contains(
            "It asked for 768.00 MiB (what it held when the cap refused it, and the refused \
             allocation): mark it @pytest.mark.gpu_memory(\"960M\"), that and 25% headroom"
        ),
        "{}",
        out(&o)
    );
    let mut cmd = r.pytest(py, &args);
    cmd.env("GPUFRAC_TEST_MARK", "960M");
    let o = output_within(cmd, 300.0, "the run marked as it said", &r.scratch.0);
    passed(&o, "2 passed");
}

/// The venv's Python as another user runs it: the venv's own interpreter
/// where that user may run it, else the system's with the venv's packages
/// (a venv made from an interpreter under /root, as pyenv's are, is not
/// theirs to run).
fn victim_python(py: &Py) -> Command {
    let runs = as_user(Command::new(py.python()).arg("--version"), 5001)
        .output()
        .is_ok_and(|o| o.status.success());
    let mut c = if runs {
        Command::new(py.python())
    } else {
        let lib = std::fs::read_dir(py.venv.join("lib"))
            .unwrap()
            .flatten()
            .map(|e| e.path().join("site-packages"))
            .find(|p| p.exists())
            .expect("the venv's site-packages");
        let mut c = Command::new("/usr/bin/python3");
        c.env("PYTHONPATH", lib);
        c
    };
    c.env("PYTHONDONTWRITEBYTECODE", "1");
    c
}

/// The plugin's reports are written where the user says, which may be a
/// directory others can write (a shared workspace, /tmp): a name another
/// user planted there beforehand, a link at the file's old temporary name
/// (`PATH.tmp`) to a file of the victim's, is never written through. As
/// root: the attacker is uid 65534, the victim uid 5001.
#[test]
fn a_report_is_never_written_through_a_link_planted_beside_it() {
    let Some(py) = py() else { return };
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip_banner(
            "the planted-link test",
            "it needs root (it runs as uids 65534 and 5001)",
        );
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let s = Scratch::new("wheel-planted");
    std::fs::set_permissions(&s.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = s.0.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let home = s.0.join("victim");
    std::fs::create_dir(&home).unwrap();
    let notes = home.join("notes");
    std::fs::write(&notes, "the victim's own\n").unwrap();
    for p in [&home, &notes] {
        std::os::unix::fs::chown(p, Some(5001), Some(5001)).unwrap();
    }
    let report = shared.join("gpu-memory.json");
    let planted = shared.join("gpu-memory.json.tmp");
    let o = as_user(
        Command::new("ln").arg("-s").arg(&notes).arg(&planted),
        65534,
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", out(&o));
    // The victim's run writes its report, through the plugin's own writer.
    let script = "import sys, types\n\
                  from gpufrac.pytest_plugin import _write\n\
                  config = types.SimpleNamespace(invocation_params=types.SimpleNamespace(dir=sys.argv[1]))\n\
                  _write(config, 'gpu-memory.json', '{\"version\": 1}\\n')\n";
    let o = as_user(victim_python(py).args(["-c", script]).arg(&shared), 5001)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out(&o));
    assert_eq!(
        std::fs::read_to_string(&notes).unwrap(),
        "the victim's own\n",
        "the report was written through the planted link"
    );
    assert_eq!(
        std::fs::read_to_string(&report).unwrap(),
        "{\"version\": 1}\n"
    );
    assert!(
        !std::fs::symlink_metadata(&report)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the report is the link"
    );
    // The planted link is left as it was, and nothing else of the write.
    let mut left: Vec<String> = std::fs::read_dir(&shared)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["gpu-memory.json", "gpu-memory.json.tmp"], "{left:?}");
}

/// A test refused at its first allocation peaked at nothing, but asked for
/// 2 GiB: --gpufrac-learn learns that (with headroom), says so instead of
/// advising the option the run already used, and the next run passes.
/// (It learned a peak of 0 before: a 1 MiB budget, doubled per failing run.)
#[test]
fn a_test_refused_at_its_first_allocation_learns_what_it_asked_for() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-learn-refused");
    let args = [
        "-n",
        "2",
        "--gpufrac-memory",
        "3G",
        "--gpufrac-default-memory",
        "1G",
        "--gpufrac-learn",
        "test_learn.py",
    ];
    let mut cmd = r.pytest_cached(py, &args);
    cmd.env("GPUFRAC_TEST_GROW", "1");
    let o = output_within(cmd, 300.0, "the refused run", &r.scratch.0);
    assert!(stdout(&o).contains("1 failed, 1 passed"), "{}", out(&o));
    assert!(
        stdout(&o).contains(
            "It asked for 2.00 GiB: --gpufrac-learn keeps 2.50 GiB as its budget, which the \
             next run reserves for it"
        ),
        "{}",
        out(&o)
    );
    assert!(
        !stdout(&o).contains("Run with --gpufrac-learn"),
        "{}",
        out(&o)
    );
    let learned = r.learned();
    let a = &learned["test_learn.py::test_learn_a"];
    assert_eq!(a["budget"], 2560 * MIB, "{learned}");
    assert_eq!(a["peak"], 2 * GIB, "{learned}");

    let mut cmd = r.pytest_cached(py, &args);
    cmd.env("GPUFRAC_TEST_GROW", "1");
    let o = output_within(cmd, 300.0, "the next run", &r.scratch.0);
    passed(&o, "2 passed");
}

/// A worker that dies holding 2 of the run's 3 GiB: its replacement's
/// next test, which needs 2 GiB, runs once the dead worker's reservation
/// is reclaimed (it would wait forever otherwise); a test that needs more
/// than the run has is skipped, saying why.
#[test]
fn a_crashed_workers_reservation_is_reclaimed_and_a_test_bigger_than_the_run_is_skipped() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-crash");
    let cmd = r.pytest(
        py,
        &["-n", "1", "-rfs", "--gpufrac-memory", "3G", "test_crash.py"],
    );
    let o = output_within(cmd, 300.0, "the run with a crash", &r.scratch.0);
    assert!(
        stdout(&o).contains("1 failed, 1 passed, 1 skipped"),
        "{}",
        out(&o)
    );
    assert_ne!(r.record("dies")["pid"], r.record("after")["pid"]);
    assert!(
        stdout(&o).contains(
            "gpufrac: this test needs 64.00 GiB of GPU memory (declared: gpu_memory('64G')), \
             more than the run's budget of 3.00 GiB (--gpufrac-memory)"
        ),
        "{}",
        out(&o)
    );
    assert_eq!(r.records(), 2, "the skipped test ran");
}

/// Between tests the plugin empties the caching allocator's pool (a
/// stand-in for cupy's), so the next test starts with nothing charged;
/// --gpufrac-keep-pools leaves it, and the report's "at start" says so;
/// the next test runs capped at its reservation plus what was kept. The
/// report lists a declaration far above its test's peak.
#[test]
fn pools_are_emptied_between_tests_unless_kept() {
    let Some(py) = py() else { return };
    for (keep, start, blocks) in [(false, 0, 0), (true, 512 * MIB, 1)] {
        let r = Run::new("wheel-pools");
        let json = r.scratch.0.join("pools.json");
        let mut cmd = r.pytest(
            py,
            &[
                "--gpufrac-memory",
                "2G",
                "--gpufrac-report",
                "--gpufrac-report-json",
            ],
        );
        cmd.arg(&json).arg("test_pools.py");
        if keep {
            cmd.arg("--gpufrac-keep-pools");
        }
        let o = output_within(cmd, 300.0, "the pools run", &r.scratch.0);
        passed(&o, "2 passed");
        assert_eq!(r.record("next")["pool_blocks"], blocks, "{}", out(&o));
        let j = report_json(&json);
        let next = test_entry(&j, "test_pools.py::test_next");
        assert_eq!(next["start_bytes"], start, "{next}");
        assert_eq!(next["peak_bytes"], start + 256 * MIB, "{next}");
        // Capped at its reservation and what its worker held before it.
        assert_eq!(next["cap_bytes"], GIB + start, "{next}");
        assert_eq!(next["declared_bytes"], GIB, "{next}");
        // 1 GiB declared, 256 MiB used: four times its peak, listed; with
        // the pool kept its peak is 768 MiB, and it is not.
        let far = "test_pools.py::test_next declares 1.00 GiB, peaked at 256.00 MiB";
        assert_eq!(stdout(&o).contains(far), !keep, "{}", out(&o));
    }
}

/// Sizes as the CLI takes them, a percentage included: the run's budget
/// as 25% of the simulated 16 GiB GPU, a mark as a share of that.
#[test]
fn sizes_take_the_clis_rules_percentages_included() {
    let Some(py) = py() else { return };
    let r = Run::new("wheel-sizes");
    let o = output_within(
        r.pytest(py, &["--gpufrac-memory", "25%", "test_report.py"]),
        300.0,
        "the 25% run",
        &r.scratch.0,
    );
    passed(&o, "4 passed");
    assert!(
        stdout(&o).contains("gpufrac: GPU memory budget 4.00 GiB, one process"),
        "{}",
        out(&o)
    );
    for (flag, bad, said) in [
        ("--gpufrac-memory", "101%", "'101%' is above 100%"),
        (
            "--gpufrac-memory",
            ".5G",
            "'.5G': write a leading zero, as in 0.5",
        ),
        ("--gpufrac-default-memory", "4X", "'4X': unknown unit 'X'"),
    ] {
        let o = r
            .pytest(py, &["--gpufrac-memory", "1G", flag, bad, "test_report.py"])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(4), "{}", out(&o));
        assert!(
            stderr(&o).contains(&format!("{flag} {said}; expected a size such as 4G")),
            "{}",
            out(&o)
        );
    }
}
