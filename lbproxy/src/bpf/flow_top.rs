//! Who fills the flow table: flows counted by Service and by client, each flow once (its
//! forward half), the largest first. `lbproxy inspect flows --top` prints them; the flow
//! collector ([`super::flow_gc`]) counts them on the walk it makes anyway, and when a flow
//! table or a destination's SNAT port space passes [`WARN_AT`] of its capacity, the
//! controller names the top ones in its log and in a Node Event ([`Pressure`]).
//!
//! Clients are named by address: nothing in the pinned maps names the pod behind one.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// A table (or a destination's SNAT port space) is reported past this fraction of its
/// capacity...
pub const WARN_AT: f64 = 0.8;
/// ...once per crossing: the report is armed again only after its fill went below this...
pub const REARM_BELOW: f64 = 0.7;
/// ...and at most once per this long, however often it crosses.
pub const MIN_INTERVAL: Duration = Duration::from_secs(300);
/// How many services and clients a log line or Event names.
pub const NAMED: usize = 5;

/// Flows counted by service id and by client address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowTally {
    pub flows: u64,
    pub by_service: HashMap<u32, u64>,
    pub by_client: HashMap<IpAddr, u64>,
}

impl FlowTally {
    /// One flow of service `svc_id` from `client`.
    pub fn add(&mut self, svc_id: u32, client: IpAddr) {
        self.flows += 1;
        *self.by_service.entry(svc_id).or_default() += 1;
        *self.by_client.entry(client).or_default() += 1;
    }

    /// The Services (`namespace/name`, every port of one together) by flows, largest first;
    /// `label` names a service id by its label (`namespace/name:port-name`), or `None`.
    pub fn services(&self, label: impl Fn(u32) -> Option<String>) -> Vec<(String, u64)> {
        let mut by_name: BTreeMap<String, u64> = BTreeMap::new();
        for (&id, &n) in &self.by_service {
            let name = label(id).map_or_else(|| unlabelled(id), |l| service_of(&l).to_string());
            *by_name.entry(name).or_default() += n;
        }
        rank(by_name)
    }

    /// The clients by flows, largest first.
    pub fn clients(&self) -> Vec<(IpAddr, u64)> {
        rank(self.by_client.iter().map(|(a, n)| (*a, *n)))
    }
}

/// The Service of a label: `namespace/name` of `namespace/name:port-name`.
pub fn service_of(label: &str) -> &str {
    label.split_once(':').map_or(label, |(svc, _)| svc)
}

/// How a flow whose service id has no label (its Service is gone) is named.
pub fn unlabelled(id: u32) -> String {
    format!("(unlabelled service id {id})")
}

/// Counts, largest first; equal counts by key, smallest first, so the order is stable.
pub fn rank<K: Ord>(counts: impl IntoIterator<Item = (K, u64)>) -> Vec<(K, u64)> {
    let mut v: Vec<(K, u64)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}

/// `n` with a comma every three digits: 54,321.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `a 3, b 2, c 1`: the first `NAMED`, then how many more there are.
fn named<K: std::fmt::Display>(list: &[(K, u64)]) -> String {
    let mut parts: Vec<String> = list
        .iter()
        .take(NAMED)
        .map(|(k, n)| format!("{k} {}", thousands(*n)))
        .collect();
    if list.len() > NAMED {
        parts.push(format!("and {} more", list.len() - NAMED));
    }
    if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join(", ")
    }
}

/// `top services ...; top clients ...` of `tally`.
fn tops(tally: &FlowTally, label: &dyn Fn(u32) -> Option<String>) -> String {
    format!(
        "top services {}; top clients {}",
        named(&tally.services(label)),
        named(&tally.clients())
    )
}

/// The busiest destination of source-NATed flows, as the collector saw it: its SNAT
/// address, backend and protocol, the ports in use towards it, and its flows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnatDest {
    pub snat: IpAddr,
    pub backend: SocketAddr,
    pub proto: u8,
    pub ports: usize,
    pub tally: FlowTally,
}

/// One flow table's fill as one collection saw it.
pub struct TableFill<'a> {
    /// `IPv4` or `IPv6`.
    pub family: &'a str,
    /// Entries (halves) in the table when the collection read it.
    pub entries: usize,
    pub capacity: u32,
    /// Entries the collection then removed as expired.
    pub deleted: usize,
    pub tally: &'a FlowTally,
    pub snat: Option<&'a SnatDest>,
}

/// A report to make: the Event's reason and the note (the log line says the same).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    pub reason: &'static str,
    pub note: String,
}

