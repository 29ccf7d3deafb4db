//! Offload: whether a fast core takes a share of the cache's clean read hits and write misses.

use super::{fast_core, speed, CacheMode, Judged, Offload, Reason};
use crate::profile::DeviceProfile;
use crate::units::pct;

/// The core serves at least this share of what the cache device does for offload to pay: the
/// study's selective offloading gained where a RAM cache and an SSD array were within a few
/// times of each other; against a core 10x slower it would only lose hits.
const OFFLOAD_MIN_RATIO: f64 = 0.25;

/// Offload: on when the core is fast and, for the busiest cached job's main direction at its
/// depth, serves at least a quarter of what the cache device does. The share balances the two:
/// the core's part of their combined speed, in steps of 5%, 5..50%.
pub(super) fn offload_rule(
    mode: CacheMode,
    cached: &[Judged],
    profile: &DeviceProfile,
) -> (Option<Offload>, Reason) {
    let (offload, text) = offload_choice(mode, cached, profile);
    let setting = match offload {
        Some(o) => format!("offload on {}%", o.share),
        None => "offload off".into(),
    };
    (offload, Reason { setting, text })
}

fn offload_choice(
    mode: CacheMode,
    cached: &[Judged],
    profile: &DeviceProfile,
) -> (Option<Offload>, String) {
    if cached.is_empty() || mode == CacheMode::Pt {
        return (
            None,
            "off: nothing is cached, so there is nothing to offload".into(),
        );
    }
    let Some(fast) = fast_core(profile) else {
        return (
            None,
            format!(
                "off: the core ({}) is neither flash nor within 4x of the cache, so every request it takes waits longer than in the cache",
                profile.core.name
            ),
        );
    };
    let Some((s, r)) = cached.iter().max_by_key(|(s, _)| s.requests()) else {
        return (None, "off: nothing is cached".into());
    };
    let main = match (&r.reads, &r.writes) {
        (Some(x), Some(w)) if s.read_share() < s.write_share() => {
            Some(("writes", w.core_mb_s, w.absorb_mb_s, w.block, w.queue_depth))
        }
        (Some(x), _) => Some(("reads", x.core_mb_s, x.cache_mb_s, x.block, x.queue_depth)),
        (None, Some(w)) => Some(("writes", w.core_mb_s, w.absorb_mb_s, w.block, w.queue_depth)),
        (None, None) => None,
    };
    let Some((dir, core, cache, block, qd)) = main else {
        return (None, "off: the cached jobs neither read nor write".into());
    };
    let ratio = core / cache.max(1e-9);
    if ratio < OFFLOAD_MIN_RATIO {
        return (
            None,
            format!(
                "off: {fast}, but at iodepth {qd} it serves {}'s {dir} at {}, only {} of the cache's {}, so requests sent there would wait longer than in the cache",
                s.name,
                speed(core, block),
                pct(ratio),
                speed(cache, block)
            ),
        );
    }
    let share = ((100.0 * core / (core + cache) / 5.0).round() as u32 * 5).clamp(5, 50);
    (
        Some(Offload {
            share,
            threshold: 1,
        }),
        format!(
            "on (share {share}%, threshold 1): {fast}, and at iodepth {qd} it serves {}'s {dir} at {}, {} of the cache's {}; while the cache device's queue is deeper, sending {share}% of clean read hits and write misses to the core (its part of the two devices' combined speed) uses both, as the ASPLOS'23 study's selective offloading did",
            s.name,
            speed(core, block),
            pct(ratio),
            speed(cache, block)
        ),
    )
}
