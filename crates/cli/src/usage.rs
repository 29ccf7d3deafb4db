//! A bad command line told in one line, as a casadm user needs it: what is wrong, the valid
//! values, the name probably meant, and the verb's own help (`hybridcache -X -H`), in the form
//! the user typed the verb.
//!
//! clap's own report spans several lines (usage, tips) that a script's log or a terminal full of
//! output loses; what matters in it comes from the error's context, not its text.

use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// The verb and the verb's own verb as typed (`["-X"]`, `["trace", "start"]`); empty when the
/// line names no verb.
pub fn typed_verbs(root: &clap::Command, args: &[OsString]) -> Vec<String> {
    let mut out = Vec::new();
    let mut cmd = root;
    let mut tokens = args.iter().skip(1).map(|a| a.to_string_lossy());
    while let Some(token) = tokens.next() {
        // The global options may come before a verb.
        if token == "--control" {
            tokens.next();
            continue;
        }
        if token.starts_with("--control=") || token == "-H" || token == "--help" {
            continue;
        }
        let Some(sub) = subcommand(cmd, &token) else {
            break;
        };
        out.push(token.into_owned());
        cmd = sub;
        if !cmd.has_subcommands() {
            break;
        }
    }
    out
}

/// The subcommand of `cmd` that `token` names: by name, alias, long flag (`--stats`) or casadm's
/// short flag (`-P`).
fn subcommand<'a>(cmd: &'a clap::Command, token: &str) -> Option<&'a clap::Command> {
    cmd.get_subcommands().find(|s| {
        if let Some(long) = token.strip_prefix("--") {
            return s.get_long_flag() == Some(long)
                || s.get_all_long_flag_aliases().any(|a| a == long);
        }
        if let Some(short) = token.strip_prefix('-') {
            let mut chars = short.chars();
            return chars.next().is_some()
                && chars.next().is_none()
                && s.get_short_flag() == short.chars().next();
        }
        s.get_name() == token || s.get_all_aliases().any(|a| a == token)
    })
}

/// Whether `-H`/`--help` comes after the verb: casadm then shows the verb's help whatever else
/// the line holds.
pub fn asks_for_help(args: &[OsString], verbs: &[String]) -> bool {
    !verbs.is_empty() && args.iter().skip(1).any(|a| a == "-H" || a == "--help")
}

/// The one line (without the `hybridcache: ` prefix) for a clap error.
pub fn message(e: &clap::Error, root: &clap::Command, verbs: &[String]) -> String {
    let text = e.to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let mut msg = lines
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ")
        .to_string();
    if e.kind() == ErrorKind::MissingRequiredArgument {
        // clap names each missing argument on a line of its own.
        if let Some(missing) = strings(e, ContextKind::InvalidArg) {
            msg = format!(
                "the following required arguments were not provided: {}",
                missing.join(", ")
            );
        }
    } else if msg.ends_with(':') {
        if let Some(next) = lines.next() {
            msg = format!("{msg} {next}");
        }
    }
    if let Some(valid) = strings(e, ContextKind::ValidValue) {
        msg = format!("{msg} (valid: {})", valid.join(", "));
    }
    let mut meant = [
        ContextKind::SuggestedArg,
        ContextKind::SuggestedValue,
        ContextKind::SuggestedSubcommand,
    ]
    .into_iter()
    .filter_map(|k| strings(e, k))
    .flatten()
    .collect::<Vec<_>>();
    // clap orders its guesses from the least to the most likely.
    meant.reverse();
    if meant.is_empty() && verbs.is_empty() {
        meant.extend(similar_verb(e, root));
    }
    if !meant.is_empty() {
        let quoted: Vec<String> = meant.iter().map(|m| format!("'{m}'")).collect();
        msg = format!("{msg}; did you mean {}?", quoted.join(" or "));
    }
    let help = if verbs.is_empty() {
        "hybridcache -H".to_string()
    } else {
        format!("hybridcache {} -H", verbs.join(" "))
    };
    format!("{msg} (see '{help}')")
}

