//! `-F` (flush-cache) with a progress bar: percent of the dirty data written, throughput and time
//! left, read from the daemon while the flush runs. Ctrl-C asks the daemon to stop the flush
//! after its current batch: what was written is recorded clean, the rest stays dirty, nothing is
//! lost, and the command exits 1 saying how far it got.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::protocol::{CacheList, FlushInfo, Request};

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
    let mut last: Option<FlushInfo> = None;
    let mut asked_to_stop = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(result) => {
                bar.finish_and_clear();
                return match result {
                    Ok(()) => Ok(()),
                    Err(e) if asked_to_stop => {
                        let how_far = last
                            .map(|f| format!(" at {:.1} %", f.percent))
                            .unwrap_or_default();
                        Err(anyhow!(
                            "flush of cache {cache} interrupted{how_far}: what was written is clean, the rest stays dirty ({e:#})"
                        ))
                    }
                    Err(e) => Err(e),
                };
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bar.finish_and_clear();
                return Err(anyhow!("the flush request ended without a reply"));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if INTERRUPTED.load(Ordering::SeqCst) && !asked_to_stop {
            asked_to_stop = true;
            bar.set_message("interrupting after the current batch ...");
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
                    bar.set_message(format!("{mib_s:.1} MiB/s{eta}"));
                }
                last = Some(f);
            }
        }
    }
}
