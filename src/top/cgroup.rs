//! The container, pod or Slurm job a process runs in, from its cgroup
//! (`/proc/PID/cgroup`).
//!
//! Read here, by `gpufrac top`, not by the broker: it is only shown, never
//! decided on, so the broker need not do one more read of /proc per
//! registration nor keep one more client-controlled string per connection
//! within its budgets; and /proc/PID/cgroup is readable by every user on a
//! default mount, so top sees what the broker would. Where it is not (a
//! `hidepid` mount, top in another pid namespace), the column says `-`.
//! The read is bounded: a cgroup path is short, and a file that is not is
//! not one to parse.

use std::io::Read;

/// Bytes of /proc/PID/cgroup read at most (cgroup v1 lists a line per
/// controller; a dozen short paths).
const MAX_READ: u64 = 8 << 10;

/// What the process's cgroup says it runs in, e.g. `docker 3f2a1b0c9d8e`,
/// `podman 77aa…`, `k8s pod 9c1e…`, `slurm job 123`; None for a process
/// in none of these (a login session, a system service).
pub fn of(pid: u32) -> Option<String> {
    let f = std::fs::File::open(format!("/proc/{pid}/cgroup")).ok()?;
    let mut text = String::new();
    f.take(MAX_READ).read_to_string(&mut text).ok()?;
    parse(&text)
}

/// The container of the first line that names one.
pub fn parse(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .find_map(classify)
}

fn classify(path: &str) -> Option<String> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    // Kubernetes first: its containers' scopes are also runtimes' (cri-o,
    // containerd, docker), but the pod is what people know them by.
    if let Some(pod) = pod_of(&parts) {
        return Some(pod);
    }
    if let Some(job) = slurm_job_of(&parts) {
        return Some(format!("slurm job {job}"));
    }
    for p in parts.iter().rev() {
        if let Some(id) = scope_id(p, "docker") {
            return Some(format!("docker {}", short(id)));
        }
        if let Some(id) = scope_id(p, "libpod") {
            return Some(format!("podman {}", short(id)));
        }
    }
    // cgroupfs drivers: /docker/<id>, /libpod_parent/libpod-<id>.
    if let Some(i) = parts.iter().position(|&p| p == "docker")
        && let Some(id) = parts.get(i + 1).filter(|id| is_hex_id(id))
    {
        return Some(format!("docker {}", short(id)));
    }
    None
}

/// A pod, only from the kubelet's own tree at the root of the hierarchy
/// (`/kubepods.slice/…`, `/kubepods/…`), and only by a well-formed pod
/// UID: a user's delegated cgroup (systemd hands one to every logged-in
/// user, under `user@UID.service`) may be named anything, `kubepods`
/// included.
fn pod_of(parts: &[&str]) -> Option<String> {
    if !parts.first()?.starts_with("kubepods") {
        return None;
    }
    let uid = parts[1..].iter().find_map(|p| {
        let p = p.strip_suffix(".slice").unwrap_or(p);
        let uid = p
            .rsplit_once("-pod")
            .map(|(_, u)| u)
            .or_else(|| p.strip_prefix("pod"))?;
        let uid = uid.replace('_', "-");
        is_pod_uid(&uid).then_some(uid)
    });
    Some(match uid {
        Some(uid) => format!("k8s pod {}", short(&uid)),
        None => "k8s".into(),
    })
}

/// A Slurm job's number, only from slurmstepd's own tree: with cgroup v2
/// `/system.slice/[NODE_]slurmstepd.scope/job_N/…`, with v1
/// `/slurm[_NODE]/uid_U/job_N/…` (the root of a controller's hierarchy),
/// and only a well-formed `job_[0-9]+`. A `slurm/job_4242` that a user
/// made in a delegated cgroup of theirs is nobody's job.
fn slurm_job_of<'a>(parts: &[&'a str]) -> Option<&'a str> {
    let job = match parts {
        ["system.slice", scope, job, ..] if scope.ends_with("slurmstepd.scope") => job,
        [root, uid, job, ..]
            if (*root == "slurm" || root.starts_with("slurm_"))
                && uid.strip_prefix("uid_").is_some_and(is_number) =>
        {
            job
        }
        _ => return None,
    };
    job.strip_prefix("job_").filter(|n| is_number(n))
}

