//! Self-test of `lbproxy_tests::apiserver` with a plain HTTP/1.1 client: list, get, watch
//! streams (replay, live, selectors, bookmarks, timeouts), broken watches, 410 Gone in both
//! modes, Events, delays, outages. Needs no root and no lbproxy binary (binds in the test's
//! own network namespace).

use std::io::{self, BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use lbproxy_tests::apiserver::{ApiServer, GoneMode, TOKEN};
use lbproxy_tests::lab::{Endpoint, EndpointSlice, Protocol, Service};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(5);

struct Client {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

struct Head {
    status: u16,
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.as_str())
    }
}

impl Client {
    fn connect(addr: SocketAddr) -> io::Result<Client> {
        let s = TcpStream::connect_timeout(&addr, T)?;
        s.set_read_timeout(Some(T))?;
        Ok(Client {
            r: BufReader::new(s.try_clone()?),
            w: s,
        })
    }

    fn send(&mut self, method: &str, target: &str, body: Option<&Value>) -> io::Result<()> {
        let b = body
            .map(|b| serde_json::to_vec(b).unwrap())
            .unwrap_or_default();
        let mut req = format!(
            "{method} {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nAccept: application/json\r\n"
        );
        if body.is_some() {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        req.push_str("\r\n");
        let mut out = req.into_bytes();
        out.extend_from_slice(&b);
        self.w.write_all(&out)
    }

    fn head(&mut self) -> io::Result<Head> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "EOF before status",
            ));
        }
        let status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            self.r.read_line(&mut h)?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').unwrap();
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        Ok(Head { status, headers })
    }

    /// A complete (Content-Length) request/response.
    fn call(&mut self, method: &str, target: &str, body: Option<&Value>) -> (u16, Value) {
        self.send(method, target, body).unwrap();
        let h = self.head().unwrap();
        let n: usize = h
            .header("content-length")
            .unwrap_or_else(|| panic!("{method} {target}: no content-length"))
            .parse()
            .unwrap();
        let mut b = vec![0; n];
        self.r.read_exact(&mut b).unwrap();
        (h.status, serde_json::from_slice(&b).unwrap())
    }

    /// Starts a watch; returns the head (the stream follows).
    fn watch(&mut self, target: &str) -> Head {
        self.send("GET", target, None).unwrap();
        self.head().unwrap()
    }

    /// Next watch event: Ok(Some(event)), Ok(None) at the terminating chunk, Err on EOF or
    /// timeout.
    fn next_event(&mut self, timeout: Duration) -> io::Result<Option<Value>> {
        self.w.set_read_timeout(Some(timeout))?;
        let mut sz = String::new();
        if self.r.read_line(&mut sz)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "EOF mid-stream",
            ));
        }
        let n = usize::from_str_radix(sz.trim(), 16).unwrap();
        if n == 0 {
            let mut crlf = String::new();
            self.r.read_line(&mut crlf)?;
            return Ok(None);
        }
        let mut b = vec![0; n + 2];
        self.r.read_exact(&mut b)?;
        assert!(
            b.ends_with(b"\n\r\n"),
            "event chunk must end with a newline: {b:?}"
        );
        Ok(Some(serde_json::from_slice(&b[..n]).unwrap()))
    }
}

fn web() -> (Value, Value) {
    let svc = Service::cluster_ip("web", "198.19.0.10")
        .port("http", 80, Protocol::Tcp, 8080)
        .to_json();
    let slice = EndpointSlice::new("web-1", "web")
        .port("http", 8080, Protocol::Tcp)
        .endpoint(Endpoint::ready("198.18.0.3").pod("b1"))
        .to_json();
    (svc, slice)
}

