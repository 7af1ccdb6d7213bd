//! `lbproxy monitor`: a live stream of the datapath's drops and rejects, with their reason,
//! 5-tuple, interface and service, read from the `LB_EVENTS_V1` ring buffer.
//!
//! The datapath sends events only while a monitor listens: this command moves
//! `LB_MONCTL_V1`'s deadline [`LEASE`] ahead every [`RENEW`], so when it stops (or is killed)
//! the events stop within [`LEASE`]. Several monitors may listen at once; each event goes to
//! one of them (a ring buffer has one reader position).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd as _;
use std::path::Path;
use std::time::{Duration, Instant};

use aya::maps::{Array, Map, MapData, RingBuf};
use lbproxy_common::{
    DropReason, FlowDir, FlowKeyOf, Hook, IpFamily, MonitorCtl, MonitorEvent, Scope, ServiceKeyOf,
    Verdict, map_names,
};
use serde::Serialize;

use crate::bpf::flow_gc::monotonic_ns;
use crate::bpf::{PinnedMaps, label_str, open_pinned};
use crate::model::Protocol;

/// How far ahead of now each renewal moves the deadline.
pub const LEASE: Duration = Duration::from_secs(3);
/// How often the deadline is renewed.
const RENEW: Duration = Duration::from_secs(1);

/// What to show, and for how long.
pub struct Options {
    pub json: bool,
    /// Only events of these reasons (labels, as in `inspect drops`); empty: all.
    pub reasons: Vec<String>,
    /// Only events of this service (`--service`, matched as `inspect` matches it).
    pub filter: crate::cli::inspect::Filter,
    /// Stop after this many events were printed.
    pub count: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Events per CPU per second the datapath may send.
    pub rate: u32,
}

/// One event as printed.
#[derive(Serialize, Debug)]
pub struct EventRow {
    /// RFC 3339, from the event's monotonic timestamp.
    pub time: String,
    /// `drop` or `reject`.
    pub verdict: &'static str,
    pub reason: String,
    /// `from_pod`, `to_pod`, `from_node` or `to_node`: the program that gave the verdict.
    pub hook: &'static str,
    pub interface: String,
    pub protocol: String,
    pub src: String,
    pub dst: String,
    /// The service the packet was for (or whose flow it belongs to); empty when none.
    pub service: String,
    pub len: u32,
    /// Events the same CPU left out just before this one, because of the rate cap.
    pub suppressed: u32,
}

pub fn run(dir: &Path, opts: &Options) -> anyhow::Result<()> {
    if !dir.exists() {
        anyhow::bail!(
            "{} does not exist: lbproxy has not run with this --bpffs-dir (or was cleaned up)",
            dir.display()
        );
    }
    if let Some(bad) = opts
        .reasons
        .iter()
        .find(|r| !DropReason::ALL.iter().any(|d| d.label() == r.as_str()))
    {
        let known: Vec<&str> = DropReason::ALL.iter().map(|d| d.label()).collect();
        anyhow::bail!(
            "--reason {bad}: no such reason; known: {}",
            known.join(", ")
        );
    }
    if opts.rate == 0 {
        anyhow::bail!("--rate 0 would send nothing; give at least 1 event per CPU per second");
    }
    let maps = PinnedMaps::open(dir)?;
    let mut ctl: Array<MapData, MonitorCtl> = open_pinned(dir, map_names::MONITOR_CTL, Map::Array)
        .map_err(|e| {
            anyhow::anyhow!(
                "{e}; the running lbproxy predates `monitor` (restart it with this version)"
            )
        })?;
    let mut ring: RingBuf<MapData> = open_pinned(dir, map_names::EVENTS, Map::RingBuf)?;
    let started = Instant::now();
    let mut printed = 0u64;
    let mut renewed: Option<Instant> = None;
    let mut resolver = Resolver::default();
    loop {
        if renewed.is_none_or(|t| t.elapsed() >= RENEW) {
            let until = monotonic_ns() + LEASE.as_nanos() as u64;
            ctl.set(
                0,
                MonitorCtl {
                    until_ns: until,
                    per_cpu_per_sec: opts.rate,
                    _pad: 0,
                },
                0,
            )?;
            if renewed.is_none() {
                // Once the datapath sends, on stderr: out of the JSON stream, and it says
                // when listening began.
                eprintln!(
                    "listening for drops and rejects (at most {} events per CPU per second); Ctrl-C to stop",
                    opts.rate
                );
            }
            renewed = Some(Instant::now());
        }
        while let Some(item) = ring.next() {
            let Some(ev) = parse_event(&item) else {
                continue;
            };
            let row = resolver.row(&maps, &ev);
            if !wanted(opts, &row) {
                continue;
            }
            if opts.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!("{}", line(&row));
            }
            printed += 1;
            if opts.count.is_some_and(|n| printed >= n) {
                return Ok(());
            }
        }
        if opts.duration.is_some_and(|d| started.elapsed() >= d) {
            return Ok(());
        }
        wait_readable(ring.as_raw_fd(), Duration::from_millis(250));
    }
}

