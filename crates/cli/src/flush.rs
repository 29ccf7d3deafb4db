//! `-F` (flush-cache) with a progress bar: the dirty lines (and bytes) cleaned so far out of those
//! the flush set out to clean, throughput and time left, read from the daemon while the flush
//! runs; the count moves with each core write, not once per batch. Ctrl-C asks the daemon to stop
//! the flush once its core writes in flight complete: what was written is recorded clean, the
//! rest stays dirty, nothing is lost, and the command exits 1 with the daemon's count of the lines
//! cleaned ("interrupted: cleaned 1,234 of 3,000 dirty lines (4.8 MiB of 11.7 MiB); 1,766 stay
//! dirty"), the figure `-P` confirms.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::protocol::{CacheList, Request};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Run a flush of cache `cache` (or one core) to completion, showing progress on a terminal.
pub fn run(control: &Path, cache: u16, core: Option<u16>) -> Result<()> {
    INTERRUPTED.store(false, Ordering::SeqCst);
    let handler = on_sigint as extern "C" fn(libc::c_int);
    // SAFETY: installing a handler that only stores to an atomic.
    let old = unsafe { libc::signal(libc::SIGINT, handler as libc::sighandler_t) };
    let result = flush(control, cache, core);
    // SAFETY: restoring the previous disposition.
    unsafe { libc::signal(libc::SIGINT, old) };
    result
}

/// "1.5 MiB".
fn size_text(bytes: u64) -> String {
    hybridcache_analyze::units::bytes(bytes)
}

fn flush(control: &Path, cache: u16, core: Option<u16>) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    {
        let control = control.to_path_buf();
        std::thread::spawn(move || {
            let r: Result<serde_json::Value> =
                crate::call(&control, &Request::Flush { cache, core });
            let _ = tx.send(r.map(|_| ()));
        });
    }
    let bar = ProgressBar::with_draw_target(Some(1000), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("flushing cache {prefix} [{bar:30}] {percent:>3}% {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(match core {
        Some(j) => format!("{cache} core {j}"),
        None => cache.to_string(),
    });
    let mut asked_to_stop = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(result) => {
                bar.finish_and_clear();
                // An interrupted flush fails with the daemon's account of it, taken from the
                // engine's count of cleaned lines once the flush stopped: the last figure polled
                // here may be older.
                return result;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bar.finish_and_clear();
                return Err(anyhow!("the flush request ended without a reply"));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if INTERRUPTED.load(Ordering::SeqCst) && !asked_to_stop {
            asked_to_stop = true;
            bar.set_message("interrupting once the core writes in flight complete ...");
            // "not flushing" means it just finished; the reply will say so.
            let _: Result<serde_json::Value> =
                crate::call(control, &Request::InterruptFlush { cache });
        }
        if let Ok(list) = crate::call::<CacheList>(control, &Request::List) {
            if let Some(f) = list
                .caches
                .into_iter()
                .find(|c| c.id == cache)
                .and_then(|c| c.flush)
            {
                bar.set_position((f.percent * 10.0) as u64);
                if !asked_to_stop {
                    let mib_s = f.bytes_per_s / (1u64 << 20) as f64;
                    let eta = f
                        .eta_s
                        .map(|s| format!(", {s:.0} s left"))
                        .unwrap_or_default();
                    bar.set_message(format!(
                        "{} of {} lines ({} of {}), {mib_s:.1} MiB/s{eta}",
                        f.done_lines,
                        f.total_lines,
                        size_text(f.done_bytes),
                        size_text(f.total_bytes)
                    ));
                }
            }
        }
    }
}
