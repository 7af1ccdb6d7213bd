//! `--lb-algorithm maglev` (issue 30 §2): a new flow's backend is entry `hash % M` of its
//! frontend's table (`LB_MAGLEV_V1`); where the table has no chunk for that entry, the jump
//! hash over the frontend's slots, which are always whole.

use lbproxy::bpf::PinnedMaps;
use lbproxy_common::{MAGLEV_CHUNK, MaglevChunk, MaglevKey};

use super::*;

/// A backend id no backend has.
const NO_SUCH_BACKEND: u32 = 0x7fff_fff0;

/// `web`'s TCP ClusterIP frontend's id.
fn web_tcp_svc_id(rig: &Rig) -> u32 {
    rig.lab
        .inspect_services()
        .iter()
        .find(|r| r.service == "default/web" && r.kind == "ClusterIP" && r.port == WEB_TCP)
        .map(|r| {
            assert_eq!(r.selection, "maglev", "{r:?}");
            r.svc_id
        })
        .expect("web's TCP ClusterIP row")
}

/// The table is what new flows read: written by the controller it sends a SYN to `web`'s
/// backend; overwritten by hand with an id no backend has, a SYN is dropped as
/// `backend_missing` (the slots alone would have translated it); with the chunk gone, the
/// slots take over and it is translated again.
#[test]
fn new_flows_read_the_maglev_table_and_fall_back_to_the_slots() {
    let rig = Rig::with_args(
        "",
        &["--lb-algorithm", "maglev", "--maglev-table-size", "251"],
    );
    let c = rig.client_ip();
    let svc_id = web_tcp_svc_id(&rig);
    let key = MaglevKey { svc_id, chunk: 0 };
    let mut maps = PinnedMaps::open(rig.lab.bpffs_dir()).expect("opening the rig's pinned maps");
    let table = maps.maglev.as_mut().expect("LB_MAGLEV_V1 pinned");
    let written = table.get(&key, 0).expect("web's table, chunk 0");
    assert!(
        written.backend_ids[..251].iter().all(|id| *id != 0)
            && written.backend_ids[251..].iter().all(|id| *id == 0),
        "251 entries, each a backend id, then zeros"
    );

    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40201, WEB_TCP));
    rig.run("SYN, the controller's table", Prog::FromPod, &syn.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
            &[],
        );

    let bogus = MaglevChunk {
        backend_ids: [NO_SUCH_BACKEND; MAGLEV_CHUNK as usize],
    };
    table.insert(key, bogus, 0).expect("overwriting chunk 0");
    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40202, WEB_TCP));
    rig.run(
        "SYN, every entry a missing backend",
        Prog::FromPod,
        &syn.bytes(),
    )
    .expect_untouched(TC_ACT_SHOT, &[("backend_missing", 1)]);

    table.remove(&key).expect("deleting chunk 0");
    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40203, WEB_TCP));
    rig.run("SYN, no chunk: the slots", Prog::FromPod, &syn.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
            &[],
        );
}
