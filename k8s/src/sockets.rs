//! The plugins' Unix sockets: a gRPC server on a socket only root can
//! reach (the device plugin's in the kubelet's device-plugins directory,
//! the DRA plugin's two in plugins_registry and plugins), knowing which
//! file it listens on so that a socket removed by the kubelet is noticed
//! and served anew; and a gRPC channel to a socket (the kubelet's).

use std::error::Error;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::Routes;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::authority::FixAuthority;

/// How long a server that is being replaced may take to finish.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A gRPC channel over a Unix socket (the kubelet's or a plugin's). The URI
/// is a placeholder that tonic requires; the connector decides where to
/// connect.
pub async fn connect_unix(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Which file a path is: its device and inode, and its change time, since
/// a socket created anew right after the old one was removed may get the
/// same inode number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId(u64, u64, i64, i64);

pub fn file_id(p: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(p)
        .ok()
        .map(|m| FileId(m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// One gRPC server on one socket.
pub struct Running {
    /// The socket file it listens on.
    pub bound: FileId,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

/// Serves `routes` on a socket at `path` (one left there by an earlier
/// instance is replaced; anything else is left alone, and refused). The
/// routes get a receiver that turns true when the server stops, for
/// streams that would otherwise never end.
pub fn serve_at(
    path: &Path,
    routes: impl FnOnce(watch::Receiver<bool>) -> Routes,
) -> Result<Running, String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            // Left by an earlier instance (or removed by the kubelet
            // meanwhile, which is as good).
            let _ = std::fs::remove_file(path);
        }
        Ok(_) => {
            return Err(format!(
                "{} exists and is not a socket; the plugin will not remove it: move it away",
                path.display()
            ));
        }
        Err(_) => {}
    }
    let listener = bind_private(path)
        .and_then(|l| {
            l.set_nonblocking(true)?;
            tokio::net::UnixListener::from_std(l)
        })
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let bound = file_id(path)
        .ok_or_else(|| format!("{} vanished right after it was made", path.display()))?;
    let (stop, stop_rx) = watch::channel(false);
    let routes = routes(stop_rx.clone());
    let mut until = stop_rx;
    let task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener).map(|c| c.map(FixAuthority::new)),
                async move {
                    let _ = until.wait_for(|s| *s).await;
                },
            ),
    );
    Ok(Running { bound, stop, task })
}

impl Running {
    /// Stops serving: streams end, calls in flight get their time.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        match tokio::time::timeout(STOP_TIMEOUT, &mut self.task).await {
            Ok(Ok(Err(e))) => tracing::warn!("a plugin server ended with {}", chain(&e)),
            Ok(_) => {}
            Err(_) => self.task.abort(),
        }
    }
}

/// An error with its causes: tonic's own text is only "transport error".
pub fn chain(e: &dyn Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Only the kubelet (root) connects to the plugin: the socket is made mode
/// 0600 whatever the umask, under a fresh name, and renamed into place
/// only then, so that it is never reachable with a looser mode.
pub fn bind_private(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = gpufrac_common::files::temporary(path);
    let l = std::os::unix::net::UnixListener::bind(&tmp)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_socket_is_private_whatever_the_umask() {
        let d = std::env::temp_dir().join(format!("gpufrac-k8s-sock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("gpufrac.sock");
        // SAFETY: umask is process-wide; this test binary binds no other
        // socket meanwhile, and the old mask is put back.
        let old = unsafe { libc::umask(0) };
        let l = bind_private(&p);
        unsafe { libc::umask(old) };
        let _l = l.unwrap();
        let meta = std::fs::symlink_metadata(&p).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.mode() & 0o777, 0o600);
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary left: {left:?}");
        std::os::unix::net::UnixStream::connect(&p).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}
