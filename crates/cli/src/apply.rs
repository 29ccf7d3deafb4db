//! `hybridcache analyze --apply`: the analyzer's recommended configuration applied to a running
//! cache through the control socket, as the same requests the printed commands would send.
//!
//! Every request is built first, so nothing is sent when the recommendation cannot be expressed;
//! the daemon then checks each one as it checks a command line. Requests go in the order of the
//! printed commands, and the first refusal stops the rest (what was applied is reported).

use std::collections::BTreeMap;
use std::path::Path;

use hybridcache_analyze::recommend::{Cleaning, Promotion, Recommendation};

use crate::protocol::Request;

fn set(cache: u16, name: &str, values: &[(&str, String)]) -> Request {
    Request::SetParam {
        cache,
        core: None,
        name: name.to_string(),
        value: String::new(),
        values: values
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// The requests that apply `rec` to cache `cache`, each with a one-line description.
pub fn requests(rec: &Recommendation, cache: u16) -> Vec<(String, Request)> {
    let c = &rec.config;
    let mut out = vec![(
        format!("cache mode {}", c.mode.as_str()),
        Request::SetCacheMode {
            cache,
            mode: c.mode.as_str().to_string(),
            // As the emitted command (`-f yes`): leaving wb or wo, flush first.
            flush: Some(true),
        },
    )];
    // Tunables before the policy, so the policy starts with its recommended values.
    match c.cleaning {
        Cleaning::Alru(p) => out.push((
            "alru tunables".into(),
            set(
                cache,
                "cleaning-alru",
                &[
                    ("wake-up", p.wake_up.to_string()),
                    ("staleness-time", p.staleness_time.to_string()),
                    ("flush-max-buffers", p.flush_max_buffers.to_string()),
                    ("activity-threshold", p.activity_threshold.to_string()),
                    ("dirty-ratio-threshold", p.dirty_ratio_threshold.to_string()),
                ],
            ),
        )),
        Cleaning::Acp(p) => out.push((
            "acp tunables".into(),
            set(
                cache,
                "cleaning-acp",
                &[
                    ("wake-up", p.wake_up.to_string()),
                    ("flush-max-buffers", p.flush_max_buffers.to_string()),
                ],
            ),
        )),
        Cleaning::Nop => {}
    }
    out.push((
        format!("cleaning policy {}", c.cleaning.name()),
        set(
            cache,
            "cleaning",
            &[("policy", c.cleaning.name().to_string())],
        ),
    ));
    out.push((
        format!("lazy flush {}", if c.lazy_flush { "on" } else { "off" }),
        set(
            cache,
            "lazy-flush",
            &[(
                "policy",
                if c.lazy_flush { "on" } else { "off" }.to_string(),
            )],
        ),
    ));
    out.push((
        format!(
            "seq cutoff {} {} KiB on every core",
            c.seq_cutoff.policy.as_str(),
            c.seq_cutoff.threshold
        ),
        set(
            cache,
            "seq-cutoff",
            &[
                ("policy", c.seq_cutoff.policy.as_str().to_string()),
                ("threshold", c.seq_cutoff.threshold.to_string()),
            ],
        ),
    ));
    match c.promotion {
        Promotion::Always => out.push((
            "promotion always".into(),
            set(cache, "promotion", &[("policy", "always".into())]),
        )),
        Promotion::Nhit { threshold, trigger } => {
            out.push((
                "nhit tunables".into(),
                set(
                    cache,
                    "promotion-nhit",
                    &[
                        ("threshold", threshold.to_string()),
                        ("trigger", trigger.to_string()),
                    ],
                ),
            ));
            out.push((
                "promotion nhit".into(),
                set(cache, "promotion", &[("policy", "nhit".into())]),
            ));
        }
    }
    let csv = rec.io_class_csv();
    if !csv.is_empty() {
        out.push((
            format!("{} IO classes", c.io_classes.len()),
            Request::LoadIoClasses {
                cache,
                csv,
                ignore_unsupported: false,
            },
        ));
    }
    // Tunables before the policy, as for cleaning.
    match c.prefetch {
        Some(ra) => {
            out.push((
                "read-ahead tunables".into(),
                set(
                    cache,
                    "prefetch-readahead",
                    &[
                        ("threshold", ra.threshold.to_string()),
                        ("distance", ra.distance.to_string()),
                        ("max-in-flight", ra.max_in_flight.to_string()),
                    ],
                ),
            ));
            out.push((
                "prefetch readahead".into(),
                set(cache, "prefetch", &[("policy", "readahead".into())]),
            ));
        }
        None => out.push((
            "prefetch none".into(),
            set(cache, "prefetch", &[("policy", "none".into())]),
        )),
    }
    match c.offload {
        Some(o) => {
            out.push((
                "offload tunables".into(),
                set(
                    cache,
                    "offload-queue",
                    &[
                        ("share", o.share.to_string()),
                        ("threshold", o.threshold.to_string()),
                    ],
                ),
            ));
            out.push((
                "offload on".into(),
                set(cache, "offload", &[("policy", "on".into())]),
            ));
        }
        None => out.push((
            "offload off".into(),
            set(cache, "offload", &[("policy", "off".into())]),
        )),
    }
    out
}

/// Send the requests; returns what was applied, or what was applied before the refusal and why.
pub fn apply(
    control: &Path,
    rec: &Recommendation,
    cache: u16,
) -> Result<Vec<String>, (Vec<String>, String)> {
    let mut done = Vec::new();
    for (what, req) in requests(rec, cache) {
        if let Err(e) = crate::call::<serde_json::Value>(control, &req) {
            let why = format!("{what}: {}", format!("{e:#}").replace('\n', " "));
            return Err((done, why));
        }
        done.push(what);
    }
    Ok(done)
}
