//! Watching `--manifests PATH`: file-system events (and a fingerprint check every 2 s, for
//! file systems whose events are unreliable) trigger a reload, whose changes go out as one
//! [`SourceEvent::Batch`]. The first good load is framed as a full list of every kind.
//!
//! A set that fails to load is reported once per change of the files, not on every event
//! or tick, and the last good state keeps serving.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::mpsc;

use super::{Loader, manifest_files};
use crate::source::{Kind, SourceEvent};

/// What a file-system event under the manifest path says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileEvent {
    /// A file was written and closed, renamed into place, removed, or its metadata changed:
    /// what is there now is complete.
    Settled,
    /// A file is being written in place (created, or data written): its close follows.
    Writing,
}

impl FileEvent {
    /// The meaning of a notify event; `None` for reads, ours included (reading the files
    /// produces open and close events, and must not trigger the next read).
    fn of(kind: notify::EventKind) -> Option<Self> {
        use notify::event::{AccessKind, AccessMode, CreateKind, EventKind, ModifyKind};
        match kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => Some(FileEvent::Settled),
            EventKind::Access(_) => None,
            EventKind::Create(CreateKind::File)
            | EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) => Some(FileEvent::Writing),
            _ => Some(FileEvent::Settled),
        }
    }
}

/// How long a file written in place may stay open before it is read anyway (a writer that
/// keeps it open, or a file system without close events).
const WRITE_SETTLE: Duration = Duration::from_millis(30);

/// Turns file-system events on the manifest path into a channel of [`FileEvent`]s.
fn watch_manifests(
    path: &Path,
) -> anyhow::Result<(
    notify::RecommendedWatcher,
    mpsc::UnboundedReceiver<FileEvent>,
)> {
    use notify::{RecursiveMode, Watcher as _};
    let (tx, rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if let Some(ev) = ev.ok().and_then(|ev| FileEvent::of(ev.kind)) {
            let _ = tx.send(ev);
        }
    })
    .context("creating the manifest watcher")?;
    // Watch the parent of a file, so editors' and ConfigMaps' atomic renames are seen.
    let target = if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    watcher
        .watch(&target, RecursiveMode::Recursive)
        .with_context(|| format!("watching {}", target.display()))?;
    Ok((watcher, rx))
}

/// Takes the events queued after `first`; when none says a write is complete, waits up to
/// [`WRITE_SETTLE`] for one. A file replaced by a rename (editors, ConfigMaps, `kubectl`
/// pipelines writing a temporary file) is so read at once, and one written in place is not
/// read half-written.
async fn settle(first: FileEvent, events: &mut mpsc::UnboundedReceiver<FileEvent>) {
    let mut settled = first == FileEvent::Settled;
    while let Ok(ev) = events.try_recv() {
        settled |= ev == FileEvent::Settled;
    }
    let deadline = tokio::time::Instant::now() + WRITE_SETTLE;
    while !settled {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(ev)) => settled = ev == FileEvent::Settled,
            Ok(None) | Err(_) => break,
        }
    }
    while events.try_recv().is_ok() {}
}

/// A cheap fingerprint of the manifest files (names, sizes, mtimes), as a safety net for
/// file systems whose events are unreliable.
fn fingerprint(path: &Path) -> Fingerprint {
    manifest_files(path)
        .unwrap_or_default()
        .into_iter()
        .map(|f| {
            let m = std::fs::metadata(&f).ok();
            let len = m.as_ref().map_or(0, std::fs::Metadata::len);
            let mtime = m.and_then(|m| m.modified().ok());
            (f, len, mtime)
        })
        .collect()
}

/// Reads the manifests under `path` now and whenever they change, sending what changed to
/// `tx`, until `tx` is closed. Fails only when the path cannot be watched.
pub fn spawn(path: PathBuf, node: String, tx: mpsc::Sender<SourceEvent>) -> anyhow::Result<()> {
    let (watcher, mut events) = watch_manifests(&path)?;
    tokio::spawn(async move {
        // The watcher stops when dropped: it lives as long as this task.
        let _watcher = watcher;
        let mut reader = Reader::for_node(node);
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            let print = fingerprint(&path);
            if let Some(ev) = reader.load(&path, print)
                && tx.send(ev).await.is_err()
            {
                return;
            }
            // Wait for a change: a file event, or a fingerprint that moved.
            loop {
                tokio::select! {
                    ev = events.recv() => {
                        let Some(ev) = ev else { return };
                        settle(ev, &mut events).await;
                        break;
                    }
                    _ = tick.tick() => {
                        if fingerprint(&path) != reader.print {
                            break;
                        }
                    }
                }
            }
        }
    });
    Ok(())
}

