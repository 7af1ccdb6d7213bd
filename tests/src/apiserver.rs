//! A small, real Kubernetes API server for tests: list + watch over plain HTTP/1.1 with real
//! JSON objects, the way `kube::runtime::watcher` (and client-go's reflector) use it.
//!
//! ```no_run
//! use std::time::Duration;
//! use lbproxy_tests::apiserver::ApiServer;
//! use lbproxy_tests::lab::{Lab, Shape, manifest::*};
//! let lab = Lab::new(Shape::Routed);
//! let api = ApiServer::start_in_ns(lab.node_ns());        // listens on 127.0.0.1:<port> in the node ns
//! api.apply(ApiServer::node("lab-node"));
//! api.apply(Service::cluster_ip("web", "198.19.0.10").port("http", 80, Protocol::Tcp, 8080).to_json());
//! let kubeconfig = api.write_kubeconfig(lab.workdir());    // server: http://127.0.0.1:<port>, a token user
//! // ... start `lbproxy run --kubeconfig <kubeconfig> ...` inside the node ns, then:
//! api.break_watches();                                     // every open watch is cut mid-stream
//! assert!(api.requests().iter().any(|r| r.is_watch()));
//! ```
//!
//! # What it serves
//! * Resources (list, watch, get, create, update, patch, delete), cluster-wide and namespaced
//!   paths: `v1` `services`, `nodes`, `events`, `pods`, `endpoints`; `discovery.k8s.io/v1`
//!   `endpointslices`; `events.k8s.io/v1` `events`; `networking.k8s.io/v1` `servicecidrs`
//!   (which [`ApiServer::hide_resource`] takes away, as an API server older than 1.33).
//! * Discovery: `/version`, `/api`, `/apis`, `/api/v1`, `/apis/<group>/<version>`.
//! * Anything else answers 404 and is printed to stderr as `apiserver: UNKNOWN ...`.
//!
//! # Semantics (as the real API server)
//! * One global `resourceVersion` counter (like etcd's revision): every create, update and
//!   delete bumps it; every object carries `metadata.resourceVersion`, `uid`, `namespace`
//!   (namespaced kinds), `name`, `creationTimestamp`, `generation`.
//! * List: `{"kind":"ServiceList","apiVersion":"v1","metadata":{"resourceVersion":"<rv>"},
//!   "items":[...]}`; items carry no `kind`/`apiVersion` (as the real server writes them).
//!   `limit` + `continue` paginate (the continue token encodes the list's RV and the last
//!   key served, so each page costs O(page) however long the list; `remainingItemCount` only
//!   without selectors, as the real server), except a list with `resourceVersion=0`
//!   (`resourceVersionMatch` unset or `NotOlderThan`): that one is served as from the real
//!   server's watch cache, the whole list in one response, `limit` ignored;
//!   `labelSelector` (`k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`) and
//!   `fieldSelector` (`path=v`, `path==v`, `path!=v` on any dotted path, e.g. `metadata.name`).
//! * Watch (`watch=true|1`): HTTP 200, `Transfer-Encoding: chunked`, one JSON event per line
//!   (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`), one chunk per event. From
//!   `resourceVersion=N` (N > 0) it first replays the retained events after N, then streams
//!   live ones. With `resourceVersion` unset or `0` it starts with synthetic `ADDED` events for
//!   every current object. A watch-list (KEP-3157: `sendInitialEvents=true`, which needs
//!   `resourceVersionMatch=NotOlderThan` and `allowWatchBookmarks=true`, else `422 Invalid`)
//!   starts with `ADDED` for every current object whatever its `resourceVersion`, then a
//!   `BOOKMARK` annotated `k8s.io/initial-events-end: "true"`; or, after
//!   [`ApiServer::refuse_watch_lists`], `422 Invalid`, as a server with the `WatchList`
//!   feature gate off. Selectors apply to watches the way the
//!   watch cache applies them: an object moving into the selector is `ADDED`, out of it
//!   `DELETED`. `BOOKMARK`s are sent every [`ApiServer::set_bookmark_interval`] when the client
//!   asked (`allowWatchBookmarks=true`). The stream ends cleanly (terminating chunk) when
//!   `timeoutSeconds` elapses (default 1800 s).
//! * A watch from an RV older than the retained history ([`ApiServer::expire_history`]) gets
//!   `410 Gone`: by default HTTP 200 and one `ERROR` event holding a `Status` with `code: 410`,
//!   `reason: Expired`, then the end of the stream (what the real server's watch cache does);
//!   or, with [`GoneMode::HttpStatus`], HTTP 410 with that `Status` as the body.
//! * Errors are `Status` objects (`NotFound`, `AlreadyExists`, `BadRequest`, ...).
//!
//! # Test controls
//! [`ApiServer::apply`], [`ApiServer::delete`], [`ApiServer::break_watches`],
//! [`ApiServer::expire_history`], [`ApiServer::set_gone_mode`], [`ApiServer::set_delay`],
//! [`ApiServer::set_watch_timeout_cap`], [`ApiServer::set_bookmark_interval`],
//! [`ApiServer::go_down`] / [`ApiServer::come_back`], [`ApiServer::requests`],
//! [`ApiServer::events_posted`], [`ApiServer::wait_for_request`].
//!
//! Every request is logged (method, path, decoded query, Authorization header, status) and,
//! with `LBPROXY_TEST_APISERVER_LOG=1`, printed to stderr as it arrives.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead as _, BufReader, Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::lab::run_in_ns;

/// The bearer token [`ApiServer::write_kubeconfig`] writes (the server accepts any token,
/// and none; tests may check [`Request::authorization`]).
pub const TOKEN: &str = "lbproxy-lab-token";

/// The server's `gitVersion` (`/version`).
pub const GIT_VERSION: &str = "v1.33.0-lbproxy-lab";

/// How a watch from an expired resourceVersion is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoneMode {
    /// HTTP 200, one `ERROR` event with a 410 `Status`, end of stream (the real API server's
    /// behaviour for watches served from its watch cache).
    ErrorEvent,
    /// HTTP 410 with the `Status` as the body (the request itself fails).
    HttpStatus,
}

/// One request as the server received it.
#[derive(Clone, Debug)]
pub struct Request {
    /// Arrival order, from 0.
    pub seq: u64,
    pub at: Instant,
    pub method: String,
    /// The path, percent-decoded, without the query.
    pub path: String,
    /// The raw query string (without `?`).
    pub query: String,
    /// Decoded query parameters (last one wins).
    pub params: BTreeMap<String, String>,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    pub user_agent: Option<String>,
    /// The response status (None while the response has not started, e.g. during a delay).
    pub status: Option<u16>,
    /// When the response's first byte was written.
    pub answered_at: Option<Instant>,
    /// When the response's last byte was written; for watches, when the stream ended
    /// (cleanly or not).
    pub ended_at: Option<Instant>,
    /// For a watch-list (`sendInitialEvents=true`): when the bookmark that ends the initial
    /// events was written (the end of the "list" part).
    pub initial_end_at: Option<Instant>,
}

impl Request {
    pub fn param(&self, k: &str) -> Option<&str> {
        self.params.get(k).map(String::as_str)
    }

    /// A GET with `watch=true` (or `1`).
    pub fn is_watch(&self) -> bool {
        self.method == "GET" && matches!(self.param("watch"), Some("true" | "1"))
    }

    /// A GET on a collection that is not a watch.
    pub fn is_list(&self) -> bool {
        self.method == "GET"
            && !self.is_watch()
            && parse_path(&self.path).is_some_and(|p| p.name.is_none())
    }

    /// The resource's plural (`services`, `endpointslices`, `nodes`, ...), if the path names
    /// a known resource.
    pub fn resource(&self) -> Option<&'static str> {
        parse_path(&self.path).map(|p| RESOURCES[p.res].plural)
    }

    /// `METHOD path?query -> status`.
    pub fn line(&self) -> String {
        let q = if self.query.is_empty() {
            String::new()
        } else {
            format!("?{}", self.query)
        };
        let st = self
            .status
            .map(|s| s.to_string())
            .unwrap_or_else(|| "...".into());
        format!("#{} {} {}{q} -> {st}", self.seq, self.method, self.path)
    }
}

