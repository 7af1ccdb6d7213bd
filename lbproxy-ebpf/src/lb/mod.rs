//! Stages 1 and 2: the load balancer proper (Cilium's `lb4_lookup_service` and
//! `lb4_select_backend_id`).
//!
//! - [`service`]: the frontend a packet is addressed to (`LB_SERVICES_V2`);
//! - [`select`]: a backend for a new flow, by jump consistent hashing over the service's
//!   slots (`LB_SLOTS_V1`), and backends by id (`LB_BACKENDS_V1`, `LB_MEMBERS_V1`);
//! - [`cidr`]: what a packet to no frontend but inside a ServiceCIDR gets (a reject or a
//!   drop);
//! - [`affinity`]: the same, for a service with `sessionAffinity: ClientIP`
//!   (`LB_AFFINITY_V1`).
//!
//! `flow` calls `select`/`affinity` for new flows only; a packet of a known flow keeps its
//! backend.

pub mod affinity;
pub mod cidr;
pub mod select;
pub mod service;