pub(crate) type Fingerprint = Vec<(PathBuf, u64, Option<std::time::SystemTime>)>;

/// The loader, and what it last reported.
#[derive(Default)]
pub(crate) struct Reader {
    loader: Loader,
    /// A good load has been sent: later ones are changes, not a full list.
    listed: bool,
    /// The files as last read.
    print: Fingerprint,
    /// The files as they were when a load was last rejected.
    rejected: Option<Fingerprint>,
    /// This node's name (`--hostname-override`): the Node object of that name is this node's.
    node: String,
}

impl Reader {
    pub(crate) fn for_node(node: String) -> Self {
        Self {
            node,
            ..Self::default()
        }
    }

    /// Loads the set; returns the event to send, if any. A rejection is reported once per
    /// change of the files (a file event that changes nothing reads them again, quietly).
    pub(crate) fn load(&mut self, path: &Path, print: Fingerprint) -> Option<SourceEvent> {
        let started = std::time::Instant::now();
        let change = match self.loader.load(path) {
            Ok(change) => {
                self.rejected = None;
                change
            }
            Err(e) => {
                let again = self.rejected.as_ref() == Some(&print);
                self.rejected = Some(print.clone());
                self.print = print;
                return (!again).then(|| SourceEvent::Rejected {
                    source: "manifests",
                    error: e.to_string(),
                });
            }
        };
        self.print = print;
        tracing::debug!(
            pieces = change.pieces,
            parsed = change.parsed,
            took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
            "manifests read"
        );
        for s in &change.skipped {
            tracing::debug!("not proxied: {s}");
        }
        let mut batch = Vec::new();
        if !self.listed {
            batch.extend(
                [Kind::Services, Kind::Slices, Kind::ServiceCidrs].map(SourceEvent::Listing),
            );
        }
        batch.extend(
            change
                .services
                .into_iter()
                .map(|(id, service)| SourceEvent::Service { id, service }),
        );
        batch.extend(
            change
                .slices
                .into_iter()
                .map(|(id, slice)| SourceEvent::Slice {
                    id,
                    slice,
                    trigger: None,
                }),
        );
        // Only this node's Node counts (its zone, whether it takes traffic); other Nodes are
        // accepted and ignored. Without one, the node has no zone and takes traffic.
        let node = &self.node;
        let ours = change
            .nodes
            .into_iter()
            .filter(|(id, _)| id.name.eq_ignore_ascii_case(node))
            .map(|(_, n)| match n {
                Some(n) => SourceEvent::Node {
                    uid: n.uid,
                    not_eligible: n.not_eligible,
                    zone: n.zone,
                },
                None => SourceEvent::Node {
                    uid: None,
                    not_eligible: None,
                    zone: None,
                },
            });
        batch.extend(ours);
        batch.extend(
            change
                .service_cidrs
                .into_iter()
                .map(|(id, cidr)| SourceEvent::ServiceCidr { id, cidr }),
        );
        if !self.listed {
            batch.extend(Kind::ALL.map(SourceEvent::Listed));
            self.listed = true;
        }
        (!batch.is_empty()).then_some(SourceEvent::Batch(batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{
        AccessKind, AccessMode, CreateKind, DataChange, EventKind, ModifyKind, RemoveKind,
        RenameMode,
    };
    use tokio::time::Instant;

    #[test]
    fn file_events_are_told_apart() {
        let of = FileEvent::of;
        assert_eq!(
            of(EventKind::Access(AccessKind::Open(AccessMode::Any))),
            None
        );
        assert_eq!(
            of(EventKind::Access(AccessKind::Close(AccessMode::Read))),
            None
        );
        assert_eq!(
            of(EventKind::Access(AccessKind::Close(AccessMode::Write))),
            Some(FileEvent::Settled)
        );
        assert_eq!(
            of(EventKind::Modify(ModifyKind::Name(RenameMode::To))),
            Some(FileEvent::Settled)
        );
        assert_eq!(
            of(EventKind::Remove(RemoveKind::File)),
            Some(FileEvent::Settled)
        );
        assert_eq!(
            of(EventKind::Create(CreateKind::File)),
            Some(FileEvent::Writing)
        );
        assert_eq!(
            of(EventKind::Modify(ModifyKind::Data(DataChange::Any))),
            Some(FileEvent::Writing)
        );
    }

    /// On tokio's paused clock: with real time, a loaded machine could wake the test after
    /// both the 5 ms sender and the 30 ms wait expired, and the late `Settled` then cut the
    /// "never closed" wait short (seen once, under four parallel builds on 2 cores).
    #[tokio::test(start_paused = true)]
    async fn settling_waits_only_for_files_still_being_written() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        // A rename into place: no wait, and the burst is taken.
        tx.send(FileEvent::Settled).unwrap();
        let t = Instant::now();
        settle(FileEvent::Settled, &mut rx).await;
        assert!(t.elapsed() < WRITE_SETTLE);
        assert!(rx.try_recv().is_err());
        // Written in place and already closed: no wait either.
        tx.send(FileEvent::Writing).unwrap();
        tx.send(FileEvent::Settled).unwrap();
        let t = Instant::now();
        settle(FileEvent::Writing, &mut rx).await;
        assert!(t.elapsed() < WRITE_SETTLE);
        // Closed a little later: read then.
        let later = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            later.send(FileEvent::Settled).unwrap();
        });
        settle(FileEvent::Writing, &mut rx).await;
        assert!(rx.try_recv().is_err());
        // Never closed: read after the wait.
        let t = Instant::now();
        settle(FileEvent::Writing, &mut rx).await;
        assert!(t.elapsed() >= WRITE_SETTLE);
    }
}