/// A create/update/patch of an Event (`v1` or `events.k8s.io/v1`).
#[derive(Clone, Debug)]
pub struct PostedEvent {
    pub method: String,
    pub path: String,
    /// The request body as sent.
    pub body: Value,
    pub at: Instant,
}

impl PostedEvent {
    /// `reason` of the event.
    pub fn reason(&self) -> Option<&str> {
        self.body["reason"].as_str()
    }

    /// The involved object / regarding (`events.k8s.io/v1`: `regarding`, `v1`:
    /// `involvedObject`).
    pub fn regarding(&self) -> &Value {
        if self.body.get("regarding").is_some() {
            &self.body["regarding"]
        } else {
            &self.body["involvedObject"]
        }
    }

    /// `note` (`events.k8s.io/v1`) or `message` (`v1`).
    pub fn note(&self) -> Option<&str> {
        self.body["note"]
            .as_str()
            .or_else(|| self.body["message"].as_str())
    }
}

// ---------------------------------------------------------------------------------------------
// Resources

struct Res {
    kind: &'static str,
    api_version: &'static str,
    /// `/api/v1` or `/apis/<group>/<version>`.
    prefix: &'static str,
    plural: &'static str,
    namespaced: bool,
}

const RESOURCES: &[Res] = &[
    Res {
        kind: "Service",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "services",
        namespaced: true,
    },
    Res {
        kind: "Node",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "nodes",
        namespaced: false,
    },
    Res {
        kind: "Event",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "events",
        namespaced: true,
    },
    Res {
        kind: "Pod",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "pods",
        namespaced: true,
    },
    Res {
        kind: "Endpoints",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "endpoints",
        namespaced: true,
    },
    Res {
        kind: "EndpointSlice",
        api_version: "discovery.k8s.io/v1",
        prefix: "/apis/discovery.k8s.io/v1",
        plural: "endpointslices",
        namespaced: true,
    },
    Res {
        kind: "Event",
        api_version: "events.k8s.io/v1",
        prefix: "/apis/events.k8s.io/v1",
        plural: "events",
        namespaced: true,
    },
    Res {
        kind: "ServiceCIDR",
        api_version: "networking.k8s.io/v1",
        prefix: "/apis/networking.k8s.io/v1",
        plural: "servicecidrs",
        namespaced: false,
    },
];

fn res_by_kind(api_version: &str, kind: &str) -> Option<usize> {
    RESOURCES
        .iter()
        .position(|r| r.kind == kind && r.api_version == api_version)
}

fn res_by_kind_only(kind: &str) -> Option<usize> {
    RESOURCES.iter().position(|r| r.kind == kind)
}

struct PathInfo {
    res: usize,
    ns: Option<String>,
    name: Option<String>,
    /// A subresource (e.g. `status`), if any.
    sub: Option<String>,
}

fn parse_path(path: &str) -> Option<PathInfo> {
    for (i, r) in RESOURCES.iter().enumerate() {
        let Some(rest) = path.strip_prefix(r.prefix) else {
            continue;
        };
        let segs: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
        let (ns, tail) = match segs.as_slice() {
            ["namespaces", ns, tail @ ..] if !tail.is_empty() => (Some(ns.to_string()), tail),
            tail => (None, tail),
        };
        if ns.is_some() && !r.namespaced {
            continue;
        }
        match tail {
            [p] if *p == r.plural => {
                return Some(PathInfo {
                    res: i,
                    ns,
                    name: None,
                    sub: None,
                });
            }
            [p, name] if *p == r.plural => {
                return Some(PathInfo {
                    res: i,
                    ns,
                    name: Some(name.to_string()),
                    sub: None,
                });
            }
            [p, name, sub] if *p == r.plural => {
                return Some(PathInfo {
                    res: i,
                    ns,
                    name: Some(name.to_string()),
                    sub: Some(sub.to_string()),
                });
            }
            _ => {}
        }
    }
    None
}

// ---------------------------------------------------------------------------------------------
// Store

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EvType {
    Added,
    Modified,
    Deleted,
}

struct HistEvent {
    rv: u64,
    res: usize,
    ty: EvType,
    obj: Value,
    /// The object before this change (MODIFIED / DELETED).
    prev: Option<Value>,
}

/// (resource index, namespace or "", name)
type Key = (usize, String, String);

struct Store {
    rv: u64,
    uid_counter: u64,
    objects: BTreeMap<Key, Value>,
    /// Objects held per resource, for `remainingItemCount`.
    counts: HashMap<usize, usize>,
    /// Stored objects looked at by every list page so far (see [`ApiServer::list_work`]).
    list_visited: u64,
    history: Vec<HistEvent>,
    /// A watch from an RV below this gets 410.
    floor: u64,
    delay: Duration,
    gone: GoneMode,
    bookmark_interval: Option<Duration>,
    /// Upper bound on a watch's lifetime (the real server ends watches after its
    /// min-request-timeout), whatever `timeoutSeconds` asked for.
    watch_cap: Option<Duration>,
    requests: Vec<Request>,
    events: Vec<PostedEvent>,
    /// Bumped by break_watches / go_down; watch loops whose generation is older stop.
    break_gen: u64,
    down: bool,
    unknown: Vec<String>,
    /// Resources (plurals) answered with 404, as a server that does not have them.
    hidden: Vec<&'static str>,
    /// Watch-lists (`sendInitialEvents=true`) answered `422 Invalid`, as a server with the
    /// `WatchList` feature gate off (Kubernetes 1.33's default).
    refuse_watch_lists: bool,
}

struct Conn {
    stream: TcpStream,
    watching: bool,
}

struct Inner {
    ns: Option<String>,
    port: u16,
    st: Mutex<Store>,
    cv: Condvar,
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, Conn>>,
    next_conn: AtomicU64,
    listener: Mutex<Option<TcpListener>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    print_log: bool,
}

/// See the [module docs](self). Stops (listener closed, connections shut down, threads
/// joined) on drop.
pub struct ApiServer {
    inner: Arc<Inner>,
    accept: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts a server listening on 127.0.0.1:<ephemeral> inside network namespace `ns`
    /// (`/run/netns/NS`), e.g. a lab's node namespace, where lbproxy runs.
    pub fn start_in_ns(ns: &str) -> ApiServer {
        let l = run_in_ns(ns, || TcpListener::bind("127.0.0.1:0"))
            .unwrap_or_else(|e| panic!("apiserver: bind 127.0.0.1:0 in netns {ns}: {e}"));
        ApiServer::with_listener(Some(ns.to_owned()), l)
    }

    /// Starts a server on 127.0.0.1:<ephemeral> in the calling thread's network namespace.
    pub fn start_here() -> ApiServer {
        let l = TcpListener::bind("127.0.0.1:0")
            .unwrap_or_else(|e| panic!("apiserver: bind 127.0.0.1:0: {e}"));
        ApiServer::with_listener(None, l)
    }

