//! The ServiceCIDR tables (`LB_SVCCIDRS_V1`, `LB_SVCCIDR6_V1`) kept equal to what
//! `desired::service_cidrs` asks for, writing only the difference.
//!
//! A full sync compares the whole table. A dirty sync compares only the host prefixes of the
//! ClusterIPs the dirty services held or hold, so one endpoint change costs nothing here; a
//! change of the ServiceCIDRs themselves, or a failed write, makes the next sync a full one.
//! Allocated ClusterIPs are written before ranges and ranges removed before ClusterIPs, so
//! an allocated ClusterIP is never, for an instant, dropped as unallocated.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use ipnet::IpNet;
use lbproxy_common::{CIDR_ALLOCATED, CIDR_SERVICE_RANGE};

use super::{MapWriteError, Maps};
use crate::desired::service_cidrs::{self, CidrEntry, host};
use crate::model::{Model, NamespacedName};

/// The map value of an entry.
pub fn encode(e: CidrEntry) -> u32 {
    match e {
        CidrEntry::Range => CIDR_SERVICE_RANGE,
        CidrEntry::Allocated => CIDR_ALLOCATED,
    }
}

/// The entry a map value stands for (`None`: a value this version does not write).
pub fn decode(v: u32) -> Option<CidrEntry> {
    match v {
        CIDR_SERVICE_RANGE => Some(CidrEntry::Range),
        CIDR_ALLOCATED => Some(CidrEntry::Allocated),
        _ => None,
    }
}

/// What is programmed, and what the model last asked for, kept so that a dirty sync is
/// O(the dirty services' ClusterIPs).
#[derive(Debug, Default)]
pub struct CidrProgrammer {
    programmed: BTreeMap<IpNet, u32>,
    /// The ranges of the last sync.
    ranges: BTreeSet<IpNet>,
    /// Each service's ClusterIPs, and how many services hold each address.
    ips_of: HashMap<NamespacedName, Vec<IpAddr>>,
    holders: HashMap<IpAddr, u32>,
    /// The next sync compares the whole table (at start, after a failed write).
    full: bool,
    /// `CONFIG_F_SERVICE_CIDRS` as last written or read (`None`: unknown).
    flag: Option<bool>,
}

impl CidrProgrammer {
    /// Starts from what the maps hold: the tries' entries and the flag.
    pub fn adopt(programmed: BTreeMap<IpNet, u32>, flag: bool) -> Self {
        Self {
            programmed,
            full: true,
            flag: Some(flag),
            ..Self::default()
        }
    }

    /// The maps were read back and differ: start from what they hold.
    pub fn readopt(&mut self, programmed: BTreeMap<IpNet, u32>, flag: bool) {
        if programmed != self.programmed || Some(flag) != self.flag {
            tracing::warn!("the ServiceCIDR maps drifted (edited by hand?); repairing");
            self.programmed = programmed;
            self.flag = Some(flag);
        }
        self.full = true;
    }

    /// What the maps hold, as written.
    pub fn programmed(&self) -> &BTreeMap<IpNet, u32> {
        &self.programmed
    }

    fn set_ips(&mut self, name: &NamespacedName, ips: Vec<IpAddr>, touched: &mut BTreeSet<IpAddr>) {
        for ip in self.ips_of.remove(name).unwrap_or_default() {
            touched.insert(ip);
            if let Some(n) = self.holders.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.holders.remove(&ip);
                }
            }
        }
        for ip in &ips {
            touched.insert(*ip);
            *self.holders.entry(*ip).or_default() += 1;
        }
        if !ips.is_empty() {
            self.ips_of.insert(name.clone(), ips);
        }
    }

    /// What the table should say of `net`.
    fn want(&self, net: &IpNet) -> Option<CidrEntry> {
        if self.ranges.is_empty() {
            return None;
        }
        if net.prefix_len() == net.max_prefix_len() && self.holders.contains_key(&net.addr()) {
            return Some(CidrEntry::Allocated);
        }
        self.ranges.contains(net).then_some(CidrEntry::Range)
    }

    /// Programs the whole table from `model`.
    pub fn all<M: Maps>(&mut self, maps: &mut M, model: &Model) -> Vec<MapWriteError> {
        self.ips_of.clear();
        self.holders.clear();
        let mut ignored = BTreeSet::new();
        for (name, svc) in &model.services {
            let ips = service_cidrs::cluster_ips(svc).collect();
            self.set_ips(name, ips, &mut ignored);
        }
        self.ranges = service_cidrs::ranges(model);
        self.full = false;
        let keys: BTreeSet<IpNet> = self
            .programmed
            .keys()
            .copied()
            .chain(self.ranges.iter().copied())
            .chain(self.holders.keys().map(|ip| host(*ip)))
            .collect();
        self.write(maps, keys)
    }

    /// Programs the change `dirty` services (and the ServiceCIDRs, when they changed) make.
    pub fn services<M: Maps>(
        &mut self,
        maps: &mut M,
        model: &Model,
        dirty: &BTreeSet<NamespacedName>,
    ) -> Vec<MapWriteError> {
        if self.full || service_cidrs::ranges(model) != self.ranges {
            return self.all(maps, model);
        }
        let mut touched = BTreeSet::new();
        for name in dirty {
            let ips = model
                .services
                .get(name)
                .map(|s| service_cidrs::cluster_ips(s).collect())
                .unwrap_or_default();
            self.set_ips(name, ips, &mut touched);
        }
        if self.ranges.is_empty() && self.flag == Some(false) {
            return Vec::new();
        }
        self.write(maps, touched.into_iter().map(host).collect())
    }

    /// Writes the entries among `keys` that differ: allocated ClusterIPs first, then ranges;
    /// removals of ranges, then of ClusterIPs. A failed write makes the next sync full.
    fn write<M: Maps>(&mut self, maps: &mut M, keys: BTreeSet<IpNet>) -> Vec<MapWriteError> {
        let mut puts: Vec<(IpNet, CidrEntry)> = Vec::new();
        let mut dels: Vec<(IpNet, Option<CidrEntry>)> = Vec::new();
        for net in keys {
            let want = self.want(&net);
            let have = self.programmed.get(&net).copied();
            match want {
                Some(e) if have != Some(encode(e)) => puts.push((net, e)),
                None if have.is_some() => dels.push((net, have.and_then(decode))),
                _ => {}
            }
        }
        puts.sort_by_key(|(n, e)| (*e == CidrEntry::Range, *n));
        dels.sort_by_key(|(n, e)| (*e != Some(CidrEntry::Range), *n));
        let mut errors = Vec::new();
        for (net, e) in puts {
            match maps.put_service_cidr(net, encode(e)) {
                Ok(()) => {
                    self.programmed.insert(net, encode(e));
                }
                Err(err) => errors.push(err),
            }
        }
        for (net, _) in dels {
            match maps.del_service_cidr(net) {
                Ok(()) => {
                    self.programmed.remove(&net);
                }
                Err(err) => errors.push(err),
            }
        }
        // The flag follows the table: set once it holds entries, cleared once it is empty.
        let on = !self.programmed.is_empty();
        if self.flag != Some(on) {
            match maps.put_service_cidrs_flag(on) {
                Ok(()) => self.flag = Some(on),
                Err(err) => errors.push(err),
            }
        }
        if !errors.is_empty() {
            self.full = true;
        }
        errors
    }
}

#[cfg(test)]
mod tests;
