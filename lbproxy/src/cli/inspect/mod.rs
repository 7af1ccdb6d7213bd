//! `lbproxy inspect`: reads the pinned maps, whether `run` is running or not, and prints an
//! aligned table for people or JSON (or YAML) for scripts. One module per view; the row
//! types each prints with `--json` are public here, their field names being the JSON keys,
//! and gathered in [`rows`].

pub mod affinity;
pub mod backends;
pub mod delivery;
pub mod drops;
pub mod flows;
pub mod services;
pub mod snat;
pub mod sockets;
pub mod status;
pub mod top;

use std::path::Path;

use serde::Serialize;

/// The types `inspect VIEW --json` (and `-o yaml`) prints, one per view, for programs that
/// read it: each is `Deserialize` too, its field names being the JSON keys. `inspect drops`
/// prints a map of packets by reason (`BTreeMap<String, u64>`).
pub mod rows {
    pub use super::affinity::AffinityRow;
    pub use super::backends::BackendRow;
    pub use super::delivery::{Delivery, RedirectInterface};
    pub use super::flows::FlowRow;
    pub use super::services::ServiceRow;
    pub use super::snat::SnatRow;
    pub use super::sockets::Sockets;
    pub use super::status::{InterfaceRow, MapFill, Status};
    pub use super::top::{TopClient, TopService};
}

pub use affinity::{AffinityRow, affinity_rows};
pub use backends::{BackendRow, backends};
pub use flows::{FlowEnds, FlowRow, flows};
pub use services::{ServiceRow, services};
pub use snat::{SnatRow, snat};
pub use status::{InterfaceRow, MapFill, Status};
pub use top::{Top, TopBy};

use crate::bpf::PinnedMaps;

fn split_label(label: &str) -> (String, String) {
    match label.rsplit_once(':') {
        Some((svc, port)) => (svc.to_string(), port.to_string()),
        None => (label.to_string(), String::new()),
    }
}

/// Prints rows as an aligned table.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let columns = rows
        .iter()
        .map(Vec::len)
        .chain([headers.len()])
        .max()
        .unwrap_or(0);
    let mut widths: Vec<usize> = vec![0; columns];
    for (i, h) in headers.iter().enumerate() {
        widths[i] = h.len();
    }
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(headers.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum What {
    Services,
    Backends,
    Flows,
    /// The datapath's drop (and reject) counters by reason, then its events.
    Drops,
    /// What the datapath did that is not a drop (a TCP segment without a flow, a flow half
    /// recreated, a later fragment without its first, ...), by event.
    Events,
    /// The stack bypass: whether it is on, the interfaces it redirects into, and how
    /// translated packets were delivered.
    Delivery,
    /// Source NAT's port space: the destinations with the most ports in use.
    Snat,
    /// Socket-level load balancing: its hooks, scope, and what they did.
    Sockets,
    /// Session affinity: each client's backend per service, and when it expires.
    Affinity,
    /// The controller's last sync (from its /healthz), the attached interfaces and how full
    /// each map is.
    Status,
}

/// How `inspect` prints: an aligned table for people, JSON or YAML for scripts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    #[default]
    Table,
    Json,
    Yaml,
}

impl Output {
    pub(crate) fn machine(self) -> bool {
        self != Output::Table
    }

    /// `v` as JSON (pretty) or YAML, ending in a newline.
    pub(crate) fn encode<T: Serialize>(self, v: &T) -> anyhow::Result<String> {
        Ok(match self {
            Output::Yaml => serde_saphyr::to_string(v)?,
            _ => format!("{}\n", serde_json::to_string_pretty(v)?),
        })
    }
}

/// `lbproxy inspect`: prints `what` once, or with `watch` every `watch` seconds (the screen
/// cleared between) until interrupted. `top` (`--top`) counts `flows` instead of listing
/// them.
pub fn run(
    dir: &Path,
    what: What,
    out: Output,
    filter: &Filter,
    top: Option<Top>,
    healthz: &str,
    watch: Option<f64>,
) -> anyhow::Result<()> {
    if top.is_some() && !matches!(what, What::Flows) {
        anyhow::bail!("--top counts flows: it goes with `inspect flows` only");
    }
    let Some(every) = watch else {
        print!("{}", render(dir, what, out, filter, top, healthz)?);
        return Ok(());
    };
    let every = std::time::Duration::try_from_secs_f64(every)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("--watch {every}: give a positive number of seconds"))?;
    loop {
        let text = render(dir, what, out, filter, top, healthz)?;
        if out == Output::Table {
            // Clear the screen and home the cursor, as watch(1) does.
            print!("\x1b[2J\x1b[H");
            println!(
                "every {:.1}s: lbproxy inspect {what:?}    {}",
                every.as_secs_f64(),
                jiff::Timestamp::now().strftime("%H:%M:%S")
            );
        }
        print!("{text}");
        use std::io::Write as _;
        std::io::stdout().flush()?;
        std::thread::sleep(every);
    }
}

/// `--service` and `--backend`.
#[derive(Default)]
pub struct Filter {
    pub service: Option<String>,
    pub backend: Option<String>,
}

impl Filter {
    /// Whether service label `label` (`namespace/name:port-name`) is the one asked for: the
    /// same label, or its `namespace/name` (every port).
    pub fn service_ok(&self, label: &str) -> bool {
        self.service.as_deref().is_none_or(|want| {
            label == want || label.split_once(':').is_some_and(|(svc, _)| svc == want)
        })
    }