    fn with_listener(ns: Option<String>, l: TcpListener) -> ApiServer {
        l.set_nonblocking(true).expect("apiserver: nonblocking");
        let port = l.local_addr().expect("apiserver: local_addr").port();
        let inner = Arc::new(Inner {
            ns,
            port,
            st: Mutex::new(Store {
                rv: 1000,
                uid_counter: 0,
                objects: BTreeMap::new(),
                counts: HashMap::new(),
                list_visited: 0,
                history: Vec::new(),
                floor: 0,
                delay: Duration::ZERO,
                gone: GoneMode::ErrorEvent,
                bookmark_interval: Some(Duration::from_secs(5)),
                watch_cap: None,
                requests: Vec::new(),
                events: Vec::new(),
                break_gen: 0,
                down: false,
                unknown: Vec::new(),
                hidden: Vec::new(),
                refuse_watch_lists: false,
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            listener: Mutex::new(Some(l)),
            threads: Mutex::new(Vec::new()),
            print_log: std::env::var_os("LBPROXY_TEST_APISERVER_LOG").is_some_and(|v| v != "0"),
        });
        let i2 = inner.clone();
        let accept = std::thread::Builder::new()
            .name("apiserver-accept".into())
            .spawn(move || accept_loop(i2))
            .expect("spawn apiserver accept thread");
        ApiServer {
            inner,
            accept: Some(accept),
        }
    }

    /// Answers every request for resource `plural` (`servicecidrs`, say) with 404 from now
    /// on, and leaves it out of discovery: an API server that does not have it (ServiceCIDR
    /// before Kubernetes 1.33, or with the API disabled).
    pub fn hide_resource(&self, plural: &'static str) {
        self.lock().hidden.push(plural);
    }

    /// Answers every watch-list (`sendInitialEvents=true`) with `422 Invalid` from now on, as
    /// an API server with the `WatchList` feature gate off (off by default in Kubernetes
    /// 1.27-1.31 and again in 1.33); other watches and lists are served as before.
    pub fn refuse_watch_lists(&self) {
        self.lock().refuse_watch_lists = true;
    }

    /// The port it listens on (127.0.0.1 in its namespace).
    pub fn port(&self) -> u16 {
        self.inner.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.inner.port))
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.inner.port)
    }

    /// The kubeconfig text: cluster `lab` at [`Self::url`], user `lab` with token [`TOKEN`],
    /// context `lab` (namespace `default`) as current-context.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\npreferences: {{}}\nclusters:\n- name: lab\n  cluster:\n    server: {}\n\
             users:\n- name: lab\n  user:\n    token: {TOKEN}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: lab\n    namespace: default\n\
             current-context: lab\n",
            self.url()
        )
    }

    /// Writes [`Self::kubeconfig`] to `<dir>/kubeconfig` and returns that path.
    pub fn write_kubeconfig(&self, dir: &Path) -> PathBuf {
        let p = dir.join("kubeconfig");
        std::fs::write(&p, self.kubeconfig())
            .unwrap_or_else(|e| panic!("apiserver: write {}: {e}", p.display()));
        p
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        self.inner.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates or replaces an object (`apiVersion` + `kind` pick the resource; namespaced
    /// kinds default to namespace `default`). Bumps the global resourceVersion and emits
    /// `ADDED` or `MODIFIED`. Returns the stored object (with its new resourceVersion).
    pub fn apply(&self, obj: Value) -> Value {
        let mut st = self.lock();
        let out = st
            .apply(obj)
            .unwrap_or_else(|e| panic!("apiserver: apply: {e}"));
        drop(st);
        self.inner.cv.notify_all();
        out
    }

    /// [`Self::apply`] for several objects.
    pub fn apply_all(&self, objs: impl IntoIterator<Item = Value>) {
        for o in objs {
            self.apply(o);
        }
    }

    /// Deletes `kind` `ns/name` (`ns` is ignored for cluster-scoped kinds; `kind` is e.g.
    /// `Service`, `EndpointSlice`, `Node`). Emits `DELETED`. Returns false if it did not exist.
    pub fn delete(&self, kind: &str, ns: &str, name: &str) -> bool {
        let res =
            res_by_kind_only(kind).unwrap_or_else(|| panic!("apiserver: unknown kind {kind}"));
        let mut st = self.lock();
        let r = st.delete(res, ns, name).is_some();
        drop(st);
        self.inner.cv.notify_all();
        r
    }

    /// The stored object, if any.
    pub fn get(&self, kind: &str, ns: &str, name: &str) -> Option<Value> {
        let res =
            res_by_kind_only(kind).unwrap_or_else(|| panic!("apiserver: unknown kind {kind}"));
        let ns = if RESOURCES[res].namespaced { ns } else { "" };
        self.lock()
            .objects
            .get(&(res, ns.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Abruptly closes every open watch connection mid-stream (no terminating chunk), as a
    /// proxy or load balancer in front of the API server would. The watchers' next watch
    /// (from their last RV) is served normally unless [`Self::expire_history`] was called.
    pub fn break_watches(&self) -> usize {
        let mut st = self.lock();
        st.break_gen += 1;
        drop(st);
        let mut n = 0;
        for c in self.inner.conns.lock().unwrap().values() {
            if c.watching {
                let _ = c.stream.shutdown(Shutdown::Both);
                n += 1;
            }
        }
        self.inner.cv.notify_all();
        n
    }

    /// Forgets the event history: every resourceVersion handed out so far becomes too old to
    /// watch from (the next watch from one gets 410, see [`GoneMode`]). A list returns a new
    /// RV that can be watched from. Open watches are not affected (combine with
    /// [`Self::break_watches`]).
    pub fn expire_history(&self) {
        let mut st = self.lock();
        st.rv += 1;
        st.floor = st.rv;
    }

    /// How an expired watch is answered (default [`GoneMode::ErrorEvent`]).
    pub fn set_gone_mode(&self, m: GoneMode) {
        self.lock().gone = m;
    }

    /// Delays the first byte of every response (list, get, watch headers, create) by `d`,
    /// counted from when the request was read. Events on open watch streams are not delayed.
    pub fn set_delay(&self, d: Duration) {
        self.lock().delay = d;
    }

    /// How often open watches that asked for bookmarks get a `BOOKMARK` (default 5 s; None:
    /// never, except the initial-events-end bookmark).
    pub fn set_bookmark_interval(&self, d: Option<Duration>) {
        self.lock().bookmark_interval = d;
        self.inner.cv.notify_all();
    }

    /// Ends every watch (cleanly, with the terminating chunk) after at most `d`, whatever
    /// `timeoutSeconds` the client asked for, as the real server does after its
    /// min-request-timeout. None (default): only `timeoutSeconds` (default 1800 s) applies.
    pub fn set_watch_timeout_cap(&self, d: Option<Duration>) {
        self.lock().watch_cap = d;
        self.inner.cv.notify_all();
    }

    /// The API server goes away: the listening socket is closed (connections are refused)
    /// and every open connection is shut down. The store is kept. See [`Self::come_back`].
    pub fn go_down(&self) {
        let mut st = self.lock();
        st.down = true;
        st.break_gen += 1;
        drop(st);
        *self.inner.listener.lock().unwrap() = None;
        for c in self.inner.conns.lock().unwrap().values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        self.inner.cv.notify_all();
    }

    /// Listens again on the same port after [`Self::go_down`].
    pub fn come_back(&self) {
        let port = self.inner.port;
        let bind = || TcpListener::bind(("127.0.0.1", port));
        // The old listener's fd can outlive go_down() for a moment (the accept thread holds
        // it until its next poll), so retry briefly before calling it a failure.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let l = loop {
            let r = match &self.inner.ns {
                Some(ns) => run_in_ns(ns, bind),
                None => bind(),
            };
            match r {
                Ok(l) => break l,
                Err(e) if std::time::Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("apiserver: rebind 127.0.0.1:{port}: {e}"),
            }
        };
        l.set_nonblocking(true).expect("nonblocking");
        *self.inner.listener.lock().unwrap() = Some(l);
        self.lock().down = false;
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<Request> {
        self.lock().requests.clone()
    }

    /// Requests with `seq >= from` (use `requests().len()` as a mark).
    pub fn requests_since(&self, from: usize) -> Vec<Request> {
        self.lock()
            .requests
            .get(from..)
            .unwrap_or_default()
            .to_vec()
    }

    /// Number of requests so far (a mark for [`Self::requests_since`]).
    pub fn request_count(&self) -> usize {
        self.lock().requests.len()
    }

    /// The request log as lines, for failure messages.
    pub fn request_log(&self) -> String {
        self.lock()
            .requests
            .iter()
            .map(Request::line)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Requests to unknown paths (each also printed to stderr).
    pub fn unknown_requests(&self) -> Vec<String> {
        self.lock().unknown.clone()
    }

    /// Polls (every 20 ms) until a request with `seq >= from` satisfies `pred`; returns it.
    pub fn wait_for_request(
        &self,
        from: usize,
        timeout: Duration,
        pred: impl Fn(&Request) -> bool,
    ) -> Option<Request> {
        let start = Instant::now();
        loop {
            if let Some(r) = self.requests_since(from).into_iter().find(|r| pred(r)) {
                return Some(r);
            }
            if start.elapsed() >= timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Watch requests on `plural` that are currently streaming (answered 200 and not ended).
    pub fn open_watches(&self, plural: &str) -> Vec<Request> {
        self.lock()
            .requests
            .iter()
            .filter(|r| {
                r.is_watch()
                    && r.resource() == Some(plural)
                    && r.status == Some(200)
                    && r.ended_at.is_none()
            })
            .cloned()
            .collect()
    }

    /// How many stored objects list requests have looked at so far, over every page: a
    /// measure of the server's list work that does not depend on the machine's speed.
    pub fn list_work(&self) -> u64 {
        self.lock().list_visited
    }

    /// Every Event created, updated or patched (both `v1` and `events.k8s.io/v1`).
    pub fn events_posted(&self) -> Vec<PostedEvent> {
        self.lock().events.clone()
    }

    /// A `v1` Node `name` with an InternalIP `198.18.255.1` (the lab node's uplink address),
    /// Ready.
    pub fn node(name: &str) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                },
            },
            "spec": {"podCIDR": "198.18.0.0/24", "podCIDRs": ["198.18.0.0/24"]},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": "198.18.255.1"},
                    {"type": "Hostname", "address": name},
                ],
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": rfc3339(SystemTime::now()),
                    "lastTransitionTime": rfc3339(SystemTime::now()),
                }],
            },
        })
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        *self.inner.listener.lock().unwrap() = None;
        for c in self.inner.conns.lock().unwrap().values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        self.inner.cv.notify_all();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let ts = std::mem::take(&mut *self.inner.threads.lock().unwrap());
        for t in ts {
            let _ = t.join();
        }
    }
}

