//! Notices a change to the `--config` file, as kube-proxy does, so that `run` can exit and be
//! started again with it (a DaemonSet restarts the container; the programs stay attached and
//! the maps pinned, so traffic keeps flowing meanwhile).
//!
//! A ConfigMap volume updates its files by swapping a symlink in the file's directory, so the
//! directory is watched, and the file's content compared: only a real change counts, not a
//! touch or a rewrite with the same bytes. A poll every 5 s backs the watch up.

use std::path::PathBuf;
use std::time::Duration;

use notify::Watcher as _;
use tokio::sync::oneshot;

/// Starts watching `path`; the receiver resolves once its content differs from what it is
/// now.
pub fn spawn(path: PathBuf) -> anyhow::Result<oneshot::Receiver<()>> {
    let original = std::fs::read(&path)
        .map_err(|e| anyhow::anyhow!("config {}: cannot read: {e}", path.display()))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), PathBuf::from);
    let (wake_tx, mut wake) = tokio::sync::mpsc::channel::<()>(1);
    let mut watcher = notify::recommended_watcher(move |_res: notify::Result<notify::Event>| {
        let _ = wake_tx.try_send(());
    })
    .map_err(|e| anyhow::anyhow!("config {}: cannot watch: {e}", path.display()))?;
    watcher
        .watch(&dir, notify::RecursiveMode::NonRecursive)
        .map_err(|e| {
            anyhow::anyhow!(
                "config {}: cannot watch {}: {e}",
                path.display(),
                dir.display()
            )
        })?;
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        // The watcher lives as long as this task.
        let _watcher = watcher;
        let mut poll = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = wake.recv() => {}
                _ = poll.tick() => {}
            }
            match std::fs::read(&path) {
                Ok(now) if now == original => {}
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "the configuration file changed");
                    let _ = tx.send(());
                    return;
                }
                // Mid-swap, or removed: look again at the next event or poll.
                Err(_) => {}
            }
        }
    });
    Ok(rx)
}