#[cfg(test)]
mod reader_tests {
    use super::*;

    /// A rejected set is reported once per change of its files: reading the same files
    /// again (a file event that changed nothing, the 2 s check) is quiet, and a change is
    /// reported again.
    #[test]
    fn a_rejection_is_reported_once_per_change() {
        let dir = std::env::temp_dir().join(format!("lbproxy-reader-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.yaml");
        let mut r = Reader::default();
        std::fs::write(&file, "spec: [unclosed\n").unwrap();
        let print = fingerprint(&file);
        let first = r.load(&file, print.clone());
        assert!(
            matches!(first, Some(SourceEvent::Rejected { .. })),
            "{first:?}"
        );
        for _ in 0..3 {
            let again = r.load(&file, print.clone());
            assert!(again.is_none(), "rejection reported again: {again:?}");
        }
        std::fs::write(&file, "spec: [still, unclosed\n").unwrap();
        let changed = r.load(&file, fingerprint(&file));
        assert!(
            matches!(changed, Some(SourceEvent::Rejected { .. })),
            "{changed:?}"
        );
        // Fixed: the first good load is a full list.
        std::fs::write(
            &file,
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 198.19.0.10}\n",
        )
        .unwrap();
        let good = r.load(&file, fingerprint(&file));
        std::fs::remove_dir_all(&dir).unwrap();
        let Some(SourceEvent::Batch(events)) = good else {
            panic!("{good:?}");
        };
        assert!(
            matches!(events.first(), Some(SourceEvent::Listing(Kind::Services))),
            "{events:?}"
        );
        assert!(
            matches!(events.last(), Some(SourceEvent::Listed(Kind::Node))),
            "{events:?}"
        );
    }

    /// The Node named like this node gives its zone (and whether it takes traffic); any
    /// other Node is accepted and ignored; removing ours leaves the node without a zone.
    #[test]
    fn this_nodes_node_gives_its_zone_and_other_nodes_are_ignored() {
        let dir = std::env::temp_dir().join(format!("lbproxy-reader-node-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.yaml");
        let node = |name: &str, zone: &str| {
            format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}, uid: u-{name}, \
                 labels: {{topology.kubernetes.io/zone: {zone}}}}}\n---\n"
            )
        };
        let nodes = |events: &[SourceEvent]| -> Vec<(Option<String>, Option<String>)> {
            events
                .iter()
                .filter_map(|e| match e {
                    SourceEvent::Node { uid, zone, .. } => Some((uid.clone(), zone.clone())),
                    _ => None,
                })
                .collect()
        };
        let mut r = Reader::for_node("node0".into());
        std::fs::write(&file, node("node1", "zone-b") + &node("Node0", "zone-a")).unwrap();
        let Some(SourceEvent::Batch(first)) = r.load(&file, fingerprint(&file)) else {
            panic!("no batch")
        };
        assert_eq!(
            nodes(&first),
            [(Some("u-Node0".into()), Some("zone-a".into()))]
        );
        assert!(matches!(first.last(), Some(SourceEvent::Listed(_))));
        std::fs::write(&file, node("node1", "zone-c") + &node("node2", "zone-a")).unwrap();
        let Some(SourceEvent::Batch(later)) = r.load(&file, fingerprint(&file)) else {
            panic!("no batch")
        };
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(nodes(&later), [(None, None)], "ours is gone: no zone");
    }
}
