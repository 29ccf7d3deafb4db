//! `hybridcache gen man DIR` and `hybridcache gen completions DIR`: the man pages and the shell
//! completions, made from the clap definition in cli.rs, for `make install` and `make deb`.
//!
//! A hidden subcommand rather than a build script or an xtask: the definition lives in this
//! binary crate (cli.rs reaches into analyze, bench, trace, ...), so only the binary itself can
//! render it without moving the whole CLI into a library; and the pages always describe exactly
//! the binary that is installed. `hide = true` keeps it out of `-H`, the man pages and the
//! completions.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, CommandFactory, Subcommand};

use crate::cli::Cli;

mod completion;

#[derive(Debug, Clone, Args)]
pub struct GenArgs {
    #[command(subcommand)]
    pub what: GenWhat,
}

#[derive(Debug, Clone, Subcommand)]
pub enum GenWhat {
    /// Man pages: hybridcache.8, one hybridcache-VERB.8 per verb, hybridcache.toml.5.
    Man {
        /// Directory to write them to (created if missing).
        dir: PathBuf,
    },
    /// Completions: hybridcache.bash, _hybridcache (zsh), hybridcache.fish.
    Completions {
        /// Directory to write them to (created if missing).
        dir: PathBuf,
    },
}

/// The configuration file's page, written by hand: its keys are serde fields (crates/daemon's
/// config.rs), which clap knows nothing about.
const TOML_PAGE: &str = include_str!("hybridcache.toml.5");

/// Section 8: the program is mostly a daemon and an administrator's tool, as casadm(8) is.
const SECTION: &str = "8";

pub fn run(args: &GenArgs) -> Result<()> {
    match &args.what {
        GenWhat::Man { dir } => man(dir),
        GenWhat::Completions { dir } => completions(dir),
    }
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// Every page clap can make, plus the hand-written hybridcache.toml(5).
pub fn man(dir: &Path) -> Result<()> {
    create_dir(dir)?;
    let mut cmd = Cli::command();
    // build() fills in the subcommands' display names (hybridcache-start-cache), which name
    // their pages.
    cmd.build();
    let mut verbs = Vec::new();
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        page_tree(sub, &[], dir, &mut verbs)?;
    }
    let mut main = Vec::new();
    page(&cmd).render(&mut main)?;
    see_also(&mut main, &verbs)?;
    write(&dir.join(format!("hybridcache.{SECTION}")), &main)?;
    write(&dir.join("hybridcache.toml.5"), TOML_PAGE.as_bytes())?;
    Ok(())
}

fn page(cmd: &clap::Command) -> clap_mangen::Man {
    clap_mangen::Man::new(cmd.clone())
        .section(SECTION)
        .source(format!("hybridcache {}", env!("CARGO_PKG_VERSION")))
        .manual("hybridcache")
}

/// A page for `cmd` (below the commands `parents`) and for each of its visible subcommands
/// (bench run, trace start, ...).
fn page_tree(
    cmd: &clap::Command,
    parents: &[&str],
    dir: &Path,
    names: &mut Vec<String>,
) -> Result<()> {
    let mut path = parents.to_vec();
    path.push(cmd.get_name());
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        page_tree(sub, &path, dir, names)?;
    }
    let man = page(cmd);
    let file = dir.join(man.get_filename());
    let mut out = Vec::new();
    man.render(&mut out)?;
    let out = with_synopsis(&out, &synopsis(cmd, parents));
    write(&file, out.as_bytes())?;
    names.push(cmd.get_display_name().unwrap_or(cmd.get_name()).to_string());
    Ok(())
}

/// `-` as roff's minus sign, so a copied option is typed as the hyphen it is.
fn roff_text(s: &str) -> String {
    s.replace('\\', "\\e").replace('-', "\\-")
}

fn bold(s: &str) -> String {
    format!("\\fB{}\\fR", roff_text(s))
}

fn italic(s: &str) -> String {
    format!("\\fI{}\\fR", roff_text(s))
}