impl Store {
    fn next_uid(&mut self) -> String {
        self.uid_counter += 1;
        format!("6c627078-0000-4000-8000-{:012x}", self.uid_counter)
    }

    fn apply(&mut self, mut obj: Value) -> Result<Value, String> {
        let kind = obj["kind"].as_str().ok_or("object has no kind")?.to_owned();
        let av = obj["apiVersion"]
            .as_str()
            .ok_or("object has no apiVersion")?
            .to_owned();
        let res = res_by_kind(&av, &kind).ok_or_else(|| format!("unknown kind {av}/{kind}"))?;
        self.apply_res(res, &mut obj, None)?;
        Ok(obj)
    }

    /// Stores `obj` as resource `res`; `want_ns` is the namespace from the request path.
    fn apply_res(
        &mut self,
        res: usize,
        obj: &mut Value,
        want_ns: Option<&str>,
    ) -> Result<EvType, String> {
        let r = &RESOURCES[res];
        if !obj.is_object() {
            return Err("object is not a JSON object".into());
        }
        obj["kind"] = json!(r.kind);
        obj["apiVersion"] = json!(r.api_version);
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        let md = &mut obj["metadata"];
        if md["name"].as_str().is_none_or(str::is_empty) {
            if let Some(g) = md["generateName"].as_str() {
                let g = format!("{g}{:05x}", self.uid_counter + 1);
                md["name"] = json!(g);
            } else {
                return Err("metadata.name is required".into());
            }
        }
        let name = md["name"].as_str().unwrap().to_owned();
        let ns = if r.namespaced {
            let ns = md["namespace"]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .or(want_ns.map(str::to_owned))
                .unwrap_or_else(|| "default".into());
            if let Some(w) = want_ns
                && w != ns
            {
                return Err(format!(
                    "the namespace of the provided object ({ns}) does not match the namespace sent on the request ({w})"
                ));
            }
            md["namespace"] = json!(ns);
            ns
        } else {
            if let Some(m) = md.as_object_mut() {
                m.remove("namespace");
            }
            String::new()
        };
        let key = (res, ns, name);
        self.rv += 1;
        let rv = self.rv;
        let prev = self.objects.get(&key).cloned();
        let ty = if prev.is_some() {
            EvType::Modified
        } else {
            EvType::Added
        };
        let uid = match &prev {
            Some(p) => p["metadata"]["uid"].clone(),
            None => json!(self.next_uid()),
        };
        let md = &mut obj["metadata"];
        md["uid"] = uid;
        md["resourceVersion"] = json!(rv.to_string());
        match &prev {
            Some(p) => {
                md["creationTimestamp"] = p["metadata"]["creationTimestamp"].clone();
                let g = p["metadata"]["generation"].as_u64().unwrap_or(1);
                let spec_changed = p.get("spec") != obj.get("spec");
                obj["metadata"]["generation"] = json!(if spec_changed { g + 1 } else { g });
            }
            None => {
                md["creationTimestamp"] = json!(rfc3339(SystemTime::now()));
                md["generation"] = json!(1);
            }
        }
        self.objects.insert(key, obj.clone());
        if prev.is_none() {
            *self.counts.entry(res).or_default() += 1;
        }
        self.history.push(HistEvent {
            rv,
            res,
            ty,
            obj: obj.clone(),
            prev,
        });
        Ok(ty)
    }