    /// [`Filter::backend_ok`] of an `addr:port` string.
    fn backend_addr_ok(&self, backend: &str) -> bool {
        let (addr, port) = backend.rsplit_once(':').unwrap_or((backend, "0"));
        self.backend_ok(addr, port.parse().unwrap_or(0))
    }

    /// Whether backend `addr`, `port` is the one asked for: the address alone, or with the
    /// port (`addr:port`, an IPv6 address in brackets).
    pub fn backend_ok(&self, addr: &str, port: u16) -> bool {
        self.backend.as_deref().is_none_or(|want| {
            want == addr || want == format!("{addr}:{port}") || want == format!("[{addr}]:{port}")
        })
    }
}

/// The text of `what`, read from the maps pinned under `dir` (`flows` counted by `top`
/// when given).
pub fn render(
    dir: &Path,
    what: What,
    out: Output,
    filter: &Filter,
    top: Option<Top>,
    healthz: &str,
) -> anyhow::Result<String> {
    if !dir.exists() {
        anyhow::bail!(
            "{} does not exist: lbproxy has not run with this --bpffs-dir (or was cleaned up)",
            dir.display()
        );
    }
    let maps = PinnedMaps::open(dir)?;
    match what {
        What::Services => services::render(&maps, out, filter),
        What::Backends => backends::render(&maps, out, filter),
        What::Flows => match top {
            Some(t) => top::render(&maps, out, filter, t),
            None => flows::render(&maps, out, filter),
        },
        What::Drops => drops::render(&maps, out),
        What::Events => drops::render_events(&maps, out),
        What::Delivery => delivery::render(&maps, out),
        What::Sockets => sockets::render(&maps, dir, out),
        What::Affinity => affinity::render(&maps, out, filter),
        What::Status => status::render(&maps, dir, out, healthz),
        What::Snat => snat::render(&maps, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &["A", "BB"],
            &[
                vec!["long-cell".into(), "x".into()],
                vec!["s".into(), "y".into()],
            ],
        );
        assert_eq!(t, "A          BB\nlong-cell  x\ns          y\n");
    }

    #[test]
    fn filters_match_service_with_or_without_port_and_backend_with_or_without_port() {
        let f = Filter {
            service: Some("ns/a".into()),
            backend: Some("198.18.0.2".into()),
        };
        assert!(f.service_ok("ns/a") && f.service_ok("ns/a:http") && !f.service_ok("ns/ab:http"));
        assert!(f.backend_ok("198.18.0.2", 80) && !f.backend_ok("198.18.0.20", 80));
        let f = Filter {
            service: Some("ns/a:dns".into()),
            backend: Some("198.18.0.2:53".into()),
        };
        assert!(f.service_ok("ns/a:dns") && !f.service_ok("ns/a:http"));
        assert!(f.backend_ok("198.18.0.2", 53) && !f.backend_ok("198.18.0.2", 80));
    }

    #[test]
    fn a_row_longer_than_the_headers_does_not_panic() {
        let t = table(&["A"], &[vec!["x".into(), "y".into()]]);
        assert_eq!(t, "A\nx  y\n");
    }

    /// `delivery` and `sockets` printed `json!` objects before they had types: their keys
    /// came out sorted, and still do.
    #[test]
    fn delivery_and_sockets_keep_their_json_key_order() {
        let d = rows::Delivery {
            packets: [("redirect_hairpin".to_string(), 2)].into(),
            redirect_interfaces: vec![rows::RedirectInterface {
                ifindex: 7,
                kind: "veth".into(),
            }],
            stack_bypass: true,
        };
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            r#"{"packets":{"redirect_hairpin":2},"redirect_interfaces":[{"ifindex":7,"kind":"veth"}],"stack_bypass":true}"#
        );
        let s = rows::Sockets {
            events: [("other_netns".to_string(), 4)].into(),
            hooks: vec!["connect4".into()],
            mode: "host".into(),
            netns_cookie: 9,
            translated_sockets: 1,
        };
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            r#"{"events":{"other_netns":4},"hooks":["connect4"],"mode":"host","netns_cookie":9,"translated_sockets":1}"#
        );
    }

    /// A row read back from its JSON prints the same JSON, optional fields left out or not.
    #[test]
    fn rows_read_back_what_they_print() {
        fn again<T: Serialize + serde::de::DeserializeOwned>(v: &T) {
            let text = serde_json::to_string(v).unwrap();
            let back: T = serde_json::from_str(&text).unwrap();
            assert_eq!(serde_json::to_string(&back).unwrap(), text);
        }
        let b = rows::BackendRow {
            id: 3,
            addr: "198.18.0.2".into(),
            port: 80,
            protocol: "TCP".into(),
            state: None,
            flows: None,
        };
        again(&b);
        again(&rows::BackendRow {
            state: Some("draining".into()),
            flows: Some(1),
            ..b
        });
    }

    #[test]
    fn labels_split_into_service_and_port() {
        assert_eq!(split_label("ns/a:http"), ("ns/a".into(), "http".into()));
        assert_eq!(split_label("ns/a"), ("ns/a".into(), String::new()));
    }
}
