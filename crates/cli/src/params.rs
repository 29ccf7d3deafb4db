//! Named cache parameters for `set-param` / `get-param` and the configuration file.
//!
//! Each parameter is one row of [`PARAMS`]: a name (casadm-style, kebab-case), whether it is
//! per core, a getter and an optional setter. New policy knobs (cleaning, sequential cutoff,
//! promotion) are added as rows here; the CLI, the control protocol and the configuration file
//! pick them up without further changes.

use hybridcache_engine::{Cache, CacheMode};

/// Applies a new value to a cache; the error is the one-line reason for the user.
pub type Setter = fn(&Cache, &str) -> Result<(), String>;

pub struct Param {
    pub name: &'static str,
    pub help: &'static str,
    /// Saved in the configuration file's `params` table (false for those with their own key).
    pub in_config: bool,
    pub get: fn(&Cache) -> String,
    /// None for read-only parameters.
    pub set: Option<Setter>,
}

fn get_mode(c: &Cache) -> String {
    c.mode().to_string()
}

fn set_mode(c: &Cache, v: &str) -> Result<(), String> {
    let mode: CacheMode = v.parse()?;
    // As casadm's set-param: no flush; dirty data drains by cleaning (use set-cache-mode -f yes
    // to flush first).
    c.set_mode(mode, false).map_err(|e| e.to_string())
}

fn get_line_size(c: &Cache) -> String {
    c.line_size().kib().to_string()
}

pub const PARAMS: &[Param] = &[
    Param {
        name: "cache-mode",
        help: "cache mode: wt, wb, wa, wi, wo or pt",
        in_config: false,
        get: get_mode,
        set: Some(set_mode),
    },
    Param {
        name: "cache-line-size",
        help: "cache line size in KiB (fixed when the cache starts)",
        in_config: false,
        get: get_line_size,
        set: None,
    },
];

/// The parameter called `name`, or an error listing the known names.
pub fn find(name: &str) -> Result<&'static Param, String> {
    PARAMS.iter().find(|p| p.name == name).ok_or_else(|| {
        let known: Vec<String> = PARAMS
            .iter()
            .map(|p| format!("{}: {}", p.name, p.help))
            .collect();
        format!("unknown parameter '{name}'; known: {}", known.join("; "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = find("cleaning-wakeup").err().unwrap();
        assert!(
            e.contains("cache-mode") && e.contains("cache-line-size"),
            "{e}"
        );
        assert!(find("cache-line-size").unwrap().set.is_none());
    }
}