/// Once per crossing of [`WARN_AT`], re-armed below [`REARM_BELOW`], at most once per
/// [`MIN_INTERVAL`]: a fill that stays high is reported once, not every collection.
#[derive(Clone, Copy, Debug)]
pub struct Gate {
    armed: bool,
    last: Option<Instant>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            armed: true,
            last: None,
        }
    }
}

impl Gate {
    /// Whether a fill of `fraction` at `now` is to be reported.
    pub fn check(&mut self, fraction: f64, now: Instant) -> bool {
        if fraction < REARM_BELOW {
            self.armed = true;
            return false;
        }
        let rested = self
            .last
            .is_none_or(|t| now.saturating_duration_since(t) >= MIN_INTERVAL);
        if fraction > WARN_AT && self.armed && rested {
            self.armed = false;
            self.last = Some(now);
            return true;
        }
        false
    }
}

/// The flow collector's reports of full tables, one [`Gate`] per flow table and one per
/// family's SNAT port space.
#[derive(Debug, Default)]
pub struct Pressure {
    tables: BTreeMap<String, Gate>,
    snat: BTreeMap<String, Gate>,
}

impl Pressure {
    /// What to report of one collection: a table past [`WARN_AT`] of its capacity, and the
    /// busiest SNAT destination past [`WARN_AT`] of `snat_range` ports. `label` names a
    /// service id, read only when there is something to report.
    pub fn check(
        &mut self,
        now: Instant,
        tables: &[TableFill<'_>],
        snat_range: u32,
        label: &dyn Fn() -> BTreeMap<u32, String>,
    ) -> Vec<Warning> {
        let mut out = Vec::new();
        let mut labels: Option<BTreeMap<u32, String>> = None;
        for t in tables {
            let fraction = t.entries as f64 / f64::from(t.capacity.max(1));
            if self
                .tables
                .entry(t.family.to_string())
                .or_default()
                .check(fraction, now)
            {
                let l = labels.get_or_insert_with(label);
                let note = format!(
                    "{} flow table {:.0}% full ({} of {} entries, {} flows; the collector then \
                     removed {} expired): {}",
                    t.family,
                    fraction * 100.0,
                    thousands(t.entries as u64),
                    thousands(u64::from(t.capacity)),
                    thousands(t.tally.flows),
                    thousands(t.deleted as u64),
                    tops(t.tally, &|id| l.get(&id).cloned()),
                );
                out.push(Warning {
                    reason: "FlowTableFilling",
                    note,
                });
            }
            let Some(s) = t.snat else { continue };
            let fraction = s.ports as f64 / f64::from(snat_range.max(1));
            if self
                .snat
                .entry(t.family.to_string())
                .or_default()
                .check(fraction, now)
            {
                let l = labels.get_or_insert_with(label);
                let proto = crate::model::Protocol::from_number(s.proto)
                    .map_or("?", crate::model::Protocol::as_str);
                let note = format!(
                    "SNAT port space {:.0}% used towards {}/{proto} from {} ({} of {} ports): {}",
                    fraction * 100.0,
                    s.backend,
                    s.snat,
                    thousands(s.ports as u64),
                    thousands(u64::from(snat_range)),
                    tops(&s.tally, &|id| l.get(&id).cloned()),
                );
                out.push(Warning {
                    reason: "SnatPortsFilling",
                    note,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn labels() -> BTreeMap<u32, String> {
        [
            (1, "default/web:http".to_string()),
            (2, "default/web:dns".to_string()),
            (3, "default/api:http".to_string()),
            (4, "default/db".to_string()),
        ]
        .into()
    }

    /// A tally of `(svc_id, client, flows)`.
    fn tally(list: &[(u32, &str, u64)]) -> FlowTally {
        let mut t = FlowTally::default();
        for (svc, client, n) in list {
            for _ in 0..*n {
                t.add(*svc, ip(client));
            }
        }
        t
    }

    #[test]
    fn services_add_up_their_ports_and_rank_largest_first_ties_by_name() {
        let l = labels();
        let t = tally(&[
            (1, "10.0.0.2", 3),
            (2, "10.0.0.2", 2), // web: 5 over two ports
            (3, "10.0.0.3", 5), // api: 5, a tie with web: by name
            (4, "fd00::3", 7),  // db, over IPv6: first
            (9, "10.0.0.3", 1), // no label
        ]);
        assert_eq!(t.flows, 18);
        assert_eq!(
            t.services(|id| l.get(&id).cloned()),
            vec![
                ("default/db".to_string(), 7),
                ("default/api".to_string(), 5),
                ("default/web".to_string(), 5),
                ("(unlabelled service id 9)".to_string(), 1),
            ]
        );
    }

    #[test]
    fn clients_of_both_families_rank_largest_first_ties_by_address() {
        let t = tally(&[
            (1, "10.0.0.3", 2),
            (1, "10.0.0.2", 2),
            (3, "fd00::2", 4),
            (3, "10.0.0.10", 1),
        ]);
        assert_eq!(
            t.clients(),
            vec![
                (IpAddr::from("fd00::2".parse::<Ipv6Addr>().unwrap()), 4),
                (ip("10.0.0.2"), 2),
                (ip("10.0.0.3"), 2),
                (ip("10.0.0.10"), 1),
            ]
        );
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(65_536), "65,536");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn a_gate_reports_once_per_crossing_and_at_most_once_per_interval() {
        let t0 = Instant::now();
        let mut g = Gate::default();
        assert!(!g.check(0.79, t0), "under 80%");
        assert!(g.check(0.81, t0), "the crossing");
        assert!(
            !g.check(0.95, t0 + Duration::from_secs(10)),
            "still high: once"
        );
        assert!(
            !g.check(0.75, t0 + Duration::from_secs(20)),
            "not re-armed above 70%"
        );
        assert!(
            !g.check(0.85, t0 + Duration::from_secs(30)),
            "no new crossing"
        );
        assert!(!g.check(0.5, t0 + Duration::from_secs(40)), "re-armed");
        // A new crossing within MIN_INTERVAL waits, armed, until the interval is over.
        assert!(!g.check(0.85, t0 + Duration::from_secs(50)));
        assert!(g.check(0.85, t0 + MIN_INTERVAL));
        assert!(!g.check(0.85, t0 + MIN_INTERVAL * 3), "once per crossing");
    }

    #[test]
    fn the_warning_names_the_top_services_and_clients() {
        let t = tally(&[
            (1, "10.0.1.5", 300),
            (3, "10.0.1.6", 120),
            (3, "10.0.1.5", 2),
        ]);
        let mut p = Pressure::default();
        let read = std::cell::Cell::new(0);
        let label = || {
            read.set(read.get() + 1);
            labels()
        };
        let fill = |entries| TableFill {
            family: "IPv4",
            entries,
            capacity: 1024,
            deleted: 3,
            tally: &t,
            snat: None,
        };
        let now = Instant::now();
        assert!(p.check(now, &[fill(800)], 100, &label).is_empty());
        assert_eq!(read.get(), 0, "labels are read only to report");
        let w = p.check(now, &[fill(850)], 100, &label);
        assert_eq!(
            w,
            vec![Warning {
                reason: "FlowTableFilling",
                note: "IPv4 flow table 83% full (850 of 1,024 entries, 422 flows; the \
                       collector then removed 3 expired): top services default/web 300, \
                       default/api 122; top clients 10.0.1.5 302, 10.0.1.6 120"
                    .to_string()
            }]
        );
        assert!(p.check(now, &[fill(900)], 100, &label).is_empty());
    }

    #[test]
    fn the_snat_warning_names_the_destination_and_its_flows() {
        let empty = FlowTally::default();
        let s = SnatDest {
            snat: ip("192.0.2.1"),
            backend: "10.0.2.7:8080".parse().unwrap(),
            proto: lbproxy_common::IPPROTO_TCP,
            ports: 90,
            tally: tally(&[(1, "203.0.113.9", 60), (3, "203.0.113.8", 30)]),
        };
        let fill = TableFill {
            family: "IPv4",
            entries: 10,
            capacity: 1024,
            deleted: 0,
            tally: &empty,
            snat: Some(&s),
        };
        let w = Pressure::default().check(Instant::now(), &[fill], 100, &labels);
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(w[0].reason, "SnatPortsFilling");
        assert_eq!(
            w[0].note,
            "SNAT port space 90% used towards 10.0.2.7:8080/TCP from 192.0.2.1 (90 of 100 \
             ports): top services default/web 60, default/api 30; top clients 203.0.113.9 60, \
             203.0.113.8 30"
        );
    }

    #[test]
    fn the_list_says_how_many_more_there_are() {
        let list: Vec<(String, u64)> = (0..7).map(|i| (format!("s{i}"), 7 - i)).collect();
        assert_eq!(named(&list), "s0 7, s1 6, s2 5, s3 4, s4 3, and 2 more");
        assert_eq!(named::<String>(&[]), "none");
    }
}