fn wanted(opts: &Options, row: &EventRow) -> bool {
    (opts.reasons.is_empty() || opts.reasons.contains(&row.reason))
        && opts.filter.service_ok(&row.service)
}

/// Waits until the ring buffer has data, or `timeout`.
fn wait_readable(fd: i32, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; an error or a signal only ends the wait early.
    unsafe { libc::poll(&raw mut pfd, 1, timeout.as_millis() as i32) };
}

fn parse_event(bytes: &[u8]) -> Option<MonitorEvent> {
    if bytes.len() < size_of::<MonitorEvent>() {
        return None;
    }
    // SAFETY: MonitorEvent is plain old data (integers and byte arrays) and the slice holds
    // at least its size; read unaligned.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<MonitorEvent>()) })
}

/// One event as a line of text.
pub fn line(r: &EventRow) -> String {
    let svc = if r.service.is_empty() {
        String::new()
    } else {
        format!(" service {}", r.service)
    };
    let sup = if r.suppressed > 0 {
        format!(" ({} suppressed before)", r.suppressed)
    } else {
        String::new()
    };
    format!(
        "{} {:<6} {} {}@{} {} {} -> {}{} len {}{}",
        r.time,
        r.verdict.to_uppercase(),
        r.reason,
        r.hook,
        r.interface,
        r.protocol,
        r.src,
        r.dst,
        svc,
        r.len,
        sup
    )
}

/// Names interfaces and services, remembering what it looked up.
#[derive(Default)]
struct Resolver {
    ifnames: BTreeMap<u32, String>,
}

impl Resolver {
    fn row(&mut self, maps: &PinnedMaps, ev: &MonitorEvent) -> EventRow {
        let ip = |a: &[u8; 16]| -> Option<IpAddr> {
            match IpFamily::try_from(ev.family).ok()? {
                IpFamily::V4 => Some(IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))),
                IpFamily::V6 => Some(IpAddr::V6(Ipv6Addr::from(*a))),
            }
        };
        let ports = ev.src_port_be != 0 || ev.dst_port_be != 0;
        let endpoint = |a: Option<IpAddr>, port_be: u16| match (a, ports) {
            (None, _) => "-".to_string(),
            (Some(IpAddr::V6(a)), true) => format!("[{a}]:{}", u16::from_be(port_be)),
            (Some(a), true) => format!("{a}:{}", u16::from_be(port_be)),
            (Some(a), false) => a.to_string(),
        };
        let (src, dst) = (ip(&ev.src_addr), ip(&ev.dst_addr));
        let reason = DropReason::ALL
            .iter()
            .find(|d| **d as u32 == ev.reason)
            .map_or_else(
                || format!("reason_{}", ev.reason),
                |d| d.label().to_string(),
            );
        EventRow {
            time: wall_time(ev.ts_ns),
            verdict: match Verdict::try_from(ev.verdict) {
                Ok(Verdict::Reject) => "reject",
                Ok(Verdict::Drop) | Err(_) => "drop",
            },
            reason,
            hook: Hook::try_from(ev.hook).map_or("?", Hook::label),
            interface: self.ifname(ev.ifindex),
            protocol: Protocol::from_number(ev.proto)
                .map_or_else(|| format!("proto_{}", ev.proto), |p| p.as_str().to_string()),
            src: endpoint(src, ev.src_port_be),
            dst: endpoint(dst, ev.dst_port_be),
            service: service_of(maps, ev),
            len: ev.len,
            suppressed: ev.suppressed,
        }
    }

    fn ifname(&mut self, ifindex: u32) -> String {
        self.ifnames
            .entry(ifindex)
            .or_insert_with(|| {
                let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
                // SAFETY: the buffer has IF_NAMESIZE bytes, as if_indextoname requires.
                let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
                if p.is_null() {
                    format!("if{ifindex}")
                } else {
                    // SAFETY: if_indextoname wrote a NUL-terminated name into buf.
                    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                }
            })
            .clone()
    }
}

