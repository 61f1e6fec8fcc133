//! One memory cap for a whole job: `gpufrac run --gpu-memory SIZE` caps all
//! of its processes together (with a broker and without one), memory of a
//! process that dies returns to the job at once, and plain `GPU_MEM_LIMIT`
//! stays per process.

mod support;
use std::process::{Command, Output, Stdio};
use support::*;

/// Kernel counts of every `fill` line in the output.
fn fills(o: &Output) -> Vec<u64> {
    stdout(o)
        .lines()
        .filter(|l| l.starts_with("fill "))
        .map(|l| {
            l.split_whitespace()
                .find_map(|kv| kv.strip_prefix("count="))
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

/// Three processes of one job, each filling the GPU with 64 MiB blocks and
/// holding them while the others try.
fn three_fill(probe: &std::path::Path) -> String {
    let p = probe.display();
    format!("for i in 1 2 3; do {p} ctx fill alloc 64M sleep-ms 1500 & done; wait")
}

#[test]
fn a_job_without_a_broker_is_capped_as_a_whole() {
    let o = run_alone("16G", &["--gpu-memory", "1G", "--", "sh", "-c"])
        .arg(three_fill(&artifacts().probe))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let f = fills(&o);
    assert_eq!(f.len(), 3, "{}", stdout(&o));
    // Each process alone would have got 16 (1 GiB / 64 MiB): together too.
    assert_eq!(f.iter().sum::<u64>(), 16, "{f:?}");
}

#[test]
fn a_job_with_a_broker_is_capped_as_a_whole_and_status_shows_its_total() {
    let b = Broker::start("16G", &[]);
    let p = artifacts().probe.display().to_string();
    let script = format!("for i in 1 2; do {p} ctx fill alloc 64M sleep-ms 3000 & done; wait");
    let child = b
        .run(&["--gpu-memory", "1G", "--", "sh", "-c"])
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Both processes registered under the job, together at the job's cap.
    wait_until(20.0, "the job's total in status", || {
        let s = b.status();
        let procs = s["gpus"][0]["processes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        procs.len() == 2
            && procs
                .iter()
                .all(|p| p["job_mem_used"].as_u64() == Some(GIB) && p["job"].is_u64())
    });
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o).iter().sum::<u64>(), 16, "{}", stdout(&o));
}

/// The broker's line for a job's end says the job's peak, even for a
/// process that takes its memory and gives it back between two of its
/// usage reports (they go every 100 ms) and exits: it says its figures
/// once more as it exits.
#[test]
fn a_short_jobs_end_line_says_its_peak() {
    let b = Broker::start("16G", &[]);
    let p = artifacts().probe.display().to_string();
    for (size, peak) in [("3G", "3.00 GiB"), ("768M", "768.00 MiB")] {
        let o = b
            .run(&[
                "--gpu-memory",
                "4G",
                "--",
                &p,
                "ctx",
                "alloc",
                "alloc",
                size,
                "free-all",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
        let line = format!("ctx alloc alloc {size} free-all\"");
        wait_until(10.0, "the lease's end in the broker's log", || {
            b.log()
                .lines()
                .any(|l| l.contains("lease ended") && l.contains(&line))
        });
        let log = b.log();
        let ended = log
            .lines()
            .find(|l| l.contains("lease ended") && l.contains(&line))
            .unwrap();
        assert!(ended.contains(&format!("peak=\"{peak}\"")), "{ended}");
    }
}

#[test]
fn memory_of_a_killed_process_returns_to_the_job_at_once() {
    let dir = Scratch::new("jobkill");
    let p = artifacts().probe.display().to_string();
    let first = dir.0.join("first.out");
    // The first process fills the cap and hangs on; once it has, it is
    // killed with SIGKILL (its shim has no chance to say anything) and a
    // second process must get the whole cap again.
    let script = format!(
        "{p} ctx fill alloc 64M sleep-ms 60000 > {f} & P=$!; \
         until grep -q '^fill' {f} 2>/dev/null; do sleep 0.01; done; \
         kill -9 $P; wait $P; cat {f}; {p} ctx fill alloc 64M",
        f = first.display()
    );
    let o = run_alone("16G", &["--gpu-memory", "1G", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![16, 16], "{}", stdout(&o));
}

#[test]
fn plain_gpu_mem_limit_stays_per_process() {
    let a = artifacts();
    let o = sim_command("sh", "16G", true)
        .env("GPU_MEM_LIMIT", "1G")
        .args(["-c", &three_fill(&a.probe)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![16, 16, 16], "{}", stdout(&o));
}

#[test]
fn the_jobs_books_are_removed_when_it_ends() {
    let o = run_alone(
        "16G",
        &[
            "--gpu-memory",
            "1G",
            "--",
            "sh",
            "-c",
            "echo $GPUFRAC_JOB_LEDGER",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let path = stdout(&o).trim().to_string();
    assert!(path.contains("gpufrac-job-"), "{path}");
    assert!(!std::path::Path::new(&path).exists(), "{path} left behind");
}

/// A process that does not descend from the job's `run` (a container's,
/// whose parent is the container runtime) joins the job by the token run
/// puts in the environment, and shares its memory cap; a wrong token makes
/// it its user's, uncapped.
#[test]
fn a_process_outside_the_run_joins_the_job_by_its_token() {
    use std::io::{BufRead, BufReader};
    let b = Broker::start("16G", &[]);
    let mut run = KillOnDrop(
        b.run(&["--gpu-memory", "1G", "--", "sh", "-c"])
            .arg("echo \"$GPUFRAC_JOB $GPUFRAC_JOB_LEDGER\"; cat > /dev/null")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let run_pid = run.0.id();
    let mut line = String::new();
    BufReader::new(run.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let (token, books) = line.trim().split_once(' ').expect("token and books");
    assert_eq!(token.len(), 16, "{line}");
    let outsider = |token: &str| {
        b.client(&artifacts().probe)
            .env("GPUFRAC_JOB", token)
            .env("GPUFRAC_JOB_LEDGER", books)
            .args(["ctx", "fill", "alloc", "64M", "sleep-ms", "1500"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let joined = outsider(token);
    let pid = joined.id();
    wait_until(20.0, "the outsider in the job", || {
        b.status()["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|ps| {
                ps.iter().any(|p| {
                    p["pid"].as_u64() == Some(u64::from(pid))
                        && p["job"].as_u64() == Some(u64::from(run_pid))
                })
            })
    });
    let o = joined.wait_with_output().unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![16], "{}", stdout(&o));

    // Another job's token: not this job's (a token no job holds counts for
    // nothing), so the process is its user's, under no cap.
    let wrong = if token == "0000000000000001" {
        "0000000000000002"
    } else {
        "0000000000000001"
    };
    let o = b
        .client(&artifacts().probe)
        .env("GPUFRAC_JOB", wrong)
        .args(["ctx", "fill", "alloc", "64M"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![256], "{}", stdout(&o));
    drop(run.0.stdin.take());
    assert!(run.0.wait().unwrap().success());
}

/// The processes of one job driven step by step
/// (tests/fixtures/cuda_steps.py): their output is read line by line as it
/// comes, and processes holding on their stdin (`hold 0`) all go on when
/// `release` closes it.
struct Steps {
    run: KillOnDrop,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

/// `python3 cuda_steps.py` with `steps`, as words of a shell command.
fn steps(steps: &str) -> String {
    format!(
        "python3 {}/tests/fixtures/cuda_steps.py {steps}",
        env!("CARGO_MANIFEST_DIR")
    )
}

impl Steps {
    /// Starts `run` (a `gpufrac run … -- sh -c SCRIPT`).
    fn start(mut run: Command) -> Steps {
        use std::io::{BufRead, BufReader, Read};
        let mut child = run
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut err = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Steps {
            stdin: child.stdin.take(),
            run: KillOnDrop(child),
            lines,
            seen: Vec::new(),
            stderr: Some(stderr),
        }
    }

    /// Waits until `n` lines starting with `step` have been printed in
    /// all; returns them.
    fn until(&mut self, step: &str, n: usize) -> Vec<String> {
        let of = |seen: &[String]| -> Vec<String> {
            seen.iter()
                .filter(|l| l.split_whitespace().next() == Some(step))
                .cloned()
                .collect()
        };
        while of(&self.seen).len() < n {
            match self.lines.recv_timeout(std::time::Duration::from_secs(30)) {
                Ok(l) => self.seen.push(l),
                Err(_) => {
                    // Release whatever holds, to show what stderr says.
                    drop(self.stdin.take());
                    let _ = self.run.0.wait();
                    let err = self.stderr.take().unwrap().join().unwrap_or_default();
                    panic!(
                        "waiting for {n} {step:?} lines; got:\n{}\nstderr:\n{err}",
                        self.seen.join("\n")
                    )
                }
            }
        }
        of(&self.seen)
    }

    /// Lets every process holding on stdin go on, all at once.
    fn release(&mut self) {
        drop(self.stdin.take());
    }

    /// Lets every process go on to its end; all it printed, and stderr.
    fn finish(mut self) -> (Vec<String>, String) {
        drop(self.stdin.take());
        self.seen.extend(self.lines.iter());
        let status = self.run.0.wait().unwrap();
        let err = self.stderr.take().unwrap().join().unwrap();
        assert!(status.success(), "{}\n{err}", self.seen.join("\n"));
        (self.seen, err)
    }
}

/// A FIFO that processes hold on (`hold 3` with `3<PATH`) until `release`:
/// kept open for writing from the start, so that opening it never blocks,
/// and closed to let every holder go on at once.
struct Fifo {
    _dir: Scratch,
    path: std::path::PathBuf,
    writer: Option<std::fs::File>,
}

impl Fifo {
    fn new(name: &str) -> Fifo {
        let dir = Scratch::new(name);
        let path = dir.0.join("hold");
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Read and write: opening does not wait for a reader.
        let writer = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        Fifo {
            _dir: dir,
            path,
            writer: Some(writer),
        }
    }

    fn release(&mut self) {
        drop(self.writer.take());
    }
}

/// The value of `key=` in a line printed by cuda_steps.py.
fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .parse()
        .unwrap()
}

/// Two processes of one 2 GiB job, released by one barrier the instant
/// before they initialise CUDA (joining the books) and fill the GPU with
/// 4 MiB blocks, each holding what it got until both have said: together
/// they never hold more than the job's cap, with a broker and without one.
#[test]
fn two_processes_of_a_job_started_at_one_instant_share_its_cap() {
    let b = Broker::start("16G", &[]);
    for broker in [false, true] {
        for round in 0..3 {
            let mut fifo = Fifo::new("barrier");
            let p = steps("hold 0 init fill 4M hold 3");
            // A shell gives background jobs /dev/null for stdin: theirs is
            // the job's, so that closing it releases both.
            let script = format!(
                "exec 9<&0; {p} 0<&9 3<{f} & {p} 0<&9 3<{f} & wait",
                f = fifo.path.display()
            );
            let args = ["--gpu-memory", "2G", "--", "sh", "-c", &script];
            let mut s = Steps::start(if broker {
                b.run(&args)
            } else {
                run_alone("16G", &args)
            });
            s.until("hold", 2);
            s.release();
            let got: u64 = s
                .until("fill", 2)
                .iter()
                .map(|l| {
                    assert_eq!(field(l, "rc"), 2, "{l}");
                    field(l, "count")
                })
                .sum();
            // Both still hold their blocks here (at `hold 3`).
            assert_eq!(
                got, 512,
                "broker={broker} round {round}: 2 GiB in 4 MiB blocks"
            );
            fifo.release();
            s.finish();
        }
    }
}

/// What a 1 GiB job's processes did when its books were damaged: the first
/// process takes 64 MiB and, while it holds it, `damage` is done to the
/// books at the path it is given; then that process tries to fill the GPU
/// with 64 MiB blocks and allocates once more, and a second process starts
/// under the damaged books and tries to fill the GPU.
struct Damaged {
    books: String,
    lines: Vec<String>,
    stderr: String,
}

fn damaged_job(damage: impl FnOnce(&str)) -> Damaged {
    let first = steps("books init alloc 64M hold 0 fill 64M alloc 64M");
    let second = steps("init fill 64M");
    let mut s = Steps::start(run_alone(
        "16G",
        &[
            "--gpu-memory",
            "1G",
            "--",
            "sh",
            "-c",
            &format!("{first}; {second}"),
        ],
    ));
    let books = s.until("books", 1)[0]
        .strip_prefix("books ")
        .unwrap()
        .to_owned();
    s.until("hold", 1);
    assert_eq!(s.until("alloc", 1), ["alloc rc=0"]);
    damage(&books);
    s.release();
    let (lines, stderr) = s.finish();
    Damaged {
        books,
        lines,
        stderr,
    }
}

impl Damaged {
    fn of(&self, step: &str) -> Vec<&str> {
        self.lines
            .iter()
            .filter(|l| l.split_whitespace().next() == Some(step))
            .map(String::as_str)
            .collect()
    }

    /// The lines on stderr that contain `text`.
    fn said(&self, text: &str) -> Vec<&str> {
        self.stderr.lines().filter(|l| l.contains(text)).collect()
    }

    /// The first process was refused from the damage on, and said why
    /// once; the second failed its initialisation, naming the books.
    fn refused(&self, charge_says: &str, open_says: &str, case: &str) {
        self.ended("fill count=0 rc=2", Some(charge_says), open_says, case);
    }

    /// The first process's fill after the damage ended with `first_fill`,
    /// having said `charge_says` once (or nothing of its books); the second
    /// failed its initialisation, saying `open_says` of the books.
    fn ended(&self, first_fill: &str, charge_says: Option<&str>, open_says: &str, case: &str) {
        let ctx = format!("{case}:\n{}\n{}", self.lines.join("\n"), self.stderr);
        assert_eq!(self.of("init"), ["init rc=0", "init rc=1"], "{ctx}");
        // Then CUDA_ERROR_INVALID_VALUE, as for a malformed variable.
        assert_eq!(self.of("fill"), [first_fill, "fill count=0 rc=1"], "{ctx}");
        assert_eq!(self.of("alloc"), ["alloc rc=0", "alloc rc=2"], "{ctx}");
        let charged = self.said(&format!(
            "the job's memory books at {} cannot be charged: ",
            self.books
        ));
        match charge_says {
            Some(says) => {
                assert_eq!(charged.len(), 1, "said once: {ctx}");
                assert!(charged[0].contains(says), "{ctx}");
            }
            None => assert!(charged.is_empty(), "{ctx}"),
        }
        let opened = self.said(&format!(
            "GPUFRAC_JOB_LEDGER=\"{}\": the job's memory books cannot be used: ",
            self.books
        ));
        assert_eq!(opened.len(), 1, "{ctx}");
        assert!(opened[0].contains(open_says), "{ctx}");
    }
}

/// Writes `bytes` at `offset` of the books, as any process of the job can.
fn poke(books: &str, offset: usize, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(books).unwrap();
    f.write_all_at(bytes, offset as u64).unwrap();
}

/// A process of the job sets a field of its books out of range, or out of
/// step with the rest: the first process's next charges are refused (never
/// passed to the driver uncapped), and a process that starts under them
/// fails to initialise, as it would with a malformed variable.
#[test]
fn damaged_books_refuse_every_charge_and_fail_new_processes() {
    use gpufrac_common::jobledger::layout;
    let cases: [(&str, usize, u64, &str, &str); 4] = [
        (
            "GPU count",
            layout::NGPUS,
            1000,
            "the GPU count is 1000, at most 8",
            "the GPU count is 1000, at most 8",
        ),
        (
            "cap",
            layout::CAP,
            u64::MAX,
            "the job's cap changed from 1073741824 to 18446744073709551615",
            "the job's cap is 18446744073709551615",
        ),
        (
            "job's total",
            layout::used(0),
            0,
            "GPU 0's total is 0 bytes but its processes hold 67108864",
            "GPU 0's total is 0 bytes but its processes hold 67108864",
        ),
        (
            "process's charge",
            layout::slot_used(0, 0),
            1 << 62,
            "GPU 0's total is 67108864 bytes but its processes hold 4611686018427387904",
            "its processes hold 4611686018427387904",
        ),
    ];
    for (case, offset, value, charge_says, open_says) in cases {
        let d = damaged_job(|books| poke(books, offset, &value.to_le_bytes()));
        d.refused(charge_says, open_says, case);
    }
}

/// Books cut short: the running process's charges are refused, and a
/// process that starts under them fails to initialise.
#[test]
fn truncated_books_refuse_charges_and_fail_new_processes() {
    let d = damaged_job(|books| {
        let f = std::fs::OpenOptions::new().write(true).open(books).unwrap();
        f.set_len(100).unwrap();
    });
    let short = "the file is 100 bytes long, the books take";
    d.refused(short, short, "truncated");
}

/// Books overwritten with garbage in place are refused by the process that
/// charges them and by a process that starts; books replaced by a garbage
/// file (a new file under their name) leave a running process charging the
/// books it has, and a newcomer fails to initialise.
#[test]
fn books_replaced_by_garbage_refuse_charges_and_fail_new_processes() {
    use gpufrac_common::jobledger::layout;
    // A fixed pattern that is no books, the books' length.
    let junk: Vec<u8> = (0..layout::LEN as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9) >> 11) as u8)
        .collect();
    let d = damaged_job(|books| poke(books, 0, &junk));
    let not_books = "the file does not hold gpufrac job books";
    d.refused(not_books, not_books, "in place");

    let d = damaged_job(|books| {
        let new = format!("{books}.new");
        std::fs::write(&new, &junk).unwrap();
        std::fs::rename(&new, books).unwrap();
    });
    // The first process keeps charging the job's own books (the old file).
    d.ended("fill count=15 rc=2", None, not_books, "renamed");
}

/// A job that queued behind another, allocated 1 GiB of its 4 GiB cap, was
/// refused 4 GiB more and was busy for a second ends with one line on
/// stderr saying each figure, and `--report` writes them as JSON.
#[test]
fn a_finished_run_says_how_it_went_and_writes_its_report() {
    let b = Broker::start("16G", &[]);
    let dir = Scratch::new("run-report");
    let go = dir.0.join("go");
    // The GPU held whole until the second job has queued.
    let mut first = b.run(&["--gpus", "1", "--", "sh", "-c"]);
    first
        .arg(format!(
            "while [ ! -e {} ]; do sleep 0.05; done",
            go.display()
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let first = KillOnDrop(first.spawn().unwrap());
    wait_until(20.0, "the first job placed", || b.leases().len() == 1);
    let report = dir.0.join("report.json");
    let start = mono_ns() + 1_500_000_000;
    let mut second = b.run(&[
        "--gpu-memory",
        "4G",
        "--gpu-compute",
        "70%",
        "--report",
        report.to_str().unwrap(),
        "--",
    ]);
    second
        .arg(&artifacts().probe)
        .args(["ctx", "alloc", "alloc", "1G", "alloc", "alloc", "4G"])
        .args(spin_args(start, start + 1_000_000_000))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let second = second.spawn().unwrap();
    let pid = second.id();
    wait_until(20.0, "the second job queued", || {
        b.status()["queue"].as_array().is_some_and(|q| q.len() == 1)
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    std::fs::write(&go, "").unwrap();
    let o = second.wait_with_output().unwrap();
    drop(first);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!("gpufrac run: job {pid} ended (exit 0): held ")),
        "{err}"
    );
    assert!(
        last.contains("peak 1.00 GiB of its 4.00 GiB cap; 1 allocation refused"),
        "{err}"
    );
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap())
        .expect("the report is JSON");
    assert_eq!(r["job"], pid, "{r}");
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["peak_mem"].as_u64(), Some(1 << 30), "{r}");
    assert_eq!(r["mem_cap"].as_u64(), Some(4 << 30), "{r}");
    assert_eq!(r["refusals"], 1, "{r}");
    assert_eq!(r["compute"].as_f64(), Some(70.0), "{r}");
    assert!(r["queued_s"].as_f64().is_some_and(|q| q >= 0.4), "{r}");
    // Busy for a second, alone on the GPU: charged and owed about that.
    let (gpu, owed) = (r["gpu_s"].as_f64().unwrap(), r["owed_s"].as_f64().unwrap());
    assert!((0.8..2.0).contains(&gpu), "{r}");
    assert!((0.8..2.0).contains(&owed), "{r}");
    assert!(r["held_s"].as_f64().unwrap() >= gpu, "{r}");
    assert!(
        r["wall_s"].as_f64().unwrap() >= r["held_s"].as_f64().unwrap(),
        "{r}"
    );
}