/// A verb page's SYNOPSIS: one line per way of typing it, casadm's first
/// (`hybridcache -S|--start-cache -d DEV [-i CACHE_ID] ...`, then `hybridcache start-cache ...`),
/// with its options (short form where there is one; optional ones in brackets). The global
/// options (--control, -H) are left to OPTIONS.
fn synopsis(cmd: &clap::Command, parents: &[&str]) -> String {
    let mut args = Vec::new();
    for a in cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !a.is_global_set())
    {
        // A short list of possible values reads better than its name (-o table|csv|json).
        let possible: Vec<String> = a
            .get_possible_values()
            .iter()
            .filter(|p| !p.is_hide_set())
            .map(|p| p.get_name().to_string())
            .collect();
        let value = match a.get_value_names().and_then(|n| n.first()) {
            _ if !possible.is_empty() && possible.len() <= 6 => possible.join("|"),
            Some(n) => n.to_string(),
            None => a.get_id().as_str().to_uppercase(),
        };
        let takes = a.get_action().takes_values();
        let optional_value = a.get_num_args().is_some_and(|n| n.min_values() == 0);
        let text = if a.is_positional() {
            italic(&value)
        } else {
            let flag = match (a.get_short(), a.get_long()) {
                (Some(c), _) => format!("-{c}"),
                (None, Some(l)) => format!("--{l}"),
                (None, None) => continue,
            };
            // `\ ` is roff's unbreakable space: a flag stays on the line of its value.
            match (takes, optional_value) {
                (false, _) => bold(&flag),
                (true, false) => format!("{}\\ {}", bold(&flag), italic(&value)),
                (true, true) => format!("{}\\ [{}]", bold(&flag), italic(&value)),
            }
        };
        args.push(if a.is_required_set() {
            text
        } else {
            format!("[{text}]")
        });
    }
    if cmd.get_subcommands().any(|s| !s.is_hide_set()) {
        args.push(italic("COMMAND"));
    }
    let args = args.join(" ");
    let mut forms = Vec::new();
    let flags: Vec<String> = cmd
        .get_short_flag()
        .map(|c| format!("-{c}"))
        .into_iter()
        .chain(cmd.get_long_flag().map(|l| format!("--{l}")))
        .map(|f| bold(&f))
        .collect();
    if parents.is_empty() && !flags.is_empty() {
        forms.push(flags.join("|"));
    }
    let mut path: Vec<&str> = parents.to_vec();
    path.push(cmd.get_name());
    forms.push(bold(&path.join(" ")));
    // Unhyphenated and ragged, so no option is split across lines; a hanging indent per form.
    let mut s = String::from(".SH SYNOPSIS\n.nh\n.ad l\n");
    for form in forms {
        s += &format!(".HP 4\n{} {form} {args}\n", bold("hybridcache"));
    }
    s += ".ad b\n.hy\n";
    s
}

/// The page `rendered` with its SYNOPSIS section replaced by `synopsis`.
fn with_synopsis(rendered: &[u8], synopsis: &str) -> String {
    let page = String::from_utf8_lossy(rendered);
    let Some(start) = page.find(".SH SYNOPSIS\n") else {
        return page.into_owned();
    };
    let end = page[start + 1..]
        .find("\n.SH ")
        .map_or(page.len(), |i| start + 1 + i + 1);
    format!("{}{synopsis}{}", &page[..start], &page[end..])
}