    fn delete(&mut self, res: usize, ns: &str, name: &str) -> Option<Value> {
        let ns = if RESOURCES[res].namespaced { ns } else { "" };
        let prev = self
            .objects
            .remove(&(res, ns.to_owned(), name.to_owned()))?;
        if let Some(n) = self.counts.get_mut(&res) {
            *n = n.saturating_sub(1);
        }
        self.rv += 1;
        let mut obj = prev.clone();
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.history.push(HistEvent {
            rv: self.rv,
            res,
            ty: EvType::Deleted,
            obj: obj.clone(),
            prev: Some(prev),
        });
        Some(obj)
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP

fn accept_loop(inner: Arc<Inner>) {
    while !inner.stop.load(Ordering::SeqCst) {
        let r = {
            let g = inner.listener.lock().unwrap();
            g.as_ref().map(TcpListener::accept)
        };
        match r {
            Some(Ok((s, _))) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_nodelay(true);
                let id = inner.next_conn.fetch_add(1, Ordering::SeqCst);
                match s.try_clone() {
                    Ok(c) => {
                        inner.conns.lock().unwrap().insert(
                            id,
                            Conn {
                                stream: c,
                                watching: false,
                            },
                        );
                    }
                    Err(_) => continue,
                }
                let i2 = inner.clone();
                let h = std::thread::Builder::new()
                    .name(format!("apiserver-conn-{id}"))
                    .spawn(move || {
                        serve_conn(&i2, id, s);
                        i2.conns.lock().unwrap().remove(&id);
                    })
                    .expect("spawn apiserver connection thread");
                let mut ts = inner.threads.lock().unwrap();
                ts.retain(|t| !t.is_finished());
                ts.push(h);
            }
            Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Some(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            Some(Err(e)) => {
                eprintln!("apiserver: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

struct HttpReq {
    method: String,
    path: String,
    query: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl HttpReq {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one request; Ok(None) on a clean EOF before a request started.
fn read_request(r: &mut BufReader<TcpStream>) -> io::Result<Option<HttpReq>> {
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_owned();
    let target = parts.next().unwrap_or("/").to_owned();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "EOF in headers",
            ));
        }
        let h = h.trim_end_matches(['\r', '\n']);
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    let mut req = HttpReq {
        method,
        path: String::new(),
        query: String::new(),
        headers,
        body: Vec::new(),
    };
    let (p, q) = target.split_once('?').unwrap_or((&target, ""));
    req.path = percent_decode(p);
    req.query = q.to_owned();
    if req
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
    {
        loop {
            let mut sz = String::new();
            r.read_line(&mut sz)?;
            let n = usize::from_str_radix(sz.trim().split(';').next().unwrap_or("0"), 16)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if n == 0 {
                // trailers until the empty line
                loop {
                    let mut t = String::new();
                    if r.read_line(&mut t)? == 0 || t.trim().is_empty() {
                        break;
                    }
                }
                break;
            }
            let mut buf = vec![0; n];
            r.read_exact(&mut buf)?;
            req.body.extend_from_slice(&buf);
            let mut crlf = [0u8; 2];
            r.read_exact(&mut crlf)?;
        }
    } else if let Some(n) = req
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        let mut buf = vec![0; n];
        r.read_exact(&mut buf)?;
        req.body = buf;
    }
    Ok(Some(req))
}

fn serve_conn(inner: &Arc<Inner>, id: u64, s: TcpStream) {
    let Ok(rs) = s.try_clone() else { return };
    let mut r = BufReader::new(rs);
    let mut w = s;
    while !inner.stop.load(Ordering::SeqCst) {
        let req = match read_request(&mut r) {
            Ok(Some(q)) => q,
            Ok(None) | Err(_) => break,
        };
        let close = req
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        match handle(inner, id, &req, &mut w) {
            Ok(true) if !close => {}
            _ => break,
        }
    }
    let _ = w.shutdown(Shutdown::Both);
}

/// A response to write (non-watch).
struct Resp {
    status: u16,
    body: Value,
}

fn status_obj(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn reason_phrase(code: u16) -> &'static str {
    match code {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        410 => "Gone",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        500 => "Internal Server Error",
        _ => "Unknown",
    }
}

fn write_json(w: &mut TcpStream, status: u16, body: &Value) -> io::Result<()> {
    write_json_bytes(w, status, &serde_json::to_vec(body).unwrap())
}

fn write_json_bytes(w: &mut TcpStream, status: u16, b: &[u8]) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\n\
         Audit-Id: lab\r\nContent-Length: {}\r\n\r\n",
        reason_phrase(status),
        b.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(b);
    w.write_all(&out)?;
    w.flush()
}

fn write_chunk(w: &mut TcpStream, data: &[u8]) -> io::Result<()> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    w.write_all(&out)?;
    w.flush()
}

/// One watch event, serialized straight from the stored object (`json!` around it would
/// first clone the whole object, which doubled the cost of a watch-list's initial events).
fn event_line(ty: &str, obj: &Value) -> Vec<u8> {
    let mut v = Vec::with_capacity(512);
    v.extend_from_slice(b"{\"type\":");
    serde_json::to_writer(&mut v, ty).unwrap();
    v.extend_from_slice(b",\"object\":");
    serde_json::to_writer(&mut v, obj).unwrap();
    v.extend_from_slice(b"}\n");
    v
}

/// Writes `events` as chunks, about 64 KiB to a write: a watch-list's initial events are
/// tens of thousands of small chunks.
fn write_chunks(w: &mut TcpStream, events: &[Vec<u8>]) -> io::Result<()> {
    let mut out = Vec::with_capacity(1 << 16);
    for e in events {
        out.extend_from_slice(format!("{:x}\r\n", e.len()).as_bytes());
        out.extend_from_slice(e);
        out.extend_from_slice(b"\r\n");
        if out.len() >= 1 << 16 {
            w.write_all(&out)?;
            out.clear();
        }
    }
    w.write_all(&out)?;
    w.flush()
}

/// Handles one request. Ok(true): the connection may be reused.
fn handle(inner: &Arc<Inner>, conn: u64, req: &HttpReq, w: &mut TcpStream) -> io::Result<bool> {
    let params = parse_query(&req.query);
    let seq;
    let delay;
    {
        let mut st = inner.st.lock().unwrap_or_else(|e| e.into_inner());
        seq = st.requests.len() as u64;
        let r = Request {
            seq,
            at: Instant::now(),
            method: req.method.clone(),
            path: req.path.clone(),
            query: req.query.clone(),
            params: params.clone(),
            authorization: req.header("authorization").map(str::to_owned),
            user_agent: req.header("user-agent").map(str::to_owned),
            status: None,
            answered_at: None,
            ended_at: None,
            initial_end_at: None,
        };
        if inner.print_log {
            eprintln!("apiserver[{}]: {}", inner.port, r.line());
        }
        st.requests.push(r);
        delay = st.delay;
    }
    let started = Instant::now();
    let set_status = |code: u16| {
        let mut st = inner.st.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = st.requests.get_mut(seq as usize) {
            r.status = Some(code);
            r.answered_at = Some(Instant::now());
        }
    };
    let wait_delay = || {
        let left = delay.saturating_sub(started.elapsed());
        if !left.is_zero() {
            std::thread::sleep(left);
        }
    };

    let is_watch = req.method == "GET"
        && matches!(params.get("watch").map(String::as_str), Some("true" | "1"));
    if is_watch
        && let Some(p) = parse_path(&req.path)
        && p.name.is_none()
    {
        return serve_watch(inner, conn, seq, &p, &params, w, &wait_delay);
    }
    let resp = route(inner, req, &params);
    // Serialized before the status is set, so `answered_at - at` is the server's own work
    // (selection, paging, serialization) and `ended_at - answered_at` the transfer.
    let body = serde_json::to_vec(&resp.body).unwrap();
    wait_delay();
    set_status(resp.status);
    write_json_bytes(w, resp.status, &body)?;
    let mut st = inner.st.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = st.requests.get_mut(seq as usize) {
        r.ended_at = Some(Instant::now());
    }
    Ok(true)
}

fn unknown(inner: &Inner, req: &HttpReq, why: &str) -> Resp {
    let line = format!("{} {}?{} ({why})", req.method, req.path, req.query);
    eprintln!("apiserver: UNKNOWN {line} -> 404");
    inner
        .st
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .unknown
        .push(line);
    Resp {
        status: 404,
        body: status_obj(
            404,
            "NotFound",
            &format!("the server could not find the requested resource ({why})"),
        ),
    }
}

fn route(inner: &Inner, req: &HttpReq, params: &BTreeMap<String, String>) -> Resp {
    let ok = |body: Value| Resp { status: 200, body };
    match (req.method.as_str(), req.path.trim_end_matches('/')) {
        ("GET", "/version") => {
            return ok(json!({
                "major": "1", "minor": "33", "gitVersion": GIT_VERSION,
                "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24.0", "compiler": "gc",
                "platform": "linux/amd64",
            }));
        }
        ("GET", "/api") => {
            return ok(json!({
                "kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": format!("127.0.0.1:{}", inner.port)}],
            }));
        }
        ("GET", "/apis") => {
            let group = |name: &str| {
                json!({
                    "name": name,
                    "versions": [{"groupVersion": format!("{name}/v1"), "version": "v1"}],
                    "preferredVersion": {"groupVersion": format!("{name}/v1"), "version": "v1"},
                })
            };
            return ok(json!({
                "kind": "APIGroupList", "apiVersion": "v1",
                "groups": [group("discovery.k8s.io"), group("events.k8s.io"), group("networking.k8s.io")],
            }));
        }
        ("GET", p) if RESOURCES.iter().any(|r| r.prefix == p) => {
            let gv = p.trim_start_matches("/api/").trim_start_matches("/apis/");
            let hidden = inner
                .st
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .hidden
                .clone();
            let resources: Vec<Value> = RESOURCES
                .iter()
                .filter(|r| r.prefix == p && !hidden.contains(&r.plural))
                .map(|r| {
                    json!({
                        "name": r.plural, "singularName": "", "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                    })
                })
                .collect();
            return ok(json!({
                "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                "resources": resources,
            }));
        }
        _ => {}
    }
    let Some(p) = parse_path(&req.path) else {
        return unknown(inner, req, "no such path");
    };
    if p.sub.is_some() {
        return unknown(inner, req, "subresources are not served");
    }
    let r = &RESOURCES[p.res];
    let mut st = inner.st.lock().unwrap_or_else(|e| e.into_inner());
    if st.hidden.contains(&r.plural) {
        return Resp {
            status: 404,
            body: status_obj(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        };
    }
    let is_event = r.kind == "Event";
    let parse_body = |st: &mut Store, method: &str| -> Result<Value, Resp> {
        let v: Value = serde_json::from_slice(&req.body).map_err(|e| Resp {
            status: 400,
            body: status_obj(400, "BadRequest", &format!("invalid JSON body: {e}")),
        })?;
        if is_event {
            st.events.push(PostedEvent {
                method: method.to_owned(),
                path: req.path.clone(),
                body: v.clone(),
                at: Instant::now(),
            });
        }
        Ok(v)
    };
    match (req.method.as_str(), &p.name) {
        ("GET", None) => {
            let lsel = match params.get("labelSelector").map(|s| LabelSelector::parse(s)) {
                Some(Err(e)) => {
                    return Resp {
                        status: 400,
                        body: status_obj(
                            400,
                            "BadRequest",
                            &format!("unable to parse requirement: {e}"),
                        ),
                    };
                }
                Some(Ok(s)) => Some(s),
                None => None,
            };
            let fsel = params.get("fieldSelector").map(|s| FieldSelector::parse(s));
            let fsel = match fsel {
                Some(Err(e)) => {
                    return Resp {
                        status: 400,
                        body: status_obj(
                            400,
                            "BadRequest",
                            &format!("invalid field selector: {e}"),
                        ),
                    };
                }
                Some(Ok(s)) => Some(s),
                None => None,
            };
            let sel = Selectors {
                ns: p.ns.clone(),
                label: lsel,
                field: fsel,
            };
            let mut list_rv = st.rv;
            // Where the previous page ended: its last key, and how many items came before.
            let mut after: Option<(usize, String, String)> = None;
            let mut offset = 0usize;
            if let Some(c) = params.get("continue").filter(|c| !c.is_empty()) {
                match decode_continue(c) {
                    Some(t) => {
                        list_rv = t.rv;
                        offset = t.offset;
                        after = Some((p.res, t.namespace, t.name));
                    }
                    None => {
                        return Resp {
                            status: 400,
                            body: status_obj(400, "BadRequest", "invalid continue token"),
                        };
                    }
                }
            }
            // `resourceVersion=0` ("any version", `resourceVersionMatch` unset or
            // NotOlderThan): the real server answers from its watch cache, the whole list in
            // one response, and ignores `limit`. With `Exact` it refuses, as the real one.
            let from_cache =
                params.get("resourceVersion").map(String::as_str) == Some("0") && after.is_none();
            match params.get("resourceVersionMatch").map(String::as_str) {
                Some("Exact") if from_cache => {
                    return Resp {
                        status: 422,
                        body: status_obj(
                            422,
                            "Invalid",
                            "resourceVersionMatch \"Exact\" is forbidden for resourceVersion \"0\"",
                        ),
                    };
                }
                None | Some("" | "NotOlderThan" | "Exact") => {}
                Some(m) => {
                    return Resp {
                        status: 422,
                        body: status_obj(
                            422,
                            "Invalid",
                            &format!("resourceVersionMatch: Unsupported value: \"{m}\""),
                        ),
                    };
                }
            }
            let limit = params
                .get("limit")
                .and_then(|l| l.parse::<usize>().ok())
                .filter(|l| *l > 0 && !from_cache);
            // One page costs O(page), whatever the list's length: the walk starts after the
            // previous page's last key (as the real server's etcd continue key does) and only
            // the items returned are cloned.
            use std::ops::Bound;
            let lo = match after {
                Some(k) => Bound::Excluded(k),
                None => Bound::Included((p.res, String::new(), String::new())),
            };
            let hi = Bound::Excluded((p.res + 1, String::new(), String::new()));
            let mut items: Vec<Value> = Vec::new();
            let mut last: Option<&Key> = None;
            let mut more = false;
            let mut visited = 0u64;
            for (k, o) in st.objects.range((lo, hi)) {
                visited += 1;
                if !sel.matches(o) {
                    continue;
                }
                if limit.is_some_and(|l| items.len() == l) {
                    more = true;
                    break;
                }
                let mut o = o.clone();
                if let Some(m) = o.as_object_mut() {
                    m.remove("kind");
                    m.remove("apiVersion");
                }
                items.push(o);
                last = Some(k);
            }
            let mut meta = json!({"resourceVersion": list_rv.to_string()});
            let continue_token = more
                .then_some(last)
                .flatten()
                .map(|(_, ns, name)| (ns.clone(), name.clone()));
            st.list_visited += visited;
            if let Some((ns, name)) = continue_token {
                let seen = offset + items.len();
                meta["continue"] = json!(encode_continue(&Continue {
                    rv: list_rv,
                    offset: seen,
                    namespace: ns,
                    name,
                }));
                // As the real server: an estimate, and only for lists without selectors.
                if sel.ns.is_none() && sel.label.is_none() && sel.field.is_none() {
                    let total = st.counts.get(&p.res).copied().unwrap_or(0);
                    meta["remainingItemCount"] = json!(total.saturating_sub(seen));
                }
            }
            ok(json!({
                "kind": format!("{}List", r.kind),
                "apiVersion": r.api_version,
                "metadata": meta,
                "items": items,
            }))
        }
        ("GET", Some(name)) => {
            let ns = p.ns.clone().unwrap_or_default();
            match st.objects.get(&(p.res, ns, name.clone())) {
                Some(o) => ok(o.clone()),
                None => not_found(r, name),
            }
        }
        ("POST", None) => {
            let mut v = match parse_body(&mut st, "POST") {
                Ok(v) => v,
                Err(e) => return e,
            };
            let name = v["metadata"]["name"].as_str().unwrap_or("").to_owned();
            let ns = if r.namespaced {
                v["metadata"]["namespace"]
                    .as_str()
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .or(p.ns.clone())
                    .unwrap_or_else(|| "default".into())
            } else {
                String::new()
            };
            if !name.is_empty() && st.objects.contains_key(&(p.res, ns, name.clone())) {
                return Resp {
                    status: 409,
                    body: status_obj(
                        409,
                        "AlreadyExists",
                        &format!("{} \"{name}\" already exists", r.plural),
                    ),
                };
            }
            match st.apply_res(p.res, &mut v, p.ns.as_deref()) {
                Ok(_) => {
                    drop(st);
                    inner.cv.notify_all();
                    Resp {
                        status: 201,
                        body: v,
                    }
                }
                Err(e) => Resp {
                    status: 422,
                    body: status_obj(422, "Invalid", &e),
                },
            }
        }
        ("PUT" | "PATCH", Some(name)) => {
            let body = match parse_body(&mut st, &req.method) {
                Ok(v) => v,
                Err(e) => return e,
            };
            let ns = p.ns.clone().unwrap_or_default();
            let existing = st.objects.get(&(p.res, ns, name.clone())).cloned();
            let mut v = if req.method == "PUT" {
                body
            } else {
                let Some(mut cur) = existing else {
                    return not_found(r, name);
                };
                merge_patch(&mut cur, &body);
                cur
            };
            if v["metadata"]["name"].as_str().is_none() {
                v["metadata"]["name"] = json!(name);
            }
            match st.apply_res(p.res, &mut v, p.ns.as_deref()) {
                Ok(ty) => {
                    drop(st);
                    inner.cv.notify_all();
                    Resp {
                        status: if ty == EvType::Added { 201 } else { 200 },
                        body: v,
                    }
                }
                Err(e) => Resp {
                    status: 422,
                    body: status_obj(422, "Invalid", &e),
                },
            }
        }
        ("DELETE", Some(name)) => {
            let ns = p.ns.clone().unwrap_or_default();
            match st.delete(p.res, &ns, name) {
                Some(o) => {
                    drop(st);
                    inner.cv.notify_all();
                    ok(o)
                }
                None => not_found(r, name),
            }
        }
        _ => {
            drop(st);
            unknown(inner, req, "method not served on this path")
        }
    }
}

fn not_found(r: &Res, name: &str) -> Resp {
    Resp {
        status: 404,
        body: status_obj(
            404,
            "NotFound",
            &format!("{} \"{name}\" not found", r.plural),
        ),
    }
}

/// What a continue token carries: the list's resourceVersion, how many items the pages
/// before held, and the key of the last one.
#[derive(Debug, PartialEq, Eq)]
struct Continue {
    rv: u64,
    offset: usize,
    namespace: String,
    name: String,
}

fn hex_str(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex_str(s: &str) -> Option<String> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// `lab-<rv>-<offset>-<namespace>-<name>`, numbers in hex and names hex-encoded (so the
/// token is URL-safe and splits on `-` unambiguously).
fn encode_continue(c: &Continue) -> String {
    format!(
        "lab-{:x}-{:x}-{}-{}",
        c.rv,
        c.offset,
        hex_str(&c.namespace),
        hex_str(&c.name)
    )
}

fn decode_continue(c: &str) -> Option<Continue> {
    let mut parts = c.strip_prefix("lab-")?.split('-');
    let t = Continue {
        rv: u64::from_str_radix(parts.next()?, 16).ok()?,
        offset: usize::from_str_radix(parts.next()?, 16).ok()?,
        namespace: unhex_str(parts.next()?)?,
        name: unhex_str(parts.next()?)?,
    };
    parts.next().is_none().then_some(t)
}

/// RFC 7386 JSON merge patch (also used for strategic merge patches, which is close enough
/// for the objects tests post).
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().unwrap();
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// Serves a watch on the collection `p`. Ok(true): the stream ended cleanly.
fn serve_watch(
    inner: &Arc<Inner>,
    conn: u64,
    seq: u64,
    p: &PathInfo,
    params: &BTreeMap<String, String>,
    w: &mut TcpStream,
    wait_delay: &dyn Fn(),
) -> io::Result<bool> {
    let r = &RESOURCES[p.res];
    let set = |f: &dyn Fn(&mut Request)| {
        let mut st = inner.st.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = st.requests.get_mut(seq as usize) {
            f(r);
        }
    };
    let bad = |w: &mut TcpStream, msg: String| -> io::Result<bool> {
        wait_delay();
        set(&|r| {
            r.status = Some(400);
            r.answered_at = Some(Instant::now());
            r.ended_at = Some(Instant::now());
        });
        write_json(w, 400, &status_obj(400, "BadRequest", &msg))?;
        Ok(true)
    };
    // A hidden resource is not there for watches either (a watch-list is a start-up's first
    // request).
    if inner
        .st
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .hidden
        .contains(&r.plural)
    {
        wait_delay();
        set(&|r| {
            r.status = Some(404);
            r.answered_at = Some(Instant::now());
            r.ended_at = Some(Instant::now());
        });
        let body = status_obj(
            404,
            "NotFound",
            "the server could not find the requested resource",
        );
        write_json(w, 404, &body)?;
        return Ok(true);
    }
    let label = match params.get("labelSelector").map(|s| LabelSelector::parse(s)) {
        Some(Err(e)) => return bad(w, format!("unable to parse requirement: {e}")),
        Some(Ok(s)) => Some(s),
        None => None,
    };
    let field = match params.get("fieldSelector").map(|s| FieldSelector::parse(s)) {
        Some(Err(e)) => return bad(w, format!("invalid field selector: {e}")),
        Some(Ok(s)) => Some(s),
        None => None,
    };
    let sel = Selectors {
        ns: p.ns.clone(),
        label,
        field,
    };
    let bookmarks = matches!(
        params.get("allowWatchBookmarks").map(String::as_str),
        Some("true" | "1")
    );
    let initial_end = matches!(
        params.get("sendInitialEvents").map(String::as_str),
        Some("true" | "1")
    );
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    let rv_param = params.get("resourceVersion").cloned().unwrap_or_default();
    // A watch-list (KEP-3157) as the real server validates it: `sendInitialEvents=true`
    // needs `resourceVersionMatch=NotOlderThan` and bookmarks; the initial events are the
    // state at least as new as `resourceVersion` (the current state here, for any value).
    let rv_match = params.get("resourceVersionMatch").map(String::as_str);
    let refused = initial_end
        && inner
            .st
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .refuse_watch_lists;
    if initial_end && (refused || rv_match != Some("NotOlderThan") || !bookmarks) {
        wait_delay();
        set(&|r| {
            r.status = Some(422);
            r.answered_at = Some(Instant::now());
            r.ended_at = Some(Instant::now());
        });
        let msg = if refused {
            "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless the \
             WatchList feature gate is enabled"
        } else if bookmarks {
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting \
             resourceVersionMatch to NotOlderThan"
        } else {
            "allowWatchBookmarks: Required value: allowWatchBookmarks required when \
             sendInitialEvents is set"
        };
        write_json(w, 422, &status_obj(422, "Invalid", msg))?;
        return Ok(true);
    }
    let rv_param = if initial_end && rv_param.parse::<u64>().is_ok() {
        String::new()
    } else {
        rv_param
    };

    // Decide the start under the lock.
    let mut initial: Vec<Vec<u8>> = Vec::new();
    let mut timeout = timeout;
    let (mut pos, gen0, gone) = {
        let st = inner.st.lock().unwrap_or_else(|e| e.into_inner());
        let gen0 = st.break_gen;
        if let Some(cap) = st.watch_cap {
            timeout = timeout.min(cap);
        }
        match rv_param.as_str() {
            "" | "0" => {
                for ((res, _, _), o) in &st.objects {
                    if *res == p.res && sel.matches(o) {
                        initial.push(event_line("ADDED", o));
                    }
                }
                if initial_end {
                    initial.push(event_line(
                        "BOOKMARK",
                        &json!({
                            "kind": r.kind, "apiVersion": r.api_version,
                            "metadata": {
                                "resourceVersion": st.rv.to_string(),
                                "annotations": {"k8s.io/initial-events-end": "true"},
                            },
                        }),
                    ));
                }
                (st.rv, gen0, None)
            }
            s => match s.parse::<u64>() {
                Err(_) => {
                    drop(st);
                    return bad(w, format!("invalid resource version: {s}"));
                }
                Ok(n) if n < st.floor => (
                    n,
                    gen0,
                    Some((
                        st.gone,
                        status_obj(
                            410,
                            "Expired",
                            &format!("too old resource version: {n} ({})", st.floor),
                        ),
                    )),
                ),
                Ok(n) => (n, gen0, None),
            },
        }
    };
    wait_delay();
    if let Some((mode, status)) = gone {
        match mode {
            GoneMode::HttpStatus => {
                set(&|r| {
                    r.status = Some(410);
                    r.answered_at = Some(Instant::now());
                    r.ended_at = Some(Instant::now());
                });
                write_json(w, 410, &status)?;
                return Ok(true);
            }
            GoneMode::ErrorEvent => {
                set(&|r| {
                    r.status = Some(200);
                    r.answered_at = Some(Instant::now());
                });
                write_watch_head(w)?;
                write_chunk(w, &event_line("ERROR", &status))?;
                set(&|r| r.ended_at = Some(Instant::now()));
                w.write_all(b"0\r\n\r\n")?;
                w.flush()?;
                return Ok(true);
            }
        }
    }
    if let Some(c) = inner.conns.lock().unwrap().get_mut(&conn) {
        c.watching = true;
    }
    set(&|r| {
        r.status = Some(200);
        r.answered_at = Some(Instant::now());
    });
    let result = (|| -> io::Result<bool> {
        write_watch_head(w)?;
        write_chunks(w, &initial)?;
        if initial_end {
            set(&|r| r.initial_end_at = Some(Instant::now()));
        }
        let start = Instant::now();
        let mut last_bookmark = Instant::now();
        loop {
            let mut out: Vec<Vec<u8>> = Vec::new();
            let mut end = false;
            {
                let mut st = inner.st.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if inner.stop.load(Ordering::SeqCst) || st.break_gen != gen0 {
                        return Err(io::Error::other("watch broken"));
                    }
                    // Events after pos.
                    let i = st.history.partition_point(|e| e.rv <= pos);
                    for e in &st.history[i..] {
                        pos = e.rv;
                        if e.res != p.res {
                            continue;
                        }
                        let now_m = e.ty != EvType::Deleted && sel.matches(&e.obj);
                        let was_m = e.prev.as_ref().is_some_and(|o| sel.matches(o));
                        let ty = match (e.ty, was_m, now_m) {
                            (EvType::Deleted, true, _) => "DELETED",
                            (EvType::Deleted, false, _) => continue,
                            (_, true, true) => "MODIFIED",
                            (_, false, true) => "ADDED",
                            (_, true, false) => "DELETED",
                            (_, false, false) => continue,
                        };
                        out.push(event_line(ty, &e.obj));
                    }
                    if pos < st.rv {
                        pos = st.rv;
                    }
                    let bm_due = bookmarks
                        && st
                            .bookmark_interval
                            .is_some_and(|d| last_bookmark.elapsed() >= d);
                    if bm_due {
                        out.push(event_line(
                            "BOOKMARK",
                            &json!({"kind": r.kind, "apiVersion": r.api_version,
                                    "metadata": {"resourceVersion": pos.to_string()}}),
                        ));
                        last_bookmark = Instant::now();
                    }
                    if start.elapsed() >= timeout {
                        end = true;
                    }
                    if !out.is_empty() || end {
                        break;
                    }
                    let mut wait = timeout.saturating_sub(start.elapsed());
                    if bookmarks && let Some(d) = st.bookmark_interval {
                        wait = wait.min(d.saturating_sub(last_bookmark.elapsed()));
                    }
                    let wait = wait
                        .max(Duration::from_millis(1))
                        .min(Duration::from_millis(500));
                    st = inner
                        .cv
                        .wait_timeout(st, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            for e in &out {
                write_chunk(w, e)?;
            }
            if end {
                // Over before the client can see it end: `open_watches` must never count a
                // watch whose client has read its last chunk.
                set(&|r| r.ended_at = Some(Instant::now()));
                w.write_all(b"0\r\n\r\n")?;
                w.flush()?;
                return Ok(true);
            }
        }
    })();
    if let Some(c) = inner.conns.lock().unwrap().get_mut(&conn) {
        c.watching = false;
    }
    set(&|r| {
        r.ended_at.get_or_insert_with(Instant::now);
    });
    result
}

fn write_watch_head(w: &mut TcpStream) -> io::Result<()> {
    w.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\n\
          Audit-Id: lab\r\nTransfer-Encoding: chunked\r\n\r\n",
    )?;
    w.flush()
}

// ---------------------------------------------------------------------------------------------
// Selectors

#[derive(Debug, Clone)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector.
#[derive(Debug, Clone)]
pub struct LabelSelector(Vec<LabelReq>);

impl LabelSelector {
    /// Parses `k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, comma-separated.
    pub fn parse(s: &str) -> Result<LabelSelector, String> {
        let mut reqs = Vec::new();
        let mut depth = 0;
        let mut cur = String::new();
        let mut parts = Vec::new();
        for c in s.chars() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(std::mem::take(&mut cur));
                    continue;
                }
                _ => {}
            }
            cur.push(c);
        }
        parts.push(cur);
        for part in parts {
            let t = part.trim();
            if t.is_empty() {
                continue;
            }
            let set_vals = |rest: &str| -> Result<Vec<String>, String> {
                let rest = rest.trim();
                let inner = rest
                    .strip_prefix('(')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| format!("{t:?}: expected (values)"))?;
                Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
            };
            let req = if let Some(k) = t.strip_prefix('!') {
                LabelReq::NotExists(k.trim().to_owned())
            } else if let Some((k, rest)) = t.split_once(" notin ") {
                LabelReq::NotIn(k.trim().to_owned(), set_vals(rest)?)
            } else if let Some((k, rest)) = t.split_once(" in ") {
                LabelReq::In(k.trim().to_owned(), set_vals(rest)?)
            } else if let Some((k, v)) = t.split_once("!=") {
                LabelReq::Ne(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = t.split_once("==") {
                LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = t.split_once('=') {
                LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
            } else if t.contains([' ', '(', ')', '<', '>']) {
                return Err(format!("{t:?}: unsupported label requirement"));
            } else {
                LabelReq::Exists(t.to_owned())
            };
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::Ne(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
        })
    }
}

/// A parsed field selector (`path=v`, `path==v`, `path!=v`, comma-separated).
#[derive(Debug, Clone)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<FieldSelector, String> {
        let mut v = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, eq, val) = if let Some((k, val)) = part.split_once("!=") {
                (k, false, val)
            } else if let Some((k, val)) = part.split_once("==") {
                (k, true, val)
            } else if let Some((k, val)) = part.split_once('=') {
                (k, true, val)
            } else {
                return Err(format!("invalid selector: {part:?}; can't understand it"));
            };
            v.push((k.trim().to_owned(), eq, val.trim().to_owned()));
        }
        Ok(FieldSelector(v))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, eq, val)| {
            let mut cur = obj;
            for seg in path.split('.') {
                cur = &cur[seg];
            }
            let s = match cur {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            (s == *val) == *eq
        })
    }
}

