//! The logger: text or one JSON object per line on stderr, at kube-proxy's `-v` levels.

use crate::config;

/// The tracing filter for kube-proxy's `-v` levels (RUST_LOG, when set, wins).
fn log_filter(verbosity: u32) -> &'static str {
    match verbosity {
        0..=2 => "info",
        3..=4 => "info,lbproxy=debug",
        5..=6 => "debug,lbproxy=trace",
        _ => "trace",
    }
}

/// Logs to stderr as text or one JSON object per line; the `log` records of aya and the
/// datapath's logger go the same way, and in JSON mode so does a panic.
pub fn init(format: config::LogFormat, verbosity: u32) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(log_filter(verbosity)));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let r = match format {
        config::LogFormat::Text => b
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        config::LogFormat::Json => {
            std::panic::set_hook(Box::new(|info| {
                tracing::error!(panic = %info, "lbproxy panicked");
            }));
            b.json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .try_init()
        }
    };
    r.map_err(|e| anyhow::anyhow!("starting the logger: {e}"))
}
