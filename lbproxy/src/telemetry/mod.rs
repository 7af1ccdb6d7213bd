//! What lbproxy says about itself: its log.

pub mod logging;
