//! The writes the programmer makes, as a trait: [`crate::bpf::PinnedMaps`] is the real one,
//! [`mem::MemMaps`] the in-memory one tests drive the programmer and controller with.

use lbproxy_common::{Backend, ServiceKey, ServiceValue, SlotKey};

/// A map write that failed, naming the map and the entry.
#[derive(Debug, thiserror::Error)]
#[error("{map}: {op} {entry}: {reason}")]
pub struct MapWriteError {
    pub map: &'static str,
    pub op: &'static str,
    pub entry: String,
    pub reason: String,
}

/// The writes the programmer makes. Implemented over the pinned BPF maps, and in memory for
/// tests.
pub trait Maps {
    fn put_backend(&mut self, id: u32, b: &Backend) -> Result<(), MapWriteError>;
    fn del_backend(&mut self, id: u32) -> Result<(), MapWriteError>;
    fn put_slot(&mut self, key: SlotKey, backend_id: u32) -> Result<(), MapWriteError>;
    fn del_slot(&mut self, key: SlotKey) -> Result<(), MapWriteError>;
    fn put_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError>;
    fn del_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError>;
    fn put_service(&mut self, key: ServiceKey, value: ServiceValue) -> Result<(), MapWriteError>;
    fn del_service(&mut self, key: ServiceKey) -> Result<(), MapWriteError>;
    fn put_label(&mut self, svc_id: u32, label: &str) -> Result<(), MapWriteError>;
    fn del_label(&mut self, svc_id: u32) -> Result<(), MapWriteError>;
}

#[cfg(test)]
pub mod mem {
    use super::*;
    use std::collections::BTreeMap;

    /// The maps in memory. After every write it checks the invariant the datapath relies
    /// on: every service's slots `0..count` exist and point at existing backends.
    #[derive(Default, Debug)]
    pub struct MemMaps {
        pub services: BTreeMap<ServiceKey, ServiceValue>,
        pub slots: BTreeMap<SlotKey, u32>,
        pub backends: BTreeMap<u32, Backend>,
        pub labels: BTreeMap<u32, String>,
        pub members: std::collections::BTreeSet<(u32, u32)>,
        pub ops: usize,
        /// Fail the n-th write from now (for failure tests).
        pub fail_at: Option<usize>,
    }

    impl MemMaps {
        fn step(&mut self, map: &'static str) -> Result<(), MapWriteError> {
            self.ops += 1;
            if let Some(n) = self.fail_at.as_mut() {
                if *n == 0 {
                    self.fail_at = None;
                    return Err(MapWriteError {
                        map,
                        op: "update",
                        entry: String::new(),
                        reason: "injected".into(),
                    });
                }
                *n -= 1;
            }
            Ok(())
        }

        pub fn check(&self) {
            for (k, v) in &self.services {
                for slot in 0..v.count {
                    let key = SlotKey {
                        svc_id: v.svc_id,
                        slot,
                    };
                    let id = self.slots.get(&key).unwrap_or_else(|| {
                        panic!("service {k:?} count {} but slot {slot} missing", v.count)
                    });
                    assert!(
                        self.backends.contains_key(id),
                        "slot {key:?} points at missing backend {id}"
                    );
                }
            }
        }
    }

    impl Maps for MemMaps {
        fn put_backend(&mut self, id: u32, b: &Backend) -> Result<(), MapWriteError> {
            self.step("backends")?;
            self.backends.insert(id, *b);
            self.check();
            Ok(())
        }
        fn del_backend(&mut self, id: u32) -> Result<(), MapWriteError> {
            self.step("backends")?;
            self.backends.remove(&id);
            self.check();
            Ok(())
        }
        fn put_slot(&mut self, key: SlotKey, backend_id: u32) -> Result<(), MapWriteError> {
            self.step("slots")?;
            self.slots.insert(key, backend_id);
            self.check();
            Ok(())
        }
        fn del_slot(&mut self, key: SlotKey) -> Result<(), MapWriteError> {
            self.step("slots")?;
            self.slots.remove(&key);
            self.check();
            Ok(())
        }
        fn put_service(
            &mut self,
            key: ServiceKey,
            value: ServiceValue,
        ) -> Result<(), MapWriteError> {
            self.step("services")?;
            self.services.insert(key, value);
            self.check();
            Ok(())
        }
        fn del_service(&mut self, key: ServiceKey) -> Result<(), MapWriteError> {
            self.step("services")?;
            self.services.remove(&key);
            self.check();
            Ok(())
        }
        fn put_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError> {
            self.step("members")?;
            self.members.insert((svc_id, backend_id));
            Ok(())
        }
        fn del_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError> {
            self.step("members")?;
            self.members.remove(&(svc_id, backend_id));
            Ok(())
        }
        fn put_label(&mut self, svc_id: u32, label: &str) -> Result<(), MapWriteError> {
            self.step("labels")?;
            self.labels.insert(svc_id, label.to_string());
            Ok(())
        }
        fn del_label(&mut self, svc_id: u32) -> Result<(), MapWriteError> {
            self.step("labels")?;
            self.labels.remove(&svc_id);
            Ok(())
        }
    }
}
