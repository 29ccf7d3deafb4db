//! Named cache parameters for `set-param` (-X) / `get-param` (-G) and the configuration file.
//!
//! Parameters come in casadm's groups: `-X -n cleaning-alru -i 1 -w 20 -s 120` sets two fields of
//! the group `cleaning-alru` at once. Each group is one row of [`GROUPS`]: its fields (wire key,
//! command-line flag, the label casadm prints with its unit), a getter for all of them, and a
//! setter that applies a set of changed fields atomically: every value is parsed and the result
//! validated before anything changes, so a bad value changes nothing.
//!
//! On the wire and in the configuration file a field is `GROUP.FIELD` (e.g.
//! `cleaning-alru.wake-up`); a group's first field may be named by the group alone (`cache-mode`,
//! `cleaning`, `promotion`).

use std::collections::BTreeMap;

use hybridcache_engine::policy::{on_off, parse_on_off};
use hybridcache_engine::{
    Cache, CacheMode, CleaningPolicy, CoreId, PrefetchPolicy, PromotionPolicy,
};

/// One field of a group.
pub struct Field {
    /// Wire and configuration name within the group.
    pub key: &'static str,
    /// The command-line flag that sets it with `-X` (see cli.rs).
    pub flag: &'static str,
    /// What `-G` prints, with the unit: casadm's own label where casadm has the parameter
    /// (casadm/cas_main.c, `cas_cache_params` and `cas_core_params`: v26.03's, or master's for a
    /// parameter only master has), so a script that looks a row up by name finds it; ours for
    /// the parameters casadm lacks, which come after casadm's in their group.
    pub label: &'static str,
}

/// Current values, in field order.
pub type Getter = fn(&Cache, Option<CoreId>) -> Result<Vec<String>, String>;
/// Apply changed fields (key -> value); all or nothing.
pub type Setter = fn(&Cache, Option<CoreId>, &BTreeMap<String, String>) -> Result<(), String>;

pub struct Group {
    pub name: &'static str,
    pub help: &'static str,
    pub fields: &'static [Field],
    /// Per core (`-j`): without one, `-X` sets every core and `-G` shows every core.
    pub per_core: bool,
    /// Saved in the configuration file's `params` table (the superblock keeps them anyway).
    pub in_config: bool,
    pub get: Getter,
    /// None for read-only groups.
    pub set: Option<Setter>,
}

fn parse_u32(key: &str, v: &str) -> Result<u32, String> {
    let t = v.trim();
    t.parse::<u32>().map_err(|e| match e.kind() {
        // A whole number too large to hold is still a number: the operator needs to hear that
        // it is too large, not that it is not one.
        std::num::IntErrorKind::PosOverflow => format!("{key}: {t} is out of range"),
        _ => format!("{key}: '{v}' is not a whole number"),
    })
}