/// FILES and SEE ALSO for hybridcache(8): the configuration page and the verbs' pages.
fn see_also(out: &mut Vec<u8>, verbs: &[String]) -> Result<()> {
    writeln!(out, ".SH FILES")?;
    writeln!(out, ".TP\n/etc/hybridcache.toml")?;
    writeln!(
        out,
        "The configuration file the systemd unit starts the daemon with; see hybridcache.toml(5)."
    )?;
    writeln!(out, ".TP\n/run/hybridcache/control.sock")?;
    writeln!(out, "The daemon's control socket (\\-\\-control).")?;
    writeln!(out, ".TP\n/run/hybridcache/nbd.sock")?;
    writeln!(out, "The daemon's NBD socket.")?;
    writeln!(out, ".SH \"SEE ALSO\"")?;
    let mut refs: Vec<String> = vec!["hybridcache.toml(5)".into()];
    refs.extend(verbs.iter().map(|v| format!("{v}({SECTION})")));
    refs.push("casadm(8)".into());
    refs.push("nbd\\-client(8)".into());
    writeln!(out, "{}", refs.join(", "))?;
    Ok(())
}

/// hybridcache.bash, _hybridcache (zsh) and hybridcache.fish, from one walk of the definition
/// (completion.rs says why not clap_complete's).
pub fn completions(dir: &Path) -> Result<()> {
    create_dir(dir)?;
    let mut cmd = Cli::command();
    // build() puts the global options (--control, -H) into every subcommand.
    cmd.build();
    let tree = completion::tree(&cmd);
    write(
        &dir.join("hybridcache.bash"),
        completion::bash(&tree, "_hybridcache").as_bytes(),
    )?;
    write(&dir.join("_hybridcache"), completion::zsh(&tree).as_bytes())?;
    write(
        &dir.join("hybridcache.fish"),
        completion::fish(&tree).as_bytes(),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_pages_and_completions() {
        let dir = tempfile::tempdir().unwrap();
        man(dir.path()).unwrap();
        completions(dir.path()).unwrap();
        for f in [
            "hybridcache.8",
            "hybridcache-start-cache.8",
            "hybridcache-bench-run.8",
            "hybridcache.toml.5",
            "hybridcache.bash",
            "_hybridcache",
            "hybridcache.fish",
        ] {
            assert!(dir.path().join(f).exists(), "{f} missing");
        }
        let main = std::fs::read_to_string(dir.path().join("hybridcache.8")).unwrap();
        assert!(main.contains(".TH hybridcache 8"), "{}", &main[..200]);
        assert!(main.contains("hybridcache.toml(5)"));
        // The hidden generator documents nothing of itself.
        assert!(!dir.path().join("hybridcache-gen.8").exists());
    }

    /// A serde Deserializer that only records the field names a struct asks for: the keys the
    /// configuration file accepts, straight from config.rs, so the page cannot miss a new one.
    struct Fields(&'static [&'static str]);

    impl<'de> serde::Deserializer<'de> for &mut Fields {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: serde::de::Visitor<'de>>(
            self,
            _: V,
        ) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields;
            Err(serde::de::Error::custom("fields recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    fn fields<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
        let mut f = Fields(&[]);
        let _ = T::deserialize(&mut f);
        f.0
    }

    #[test]
    fn the_toml_page_names_every_key_of_the_file() {
        use hybridcache_daemon::config::{CacheSection, CoreSection, DaemonSection};
        let sections = [
            ("[daemon]", fields::<DaemonSection>()),
            ("[[cache]]", fields::<CacheSection>()),
            ("[[core]]", fields::<CoreSection>()),
        ];
        for (section, keys) in sections {
            assert!(!keys.is_empty(), "{section}: no fields recorded");
            // The page's section for this table: from its .SH to the next one.
            let start = TOML_PAGE
                .find(&format!(".SH \"{section}\""))
                .unwrap_or_else(|| panic!("hybridcache.toml.5 has no {section} section"));
            let rest = &TOML_PAGE[start + 4..];
            let body = &rest[..rest.find(".SH ").unwrap_or(rest.len())];
            for key in keys {
                // `params` is the [cache.params] table.
                let shown = if *key == "params" {
                    "[cache.params]"
                } else {
                    key
                };
                assert!(
                    body.contains(&format!(".BR {shown} "))
                        || body.contains(&format!(".B {shown}\n")),
                    "hybridcache.toml.5 does not describe {section} {key}"
                );
            }
        }
    }
}