struct Selectors {
    ns: Option<String>,
    label: Option<LabelSelector>,
    field: Option<FieldSelector>,
}

impl Selectors {
    fn matches(&self, o: &Value) -> bool {
        self.ns
            .as_ref()
            .is_none_or(|ns| o["metadata"]["namespace"].as_str() == Some(ns.as_str()))
            && self.label.as_ref().is_none_or(|l| l.matches(o))
            && self.field.as_ref().is_none_or(|f| f.matches(o))
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers

fn parse_query(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                percent_decode(&k.replace('+', " ")),
                percent_decode(&v.replace('+', " ")),
            )
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push(h * 16 + l);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// `t` as RFC 3339 in UTC with second precision (`2025-01-02T03:04:05Z`), as Kubernetes
/// writes `metav1.Time`.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            "2023-11-14T22:13:20Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
    }

    #[test]
    fn selectors() {
        let o = json!({"metadata": {"name": "n1", "labels": {"kubernetes.io/service-name": "web", "a": "1"}}});
        let p = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(p("kubernetes.io/service-name"));
        assert!(!p("!kubernetes.io/service-name"));
        assert!(p("a=1,kubernetes.io/service-name==web"));
        assert!(!p("a!=1"));
        assert!(p("a in (1,2)"));
        assert!(!p("a notin (1,2)"));
        assert!(p("!b"));
        let f = |s: &str| FieldSelector::parse(s).unwrap().matches(&o);
        assert!(f("metadata.name=n1"));
        assert!(!f("metadata.name!=n1"));
        assert!(!f("metadata.name=n2"));
    }