fn engine<T>(r: hybridcache_engine::Result<T>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

/// Apply `values` to `fields`, refusing keys the group does not have.
fn each(
    group: &str,
    values: &BTreeMap<String, String>,
    mut apply: impl FnMut(&str, &str) -> Result<bool, String>,
) -> Result<(), String> {
    for (k, v) in values {
        if !apply(k, v)? {
            return Err(format!("parameter group '{group}' has no field '{k}'"));
        }
    }
    Ok(())
}

/// Apply `values` to a group whose fields are all whole numbers: `slots` names each field and
/// where it goes.
fn set_u32s(
    group: &str,
    values: &BTreeMap<String, String>,
    slots: &mut [(&str, &mut u32)],
) -> Result<(), String> {
    each(group, values, |k, v| {
        let Some((_, slot)) = slots.iter_mut().find(|(name, _)| *name == k) else {
            return Ok(false);
        };
        **slot = parse_u32(k, v)?;
        Ok(true)
    })
}

fn get_mode(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    Ok(vec![c.mode().to_string()])
}

fn set_mode(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut mode = c.mode();
    each("cache-mode", v, |k, v| {
        Ok(k == "mode" && {
            mode = v.parse::<CacheMode>()?;
            true
        })
    })?;
    // As casadm's set-param: no flush; dirty data drains by cleaning (use set-cache-mode -f yes
    // to flush first).
    engine(c.set_mode(mode, false))
}

fn get_line_size(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    Ok(vec![c.line_size().kib().to_string()])
}

fn get_cleaning(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    // The policy casadm knows (nop, alru, acp), never a preset's name: casadm has none, and a
    // preset is only that policy with the tunables `cleaning-alru`/`cleaning-acp` show.
    Ok(vec![c.cleaning().policy.to_string()])
}

fn set_cleaning(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut cfg = c.cleaning();
    each("cleaning", v, |k, v| {
        if k != "policy" {
            return Ok(false);
        }
        match v.parse::<CleaningPolicy>() {
            Ok(p) => cfg.policy = p,
            Err(_) => engine(cfg.apply_preset(v))?,
        }
        Ok(true)
    })?;
    engine(c.set_cleaning(cfg))
}

fn get_alru(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    let a = c.cleaning().alru;
    Ok([
        a.wake_up_s,
        a.staleness_time_s,
        a.flush_max_buffers,
        a.activity_threshold_ms,
        a.dirty_ratio_threshold,
        a.dirty_ratio_inertia_mib,
    ]
    .iter()
    .map(u32::to_string)
    .collect())
}

fn set_alru(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut cfg = c.cleaning();
    let a = &mut cfg.alru;
    set_u32s(
        "cleaning-alru",
        v,
        &mut [
            ("wake-up", &mut a.wake_up_s),
            ("staleness-time", &mut a.staleness_time_s),
            ("flush-max-buffers", &mut a.flush_max_buffers),
            ("activity-threshold", &mut a.activity_threshold_ms),
            ("dirty-ratio-threshold", &mut a.dirty_ratio_threshold),
            ("dirty-ratio-inertia", &mut a.dirty_ratio_inertia_mib),
        ],
    )?;
    engine(c.set_cleaning(cfg))
}

fn get_acp(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    let a = c.cleaning().acp;
    Ok(vec![
        a.wake_up_ms.to_string(),
        a.flush_max_buffers.to_string(),
    ])
}

fn set_acp(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut cfg = c.cleaning();
    let a = &mut cfg.acp;
    set_u32s(
        "cleaning-acp",
        v,
        &mut [
            ("wake-up", &mut a.wake_up_ms),
            ("flush-max-buffers", &mut a.flush_max_buffers),
        ],
    )?;
    engine(c.set_cleaning(cfg))
}

fn get_cleaning_io(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    let io = c.cleaning().io;
    Ok(vec![
        io.merge_max_kib.to_string(),
        io.max_bandwidth_mib_s.to_string(),
    ])
}

fn set_cleaning_io(
    c: &Cache,
    _: Option<CoreId>,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    let mut cfg = c.cleaning();
    let io = &mut cfg.io;
    set_u32s(
        "cleaning-io",
        v,
        &mut [
            ("merge-max", &mut io.merge_max_kib),
            ("max-bandwidth", &mut io.max_bandwidth_mib_s),
        ],
    )?;
    engine(c.set_cleaning(cfg))
}

fn get_seq_cutoff(c: &Cache, core: Option<CoreId>) -> Result<Vec<String>, String> {
    let core = core.ok_or("seq-cutoff is per core: name one with -j")?;
    let s = engine(c.seq_cutoff(core))?;
    Ok(vec![
        s.threshold_kib.to_string(),
        s.policy.to_string(),
        s.promotion_count.to_string(),
    ])
}

/// Apply seq-cutoff fields to `s` and check the result.
fn apply_seq_cutoff(
    s: &mut hybridcache_engine::SeqCutoff,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    each("seq-cutoff", v, |k, v| {
        match k {
            "policy" => s.policy = v.parse()?,
            "threshold" => s.threshold_kib = parse_u32(k, v)?,
            "promotion-count" => s.promotion_count = parse_u32(k, v)?,
            // seq-detect's (casadm master); set_seq_cutoff_group keeps it out of seq-cutoff.
            "promotion-threshold" => s.promotion_threshold_kib = parse_u32(k, v)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    engine(s.validate())
}

/// v26.03's `seq-cutoff` group, which has no byte threshold: that is master's `seq-detect`.
fn set_seq_cutoff_group(
    c: &Cache,
    core: Option<CoreId>,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    if v.contains_key("promotion-threshold") {
        return Err("parameter group 'seq-cutoff' has no field 'promotion-threshold' (it is seq-detect's: -X -n seq-detect --promotion-threshold KiB)".into());
    }
    set_seq_cutoff(c, core, v)
}

fn set_seq_cutoff(
    c: &Cache,
    core: Option<CoreId>,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    // Without -j every core gets the fields given, each keeping its own other fields. Every
    // core's result is checked before any is set.
    let cores: Vec<CoreId> = match core {
        Some(id) => vec![id],
        None => c.cores().iter().map(|i| i.id).collect(),
    };
    let mut planned = Vec::new();
    for id in &cores {
        let mut s = engine(c.seq_cutoff(*id))?;
        apply_seq_cutoff(&mut s, v)?;
        planned.push((*id, s));
    }
    if cores.is_empty() {
        // No core yet: still check the values, so a typo is not silently accepted.
        apply_seq_cutoff(&mut hybridcache_engine::SeqCutoff::default(), v)?;
    }
    for (id, s) in planned {
        engine(c.set_seq_cutoff(Some(id), s))?;
    }
    Ok(())
}

/// casadm master's `seq-detect` group (cas_main.c, `set_param_seq_detect_handle_option`): its
/// promotion count is the engine's, which v26.03's `seq-cutoff` also sets; its promotion
/// threshold (KiB, 0 for none) promotes a stream by its bytes (OCF's ocf_seq_detect.c).
fn get_seq_detect(c: &Cache, core: Option<CoreId>) -> Result<Vec<String>, String> {
    let core = core.ok_or("seq-detect is per core: name one with -j")?;
    let s = engine(c.seq_cutoff(core))?;
    Ok(vec![
        s.promotion_count.to_string(),
        s.promotion_threshold_kib.to_string(),
    ])
}

fn set_seq_detect(
    c: &Cache,
    core: Option<CoreId>,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    each("seq-detect", v, |k, _| {
        Ok(k == "promotion-count" || k == "promotion-threshold")
    })?;
    set_seq_cutoff(c, core, v)
}

fn get_promotion(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    Ok(vec![c.promotion().policy.to_string()])
}

fn set_promotion(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut p = c.promotion();
    each("promotion", v, |k, v| {
        Ok(k == "policy" && {
            p.policy = v.parse::<PromotionPolicy>()?;
            true
        })
    })?;
    engine(c.set_promotion(p))
}

fn get_nhit(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    let p = c.promotion();
    Ok(vec![p.threshold.to_string(), p.trigger_pct.to_string()])
}

fn set_nhit(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut p = c.promotion();
    set_u32s(
        "promotion-nhit",
        v,
        &mut [
            ("threshold", &mut p.threshold),
            ("trigger", &mut p.trigger_pct),
        ],
    )?;
    engine(c.set_promotion(p))
}

fn get_lazy_flush(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    Ok(vec![on_off(c.lazy_flush().enabled).to_string()])
}

fn set_lazy_flush(
    c: &Cache,
    _: Option<CoreId>,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    let mut p = c.lazy_flush();
    each("lazy-flush", v, |k, v| {
        Ok(k == "policy" && {
            p.enabled = parse_on_off("lazy-flush", v)?;
            true
        })
    })?;
    engine(c.set_lazy_flush(p))
}

fn get_prefetch(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    Ok(vec![c.prefetch().policy.to_string()])
}

fn set_prefetch(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut p = c.prefetch();
    each("prefetch", v, |k, v| {
        Ok(k == "policy" && {
            p.policy = v.parse::<PrefetchPolicy>()?;
            true
        })
    })?;
    engine(c.set_prefetch(p))
}

fn get_readahead(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    let p = c.prefetch();
    Ok([p.threshold_kib, p.distance_kib, p.max_in_flight]
        .iter()
        .map(u32::to_string)
        .collect())
}

fn set_readahead(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut p = c.prefetch();
    set_u32s(
        "prefetch-readahead",
        v,
        &mut [
            ("threshold", &mut p.threshold_kib),
            ("distance", &mut p.distance_kib),
            ("max-in-flight", &mut p.max_in_flight),
        ],
    )?;
    engine(c.set_prefetch(p))
}

fn get_offload(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    Ok(vec![on_off(c.offload().enabled).to_string()])
}

fn set_offload(c: &Cache, _: Option<CoreId>, v: &BTreeMap<String, String>) -> Result<(), String> {
    let mut p = c.offload();
    each("offload", v, |k, v| {
        Ok(k == "policy" && {
            p.enabled = parse_on_off("offload", v)?;
            true
        })
    })?;
    engine(c.set_offload(p))
}

fn get_fallback_pt(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    let p = c.fallback_pt();
    Ok(vec![p.threshold.to_string(), p.window_s.to_string()])
}

/// A threshold above the errors counted (or 0) leaves a fallback in force, one at or below
/// them enters it (engine fallback.rs).
fn set_fallback_pt(
    c: &Cache,
    _: Option<CoreId>,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    let mut p = c.fallback_pt();
    set_u32s(
        "fallback-pt",
        v,
        &mut [("threshold", &mut p.threshold), ("window", &mut p.window_s)],
    )?;
    engine(c.set_fallback_pt(p))
}

fn get_offload_queue(c: &Cache, _: Option<CoreId>) -> Result<Vec<String>, String> {
    let p = c.offload();
    Ok(vec![p.share_pct.to_string(), p.threshold.to_string()])
}

fn set_offload_queue(
    c: &Cache,
    _: Option<CoreId>,
    v: &BTreeMap<String, String>,
) -> Result<(), String> {
    let mut p = c.offload();
    set_u32s(
        "offload-queue",
        v,
        &mut [("share", &mut p.share_pct), ("threshold", &mut p.threshold)],
    )?;
    engine(c.set_offload(p))
}

const fn field(key: &'static str, flag: &'static str, label: &'static str) -> Field {
    Field { key, flag, label }
}

pub const GROUPS: &[Group] = &[
    Group {
        name: "cache-mode",
        help: "cache mode: wt, wb, wa, wi, wo or pt (-v)",
        fields: &[field("mode", "-v", "Cache mode")],
        per_core: false,
        in_config: false,
        get: get_mode,
        set: Some(set_mode),
    },
    Group {
        name: "cache-line-size",
        help: "cache line size in KiB (fixed when the cache starts)",
        fields: &[field("size", "", "Cache line size [KiB]")],
        per_core: false,
        in_config: false,
        get: get_line_size,
        set: None,
    },
    Group {
        name: "cleaning",
        help: "cleaning policy: nop, alru, acp, or a preset (-p)",
        fields: &[field("policy", "-p", "Cleaning policy type")],
        per_core: false,
        in_config: true,
        get: get_cleaning,
        set: Some(set_cleaning),
    },
    Group {
        name: "cleaning-alru",
        help: "alru tunables (-w -s -b -t -d --dirty-ratio-inertia)",
        fields: &[
            field("wake-up", "-w", "Wake up time [s]"),
            field("staleness-time", "-s", "Stale buffer time [s]"),
            field("flush-max-buffers", "-b", "Flush max buffers"),
            field("activity-threshold", "-t", "Activity threshold [ms]"),
            field(
                "dirty-ratio-threshold",
                "-d",
                "Dirty ratio trigger threshold [%]",
            ),
            field(
                "dirty-ratio-inertia",
                "--dirty-ratio-inertia",
                "Dirty ratio trigger inertia [MiB]",
            ),
        ],
        per_core: false,
        in_config: true,
        get: get_alru,
        set: Some(set_alru),
    },
    Group {
        name: "cleaning-acp",
        help: "acp tunables (-w -b)",
        fields: &[
            field("wake-up", "-w", "Wake up time [ms]"),
            field("flush-max-buffers", "-b", "Flush max buffers"),
        ],
        per_core: false,
        in_config: true,
        get: get_acp,
        set: Some(set_acp),
    },
    Group {
        name: "cleaning-io",
        help: "cleaning's core writes (--merge-max --max-bandwidth)",
        fields: &[
            field("merge-max", "--merge-max", "Largest cleaning write [KiB]"),
            field(
                "max-bandwidth",
                "--max-bandwidth",
                "Cleaning bandwidth cap [MiB/s] (0 = none)",
            ),
        ],
        per_core: false,
        in_config: true,
        get: get_cleaning_io,
        set: Some(set_cleaning_io),
    },
    Group {
        name: "seq-cutoff",
        help: "sequential cutoff, per core (-j; -p -t --promotion-count)",
        // casadm's order (modules/include/cas_ioctl_codes.h, `kcas_core_param_id`), which is
        // the order `-G` prints them in.
        fields: &[
            field("threshold", "-t", "Sequential cutoff threshold [KiB]"),
            field("policy", "-p", "Sequential cutoff policy"),
            field(
                "promotion-count",
                "--promotion-count",
                "Sequential cutoff promotion request count threshold",
            ),
        ],
        per_core: true,
        in_config: false,
        get: get_seq_cutoff,
        set: Some(set_seq_cutoff_group),
    },
    Group {
        name: "seq-detect",
        help: "sequence detector, per core (-j; --promotion-count, --promotion-threshold), casadm master's group",
        fields: &[
            field(
                "promotion-count",
                "--promotion-count",
                "Sequence detector promotion request count",
            ),
            field(
                "promotion-threshold",
                "--promotion-threshold",
                "Sequence detector promotion threshold [KiB]",
            ),
        ],
        per_core: true,
        in_config: false,
        get: get_seq_detect,
        set: Some(set_seq_detect),
    },
    Group {
        name: "promotion",
        help: "promotion policy: always or nhit (-p)",
        fields: &[field("policy", "-p", "Promotion policy type")],
        per_core: false,
        in_config: true,
        get: get_promotion,
        set: Some(set_promotion),
    },
    Group {
        name: "promotion-nhit",
        help: "nhit tunables (-t threshold, -o trigger %)",
        fields: &[
            field("threshold", "-t", "Insertion threshold"),
            field("trigger", "-o", "Policy trigger [%]"),
        ],
        per_core: false,
        in_config: true,
        get: get_nhit,
        set: Some(set_nhit),
    },
    Group {
        // Its own group rather than a field of `cleaning`: it changes how writes are routed
        // whatever the cleaning policy (nop included), so it must not read as one policy's knob.
        name: "lazy-flush",
        help: "write-back writes with no free or clean line go to the core: on or off (-p)",
        fields: &[field("policy", "-p", "Lazy flush")],
        per_core: false,
        in_config: true,
        get: get_lazy_flush,
        set: Some(set_lazy_flush),
    },
    Group {
        name: "prefetch",
        help: "prefetch policy: readahead or none (-p)",
        fields: &[field("policy", "-p", "Prefetch policy")],
        per_core: false,
        in_config: true,
        get: get_prefetch,
        set: Some(set_prefetch),
    },
    Group {
        name: "prefetch-readahead",
        help: "read-ahead tunables (-t threshold KiB, --distance KiB, --max-in-flight)",
        fields: &[
            // casadm master's label (casadm/cas_main.c, `cas_cache_params`); v26.03 has no
            // prefetch. The other two are ours.
            field("threshold", "-t", "Readahead threshold [KiB]"),
            field("distance", "--distance", "Readahead distance [KiB]"),
            field(
                "max-in-flight",
                "--max-in-flight",
                "Prefetch requests in flight at most",
            ),
        ],
        per_core: false,
        in_config: true,
        get: get_readahead,
        set: Some(set_readahead),
    },
    Group {
        name: "offload",
        help: "send a share of clean read hits and write misses to the core while the cache device is busier: on or off (-p)",
        fields: &[field("policy", "-p", "Offload")],
        per_core: false,
        in_config: true,
        get: get_offload,
        set: Some(set_offload),
    },
    Group {
        name: "offload-queue",
        help: "offload tunables (--share %, -t queue depth difference)",
        fields: &[
            field("share", "--share", "Offloaded share [%]"),
            field(
                "threshold",
                "-t",
                "Cache queue depth above the core's [requests]",
            ),
        ],
        per_core: false,
        in_config: true,
        get: get_offload_queue,
        set: Some(set_offload_queue),
    },
    Group {
        name: "fallback-pt",
        help: "fallback pass-through: cache-device errors within the window that turn new I/O pass-through (-t, 0 = off, up to 1000000; --window seconds, 0 = never forget)",
        fields: &[
            // casadm's label for the threshold; the window is ours (bcache decays errors).
            field("threshold", "-t", "Error threshold"),
            field("window", "--window", "Error window [s]"),
        ],
        per_core: false,
        in_config: true,
        get: get_fallback_pt,
        set: Some(set_fallback_pt),
    },
];

/// The group called `name`, or an error listing the known names.
pub fn find(name: &str) -> Result<&'static Group, String> {
    GROUPS.iter().find(|p| p.name == name).ok_or_else(|| {
        let known: Vec<String> = GROUPS
            .iter()
            .map(|p| format!("{}: {}", p.name, p.help))
            .collect();
        format!("unknown parameter '{name}'; known: {}", known.join("; "))
    })
}

/// Split a configuration-file key `GROUP.FIELD` (or a bare group name, meaning its first field).
pub fn split_key(key: &str) -> Result<(&'static Group, String), String> {
    let (group, field) = match key.split_once('.') {
        Some((g, f)) => (find(g)?, f.to_string()),
        None => {
            let g = find(key)?;
            (g, g.fields[0].key.to_string())
        }
    };
    if !group.fields.iter().any(|f| f.key == field) {
        return Err(format!(
            "parameter group '{}' has no field '{field}' (fields: {})",
            group.name,
            group
                .fields
                .iter()
                .map(|f| f.key)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok((group, field))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = find("cleaning-wakeup").err().unwrap();
        assert!(
            e.contains("cache-mode") && e.contains("cleaning-alru") && e.contains("seq-cutoff"),
            "{e}"
        );
        assert!(find("cache-line-size").unwrap().set.is_none());
    }

    #[test]
    fn a_number_too_large_is_out_of_range_not_a_non_number() {
        let e = parse_u32("wake-up", "99999999999999999999999").unwrap_err();
        assert_eq!(e, "wake-up: 99999999999999999999999 is out of range");
        let e = parse_u32("wake-up", "ten").unwrap_err();
        assert!(e.contains("not a whole number"), "{e}");
        let e = parse_u32("wake-up", "-1").unwrap_err();
        assert!(e.contains("not a whole number"), "{e}");
    }

    #[test]
    fn config_keys_name_a_group_and_field() {
        let (g, f) = split_key("cleaning-alru.wake-up").unwrap();
        assert_eq!((g.name, f.as_str()), ("cleaning-alru", "wake-up"));
        let (g, f) = split_key("cleaning").unwrap();
        assert_eq!((g.name, f.as_str()), ("cleaning", "policy"));
        let e = split_key("cleaning-alru.wakeup").err().unwrap();
        assert!(e.contains("fields: wake-up"), "{e}");
    }

    #[test]
    fn every_settable_field_has_a_flag_and_flags_are_unique_per_group() {
        for g in GROUPS.iter().filter(|g| g.set.is_some()) {
            let mut flags: Vec<&str> = g.fields.iter().map(|f| f.flag).collect();
            assert!(flags.iter().all(|f| !f.is_empty()), "{}", g.name);
            flags.sort();
            flags.dedup();
            assert_eq!(flags.len(), g.fields.len(), "{}", g.name);
        }
    }
}
