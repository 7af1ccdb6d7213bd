//! The rig: a lab, lbproxy, and the programs on the client pod's interface, run on one
//! frame at a time; and [`Outcome`], what one run gave, compared in full.

use std::cell::RefCell;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use super::*;

// ---------------------------------------------------------------------------------------
// The rig: a lab, lbproxy, and the programs on the client pod's interface.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Prog {
    /// tcx ingress on the pod's host-side veth: packets leaving the pod.
    FromPod,
    /// tcx egress on the pod's host-side veth: packets entering the pod.
    ToPod,
    /// tcx ingress on the node's uplink: packets from outside the node.
    FromNode,
    /// tcx egress on the node's uplink: packets leaving the node.
    ToNode,
}

impl Prog {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Prog::FromPod => "lb_from_pod",
            Prog::ToPod => "lb_to_pod",
            Prog::FromNode => "lb_from_node",
            Prog::ToNode => "lb_to_node",
        }
    }
}

/// Counter deltas, only the reasons that moved.
pub(crate) type Drops = BTreeMap<String, u64>;

/// Where the rig keeps the event counters among the drop counters it reads.
const EVENT_KEY: &str = "event:";

/// The event deltas `drops` implies: its deprecated reasons, which are events now.
fn events_of(drops: &Drops) -> Drops {
    drops
        .iter()
        .filter(|(k, _)| DATAPATH_EVENTS.contains(&k.as_str()))
        .map(|(k, n)| (k.clone(), *n))
        .collect()
}

/// What one program run gave.
pub(crate) struct Outcome {
    pub(crate) what: String,
    pub(crate) input: Vec<u8>,
    pub(crate) rc: i32,
    pub(crate) out: Vec<u8>,
    pub(crate) drops: Drops,
    /// How the event counters moved.
    pub(crate) events: Drops,
    /// `skb->mark` as the program left it.
    pub(crate) mark: u32,
}

impl Outcome {
    /// Panics, showing everything observed, unless the run returned `rc`, left exactly
    /// `want` and moved exactly the counters in `drops` (by the amounts given), the event
    /// counters included: those of the reasons in `drops` that are [`DATAPATH_EVENTS`], no
    /// other.
    pub(crate) fn expect(&self, rc: i32, want: &[u8], drops: &[(&str, u64)]) {
        let want_drops: Drops = drops.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
        let want_events = events_of(&want_drops);
        if self.rc == rc
            && self.out == want
            && self.drops == want_drops
            && self.events == want_events
        {
            return;
        }
        let mut msg = format!("{}:\n", self.what);
        if self.rc != rc {
            let _ = writeln!(
                msg,
                "  verdict: got {}, want {}",
                tc_name(self.rc),
                tc_name(rc)
            );
        }
        if self.drops != want_drops {
            let _ = writeln!(
                msg,
                "  drop counters moved: got {:?}, want {:?}",
                self.drops, want_drops
            );
        }
        if self.events != want_events {
            let _ = writeln!(
                msg,
                "  event counters moved: got {:?}, want {:?}",
                self.events, want_events
            );
        }
        if self.out != want {
            let _ = writeln!(msg, "  output differs: {}", diff(&self.out, want));
            let _ = writeln!(msg, "  got:\n{}", describe(&self.out));
            let _ = writeln!(msg, "  want:\n{}", describe(want));
        } else {
            let _ = writeln!(msg, "  output as expected:\n{}", describe(&self.out));
        }
        let _ = write!(
            msg,
            "  input:\n{}\n  input bytes  {}\n  output bytes {}",
            describe(&self.input),
            hex(&self.input),
            hex(&self.out)
        );
        panic!("{msg}");
    }

    /// [`Self::expect`] for a frame that must come out exactly as it went in.
    pub(crate) fn expect_untouched(&self, rc: i32, drops: &[(&str, u64)]) {
        let input = self.input.clone();
        self.expect(rc, &input, drops);
    }
}

/// One lab with one client pod, lbproxy running with the `web` service (one endpoint,
/// [`BACKEND`]) and the `empty` service (no endpoints), and the ids of the programs it
/// attached to the client's host-side veth.
pub(crate) struct Rig {
    // Dropped before the lab, which then cleans up the pinned maps and links.
    pub(crate) lb: Lbproxy,
    pub(crate) lab: Lab,
    pub(crate) client: Pod,
    pub(crate) ifindex: u32,
    pub(crate) from_pod: u32,
    pub(crate) to_pod: u32,
    /// The uplink's ifindex and the ids of `lb_from_node` and `lb_to_node` on it.
    pub(crate) uplink: (u32, u32, u32),
    /// The counters as last read.
    pub(crate) counters: RefCell<BTreeMap<String, u64>>,
    /// The manifest of the rig's own services, which [`Rig::rewrite_extra`] keeps.
    own: String,
}

impl Rig {
    pub(crate) fn new() -> Rig {
        Rig::with_extra("")
    }

    /// [`Rig::new`], with `extra` (YAML documents, each starting with `---`) beside the
    /// rig's own services.
    pub(crate) fn with_extra(extra: &str) -> Rig {
        Rig::with_args(extra, &[])
    }

