//! The shell completions and the verbs' man pages know casadm's forms (issue 33): the bash
//! completion, sourced in `bash -c` and called as bash calls it (COMP_WORDS, COMP_CWORD), offers
//! each verb's options in every form (`-S`, `--start-cache`, `start-cache`), parameter groups
//! after `-X -n`, modes after `-c`, output formats after `-o`, file names only where a device or
//! a file goes, the running daemon's cache and core ids, and never the hidden commands; each
//! verb's page shows its casadm forms in SYNOPSIS.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{file_cache, need, workdir, BIN};

/// `hybridcache gen completions` and `gen man` into `dir`.
fn generate(dir: &Path) -> (PathBuf, PathBuf) {
    let (comp, man) = (dir.join("completions"), dir.join("man"));
    for (what, to) in [("completions", &comp), ("man", &man)] {
        let out = Command::new(BIN)
            .args(["gen", what])
            .arg(to)
            .output()
            .expect("run hybridcache gen");
        assert!(
            out.status.success(),
            "gen {what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (comp, man)
}

/// What the bash completion offers for `line` (words split at spaces as bash splits them, and
/// `--opt=value` at `=` and `file:PATH` at `:` as bash's COMP_WORDBREAKS does; a trailing space
/// starts an empty word),
/// run in `cwd`: COMPREPLY, sorted. The function is the one the script registers
/// with `complete -F`. Stderr must stay empty: a completion never writes on the terminal.
fn offers(script: &Path, cwd: &Path, line: &str) -> Vec<String> {
    let mut words: Vec<&str> = vec!["hybridcache"];
    for w in line.split(' ') {
        let w = match w.split_once('=') {
            Some((opt, value)) if opt.starts_with("--") => {
                words.extend([opt, "="]);
                value
            }
            _ => w,
        };
        // bash's COMP_WORDBREAKS has `:` too: `file:/x` is three words, `file`, `:`, `/x`.
        let mut parts = w.split(':');
        words.push(parts.next().unwrap_or_default());
        for part in parts {
            words.extend([":", part]);
        }
    }
    let quoted: Vec<String> = words
        .iter()
        .map(|w| format!("'{}'", w.replace('\'', r"'\''")))
        .collect();
    let program = format!(
        r#"source '{script}' || exit 9
spec=$(complete -p hybridcache) || exit 8
func=${{spec#*-F }}; func=${{func%% *}}
COMP_WORDS=({words})
COMP_CWORD={cword}
COMP_LINE='hybridcache {line}'
COMP_POINT=${{#COMP_LINE}}
"$func" hybridcache "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
printf '%s\n' "${{COMPREPLY[@]}}""#,
        script = script.display(),
        words = quoted.join(" "),
        cword = words.len() - 1,
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(&program)
        .current_dir(cwd)
        // The completion runs the word it completes for (`hybridcache`): this build.
        .env("PATH", path_with_bin())
        .env_remove("HYBRIDCACHE_CONTROL")
        .output()
        .expect("run bash");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "completing {line:?}: status {}, stderr: {stderr}",
        out.status
    );
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    v.sort();
    v
}

fn has_all(got: &[String], want: &[&str], what: &str) {
    for w in want {
        assert!(
            got.iter().any(|g| g == w),
            "{what}: {w} missing from {got:?}"
        );
    }
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

#[test]
fn bash_completion_knows_every_casadm_form() {
    let dir = workdir();
    let (comp, _) = generate(dir.path());
    let bash = comp.join("hybridcache.bash");
    // A file that must not be offered where no file goes.
    std::fs::write(dir.path().join("wb-notes.txt"), "").unwrap();
    let at = |line: &str| offers(&bash, dir.path(), line);

    // A verb's options, in each of its forms.
    let start = [
        "--cache-device",
        "--cache-id",
        "--cache-mode",
        "--cache-line-size",
        "--force",
        "--load",
    ];
    for verb in ["-S", "--start-cache", "start-cache"] {
        has_all(&at(&format!("{verb} --")), &start, verb);
    }
    has_all(&at("-S -"), &["-d", "-i", "-c", "-x", "-f", "-l"], "-S -");
    has_all(&at("-T --"), &["--cache-id", "--no-data-flush"], "-T --");
    has_all(&at("-A --"), &["--core-device", "--core-id"], "-A --");
    has_all(
        &at("-P --"),
        &["--cache-id", "--core-id", "--filter", "--output-format"],
        "-P --",
    );

    // Values: parameter groups after -n of -X and -G, modes after -c, formats after -o.
    let groups = at("-X -n ");
    has_all(
        &groups,
        &[
            "cleaning",
            "cleaning-alru",
            "seq-cutoff",
            "promotion-nhit",
            "offload-queue",
        ],
        "-X -n",
    );
    assert!(
        !groups.iter().any(|g| g == "start-cache" || g == "-S"),
        "-X -n offers verbs: {groups:?}"
    );
    assert_eq!(at("-G -n cle"), at("--get-param --name cle"));
    has_all(&at("-G -n cle"), &["cleaning", "cleaning-acp"], "-G -n cle");
    let modes = sorted(&["wt", "wb", "wa", "wi", "wo", "pt"]);
    assert_eq!(at("-Q -c "), modes, "-Q -c");
    assert_eq!(at("-S -d ram:1G -c "), modes, "-S -c");
    assert_eq!(at("set-cache-mode -c "), modes, "set-cache-mode -c");
    assert_eq!(
        at("set-cache-mode -c w"),
        sorted(&["wt", "wb", "wa", "wi", "wo"])
    );
    assert_eq!(
        at("--set-cache-mode --cache-mode=w"),
        sorted(&["wt", "wb", "wa", "wi", "wo"])
    );
    assert_eq!(at("-Q -c wb -i 1 -f "), sorted(&["yes", "no"]));
    assert_eq!(at("-L -o "), sorted(&["table", "csv", "json"]));
    has_all(
        &at("-P -i 1 -f "),
        &["all", "conf", "usage", "err"],
        "-P -f",
    );
    assert_eq!(at("-P -i 1 -f conf,u"), vec!["conf,usage".to_string()]);
    has_all(&at("-S -x "), &["4", "64"], "-S -x");

    // File names only where a device or a file goes.
    assert_eq!(at("-S -d wb-"), vec!["wb-notes.txt".to_string()]);
    assert_eq!(at("-A -i 1 -d wb-"), vec!["wb-notes.txt".to_string()]);
    assert!(at("-X -n seq-cutoff -i 1 -t ").is_empty());

    // The verbs, and not the hidden ones.
    let verbs = at("");
    has_all(
        &verbs,
        &["start-cache", "stop-cache", "set-param", "analyze", "bench"],
        "verbs",
    );
    let flags = at("-");
    has_all(
        &flags,
        &["-S", "--start-cache", "-X", "-G", "-Q", "--control"],
        "verb flags",
    );
    for hidden in ["script", "--script", "gen"] {
        assert!(
            !verbs.iter().chain(&flags).any(|v| v == hidden),
            "{hidden} offered: {verbs:?} {flags:?}"
        );
    }
    // Nested commands and options after the verb's values.
    has_all(&at("trace "), &["start", "stop", "status"], "trace");
    has_all(
        &at("-S -d ram:1G -i 3 --"),
        &["--cache-mode", "--load"],
        "-S after values",
    );
}

/// An option already on the line is not offered again, in none of its forms (`-d` typed,
/// `--cache-device` is not offered either).
#[test]
fn bash_completion_leaves_out_options_already_typed() {
    let dir = workdir();
    let (comp, _) = generate(dir.path());
    let bash = comp.join("hybridcache.bash");
    let at = |line: &str| offers(&bash, dir.path(), line);

    let got = at("-S -d ram:1G --");
    assert!(!got.contains(&"--cache-device".to_string()), "{got:?}");
    has_all(
        &got,
        &["--cache-id", "--cache-mode", "--load"],
        "-S -d X --",
    );
    let got = at("-S --cache-device ram:1G -c wb -");
    for gone in ["-d", "--cache-device", "-c", "--cache-mode"] {
        assert!(!got.contains(&gone.to_string()), "{gone} in {got:?}");
    }
    has_all(&got, &["-i", "-x", "--load"], "-S --cache-device X -c wb -");
    let got = at("-S --cache-id=3 --");
    assert!(!got.contains(&"--cache-id".to_string()), "{got:?}");
    // Clustered short flags are each typed; the last of a cluster may take the next word.
    let got = at("-S -fl -");
    for gone in ["-f", "--force", "-l", "--load"] {
        assert!(!got.contains(&gone.to_string()), "{gone} in {got:?}");
    }
    has_all(&got, &["-d", "-c", "-i"], "-S -fl -");
    assert_eq!(
        at("-S -fc "),
        sorted(&["wt", "wb", "wa", "wi", "wo", "pt"]),
        "-S -fc"
    );
    let got = at("-S -fcwb -");
    assert!(!got.contains(&"-c".to_string()), "{got:?}");
    // zsh runs the same function (bashcompinit).
    if need(&["zsh"]) {
        let got = zsh_offers(&comp.join("_hybridcache"), dir.path(), "-S -d ram:1G --");
        assert!(!got.contains(&"--cache-device".to_string()), "zsh: {got:?}");
        has_all(&got, &["--cache-id", "--load"], "zsh -S -d X --");
    }
}

/// bash breaks words at `:` (COMP_WORDBREAKS): a device spec's `file:` prefix must not stop
/// its path being completed, nor the words after it being read.
#[test]
fn bash_completion_completes_the_path_of_a_file_spec() {
    let dir = workdir();
    let (comp, _) = generate(dir.path());
    let bash = comp.join("hybridcache.bash");
    let at = |line: &str| offers(&bash, dir.path(), line);
    std::fs::write(dir.path().join("cache-file.img"), "").unwrap();
    assert_eq!(
        at("-S -d file:cache-f"),
        ["cache-file.img"],
        "-S -d file:cache-f"
    );
    assert!(
        at("-S -d file:").contains(&"cache-file.img".to_string()),
        "-S -d file:"
    );
    assert_eq!(
        at("-S -d file:cache-file.img -c w"),
        ["wa", "wb", "wi", "wo", "wt"]
    );
    let got = at("-S -d file:cache-file.img --");
    assert!(!got.contains(&"--cache-device".to_string()), "{got:?}");
    // zsh does not split the word: the whole of it is replaced, `file:` kept.
    if need(&["zsh"]) {
        let got = zsh_offers(&comp.join("_hybridcache"), dir.path(), "-S -d file:cache-f");
        assert_eq!(got, ["file:cache-file.img"], "zsh");
    }
}

#[test]
fn completions_offer_the_daemon_s_ids_and_are_quiet_without_it() {
    let fc = file_cache(16 << 20, 32 << 20, &[]);
    let d = &fc.daemon;
    d.ok(&["-S", "-d", "ram:16M", "-i", "7"]);
    let dir = workdir();
    let (comp, _) = generate(dir.path());
    let bash = comp.join("hybridcache.bash");
    let control = d.control.display().to_string();
    let at = |line: &str| offers(&bash, dir.path(), line);
    assert_eq!(
        at(&format!("--control {control} -P -i ")),
        sorted(&["1", "7"])
    );
    assert_eq!(
        at(&format!("-T --control={control} -i ")),
        sorted(&["1", "7"])
    );
    assert_eq!(
        at(&format!("-R --control {control} -i 1 -j ")),
        vec!["1".to_string()]
    );
    assert!(at(&format!("-R --control {control} -i 7 -j ")).is_empty());
    // No daemon on this socket: nothing offered, nothing printed (offers() checks stderr).
    let none = dir.path().join("none.sock");
    assert!(at(&format!("--control {} -P -i ", none.display())).is_empty());

    // zsh and fish ask the daemon the same way.
    type Offers = fn(&Path, &Path, &str) -> Vec<String>;
    let mut shells: Vec<(&str, PathBuf, Offers)> = Vec::new();
    if need(&["zsh"]) {
        shells.push(("zsh", comp.join("_hybridcache"), zsh_offers));
    }
    if need(&["fish"]) {
        shells.push(("fish", comp.join("hybridcache.fish"), fish_offers));
    }
    for (shell, script, offers) in shells {
        let at = |line: &str| offers(&script, dir.path(), line);
        let ids = at(&format!("--control {control} -P -i "));
        assert_eq!(ids, sorted(&["1", "7"]), "{shell}");
        let cores = at(&format!("-R --control {control} -i 1 -j "));
        assert_eq!(cores, vec!["1".to_string()], "{shell}");
        assert!(at(&format!("--control {} -P -i ", none.display())).is_empty());
    }
}

/// PATH with this build's directory first: the completions run `hybridcache -L` for ids.
fn path_with_bin() -> String {
    format!(
        "{}:{}",
        Path::new(BIN).parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// What fish offers for `line` (`complete -C`), the candidates without their descriptions.
fn fish_offers(script: &Path, cwd: &Path, line: &str) -> Vec<String> {
    let out = Command::new("fish")
        .arg("--no-config")
        .arg("-c")
        .arg(format!(
            "source '{}'; and complete -C 'hybridcache {line}'",
            script.display()
        ))
        .current_dir(cwd)
        .env("PATH", path_with_bin())
        .env_remove("HYBRIDCACHE_CONTROL")
        .output()
        .expect("run fish");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "fish completing {line:?}: {stderr}"
    );
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split('\t').next().unwrap_or_default().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    v.sort();
    v
}

/// What the zsh script's function gives zsh's completion system for `line`, asked the way
/// bashcompinit's `_bash_complete` asks (`compgen -F`); zsh itself then keeps the candidates
/// that start with the word typed, so this is compared after that filter.
fn zsh_offers(script: &Path, cwd: &Path, line: &str) -> Vec<String> {
    let out = Command::new("zsh")
        .arg("-fc")
        .arg(format!(
            r#"autoload -U compinit && compinit -u -D
source '{}' || exit 9
words=(hybridcache ${{(s: :)1}}); [[ $1 == *" " || -z $1 ]] && words+=("")
COMP_WORDS=("${{words[@]}}"); COMP_CWORD=$(( ${{#words}} - 1 ))
compgen -F _hybridcache_bash -- "${{words[-1]}}""#,
            script.display()
        ))
        .arg("zsh")
        .arg(line)
        .current_dir(cwd)
        .env("PATH", path_with_bin())
        .env_remove("HYBRIDCACHE_CONTROL")
        .output()
        .expect("run zsh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "zsh completing {line:?}: {stderr}"
    );
    let typed = line.rsplit(' ').next().unwrap_or_default();
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty() && l.starts_with(typed))
        .map(String::from)
        .collect();
    v.sort();
    v
}

/// zsh and fish get the same tree: a verb's options in its casadm forms, groups, modes, files
/// only for devices, no hidden commands.
#[test]
fn zsh_and_fish_completions_know_the_casadm_forms() {
    let dir = workdir();
    let (comp, _) = generate(dir.path());
    std::fs::write(dir.path().join("wb-notes.txt"), "").unwrap();
    let modes = sorted(&["wt", "wb", "wa", "wi", "wo", "pt"]);
    let start = ["--cache-device", "--cache-id", "--cache-mode", "--load"];
    type Offers = fn(&Path, &Path, &str) -> Vec<String>;
    let mut shells: Vec<(&str, PathBuf, Offers)> = Vec::new();
    if need(&["zsh"]) {
        shells.push(("zsh", comp.join("_hybridcache"), zsh_offers));
    }
    if need(&["fish"]) {
        shells.push(("fish", comp.join("hybridcache.fish"), fish_offers));
    }
    for (shell, script, offers) in shells {
        let at = |line: &str| offers(&script, dir.path(), line);
        has_all(&at("-S --"), &start, shell);
        has_all(&at("--start-cache --"), &start, shell);
        let groups = at("-X -n ");
        has_all(&groups, &["cleaning", "seq-cutoff", "offload-queue"], shell);
        assert!(
            !groups.iter().any(|g| g == "start-cache"),
            "{shell}: {groups:?}"
        );
        assert_eq!(at("-Q -c "), modes, "{shell} -Q -c");
        assert_eq!(at("set-cache-mode -c "), modes, "{shell} set-cache-mode -c");
        assert_eq!(at("-S -d wb-"), vec!["wb-notes.txt".to_string()], "{shell}");
        let verbs = at("");
        has_all(&verbs, &["start-cache", "set-param"], shell);
        assert!(
            !verbs.iter().any(|v| v == "script" || v == "gen"),
            "{shell}: {verbs:?}"
        );
        let flags = at("-");
        has_all(&flags, &["-S", "--start-cache"], shell);
        assert!(!flags.iter().any(|v| v == "--script"), "{shell}: {flags:?}");
    }
}

/// What `man -l` prints for a page.
fn rendered(page: &Path) -> String {
    let out = Command::new("man")
        .arg("-l")
        .arg(page)
        .env("MANWIDTH", "200")
        .env("MAN_KEEP_FORMATTING", "0")
        .env("MANPAGER", "cat")
        .env("PAGER", "cat")
        .output()
        .unwrap_or_else(|e| panic!("cannot run man ({e}): install man-db (make deps)"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "man -l {}: {stderr}",
        page.display()
    );
    // Bold and underline as overstrikes when not on a terminal: keep the letters.
    let text = String::from_utf8_lossy(&out.stdout);
    let mut plain = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if chars.peek() == Some(&'\u{8}') {
            chars.next();
            continue;
        }
        plain.push(c);
    }
    plain.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn verb_pages_show_the_casadm_forms_in_their_synopsis() {
    let dir = workdir();
    let (_, man) = generate(dir.path());
    let synopsis = |page: &str| {
        let text = rendered(&man.join(page));
        let start = text
            .find("SYNOPSIS")
            .unwrap_or_else(|| panic!("{page}: no SYNOPSIS"));
        let end = text[start..]
            .find("DESCRIPTION")
            .map_or(text.len(), |i| start + i);
        text[start..end].to_string()
    };
    let start = synopsis("hybridcache-start-cache.8");
    assert!(
        start.contains("hybridcache -S|--start-cache -d DEV [-i ID]"),
        "{start}"
    );
    assert!(start.contains("hybridcache start-cache -d DEV"), "{start}");
    assert!(start.contains("[-c wt|wb|wa|wi|wo|pt]"), "{start}");
    let set = synopsis("hybridcache-set-param.8");
    assert!(
        set.contains("hybridcache -X|--set-param -n GROUP -i ID"),
        "{set}"
    );
    let inactive = synopsis("hybridcache-remove-inactive.8");
    assert!(
        inactive.contains("hybridcache --remove-inactive -i ID -j CORE [-f]"),
        "{inactive}"
    );
    let run = synopsis("hybridcache-bench-run.8");
    assert!(run.contains("hybridcache bench run"), "{run}");
}