/// The service an event is about: the frontend it was addressed to, else the flow it
/// belongs to (a reply, or a packet of a flow whose backend left). Looked up in the maps of
/// the event's family.
fn service_of(maps: &PinnedMaps, ev: &MonitorEvent) -> String {
    let svc_id = if ev.family == u8::from(IpFamily::V4) {
        let v4 = |a: &[u8; 16]| [a[0], a[1], a[2], a[3]];
        svc_id_of(
            ev,
            (v4(&ev.src_addr), v4(&ev.dst_addr)),
            [0; 4],
            |k| maps.services.get(k, 0).ok().map(|v| v.svc_id),
            |k| maps.flows.get(k, 0).ok().map(|v| v.svc_id),
        )
    } else if ev.family == u8::from(IpFamily::V6) {
        svc_id_of(
            ev,
            (ev.src_addr, ev.dst_addr),
            [0; 16],
            |k| maps.services6.get(k, 0).ok().map(|v| v.svc_id),
            |k| maps.flows6.get(k, 0).ok().map(|v| v.svc_id),
        )
    } else {
        None
    };
    svc_id
        .and_then(|id| maps.labels.get(&id, 0).ok())
        .map(|l| label_str(&l))
        .unwrap_or_default()
}

/// [`service_of`]'s lookups in one family: the exact frontend, the NodePort one (keyed by
/// port alone, at the family's unspecified address `any`), then either half of a flow.
fn svc_id_of<A: Copy>(
    ev: &MonitorEvent,
    (src, dst): (A, A),
    any: A,
    service: impl Fn(&ServiceKeyOf<A>) -> Option<u32>,
    flow: impl Fn(&FlowKeyOf<A>) -> Option<u32>,
) -> Option<u32> {
    let frontend = ServiceKeyOf {
        addr: dst,
        port_be: ev.dst_port_be,
        proto: ev.proto,
        scope: Scope::Default.into(),
    };
    let nodeport = ServiceKeyOf {
        addr: any,
        ..frontend
    };
    [frontend, nodeport].iter().find_map(&service).or_else(|| {
        [FlowDir::Forward, FlowDir::Reply].iter().find_map(|&dir| {
            flow(&FlowKeyOf {
                src_addr: src,
                dst_addr: dst,
                src_port_be: ev.src_port_be,
                dst_port_be: ev.dst_port_be,
                proto: ev.proto,
                dir: dir.into(),
                _pad: [0; 2],
            })
        })
    })
}

/// A `CLOCK_MONOTONIC` time as wall-clock RFC 3339.
fn wall_time(mono_ns: u64) -> String {
    let ago = monotonic_ns().saturating_sub(mono_ns);
    let t = jiff::Timestamp::now() - jiff::SignedDuration::from_nanos(ago as i64);
    t.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}