fn rv_of(v: &Value) -> u64 {
    v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Listing N objects in pages costs O(N) in all, not O(N) per page: the server looks at
/// each stored object about once over a whole paginated list (before, every page cloned the
/// whole list and skipped to its offset, and a start-up at 50,000 services took minutes).
/// Counted in objects looked at, not timed. Pages also carry every object exactly once,
/// with objects created and deleted between pages handled by key, not offset.
#[test]
fn a_paginated_list_looks_at_each_object_about_once() {
    let api = ApiServer::start_here();
    let n = 3000usize;
    let limit = 100usize;
    for i in 0..n {
        api.apply(
            EndpointSlice::new(&format!("s{i:05}"), &format!("svc{i}"))
                .endpoint(Endpoint::ready(format!(
                    "198.18.{}.{}",
                    i / 250,
                    i % 250 + 1
                )))
                .to_json(),
        );
        // Unlabelled slices the selector skips, and other kinds, are stored too.
        if i % 10 == 0 {
            let mut other = EndpointSlice::new(&format!("u{i:05}"), "x").to_json();
            other["metadata"]["labels"] = json!({});
            api.apply(other);
            api.apply(Service::cluster_ip(&format!("svc{i}"), "198.19.0.10").to_json());
        }
    }
    let mut c = Client::connect(api.addr()).unwrap();
    let mut names = Vec::new();
    let mut pages = 0;
    let mut cont = String::new();
    let before = api.list_work();
    loop {
        let mut target = format!(
            "/apis/discovery.k8s.io/v1/endpointslices?labelSelector=kubernetes.io%2Fservice-name&limit={limit}"
        );
        if !cont.is_empty() {
            target.push_str(&format!("&continue={cont}"));
        }
        let (st, l) = c.call("GET", &target, None);
        assert_eq!(st, 200, "{l}");
        pages += 1;
        names.extend(
            l["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned()),
        );
        if pages == 3 {
            // Between pages: one already listed goes, one not yet listed arrives.
            api.delete("EndpointSlice", "default", "s00000");
            api.apply(EndpointSlice::new("s99999", "late").to_json());
        }
        match l["metadata"]["continue"].as_str() {
            Some(c) => cont = c.to_owned(),
            None => break,
        }
    }
    let work = api.list_work() - before;
    let mut want: Vec<String> = (0..n).map(|i| format!("s{i:05}")).collect();
    want.push("s99999".into());
    assert_eq!(names, want, "every slice once, in key order");
    // Every labelled slice, the unlabelled ones between them, and one look-ahead per page.
    let stored = n + n / 10 + 1;
    assert!(
        work <= (stored + pages) as u64,
        "{work} objects looked at to list {stored} stored in {pages} pages: the work grows \
         faster than the list"
    );
}

/// A list with `resourceVersion=0` is served as the real server's watch cache serves it: the
/// whole list in one response, `limit` ignored, no `continue`. `resourceVersionMatch`
/// NotOlderThan is the same; `Exact` with "0" is refused; without `resourceVersion` the same
/// `limit` paginates as before.
#[test]
fn a_list_from_the_watch_cache_is_one_response() {
    let api = ApiServer::start_here();
    let n = 1200usize;
    for i in 0..n {
        api.apply(Service::cluster_ip(&format!("s{i:05}"), "198.19.0.10").to_json());
    }
    api.apply(ApiServer::node("lab-node"));
    let mut c = Client::connect(api.addr()).unwrap();
    for q in [
        "limit=500&resourceVersion=0",
        "limit=500&resourceVersion=0&resourceVersionMatch=NotOlderThan",
        "resourceVersion=0",
    ] {
        let (st, l) = c.call("GET", &format!("/api/v1/services?{q}"), None);
        assert_eq!(st, 200, "{q}: {l}");
        assert_eq!(
            l["items"].as_array().unwrap().len(),
            n,
            "{q}: every item at once"
        );
        assert!(
            l["metadata"].get("continue").is_none(),
            "{q}: {}",
            l["metadata"]
        );
        assert!(
            l["metadata"].get("remainingItemCount").is_none(),
            "{q}: {}",
            l["metadata"]
        );
        assert_eq!(
            rv_of(&json!({"metadata": l["metadata"]})),
            api.resource_version()
        );
    }
    let (st, l) = c.call(
        "GET",
        "/api/v1/services?limit=500&resourceVersion=0&resourceVersionMatch=Exact",
        None,
    );
    assert_eq!((st, l["reason"].as_str()), (422, Some("Invalid")), "{l}");
    let (st, l) = c.call("GET", "/api/v1/services?limit=500", None);
    assert_eq!(st, 200, "{l}");
    assert_eq!(
        l["items"].as_array().unwrap().len(),
        500,
        "a consistent list pages"
    );
    assert!(l["metadata"]["continue"].is_string(), "{}", l["metadata"]);
    // Selectors apply as usual.
    let (st, l) = c.call(
        "GET",
        "/api/v1/nodes?resourceVersion=0&resourceVersionMatch=NotOlderThan&fieldSelector=metadata.name%3Dlab-node&limit=500",
        None,
    );
    assert_eq!(st, 200, "{l}");
    assert_eq!(l["items"].as_array().unwrap().len(), 1, "{l}");
}

/// A watch-list (KEP-3157, `sendInitialEvents=true`) as the real server validates and serves
/// it: ADDED for every object (whatever `resourceVersion` names), then one BOOKMARK annotated
/// `k8s.io/initial-events-end`, then live events; without `resourceVersionMatch=NotOlderThan`
/// or without bookmarks it is refused (422), and so is every watch-list once the server
/// plays one with the `WatchList` gate off.
#[test]
fn a_watch_list_sends_the_state_then_the_end_bookmark() {
    let api = ApiServer::start_here();
    for i in 0..700usize {
        api.apply(Service::cluster_ip(&format!("s{i:05}"), "198.19.0.10").to_json());
    }
    let mut c = Client::connect(api.addr()).unwrap();
    for q in [
        "watch=1&sendInitialEvents=true&allowWatchBookmarks=true",
        "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
        "watch=1&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=Exact&resourceVersion=0",
    ] {
        let (st, l) = c.call("GET", &format!("/api/v1/services?{q}"), None);
        assert_eq!(
            (st, l["reason"].as_str()),
            (422, Some("Invalid")),
            "{q}: {l}"
        );
    }
    for rv in ["0", "", "1"] {
        let now = api.resource_version();
        let mut c = Client::connect(api.addr()).unwrap();
        let h = c.watch(&format!(
            "/api/v1/services?watch=1&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&resourceVersion={rv}&timeoutSeconds=30"
        ));
        assert_eq!(h.status, 200);
        let mut added = 0;
        let end = loop {
            let e = c.next_event(T).unwrap().expect("the stream goes on");
            match e["type"].as_str() {
                Some("ADDED") => added += 1,
                Some("BOOKMARK") => break e,
                _ => panic!("rv {rv:?}: {e}"),
            }
        };
        assert_eq!(
            added, 700,
            "rv {rv:?}: every object once before the bookmark"
        );
        assert_eq!(
            end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
            "true"
        );
        assert_eq!(rv_of(&end["object"]), now, "rv {rv:?}");
        // Then live.
        api.apply(Service::cluster_ip(&format!("late-{rv}"), "198.19.0.11").to_json());
        let e = c.next_event(T).unwrap().unwrap();
        assert_eq!(e["type"], "ADDED", "{e}");
        assert_eq!(e["object"]["metadata"]["name"], format!("late-{rv}"));
        api.delete("Service", "default", &format!("late-{rv}"));
    }
    // A server with the WatchList gate off refuses watch-lists, and only them.
    api.refuse_watch_lists();
    let (st, l) = c.call(
        "GET",
        "/api/v1/services?watch=1&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&resourceVersion=0",
        None,
    );
    assert_eq!((st, l["reason"].as_str()), (422, Some("Invalid")), "{l}");
    let (st, l) = c.call("GET", "/api/v1/services?resourceVersion=0", None);
    assert_eq!(st, 200, "{l}");
    assert_eq!(l["items"].as_array().unwrap().len(), 700);
    let mut c = Client::connect(api.addr()).unwrap();
    assert_eq!(
        c.watch("/api/v1/services?watch=1&resourceVersion=0").status,
        200
    );
    assert_eq!(c.next_event(T).unwrap().unwrap()["type"], "ADDED");
    // A hidden resource is 404 for watches too.
    api.hide_resource("servicecidrs");
    let mut c = Client::connect(api.addr()).unwrap();
    let (st, l) = c.call(
        "GET",
        "/apis/networking.k8s.io/v1/servicecidrs?watch=1&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan",
        None,
    );
    assert_eq!((st, l["reason"].as_str()), (404, Some("NotFound")), "{l}");
}

#[test]
fn list_get_selectors_pagination() {
    let api = ApiServer::start_here();
    let (svc, slice) = web();
    api.apply(svc);
    api.apply(slice);
    let mut other = EndpointSlice::new("unlabelled", "x").to_json();
    other["metadata"]["labels"] = json!({});
    api.apply(other);
    api.apply(ApiServer::node("lab-node"));
    api.apply(ApiServer::node("other-node"));
    let mut c = Client::connect(api.addr()).unwrap();

    let (st, l) = c.call("GET", "/api/v1/services?limit=500", None);
    assert_eq!(st, 200, "{l}");
    assert_eq!(l["kind"], "ServiceList");
    assert_eq!(l["apiVersion"], "v1");
    assert_eq!(
        l["metadata"]["resourceVersion"],
        api.resource_version().to_string().as_str()
    );
    assert!(l["metadata"].get("continue").is_none(), "{l}");
    let items = l["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    let it = &items[0];
    assert!(
        it.get("kind").is_none() && it.get("apiVersion").is_none(),
        "{it}"
    );
    for k in [
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "creationTimestamp",
    ] {
        assert!(
            it["metadata"][k].is_string(),
            "item without metadata.{k}: {it}"
        );
    }
    assert_eq!(it["spec"]["clusterIP"], "198.19.0.10");

    let (_, l) = c.call(
        "GET",
        "/apis/discovery.k8s.io/v1/endpointslices?labelSelector=kubernetes.io%2Fservice-name&limit=500",
        None,
    );
    assert_eq!(l["kind"], "EndpointSliceList");
    let names: Vec<&str> = l["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["web-1"]);
    assert_eq!(l["items"][0]["endpoints"][0]["addresses"][0], "198.18.0.3");

    let (_, l) = c.call(
        "GET",
        "/api/v1/nodes?fieldSelector=metadata.name%3Dlab-node",
        None,
    );
    assert_eq!(l["items"].as_array().unwrap().len(), 1, "{l}");
    assert_eq!(l["items"][0]["metadata"]["name"], "lab-node");
    assert!(l["items"][0]["metadata"].get("namespace").is_none());

    // Pagination.
    let (_, p1) = c.call("GET", "/api/v1/nodes?limit=1", None);
    assert_eq!(p1["items"].as_array().unwrap().len(), 1);
    let cont = p1["metadata"]["continue"].as_str().unwrap().to_owned();
    let (_, p2) = c.call(
        "GET",
        &format!("/api/v1/nodes?limit=1&continue={cont}"),
        None,
    );
    assert_eq!(p2["items"].as_array().unwrap().len(), 1);
    assert!(p2["metadata"].get("continue").is_none(), "{p2}");
    assert_ne!(
        p1["items"][0]["metadata"]["name"],
        p2["items"][0]["metadata"]["name"]
    );
    assert_eq!(
        p1["metadata"]["resourceVersion"],
        p2["metadata"]["resourceVersion"]
    );

    // Namespaced list and get.
    let (_, l) = c.call("GET", "/api/v1/namespaces/other/services", None);
    assert_eq!(l["items"].as_array().unwrap().len(), 0);
    let (st, o) = c.call("GET", "/api/v1/namespaces/default/services/web", None);
    assert_eq!((st, &o["kind"]), (200, &json!("Service")));
    let (st, o) = c.call("GET", "/api/v1/namespaces/default/services/nope", None);
    assert_eq!((st, &o["reason"]), (404, &json!("NotFound")));

    // Discovery and unknown paths.
    let (st, v) = c.call("GET", "/version", None);
    assert_eq!(st, 200);
    assert_eq!(v["major"], "1");
    let (st, _) = c.call("GET", "/apis/apps/v1/deployments", None);
    assert_eq!(st, 404);
    assert_eq!(api.unknown_requests().len(), 1);

    let reqs = api.requests();
    assert!(
        reqs.iter()
            .all(|r| r.authorization.as_deref() == Some(&format!("Bearer {TOKEN}")))
    );
    let r = &reqs[1];
    assert!(r.is_list() && !r.is_watch());
    assert_eq!(r.resource(), Some("endpointslices"));
    assert_eq!(r.param("labelSelector"), Some("kubernetes.io/service-name"));
}

#[test]
fn watch_replay_live_selectors_timeout() {
    let api = ApiServer::start_here();
    let (svc, slice) = web();
    api.apply(svc.clone());
    let rv0 = api.resource_version();
    api.apply(slice.clone());
    let mut c = Client::connect(api.addr()).unwrap();
    let h = c.watch(&format!(
        "/apis/discovery.k8s.io/v1/endpointslices?watch=true&resourceVersion={rv0}&allowWatchBookmarks=true&timeoutSeconds=2&labelSelector=kubernetes.io%2Fservice-name"
    ));
    assert_eq!(h.status, 200);
    assert_eq!(h.header("transfer-encoding"), Some("chunked"));
    // Replay of the event after rv0.
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(e["type"], "ADDED", "{e}");
    assert_eq!(e["object"]["kind"], "EndpointSlice");
    assert_eq!(e["object"]["apiVersion"], "discovery.k8s.io/v1");
    // Live: modify, the label goes away (DELETED for this selector), comes back (ADDED),
    // delete.
    let mut s2 = slice.clone();
    s2["endpoints"][0]["addresses"][0] = json!("198.18.0.4");
    let stored = api.apply(s2.clone());
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(e["type"], "MODIFIED");
    assert_eq!(e["object"]["endpoints"][0]["addresses"][0], "198.18.0.4");
    assert_eq!(rv_of(&e["object"]), rv_of(&stored));
    let mut s3 = s2.clone();
    s3["metadata"]["labels"] = json!({});
    api.apply(s3);
    assert_eq!(c.next_event(T).unwrap().unwrap()["type"], "DELETED");
    api.apply(s2);
    assert_eq!(c.next_event(T).unwrap().unwrap()["type"], "ADDED");
    // A Service change is not on this watch; the slice deletion is.
    let mut svc2 = svc.clone();
    svc2["spec"]["ports"][0]["port"] = json!(81);
    api.apply(svc2);
    assert!(api.delete("EndpointSlice", "default", "web-1"));
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(e["type"], "DELETED", "{e}");
    assert_eq!(rv_of(&e["object"]), api.resource_version());
    // timeoutSeconds=2: the stream ends cleanly, and the connection is reused.
    let t = Instant::now();
    loop {
        match c.next_event(T).unwrap() {
            None => break,
            Some(e) => assert_eq!(e["type"], "BOOKMARK", "{e}"),
        }
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let (st, _) = c.call("GET", "/api/v1/services", None);
    assert_eq!(st, 200);

    // Watch from "0": synthetic ADDED for what exists, then live; initial-events-end
    // bookmark with sendInitialEvents.
    let mut c = Client::connect(api.addr()).unwrap();
    c.watch("/api/v1/services?watch=1&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan");
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(
        (
            e["type"].as_str(),
            e["object"]["spec"]["ports"][0]["port"].as_u64()
        ),
        (Some("ADDED"), Some(81))
    );
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(e["type"], "BOOKMARK");
    assert_eq!(
        e["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    assert_eq!(rv_of(&e["object"]), api.resource_version());

    // The server's own cap on a watch's lifetime.
    api.set_watch_timeout_cap(Some(Duration::from_millis(300)));
    let mut c2 = Client::connect(api.addr()).unwrap();
    let rv = api.resource_version();
    c2.watch(&format!("/api/v1/services?watch=true&resourceVersion={rv}"));
    let t = Instant::now();
    assert!(c2.next_event(T).unwrap().is_none());
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    api.set_watch_timeout_cap(None);

    // Periodic bookmarks.
    api.set_bookmark_interval(Some(Duration::from_millis(200)));
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(e["type"], "BOOKMARK");
    assert_eq!(e["object"]["kind"], "Service");
    assert_eq!(api.open_watches("services").len(), 1);
}

#[test]
fn broken_watch_resume_and_gone() {
    let api = ApiServer::start_here();
    let (svc, _) = web();
    api.apply(svc.clone());
    let rv = api.resource_version();
    let mut c = Client::connect(api.addr()).unwrap();
    c.watch(&format!("/api/v1/services?watch=true&resourceVersion={rv}"));
    // Give the watch a moment to register as open.
    let t = Instant::now();
    while api.open_watches("services").is_empty() {
        assert!(t.elapsed() < T);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(api.break_watches(), 1);
    let e = c.next_event(T);
    assert!(
        matches!(&e, Err(e) if e.kind() == io::ErrorKind::UnexpectedEof),
        "a broken watch ends without the terminating chunk: {e:?}"
    );
    // A change after the break arrives on a resumed watch.
    let mut svc2 = svc.clone();
    svc2["spec"]["ports"][0]["port"] = json!(81);
    api.apply(svc2.clone());
    let mut c = Client::connect(api.addr()).unwrap();
    c.watch(&format!("/api/v1/services?watch=true&resourceVersion={rv}"));
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(e["type"], "MODIFIED");

    // Expired: ERROR event with a 410 Status, then the end of the stream.
    api.expire_history();
    let mut c = Client::connect(api.addr()).unwrap();
    let h = c.watch(&format!("/api/v1/services?watch=true&resourceVersion={rv}"));
    assert_eq!(h.status, 200);
    let e = c.next_event(T).unwrap().unwrap();
    assert_eq!(e["type"], "ERROR", "{e}");
    assert_eq!(e["object"]["kind"], "Status");
    assert_eq!(e["object"]["code"], 410);
    assert_eq!(e["object"]["reason"], "Expired");
    assert!(
        e["object"]["message"]
            .as_str()
            .unwrap()
            .starts_with("too old resource version: ")
    );
    assert!(c.next_event(T).unwrap().is_none());
    // HTTP 410 mode.
    api.set_gone_mode(GoneMode::HttpStatus);
    let mut c = Client::connect(api.addr()).unwrap();
    c.send(
        "GET",
        &format!("/api/v1/services?watch=true&resourceVersion={rv}"),
        None,
    )
    .unwrap();
    let h = c.head().unwrap();
    assert_eq!(h.status, 410);
    // A fresh list gives an RV that can be watched from.
    let (_, l) = c_call(&api, "GET", "/api/v1/services");
    let lrv = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut c = Client::connect(api.addr()).unwrap();
    let h = c.watch(&format!(
        "/api/v1/services?watch=true&resourceVersion={lrv}"
    ));
    assert_eq!(h.status, 200);
    api.delete("Service", "default", "web");
    assert_eq!(c.next_event(T).unwrap().unwrap()["type"], "DELETED");
}

fn c_call(api: &ApiServer, m: &str, p: &str) -> (u16, Value) {
    Client::connect(api.addr()).unwrap().call(m, p, None)
}

#[test]
fn events_delay_outage() {
    let api = ApiServer::start_here();
    let ev = json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": "lab-node.1", "namespace": "default"},
        "eventTime": "2025-01-01T00:00:00.000000Z",
        "reason": "SyncFailed", "note": "cannot program", "type": "Warning",
        "action": "Sync", "reportingController": "lbproxy", "reportingInstance": "lbproxy-lab-node",
        "regarding": {"kind": "Node", "name": "lab-node", "apiVersion": "v1"},
    });
    let mut c = Client::connect(api.addr()).unwrap();
    let (st, o) = c.call(
        "POST",
        "/apis/events.k8s.io/v1/namespaces/default/events",
        Some(&ev),
    );
    assert_eq!(st, 201, "{o}");
    assert!(o["metadata"]["uid"].is_string());
    let (st, _) = c.call(
        "POST",
        "/apis/events.k8s.io/v1/namespaces/default/events",
        Some(&ev),
    );
    assert_eq!(st, 409);
    let (st, _) = c.call(
        "PATCH",
        "/apis/events.k8s.io/v1/namespaces/default/events/lab-node.1",
        Some(&json!({"series": {"count": 2}})),
    );
    assert_eq!(st, 200);
    let core = json!({"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "lab-node."},
        "reason": "X", "message": "m", "involvedObject": {"kind": "Node", "name": "lab-node"}});
    let (st, o) = c.call("POST", "/api/v1/namespaces/default/events", Some(&core));
    assert_eq!(st, 201, "{o}");
    let evs = api.events_posted();
    assert_eq!(evs.len(), 4);
    assert_eq!(evs[0].reason(), Some("SyncFailed"));
    assert_eq!(evs[0].regarding()["name"], "lab-node");
    assert_eq!(evs[3].regarding()["kind"], "Node");
    assert_eq!(evs[3].note(), Some("m"));

    api.set_delay(Duration::from_millis(300));
    let t = Instant::now();
    let (st, _) = c.call("GET", "/api/v1/services", None);
    assert_eq!(st, 200);
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    api.set_delay(Duration::ZERO);

    api.go_down();
    let e = TcpStream::connect_timeout(&api.addr(), T);
    assert!(
        matches!(&e, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused),
        "{e:?}"
    );
    assert!(c.call_checked("GET", "/api/v1/services").is_err());
    api.come_back();
    let (st, _) = c_call(&api, "GET", "/api/v1/services");
    assert_eq!(st, 200);
}

impl Client {
    fn call_checked(&mut self, m: &str, p: &str) -> io::Result<u16> {
        self.send(m, p, None)?;
        Ok(self.head()?.status)
    }
}
