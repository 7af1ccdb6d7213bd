//! The process metrics every Prometheus client exports, read from procfs at each scrape.

/// The process metrics every Prometheus client exports (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, ...), read from procfs at each scrape.
#[derive(Debug)]
pub(super) struct ProcessCollector;

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric as _;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::registry::Unit;
        let Ok(me) = procfs::process::Process::myself() else {
            return Ok(());
        };
        let tps = procfs::ticks_per_second() as f64;
        let page = procfs::page_size() as f64;
        if let Ok(stat) = me.stat() {
            let cpu = ConstCounter::new((stat.utime + stat.stime) as f64 / tps);
            cpu.encode(encoder.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent in seconds",
                Some(&Unit::Seconds),
                cpu.metric_type(),
            )?)?;
            let rss = ConstGauge::new(stat.rss as f64 * page);
            rss.encode(encoder.encode_descriptor(
                "process_resident_memory",
                "Resident memory size in bytes",
                Some(&Unit::Bytes),
                rss.metric_type(),
            )?)?;
            let vsz = ConstGauge::new(stat.vsize as f64);
            vsz.encode(encoder.encode_descriptor(
                "process_virtual_memory",
                "Virtual memory size in bytes",
                Some(&Unit::Bytes),
                vsz.metric_type(),
            )?)?;
            if let Ok(boot) = procfs::boot_time_secs() {
                let start = ConstGauge::new(boot as f64 + stat.starttime as f64 / tps);
                start.encode(encoder.encode_descriptor(
                    "process_start_time",
                    "Start time of the process since unix epoch in seconds",
                    Some(&Unit::Seconds),
                    start.metric_type(),
                )?)?;
            }
        }
        if let Ok(n) = me.fd_count() {
            let fds = ConstGauge::new(n as i64);
            fds.encode(encoder.encode_descriptor(
                "process_open_fds",
                "Number of open file descriptors",
                None,
                fds.metric_type(),
            )?)?;
        }
        if let Ok(limits) = me.limits()
            && let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit
        {
            let max = ConstGauge::new(i64::try_from(max).unwrap_or(i64::MAX));
            max.encode(encoder.encode_descriptor(
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                max.metric_type(),
            )?)?;
        }
        Ok(())
    }
}