    /// [`Rig::with_extra`], lbproxy started with `args` added to the lab's command line.
    pub(crate) fn with_args(extra: &str, args: &[&str]) -> Rig {
        let lab = Lab::new(Shape::Routed);
        let client = lab.add_pod("client");
        let own = merge([
            web_objects("web", WEB_VIP, vec![Endpoint::ready(BACKEND)]),
            web_objects("empty", empty_vip(), vec![]),
            web_objects("self", self_vip(), vec![Endpoint::ready(client.ip)]),
        ]);
        let own = own.to_yaml();
        lab.write_manifest_text(&format!("{own}{extra}"));
        let mut lb = lab.start_lbproxy_with(args);
        lb.expect_healthy(HEALTHY_WITHIN);
        let found = wait_for(Duration::from_secs(5), Duration::from_millis(20), || {
            let att = lab.tcx_attachments();
            let find = |dir: &str, name: &str| {
                att.iter()
                    .find(|a| {
                        a.ifname == client.host_if && a.direction == dir && a.prog_name == name
                    })
                    .map(|a| (a.ifindex, a.prog_id))
            };
            let on_uplink = |dir: &str, name: &str| {
                att.iter()
                    .find(|a| a.ifname == UPLINK_IF && a.direction == dir && a.prog_name == name)
                    .map(|a| (a.ifindex, a.prog_id))
            };
            match (
                find("ingress", "lb_from_pod"),
                find("egress", "lb_to_pod"),
                on_uplink("ingress", "lb_from_node"),
                on_uplink("egress", "lb_to_node"),
            ) {
                (Some((ifindex, from)), Some((_, to)), Some((up, fnode)), Some((_, tnode))) => {
                    Some((ifindex, from, to, (up, fnode, tnode)))
                }
                _ => None,
            }
        });
        let ((ifindex, from_pod, to_pod, uplink), _) = found.unwrap_or_else(|waited| {
            panic!(
                "lbproxy did not attach lb_from_pod (tcx ingress) and lb_to_pod (tcx egress) to \
                 {}, and lb_from_node and lb_to_node to {UPLINK_IF}, within {waited:?}; \
                 attachments: {:?}\n{}",
                client.host_if,
                lab.tcx_attachments(),
                lb.log()
            )
        });
        let rig = Rig {
            lb,
            lab,
            client,
            ifindex,
            from_pod,
            to_pod,
            uplink,
            counters: RefCell::new(BTreeMap::new()),
            own,
        };
        *rig.counters.borrow_mut() = rig.read_counters();
        assert!(
            rig.counters.borrow().values().all(|&n| n == 0),
            "fresh datapath, yet counters are not all zero: {:?}",
            rig.counters.borrow()
        );
        let events: Vec<String> = rig.lab.event_counts().into_keys().collect();
        assert_eq!(
            events, DATAPATH_EVENTS,
            "inspect events --json lists other events"
        );
        rig
    }

    /// Rewrites the manifest with `extra` in place of what [`Rig::with_extra`] was given,
    /// the rig's own services unchanged.
    pub(crate) fn rewrite_extra(&self, extra: &str) {
        self.lab
            .write_manifest_text(&format!("{}{extra}", self.own));
    }

    pub(crate) fn client_ip(&self) -> Ipv4Addr {
        self.client.ip
    }

    /// The drop counters by reason and, keyed `event:NAME`, the event counters.
    pub(crate) fn read_counters(&self) -> BTreeMap<String, u64> {
        let mut all = self.lab.drop_counts();
        let events = self.lab.event_counts().into_iter();
        all.extend(events.map(|(k, n)| (format!("{EVENT_KEY}{k}"), n)));
        all
    }

    /// Runs `prog` once on `frame` and reads how the counters moved.
    pub(crate) fn run(&self, what: &str, prog: Prog, frame: &[u8]) -> Outcome {
        self.run_marked(what, prog, frame, 0)
    }

    /// [`Rig::run`] of a packet that arrives with `skb->mark` = `mark`.
    pub(crate) fn run_marked(&self, what: &str, prog: Prog, frame: &[u8], mark: u32) -> Outcome {
        let (id, ifindex) = match prog {
            Prog::FromPod => (self.from_pod, self.ifindex),
            Prog::ToPod => (self.to_pod, self.ifindex),
            Prog::FromNode => (self.uplink.1, self.uplink.0),
            Prog::ToNode => (self.uplink.2, self.uplink.0),
        };
        let r = bpf::prog_test_run_marked(self.lab.node_ns(), id, ifindex, frame, mark)
            .unwrap_or_else(|e| {
                panic!(
                    "{what}: BPF_PROG_TEST_RUN of {} (prog id {id}) on {} bytes failed: {e}\n  {}",
                    prog.name(),
                    frame.len(),
                    hex(frame)
                )
            });
        let (drops, events) = self.take_all_deltas();
        Outcome {
            what: format!("{what} [{}]", prog.name()),
            input: frame.to_vec(),
            rc: r.retval,
            out: r.data,
            drops,
            events,
            mark: r.mark,
        }
    }