fn strings(e: &clap::Error, kind: ContextKind) -> Option<Vec<String>> {
    match e.get(kind)? {
        ContextValue::String(s) => Some(vec![s.clone()]),
        ContextValue::Strings(v) if !v.is_empty() => Some(v.clone()),
        _ => None,
    }
}

/// clap suggests subcommand names but not casadm-style long verbs (`--stat` for `--stats`).
fn similar_verb(e: &clap::Error, root: &clap::Command) -> Option<String> {
    if !matches!(
        e.kind(),
        ErrorKind::UnknownArgument | ErrorKind::InvalidSubcommand
    ) {
        return None;
    }
    let typed = strings(e, ContextKind::InvalidArg)
        .or_else(|| strings(e, ContextKind::InvalidSubcommand))?
        .pop()?;
    let long = typed.strip_prefix("--")?;
    root.get_subcommands()
        .filter(|s| !s.is_hide_set())
        .filter_map(|s| s.get_long_flag())
        .map(|flag| (edit_distance(long, flag), flag))
        .filter(|(d, flag)| *d <= close_enough(flag))
        .min()
        .map(|(_, flag)| format!("--{flag}"))
}

/// How many edits still make a name a likely typo of `name`: a third of it, at least one.
pub fn close_enough(name: &str) -> usize {
    (name.chars().count() / 3).max(1)
}

/// Edits (insert, delete, replace, swap two neighbours) from `a` to `b`.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // d[i][j]: edits from a[..i] to b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let replace = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + replace);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::{CommandFactory, Parser};

    fn line(args: &[&str]) -> String {
        let argv: Vec<OsString> = std::iter::once("hybridcache")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect();
        let e = Cli::try_parse_from(&argv).unwrap_err();
        let root = Cli::command();
        message(&e, &root, &typed_verbs(&root, &argv))
    }

    #[test]
    fn edit_distance_counts_a_swap_as_one() {
        assert_eq!(edit_distance("seq-cuttof", "seq-cutoff"), 2);
        assert_eq!(edit_distance("stats", "sttas"), 1);
        assert_eq!(edit_distance("stat", "stats"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn verbs_are_found_in_every_form_and_after_the_global_options() {
        let root = Cli::command();
        let verbs = |args: &[&str]| {
            let argv: Vec<OsString> = std::iter::once("hybridcache")
                .chain(args.iter().copied())
                .map(OsString::from)
                .collect();
            typed_verbs(&root, &argv)
        };
        assert_eq!(verbs(&["-X", "-n", "x"]), ["-X"]);
        assert_eq!(verbs(&["--set-param"]), ["--set-param"]);
        assert_eq!(verbs(&["set-param"]), ["set-param"]);
        assert_eq!(verbs(&["--control", "-X", "-P"]), ["-P"]);
        assert_eq!(verbs(&["--control=/s", "-H", "-L"]), ["-L"]);
        assert_eq!(verbs(&["trace", "status", "--json"]), ["trace", "status"]);
        assert_eq!(verbs(&["trace", "--bogus"]), ["trace"]);
        assert!(verbs(&["-Y", "-L"]).is_empty());
        assert!(verbs(&["--stat"]).is_empty());
        // Two letters are not a short verb.
        assert!(verbs(&["-SL"]).is_empty());
    }

    #[test]
    fn one_line_with_the_fix_and_the_verb_s_help() {
        assert_eq!(
            line(&["-L", "-o", "jsn"]),
            "invalid value 'jsn' for '--output-format <OUTPUT>' (valid: table, csv, json); did you mean 'json'? (see 'hybridcache -L -H')"
        );
        assert_eq!(
            line(&["--stat", "-i", "1"]),
            "unexpected argument '--stat' found; did you mean '--stats'? (see 'hybridcache -H')"
        );
        assert_eq!(
            line(&["--frobnicate"]),
            "unexpected argument '--frobnicate' found (see 'hybridcache -H')"
        );
        assert_eq!(
            line(&["-T"]),
            "the following required arguments were not provided: --cache-id <ID> (see 'hybridcache -T -H')"
        );
        let stat = line(&["stat"]);
        assert!(
            stat.starts_with("unrecognized subcommand 'stat'; did you mean 'stats' or "),
            "{stat}"
        );
    }
}
