//! The daemon's log: `tracing` events with timestamps and levels on stderr (journald picks them
//! up under systemd), filtered by `RUST_LOG` (default `info`).

use std::io::IsTerminal;
use std::sync::Once;

/// Install the log subscriber once per process; later calls do nothing.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            // Colour codes only for a person at a terminal, never into journald or a file.
            .with_ansi(std::io::stderr().is_terminal())
            .try_init();
    });
}