    /// Sends `frame` through the real veth so that `prog` sees it (from the pod's `eth0` for
    /// `lb_from_pod`, out of the host side for `lb_to_pod`, with an `AF_PACKET` socket), for
    /// frames `BPF_PROG_TEST_RUN` refuses to run. Returns the send's result and how the
    /// counters moved. A TC_ACT_SHOT at tcx egress makes the send itself fail with ENOBUFS
    /// (NET_XMIT_DROP); at the peer's ingress it is invisible to the sender.
    pub(crate) fn inject(&self, prog: Prog, frame: &[u8]) -> (Result<(), i32>, Drops) {
        let (ns, ifname) = match prog {
            Prog::FromPod => (self.client.netns.as_str(), "eth0"),
            Prog::ToPod => (self.lab.node_ns(), self.client.host_if.as_str()),
            Prog::FromNode => (self.lab.uplink_ns(), "eth0"),
            Prog::ToNode => (self.lab.node_ns(), UPLINK_IF),
        };
        let sent =
            run_in_ns(ns, || send_raw(ifname, frame)).map_err(|e| e.raw_os_error().unwrap_or(-1));
        // The counters move while the frame crosses the veth; wait for the first change,
        // then a little longer so a second count would show too.
        let before = self.counters.borrow().clone();
        let _ = wait_for(Duration::from_secs(2), Duration::from_millis(10), || {
            (self.read_counters() != before).then_some(())
        });
        std::thread::sleep(Duration::from_millis(100));
        (sent, self.take_deltas())
    }

    /// How the drop counters moved since they were last read. Panics unless the event
    /// counters moved exactly as the reasons that are events now.
    pub(crate) fn take_deltas(&self) -> Drops {
        let (drops, events) = self.take_all_deltas();
        assert_eq!(
            events,
            events_of(&drops),
            "the event counters did not move as their deprecated drop reasons (drops {drops:?})"
        );
        drops
    }

    /// How the drop counters and the event counters moved since they were last read.
    fn take_all_deltas(&self) -> (Drops, Drops) {
        let now = self.read_counters();
        let before = self.counters.replace(now.clone());
        let (mut drops, mut events) = (Drops::new(), Drops::new());
        for (k, &n) in &now {
            let was = before.get(k).copied().unwrap_or(0);
            let d = n
                .checked_sub(was)
                .unwrap_or_else(|| panic!("counter {k} went down: {was} -> {n}"));
            if d == 0 {
                continue;
            }
            match k.strip_prefix(EVENT_KEY) {
                Some(event) => events.insert(event.to_owned(), d),
                None => drops.insert(k.clone(), d),
            };
        }
        (drops, events)
    }

    /// Waits (up to 5 s: lbproxy copies the datapath's counters every 2 s) until
    /// `/metrics` has each `series` (name and labels, as exported) at its value.
    pub(crate) fn expect_metrics(&self, series: &[(&str, u64)]) {
        let addr = METRICS_ADDR.parse().unwrap();
        let read = || {
            let r = http_get_full(self.lab.node_ns(), addr, "/metrics", Duration::from_secs(2));
            let body = r.map(|r| r.body).unwrap_or_default();
            let value = |s: &str| {
                body.lines()
                    .find_map(|l| l.strip_prefix(s)?.strip_prefix(' ')?.trim().parse().ok())
            };
            series
                .iter()
                .map(|(s, _)| ((*s).to_owned(), value(s)))
                .collect::<Vec<(String, Option<u64>)>>()
        };
        let want: Vec<(String, Option<u64>)> = series
            .iter()
            .map(|(s, n)| ((*s).to_owned(), Some(*n)))
            .collect();
        let got = wait_for(Duration::from_secs(5), Duration::from_millis(200), || {
            let got = read();
            (got == want).then_some(())
        });
        assert!(got.is_ok(), "/metrics: got {:?}, want {want:?}", read());
    }

    /// The flows `lbproxy inspect flows --json` shows from `client_port` of the client.
    pub(crate) fn flows_from(&self, client_port: u16) -> Vec<FlowRow> {
        let client = format!("{}:{client_port}", self.client_ip());
        self.lab
            .inspect_flows()
            .into_iter()
            .filter(|f| f.client == client)
            .collect()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "rig: client {} on {} (ifindex {}), lb_from_pod prog {}, lb_to_pod prog {}, \
                 lbproxy pid {}",
                self.client.ip,
                self.client.host_if,
                self.ifindex,
                self.from_pod,
                self.to_pod,
                self.lb.pid()
            );
        }
    }
}

/// Sends one raw Ethernet frame out of interface `ifname` of the calling thread's namespace.
pub(crate) fn send_raw(ifname: &str, frame: &[u8]) -> std::io::Result<()> {
    let name = std::ffi::CString::new(ifname).expect("interface name");
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Protocol 0: this socket only sends.
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_ifindex = ifindex as i32;
    addr.sll_halen = 6;
    addr.sll_addr[..6].copy_from_slice(&frame[..6]);
    // SAFETY: `frame` and `addr` are valid for the lengths given.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&raw const addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    assert_eq!(n as usize, frame.len(), "AF_PACKET sent a partial frame");
    Ok(())
}