fn is_number(s: &str) -> bool {
    !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit())
}

/// A Kubernetes pod UID: 8-4-4-4-12 hexadecimal digits.
fn is_pod_uid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// `docker-<id>.scope` or `libpod-<id>.scope` (the systemd drivers), or
/// `libpod-<id>` (cgroupfs); not the `-conmon-` monitor's own scope.
fn scope_id<'a>(part: &'a str, runtime: &str) -> Option<&'a str> {
    let rest = part.strip_prefix(runtime)?.strip_prefix('-')?;
    let id = rest.strip_suffix(".scope").unwrap_or(rest);
    is_hex_id(id).then_some(id)
}

fn is_hex_id(s: &str) -> bool {
    s.len() >= 12 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The first 12 characters, as `docker ps` shows ids.
fn short(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a";

    #[test]
    fn runtimes_pods_and_slurm_jobs() {
        let cases = [
            (
                format!("0::/system.slice/docker-{ID}.scope\n"),
                Some("docker 3f2a1b0c9d8e"),
            ),
            (
                format!("12:memory:/docker/{ID}\n11:cpu:/docker/{ID}\n"),
                Some("docker 3f2a1b0c9d8e"),
            ),
            (
                format!("0::/machine.slice/libpod-{ID}.scope/container\n"),
                Some("podman 3f2a1b0c9d8e"),
            ),
            (
                format!(
                    "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope\n"
                ),
                Some("podman 3f2a1b0c9d8e"),
            ),
            (
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/\
                     kubepods-burstable-pod9c1e5d2a_77aa_4b1b_9f00_0123456789ab.slice/\
                     cri-containerd-{ID}.scope\n"
                ),
                Some("k8s pod 9c1e5d2a-77a"),
            ),
            (
                "0::/kubepods/besteffort/pod9c1e5d2a-77aa-4b1b-9f00-0123456789ab/abc\n".into(),
                Some("k8s pod 9c1e5d2a-77a"),
            ),
            (
                "0::/system.slice/slurmstepd.scope/job_123/step_0/user/task_0\n".into(),
                Some("slurm job 123"),
            ),
            (
                "4:memory:/slurm/uid_1000/job_77/step_batch/task_0\n".into(),
                Some("slurm job 77"),
            ),
            (
                "0::/user.slice/user-1000.slice/session-3.scope\n".into(),
                None,
            ),
            ("0::/system.slice/docker.service\n".into(), None),
            // The review's plant: a user's delegated cgroup named like a
            // Slurm job, a right-to-left override in it. Nobody's job, and
            // nothing of the name shown.
            (
                "0::/user.slice/user-65534.slice/user@65534.service/slurm/job_4242\u{202e}LIVE\n"
                    .into(),
                None,
            ),
            (
                "0::/user.slice/user-65534.slice/user@65534.service/app.slice/slurm/job_4242/x\n"
                    .into(),
                None,
            ),
            (
                "0::/user.slice/user-65534.slice/user@65534.service/system.slice/\
                 slurmstepd.scope/job_9/step_0\n"
                    .into(),
                None,
            ),
            (
                "0::/user.slice/user-65534.slice/user@65534.service/kubepods.slice/\
                 kubepods-pod9c1e5d2a_77aa_4b1b_9f00_0123456789ab.slice\n"
                    .into(),
                None,
            ),
            // Ill-formed ids at the real roots.
            (
                "0::/system.slice/slurmstepd.scope/job_12\u{202e}3/step_0\n".into(),
                None,
            ),
            (
                "0::/kubepods/besteffort/pod9c1e\u{200b}5d2a-77aa-4b1b-9f00-0123456789ab/abc\n"
                    .into(),
                Some("k8s"),
            ),
            (
                "0::/system.slice/node1_slurmstepd.scope/job_55/step_0\n".into(),
                Some("slurm job 55"),
            ),
            ("0::/\n".into(), None),
            ("garbage".into(), None),
        ];
        for (text, want) in cases {
            assert_eq!(parse(&text).as_deref(), want, "{text}");
        }
    }

    #[test]
    fn this_process_and_a_missing_one() {
        // Whatever this test runs in, reading it does not fail or hang.
        let _ = of(std::process::id());
        assert_eq!(of(u32::MAX), None);
    }
}