    #[test]
    fn queries_and_paths() {
        let q = parse_query("labelSelector=kubernetes.io%2Fservice-name&watch=true&x=a+b");
        assert_eq!(q["labelSelector"], "kubernetes.io/service-name");
        assert_eq!(q["x"], "a b");
        let p = parse_path("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices").unwrap();
        assert_eq!(RESOURCES[p.res].plural, "endpointslices");
        assert_eq!(p.ns.as_deref(), Some("default"));
        let p = parse_path("/api/v1/nodes/lab-node").unwrap();
        assert_eq!(p.name.as_deref(), Some("lab-node"));
        assert!(parse_path("/api/v1/namespaces/default/nodes").is_none());
        let p = parse_path("/apis/events.k8s.io/v1/namespaces/default/events").unwrap();
        assert_eq!(RESOURCES[p.res].api_version, "events.k8s.io/v1");
        let t = Continue {
            rv: 1234,
            offset: 56,
            namespace: String::new(),
            name: "svc-1-abcde".into(),
        };
        assert_eq!(decode_continue(&encode_continue(&t)), Some(t));
        assert_eq!(decode_continue("lab-4d2-38"), None);
        assert_eq!(decode_continue("lab-4d2-38-6-61"), None);
    }

    #[test]
    fn patch() {
        let mut t = json!({"a": {"b": 1, "c": 2}, "d": 3});
        merge_patch(&mut t, &json!({"a": {"b": null, "e": 5}, "d": 4}));
        assert_eq!(t, json!({"a": {"c": 2, "e": 5}, "d": 4}));
    }
}
