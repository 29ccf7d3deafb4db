//! The docs' commands run: every command block of README.md and docs/cli.md is executed against
//! a real daemon, so the docs cannot drift from the program again.
//!
//! # Which blocks and lines run
//!
//! - **Blocks.** Fenced blocks tagged `sh`, `bash`, `shell` or `console`, or not tagged at all,
//!   are command blocks. Any other tag (`text` for a synopsis or an output, `toml`, `ini`, `json`)
//!   is not run. A block is a **transcript** when one of its lines starts with `$ `: those lines
//!   are the commands and the lines after each are its output. Otherwise every line is a command,
//!   except blank lines and `#` comments. A line ending in `\` continues on the next.
//! - **Markers**, HTML comments on the lines just before a block (blank lines between allowed):
//!   `<!-- doc-test: skip (REASON) -->` does not run the block (the reason is required: things
//!   this test cannot do, such as a second daemon, root-only mounts or a kernel driver);
//!   `<!-- doc-test: reset -->` starts the block from nothing (a new daemon, new devices): a
//!   block that begins a new story; `<!-- doc-test: setup COMMAND -->` runs COMMAND first, by the
//!   same rules, and it must succeed: the state the prose describes but the block does not show.
//! - **Lines.** A command line runs when each program in it (`a && b`, `a | b`, `$(...)`) is
//!   `hybridcache` or one of [`TOOLS`] (file set-up, `sleep`, NBD clients, `jq` and `socat`); a tool that is
//!   not installed skips the line through `common::need` (which fails in CI). Every other line is
//!   not run and is listed as such: building and installing (`cargo`, `make`), what needs root or
//!   a kernel driver (`modprobe`, `mount`, `losetup`, `nbdfuse`, `nbd-client`, `systemctl`,
//!   `qemu-system-*`), shell assignments (`export`, `dev=$(...)`), background jobs (`&`). A line
//!   that the rule leaves out but that has a `hybridcache` command is an error: split the line,
//!   or skip its block with the reason.
//! - **The daemon.** Each file starts with a daemon of the test. A `hybridcache daemon ...` line
//!   replaces it by one started with that line's options (`--control`/`--nbd-socket` are the
//!   test's own); `hybridcache stop-daemon` stops it as for a user.
//! - **Substitutions**, in commands and in shown output alike: a socket named `control.sock` or
//!   `nbd.sock` is the test daemon's; a `/dev/...` device (not `/dev/null`, `/dev/nbd*`,
//!   `/dev/ublkb*`) is a sparse file of [`DEVICE_BYTES`] in the test's directory, made on first
//!   use; other paths under `/tmp`, `/mnt`, `/var`, `/srv`, `/etc`, `/run`, `/home` are the same
//!   paths under the test's directory, where an `/etc/...` file the doc uses but does not write
//!   is a copy of the last ```toml block above it (for `.toml`) or of `packaging/NAME`;
//!   `nbd://localhost|127.0.0.1[:PORT]/NAME` is the test daemon's export; any other
//!   `nbd://HOST[:PORT]/NAME` (a remote core) is an nbdkit memory disk. `hybridcache` is this
//!   build with `--control` of the test daemon; `fio` gets `--io_size=16m` so that the doc's
//!   sizes stay regions and the test stays short. Commands run in a scratch directory that links
//!   the workspace's top-level entries, so `packaging/...` resolves and nothing is written to the
//!   sources.
//! - **Checks.** A command must exit 0, unless the doc shows it failing: its first output line is
//!   `hybridcache: ...` (the CLI's error format); then it must exit non-zero with an error whose
//!   first two words are the doc's. When the doc shows output, the first line must have the same
//!   shape (numbers and whitespace aside; `...` ends the comparison). Failures name the file and
//!   line, the command as written and as run, and its stderr.
//!
//! # Output samples (docs/observability.md, docs/policies.md)
//!
//! These two docs show what the program prints. There only ```` ```console ```` blocks run (their
//! other blocks are synopses, configuration and log excerpts), each a transcript as above, and a
//! command's **whole** output must be the doc's: stdout, or stderr when the doc shows an error.
//! Line by line, with these allowances and no others:
//!
//! - runs of spaces count as one, and runs of `═` as one (a table's columns are as wide as its
//!   widest cell, so its padding and rules follow the values);
//! - `<N>` in the doc stands for one number that varies from run to run (a time, a rate, a
//!   count that depends on timing): digits with an optional sign, decimal point and thousands
//!   commas. Everything else, other numbers included, must be as shown;
//! - a line `...` alone stands for any number of lines (none included), to shorten a long
//!   output; the lines after it must follow in order.
//!
//! The blocks' paths and sockets are substituted as everywhere (in the output too). A block runs
//! after the `setup` markers before it: the state it shows is made there, so the sample shows
//! only what the prose is about.

mod common;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{have, nbdkit, need, sparse_file, workdir, Daemon, Kill, BIN};

/// Programs other than `hybridcache` that a doc line may run.
const TOOLS: &[&str] = &[
    "mkdir",
    "sleep",
    "truncate",
    "echo",
    "cat",
    "jq",
    "socat",
    "fio",
    "nbdinfo",
    "nbdcopy",
    "qemu-img",
    "mkfs.ext4",
];

/// Programs that are always there (coreutils); the others go through `common::need`.
const BASE_TOOLS: &[&str] = &["mkdir", "sleep", "truncate", "echo", "cat"];

/// Size of each device the docs name: large enough for any cache or core of the examples.
const DEVICE_BYTES: u64 = 1 << 30;

/// Longest a single doc command may take before it counts as hung.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

const DOCS: &[&str] = &["README.md", "docs/cli.md"];

/// Docs whose ```console blocks are output samples, compared whole (module doc).
const SAMPLE_DOCS: &[&str] = &["docs/observability.md", "docs/policies.md"];

#[test]
fn every_command_of_the_docs_runs() {
    let root = workspace_root();
    let mut report = Report::default();
    for doc in DOCS {
        let path = root.join(doc);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{doc}: {e}"));
        run_file(doc, &text, &mut report);
    }
    for doc in SAMPLE_DOCS {
        let path = root.join(doc);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{doc}: {e}"));
        run_samples(doc, &text, &mut report);
    }
    eprintln!("{}", report.summary());
    assert!(
        report.failures.is_empty(),
        "{} doc command(s) failed:\n\n{}",
        report.failures.len(),
        report.failures.join("\n")
    );
    assert!(report.ran > 0, "no doc command ran");
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/cli is two levels below the workspace root")
        .to_path_buf()
}

#[derive(Default)]
struct Report {
    ran: usize,
    not_run: Vec<String>,
    skipped_blocks: Vec<String>,
    failures: Vec<String>,
}

impl Report {
    fn summary(&self) -> String {
        let mut s = format!(
            "doc test: {} commands run, {} lines not run, {} blocks skipped\n",
            self.ran,
            self.not_run.len(),
            self.skipped_blocks.len()
        );
        for b in &self.skipped_blocks {
            let _ = writeln!(s, "  skipped block {b}");
        }
        for l in &self.not_run {
            let _ = writeln!(s, "  not run {l}");
        }
        s
    }
}

// ---------------------------------------------------------------------------------------------
// Markdown

#[derive(Debug, Default)]
struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    lang: String,
    /// (1-based line, text)
    lines: Vec<(usize, String)>,
    skip: Option<String>,
    reset: bool,
    setup: Vec<(usize, String)>,
}

/// The fenced blocks of a Markdown text with the markers before each; a malformed marker is an
/// error, so that a typo does not silently run or skip a block.
fn blocks(doc: &str, text: &str) -> Result<Vec<Block>, String> {
    let mut out = Vec::new();
    let mut pending = Block::default();
    let mut current: Option<Block> = None;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim();
        if let Some(b) = current.as_mut() {
            if trimmed.starts_with("```") {
                out.push(current.take().expect("inside a block"));
            } else {
                b.lines.push((n, raw.to_string()));
            }
            continue;
        }
        if let Some(lang) = trimmed.strip_prefix("```") {
            let mut b = std::mem::take(&mut pending);
            b.line = n;
            b.lang = lang.split_whitespace().next().unwrap_or("").to_string();
            current = Some(b);
        } else if let Some(rest) = trimmed.strip_prefix("<!-- doc-test:") {
            let body = rest
                .strip_suffix("-->")
                .ok_or_else(|| format!("{doc}:{n}: a doc-test marker must end on its line"))?
                .trim();
            if let Some(reason) = body.strip_prefix("skip") {
                let reason = reason.trim();
                let reason = reason
                    .strip_prefix('(')
                    .and_then(|r| r.strip_suffix(')'))
                    .map(str::trim)
                    .filter(|r| !r.is_empty())
                    .ok_or_else(|| format!("{doc}:{n}: `skip` needs a reason: skip (REASON)"))?;
                pending.skip = Some(format!("{doc}:{n}: {reason}"));
            } else if body == "reset" {
                pending.reset = true;
            } else if let Some(cmd) = body.strip_prefix("setup ") {
                pending.setup.push((n, cmd.trim().to_string()));
            } else {
                return Err(format!("{doc}:{n}: unknown doc-test marker: {body}"));
            }
        } else if !trimmed.is_empty() && has_markers(&pending) {
            return Err(format!(
                "{doc}:{n}: a doc-test marker must come just before a fenced block"
            ));
        }
    }
    if current.is_some() {
        return Err(format!("{doc}: unterminated fenced block"));
    }
    Ok(out)
}

fn has_markers(b: &Block) -> bool {
    b.skip.is_some() || b.reset || !b.setup.is_empty()
}

fn is_command_block(lang: &str) -> bool {
    matches!(lang, "" | "sh" | "bash" | "shell" | "console")
}

/// One command of a block: its line, its text (continuations joined) and the output shown.
#[derive(Debug)]
struct DocCommand {
    line: usize,
    written: String,
    output: Vec<String>,
    /// An output sample: the whole output must be the doc's (module doc), not only its shape.
    whole: bool,
}

fn commands(block: &Block) -> Vec<DocCommand> {
    let transcript = block.lines.iter().any(|(_, l)| l.starts_with("$ "));
    let mut out: Vec<DocCommand> = Vec::new();
    let mut continuing = false;
    for (n, l) in &block.lines {
        if continuing {
            let last = out.last_mut().expect("a command to continue");
            continuing = join(&mut last.written, l);
            continue;
        }
        if transcript {
            if let Some(cmd) = l.strip_prefix("$ ") {
                let mut written = String::new();
                continuing = join(&mut written, cmd);
                out.push(DocCommand {
                    line: *n,
                    written,
                    output: Vec::new(),
                    whole: false,
                });
            } else if let Some(last) = out.last_mut() {
                last.output.push(l.clone());
            }
        } else {
            let t = l.trim();
            if t.is_empty() || t.starts_with('#') {
                continue;
            }
            let mut written = String::new();
            continuing = join(&mut written, t);
            out.push(DocCommand {
                line: *n,
                written,
                output: Vec::new(),
                whole: false,
            });
        }
    }
    out
}

/// Appends a line to a command; returns whether it continues on the next line.
fn join(cmd: &mut String, line: &str) -> bool {
    let t = line.trim_end();
    let (t, more) = match t.strip_suffix('\\') {
        Some(t) => (t, true),
        None => (t, false),
    };
    if !cmd.is_empty() {
        cmd.push(' ');
    }
    cmd.push_str(t.trim());
    more
}

// ---------------------------------------------------------------------------------------------
// Shell lines

/// A command line cut into its simple commands: byte ranges of `s`, quote-aware, split at
/// `&&`, `||`, `|`, `;`, `&`, `$(`, `(` and `)`, and ended by a `#` comment. `background` says
/// whether the line ends with a lone `&`; `end` is where the comment starts.
struct Split {
    segments: Vec<(usize, usize)>,
    background: bool,
    end: usize,
}

fn split(s: &str) -> Split {
    let b = s.as_bytes();
    let mut segments = Vec::new();
    let mut start = 0;
    let mut quote: Option<u8> = None;
    let mut i = 0;
    let mut last_sep_amp = false;
    let mut end = b.len();
    while i < b.len() {
        let c = b[i];
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        let sep_len = match c {
            b'\'' | b'"' => {
                quote = Some(c);
                i += 1;
                continue;
            }
            b'#' if i == 0 || b[i - 1].is_ascii_whitespace() => {
                end = i;
                break;
            }
            b'&' if b.get(i + 1) == Some(&b'&') => 2,
            b'|' if b.get(i + 1) == Some(&b'|') => 2,
            b'$' if b.get(i + 1) == Some(&b'(') => 2,
            b'&' | b'|' | b';' | b'(' | b')' => 1,
            _ => 0,
        };
        if sep_len == 0 {
            if !c.is_ascii_whitespace() {
                last_sep_amp = false;
            }
            i += 1;
            continue;
        }
        segments.push((start, i));
        last_sep_amp = c == b'&' && sep_len == 1;
        i += sep_len;
        start = i;
    }
    segments.push((start, end));
    segments.retain(|&(a, z)| !s[a..z].trim().is_empty());
    Split {
        segments,
        background: last_sep_amp,
        end,
    }
}

/// The program of a simple command: its first word, or None for an assignment (`X=...`).
fn program(segment: &str) -> Option<&str> {
    let word = segment.split_whitespace().next()?;
    if word.contains('=') {
        return None;
    }
    Some(word.trim_matches(|c| c == '\'' || c == '"'))
}

/// Words of a command line, quotes removed (no expansion: the docs' daemon lines need none).
fn words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut in_word = false;
    for c in s.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The world a file's commands run in

struct World {
    // Fields drop in order: the daemon and servers go before their directory.
    daemon: Option<Daemon>,
    remotes: HashMap<String, Kill>,
    dir: tempfile::TempDir,
    /// The last ```toml block of the file, for `/etc/*.toml` files the doc uses.
    last_toml: Option<String>,
}

impl World {
    fn new() -> World {
        let dir = workdir();
        let cwd = dir.path().join("cwd");
        std::fs::create_dir(&cwd).expect("scratch directory");
        // The docs run commands from the source tree (`packaging/...`); links give them its
        // files without letting them write there.
        let root = workspace_root();
        if let Ok(entries) = std::fs::read_dir(&root) {
            for e in entries.flatten() {
                let name = e.file_name();
                if name == "target" || name.to_string_lossy().starts_with('.') {
                    continue;
                }
                let _ = std::os::unix::fs::symlink(e.path(), cwd.join(&name));
            }
        }
        let daemon = Some(Daemon::start(dir.path()));
        World {
            daemon,
            remotes: HashMap::new(),
            dir,
            last_toml: None,
        }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn control(&self) -> PathBuf {
        self.root().join("control.sock")
    }

    fn nbd(&self) -> PathBuf {
        self.root().join("nbd.sock")
    }

    fn cwd(&self) -> PathBuf {
        self.root().join("cwd")
    }

    /// Replaces the test's daemon by one started with `args` (a doc's `hybridcache daemon` line).
    fn restart_daemon(&mut self, args: &[String]) -> Result<(), String> {
        if let Some(mut d) = self.daemon.take() {
            d.stop();
        }
        let mut extra: Vec<&str> = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let a = args[i].as_str();
            if a == "--control" || a == "--nbd-socket" {
                i += 2;
                continue;
            }
            if a.starts_with("--control=") || a.starts_with("--nbd-socket=") {
                i += 1;
                continue;
            }
            extra.push(a);
            i += 1;
        }
        let root = self.root().to_path_buf();
        // Daemon::start_with panics with the daemon's log when it does not start; that is one
        // failure of this doc line, not the end of the run.
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Daemon::start_with(&root, &extra)
        }));
        match started {
            Ok(d) => {
                self.daemon = Some(d);
                Ok(())
            }
            Err(e) => Err(format!(
                "the daemon did not start: {}",
                e.downcast_ref::<String>().map_or("", |s| s.as_str())
            )),
        }
    }

    /// The doc's text with its paths and URIs made the test's (see the module's rule); with
    /// `make`, the devices and servers it names are made too.
    fn substitute(&mut self, s: &str, make: bool) -> Result<String, String> {
        let mut out = String::new();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let rest = &s[i..];
            let boundary = i == 0 || b" \t'\"=:(,".contains(&b[i - 1]);
            if boundary && rest.starts_with("nbd://") {
                let len = rest
                    .find(|c: char| c.is_whitespace() || c == '\'' || c == '"')
                    .unwrap_or(rest.len());
                out.push_str(&self.nbd_uri(&rest[..len], make)?);
                i += len;
                continue;
            }
            if boundary && b[i] == b'/' {
                let len = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || "._/+@-".contains(c)))
                    .unwrap_or(rest.len());
                out.push_str(&self.path(&rest[..len], make)?);
                i += len;
                continue;
            }
            let c = rest.chars().next().expect("not at the end");
            out.push(c);
            i += c.len_utf8();
        }
        Ok(out)
    }

    fn path(&mut self, p: &str, make: bool) -> Result<String, String> {
        let name = p.rsplit('/').next().unwrap_or("");
        if name == "control.sock" {
            return Ok(self.control().display().to_string());
        }
        if name == "nbd.sock" {
            return Ok(self.nbd().display().to_string());
        }
        if let Some(dev) = p.strip_prefix("/dev/") {
            let kernel = ["null", "zero", "random", "urandom", "fuse"].contains(&dev)
                || dev.starts_with("nbd")
                || dev.starts_with("ublk");
            if kernel || dev.is_empty() {
                return Ok(p.to_string());
            }
            let file = self.root().join("dev").join(dev);
            if make && !file.exists() {
                if let Some(parent) = file.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| format!("{p}: {e}"))?;
                }
                sparse_file(&file, DEVICE_BYTES);
            }
            return Ok(file.display().to_string());
        }
        let mapped = [
            "/tmp/", "/mnt/", "/var/", "/srv/", "/etc/", "/run/", "/home/",
        ]
        .iter()
        .any(|r| p.starts_with(r) || p == &r[..r.len() - 1]);
        if !mapped {
            return Ok(p.to_string());
        }
        let file = self.root().join(p.trim_start_matches('/'));
        if make && p.starts_with("/etc/") && !file.exists() && !p.ends_with('/') {
            self.etc_copy(p, &file)?;
        }
        Ok(file.display().to_string())
    }

    /// An `/etc` file the doc uses without writing it: the last ```toml block for a `.toml`
    /// file, else the workspace's `packaging/NAME` when there is one.
    fn etc_copy(&mut self, p: &str, file: &Path) -> Result<(), String> {
        let name = file.file_name().map(|n| n.to_owned()).unwrap_or_default();
        let content = if p.ends_with(".toml") {
            match self.last_toml.clone() {
                Some(t) => Some(self.substitute(&t, true)?),
                None => None,
            }
        } else {
            std::fs::read_to_string(workspace_root().join("packaging").join(&name)).ok()
        };
        if let Some(content) = content {
            if let Some(parent) = file.parent() {
                std::fs::create_dir_all(parent).map_err(|e| format!("{p}: {e}"))?;
            }
            std::fs::write(file, content).map_err(|e| format!("{p}: {e}"))?;
        }
        Ok(())
    }

    fn nbd_uri(&mut self, uri: &str, make: bool) -> Result<String, String> {
        let rest = &uri["nbd://".len()..];
        let (authority, name) = rest.split_once('/').unwrap_or((rest, ""));
        let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
        if ["localhost", "127.0.0.1", "[::1]"].contains(&host) {
            return Ok(format!(
                "nbd+unix:///{name}?socket={}",
                self.nbd().display()
            ));
        }
        let tag: String = authority
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let sock = self.root().join(format!("remote-{tag}.sock"));
        if make && !self.remotes.contains_key(authority) {
            if !need(&["nbdkit"]) {
                return Err(format!("{uri}: nbdkit is not installed to stand in for it"));
            }
            let server = nbdkit(&sock, &["memory".to_string(), "1G".to_string()]);
            self.remotes.insert(authority.to_string(), server);
        }
        Ok(format!("nbd+unix:///{name}?socket={}", sock.display()))
    }

    /// The command line as run: comment cut, paths substituted, `hybridcache` pointed at the
    /// test's build and daemon.
    fn as_run(&mut self, written: &str) -> Result<String, String> {
        let code = &written[..split(written).end];
        let s = self.substitute(code.trim(), true)?;
        let sp = split(&s);
        let mut out = String::new();
        let mut at = 0;
        for &(a, z) in &sp.segments {
            let seg = &s[a..z];
            let lead = seg.len() - seg.trim_start().len();
            let Some(prog) = program(seg) else { continue };
            let p = a + lead;
            let replacement = match prog {
                "hybridcache" => format!("'{BIN}' --control '{}'", self.control().display()),
                "fio" => "fio --io_size=16m".to_string(),
                _ => continue,
            };
            out.push_str(&s[at..p]);
            out.push_str(&replacement);
            at = p + prog.len();
        }
        out.push_str(&s[at..]);
        Ok(out)
    }
}

/// Why a command line is not run, or None when it is.
#[derive(Debug, PartialEq)]
enum NotRun {
    /// By the rule: a program the test does not run, an assignment, a background job.
    Rule(String),
    /// A tool the line needs is not installed (and `common::need` allows skipping).
    Missing(String),
}

fn not_run_reason(written: &str, have_cache: &mut HashMap<String, bool>) -> Option<NotRun> {
    let sp = split(written);
    if sp.segments.is_empty() {
        return Some(NotRun::Rule("no command".into()));
    }
    let mut missing = Vec::new();
    for &(a, z) in &sp.segments {
        let Some(prog) = program(&written[a..z]) else {
            return Some(NotRun::Rule("a shell assignment".into()));
        };
        if prog == "hybridcache" || BASE_TOOLS.contains(&prog) {
            continue;
        }
        if !TOOLS.contains(&prog) {
            return Some(NotRun::Rule(format!(
                "`{prog}` is not one of the tools the test runs"
            )));
        }
        let installed = *have_cache
            .entry(prog.to_string())
            .or_insert_with(|| have(prog));
        if !installed {
            missing.push(prog);
        }
    }
    if sp.background {
        return Some(NotRun::Rule("a background job".into()));
    }
    if !missing.is_empty() && !need(&missing) {
        return Some(NotRun::Missing(format!(
            "{} not installed",
            missing.join(", ")
        )));
    }
    None
}

/// `hybridcache daemon ...` lines: their options, else None.
fn daemon_line(written: &str) -> Option<Vec<String>> {
    let sp = split(written);
    let [(a, z)] = sp.segments[..] else {
        return None;
    };
    let w = words(&written[a..z]);
    if w.len() >= 2 && w[0] == "hybridcache" && w[1] == "daemon" {
        Some(w[2..].to_vec())
    } else {
        None
    }
}

// ---------------------------------------------------------------------------------------------
// Running

struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn run_sh(cmd: &str, world: &World) -> Result<Ran, String> {
    let out_path = world.root().join("cmd.out");
    let err_path = world.root().join("cmd.err");
    let out_f = std::fs::File::create(&out_path).map_err(|e| e.to_string())?;
    let err_f = std::fs::File::create(&err_path).map_err(|e| e.to_string())?;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(world.cwd())
        .env("HYBRIDCACHE_CONTROL", world.control())
        .stdin(Stdio::null())
        .stdout(out_f)
        .stderr(err_f)
        .spawn()
        .map_err(|e| format!("sh: {e}"))?;
    let deadline = Instant::now() + COMMAND_TIMEOUT;
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {COMMAND_TIMEOUT:?}: killed"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Ran {
        code: status.code(),
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    })
}

/// A line's shape: whitespace dropped and every number one `N`, so that counts, sizes and
/// column widths may differ from the doc's.
fn shape(s: &str) -> String {
    let mut out = String::new();
    let mut in_num = false;
    let chars: Vec<char> = s.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        if c.is_whitespace() {
            continue;
        }
        // JSON tools write 0.0 as 0: a decimal point inside a number is part of it.
        let decimal_point =
            c == '.' && in_num && chars.get(i + 1).is_some_and(|n| n.is_ascii_digit());
        if c.is_ascii_digit() || decimal_point {
            if !in_num {
                out.push('N');
            }
            in_num = true;
        } else {
            in_num = false;
            out.push(c);
        }
    }
    out
}

/// Whether an actual line matches the doc's line by shape; the doc's `...` ends the comparison.
fn same_shape(doc: &str, actual: &str) -> bool {
    match doc.find("...") {
        Some(cut) => shape(actual).starts_with(&shape(&doc[..cut])),
        None => shape(doc) == shape(actual),
    }
}

/// A line as an output sample compares it: runs of spaces and of `═` as one (module doc).
fn sample_norm(s: &str) -> String {
    let mut out = String::new();
    let mut last: Option<char> = None;
    for c in s.trim_end().chars() {
        let c = if c.is_whitespace() { ' ' } else { c };
        if (c == ' ' || c == '═') && last == Some(c) {
            continue;
        }
        out.push(c);
        last = Some(c);
    }
    out
}

/// The length of the number `s` starts with (module doc: `<N>`), 0 when none.
fn number_len(s: &str) -> usize {
    let mut end = 0;
    for (i, c) in s.char_indices() {
        let part = c.is_ascii_digit() || (i == 0 && c == '-') || (i > 0 && (c == '.' || c == ','));
        if !part {
            break;
        }
        if c.is_ascii_digit() {
            // A trailing comma or point is the text's, not the number's.
            end = i + 1;
        }
    }
    end
}

/// Whether `got` is the doc's sample line `want`, where `<N>` stands for any one number.
fn sample_line(want: &str, got: &str) -> bool {
    let want = sample_norm(want);
    let got = sample_norm(got);
    let mut parts = want.split("<N>");
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = got.strip_prefix(first) else {
        return false;
    };
    for part in parts {
        let n = number_len(rest);
        if n == 0 {
            return false;
        }
        let Some(after) = rest[n..].strip_prefix(part) else {
            return false;
        };
        rest = after;
    }
    rest.is_empty()
}

/// Whether a command's whole output is the doc's sample (module doc); Err says where not.
fn sample_matches(want: &[String], got: &str) -> Result<(), String> {
    // Trailing blank lines of the block are the doc's layout, not output.
    let mut want: Vec<&str> = want.iter().map(String::as_str).collect();
    while want.last().is_some_and(|l| l.trim().is_empty()) {
        want.pop();
    }
    let got: Vec<&str> = got.lines().collect();
    sample_walk(&want, &got, 0, 0).map_err(|(_, e)| e)
}

/// Err carries how many of the doc's lines matched before the mismatch, so that after a `...`
/// the mismatch reported is the one of the alignment that got furthest.
fn sample_walk(want: &[&str], got: &[&str], w0: usize, g0: usize) -> Result<(), (usize, String)> {
    match want.first() {
        None if got.is_empty() => Ok(()),
        None => Err((
            w0,
            format!("output line {} `{}` is not in the doc", g0 + 1, got[0]),
        )),
        Some(l) if l.trim() == "..." => {
            let rest = &want[1..];
            let mut best: Option<(usize, String)> = None;
            for skip in 0..=got.len() {
                match sample_walk(rest, &got[skip..], w0 + 1, g0 + skip) {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        if best.as_ref().map_or(true, |b| e.0 > b.0) {
                            best = Some(e);
                        }
                    }
                }
            }
            Err(best.unwrap_or_default())
        }
        Some(l) => match got.first() {
            None => Err((w0, format!("the doc's line {} `{l}` is missing", w0 + 1))),
            Some(g) if sample_line(l, g) => sample_walk(&want[1..], &got[1..], w0 + 1, g0 + 1),
            Some(g) => Err((
                w0,
                format!("the doc's line {} `{l}`, got line {} `{g}`", w0 + 1, g0 + 1),
            )),
        },
    }
}

const ERROR_PREFIX: &str = "hybridcache: ";

fn first_words(s: &str, n: usize) -> String {
    s.split_whitespace().take(n).collect::<Vec<_>>().join(" ")
}

fn run_file(doc: &str, text: &str, report: &mut Report) {
    run_blocks(doc, text, false, report)
}

/// A doc of output samples (module doc): its ```console blocks only, outputs compared whole.
fn run_samples(doc: &str, text: &str, report: &mut Report) {
    run_blocks(doc, text, true, report)
}

fn run_blocks(doc: &str, text: &str, samples: bool, report: &mut Report) {
    let blocks = match blocks(doc, text) {
        Ok(b) => b,
        Err(e) => {
            report.failures.push(e);
            return;
        }
    };
    let mut world = World::new();
    let mut have_cache = HashMap::new();
    for block in &blocks {
        if block.lang == "toml" {
            world.last_toml = Some(block.lines.iter().map(|(_, l)| format!("{l}\n")).collect());
        }
        if !is_command_block(&block.lang) || (samples && block.lang != "console") {
            continue;
        }
        if samples && !block.lines.iter().any(|(_, l)| l.starts_with("$ ")) {
            report.failures.push(format!(
                "{doc}:{}: an output sample must be a transcript (`$ ` before each command)",
                block.line
            ));
            continue;
        }
        if let Some(reason) = &block.skip {
            report.skipped_blocks.push(reason.clone());
            continue;
        }
        if block.reset {
            world = World::new();
        }
        let setup = block.setup.iter().map(|(n, c)| DocCommand {
            line: *n,
            written: c.clone(),
            output: Vec::new(),
            whole: false,
        });
        let setup_count = block.setup.len();
        for (k, mut cmd) in setup.chain(commands(block)).enumerate() {
            let is_setup = k < setup_count;
            cmd.whole = samples && !is_setup;
            run_command(doc, &cmd, is_setup, &mut world, &mut have_cache, report);
        }
    }
}

fn run_command(
    doc: &str,
    cmd: &DocCommand,
    is_setup: bool,
    world: &mut World,
    have_cache: &mut HashMap<String, bool>,
    report: &mut Report,
) {
    let at = format!("{doc}:{}", cmd.line);
    let failures = std::cell::RefCell::new(Vec::new());
    let fail = |what: String| {
        failures
            .borrow_mut()
            .push(format!("{at}: {what}\n  as written: {}\n", cmd.written))
    };
    run_checked(cmd, is_setup, world, have_cache, report, &at, &fail);
    report.failures.extend(failures.into_inner());
}

fn run_checked(
    cmd: &DocCommand,
    is_setup: bool,
    world: &mut World,
    have_cache: &mut HashMap<String, bool>,
    report: &mut Report,
    at: &str,
    fail: &dyn Fn(String),
) {
    if let Some(args) = daemon_line(&cmd.written) {
        let args: Result<Vec<String>, String> =
            args.iter().map(|a| world.substitute(a, true)).collect();
        match args {
            Ok(args) => {
                report.ran += 1;
                if let Err(e) = world.restart_daemon(&args) {
                    fail(e);
                }
            }
            Err(e) => fail(e),
        }
        return;
    }
    if let Some(why) = not_run_reason(&cmd.written, have_cache) {
        let reason = match &why {
            NotRun::Rule(r) | NotRun::Missing(r) => r.clone(),
        };
        let sp = split(&cmd.written);
        let names_hybridcache = sp
            .segments
            .iter()
            .any(|&(a, z)| program(&cmd.written[a..z]) == Some("hybridcache"));
        if is_setup {
            fail(format!("a setup command must run, but: {reason}"));
        } else {
            report
                .not_run
                .push(format!("{at}: {} ({reason})", cmd.written));
        }
        // A hybridcache command must not hide in a line the rule leaves out: that is how a doc
        // drifts unseen. Such a line is split, or its block marked skip with the reason.
        if names_hybridcache && matches!(why, NotRun::Rule(_)) {
            fail(format!(
                "a hybridcache command in a line that is not run ({reason}): split the line, \
                 or mark the block `<!-- doc-test: skip (REASON) -->`"
            ));
        }
        return;
    }
    let run = match world.as_run(&cmd.written) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let started = Instant::now();
    let ran = run_sh(&run, world);
    if started.elapsed() > Duration::from_secs(2) {
        eprintln!("{at}: took {:?}: {run}", started.elapsed());
    }
    let ran = match ran {
        Ok(r) => r,
        Err(e) => return fail(format!("{e}\n  as run: {run}")),
    };
    report.ran += 1;
    let details = format!(
        "  as run: {run}\n  exit: {}\n  stderr: {}\n  stdout: {}",
        ran.code.map_or("signal".to_string(), |c| c.to_string()),
        ran.stderr.trim_end(),
        ran.stdout
            .lines()
            .take(5)
            .collect::<Vec<_>>()
            .join("\n          "),
    );
    if cmd.whole {
        // The doc shows the error (stderr) when its output starts with the CLI's prefix.
        let error = cmd
            .output
            .first()
            .is_some_and(|l| l.starts_with(ERROR_PREFIX));
        if error == (ran.code == Some(0)) {
            return fail(format!(
                "{}\n{details}",
                if error {
                    "the doc shows this failing, but it succeeded"
                } else {
                    "exited non-zero"
                }
            ));
        }
        let mut want = Vec::new();
        for l in &cmd.output {
            match world.substitute(l, false) {
                Ok(l) => want.push(l),
                Err(e) => return fail(e),
            }
        }
        let got = if error { &ran.stderr } else { &ran.stdout };
        if let Err(e) = sample_matches(&want, got) {
            fail(format!(
                "output differs from the doc's sample: {e}\n{details}"
            ));
        }
        return;
    }
    let expected = match cmd.output.first() {
        Some(l) => match world.substitute(l, false) {
            Ok(l) => Some(l),
            Err(e) => return fail(e),
        },
        None => None,
    };
    match expected.as_deref() {
        Some(e) if e.starts_with(ERROR_PREFIX) => {
            let want = first_words(&e[ERROR_PREFIX.len()..], 2);
            let got = ran.stderr.lines().next().unwrap_or("");
            if ran.code == Some(0) {
                fail(format!(
                    "the doc shows this failing, but it succeeded\n{details}"
                ));
            } else if !got.starts_with(ERROR_PREFIX)
                || shape(&first_words(&got[ERROR_PREFIX.len()..], 2)) != shape(&want)
            {
                fail(format!("another error than the doc's `{e}`\n{details}"));
            }
        }
        _ if ran.code != Some(0) => fail(format!("exited non-zero\n{details}")),
        Some(e) => {
            let got = ran.stdout.lines().next().unwrap_or("");
            if !same_shape(e, got) {
                fail(format!(
                    "output differs from the doc's: first line `{e}`, got `{got}`\n{details}"
                ));
            }
        }
        None => {}
    }
}

// ---------------------------------------------------------------------------------------------
// The harness's own rules

#[test]
fn blocks_and_markers_are_parsed() {
    let md = "text\n<!-- doc-test: skip (needs root) -->\n```sh\nmount x\n```\n\n\
              <!-- doc-test: reset -->\n<!-- doc-test: setup hybridcache -S -d ram:1G -->\n\n\
              ```\n$ hybridcache -L\ntype id\n$ hybridcache -T \\\n  -i 1\n```\n```text\nx\n```\n";
    let b = blocks("t.md", md).expect("parses");
    assert_eq!(b.len(), 3);
    assert_eq!(b[0].skip.as_deref(), Some("t.md:2: needs root"));
    assert!(b[1].reset && b[1].setup.len() == 1);
    let cmds = commands(&b[1]);
    assert_eq!(cmds.len(), 2);
    assert_eq!(cmds[0].output, vec!["type id"]);
    assert_eq!(cmds[1].written, "hybridcache -T -i 1");
    assert!(!is_command_block(&b[2].lang));
    assert!(blocks("t.md", "<!-- doc-test: skip -->\n```\n```\n").is_err());
    assert!(blocks("t.md", "<!-- doc-test: skpi (x) -->\n```\n```\n").is_err());
    assert!(blocks("t.md", "<!-- doc-test: reset -->\nprose\n```\n```\n").is_err());
}

#[test]
fn which_lines_run() {
    let mut c = HashMap::new();
    assert_eq!(not_run_reason("hybridcache -L   # list", &mut c), None);
    assert!(matches!(
        not_run_reason("make install", &mut c),
        Some(NotRun::Rule(_))
    ));
    assert_eq!(
        not_run_reason("mkdir -p /tmp/hc && truncate -s 1G /tmp/hc/a.img", &mut c),
        None
    );
    assert!(not_run_reason("cargo build --release", &mut c).is_some());
    assert!(not_run_reason("export PATH=$PWD/target/release:$PATH", &mut c).is_some());
    assert!(not_run_reason("dev=$(losetup -f --show x)", &mut c).is_some());
    assert!(not_run_reason("nbdfuse /a 'nbd+unix:///x' &", &mut c).is_some());
    assert!(not_run_reason("hybridcache -L && mount /dev/x /mnt", &mut c).is_some());
    assert_eq!(
        daemon_line("hybridcache daemon --control /a --nbd-socket '/b c' &"),
        Some(vec![
            "--control".into(),
            "/a".into(),
            "--nbd-socket".into(),
            "/b c".into()
        ])
    );
    assert_eq!(daemon_line("hybridcache -L"), None);
}

#[test]
fn output_is_compared_by_shape() {
    assert!(same_shape("cache 1 started", "cache 12 started"));
    assert!(same_shape(
        "type    id   disk      status",
        "type id disk status"
    ));
    assert!(!same_shape("cache 1 started", "cache 1 loaded"));
    assert!(same_shape(r#"{"percent":12.5}"#, r#"{"percent":0}"#));
    assert!(!same_shape("a ...", "b c"));
    assert!(same_shape(
        r#"{"ok":true,"result":{...}}"#,
        r#"{"ok":true,"result":{"a":1}}"#
    ));
}

/// The test must be able to fail: a doc whose command fails, whose output is not the program's,
/// or that shows an error where the program succeeds, is reported with its line, the command as
/// written and as run, and stderr.
#[test]
fn a_doc_that_drifted_fails_with_its_lines() {
    let md = "```\n\
              $ hybridcache -S -d /dev/nvme0n1 -c wb\n\
              cache 1 started\n\
              $ hybridcache -S -d /dev/nvme0n1 -c wb\n\
              $ hybridcache -L\n\
              cache 1 started\n\
              $ hybridcache -T -i 1\n\
              hybridcache: cache 1 is busy\n\
              $ hybridcache -T -i 1\n\
              hybridcache: cache 1 does not exist\n\
              ```\n";
    let mut report = Report::default();
    run_file("t.md", md, &mut report);
    assert_eq!(report.ran, 5);
    let f = &report.failures;
    assert_eq!(f.len(), 3, "{f:#?}");
    assert!(f[0].starts_with("t.md:4: exited non-zero"), "{}", f[0]);
    assert!(
        f[0].contains("as written: hybridcache -S -d /dev/nvme0n1 -c wb")
            && f[0].contains("--control")
            && f[0].contains("/dev/nvme0n1 -c wb")
            && f[0].contains("stderr: hybridcache: "),
        "{}",
        f[0]
    );
    assert!(f[1].starts_with("t.md:5: output differs"), "{}", f[1]);
    assert!(
        f[2].starts_with("t.md:7: the doc shows this failing, but it succeeded"),
        "{}",
        f[2]
    );
}

#[test]
fn samples_compare_the_whole_output() {
    assert!(sample_line(
        "║ Wake up time [s] │ 20 ║",
        "║ Wake up time [s]    │ 20    ║"
    ));
    assert!(sample_line("╔═══╤═╗", "╔══════════╤═══════╗"));
    assert!(!sample_line(
        "║ Wake up time [s] │ 20 ║",
        "║ Wake up time [s] │ 30 ║"
    ));
    assert!(sample_line("Dirty for,<N> [s]", "Dirty for,23 [s]"));
    assert!(sample_line(
        "rate <N> MB/s, <N> lines",
        "rate 1,234.5 MB/s, 7 lines"
    ));
    assert!(!sample_line("Dirty for,<N> [s]", "Dirty for,2 [m] 3 [s]"));
    assert!(!sample_line("<N>", "x"));
    let lines = |s: &str| s.lines().map(str::to_string).collect::<Vec<_>>();
    assert!(sample_matches(&lines("a\n...\nd"), "a\nb\nc\nd\n").is_ok());
    assert!(sample_matches(&lines("a\n...\nd"), "a\nd\n").is_ok());
    assert!(sample_matches(&lines("a\nb"), "a\nb\nc\n").is_err());
    assert!(sample_matches(&lines("a\nb\n"), "a\n").is_err());
}

/// A sample that is not what the program prints fails, with the line that differs; blocks other
/// than ```console are not run in a samples doc.
#[test]
fn a_sample_that_drifted_fails() {
    let md = "```\n\
              hybridcache -X -n no-such-group -i 1 -p x|y\n\
              ```\n\
              <!-- doc-test: setup hybridcache -S -d /dev/nvme0n1 -c wb -->\n\
              ```console\n\
              $ hybridcache -G -n cleaning -i 1 -o csv\n\
              Parameter name,Value\n\
              Cleaning policy type,alru\n\
              $ hybridcache -G -n cleaning -i 1 -o csv\n\
              Parameter name,Value\n\
              Cleaning policy type,acp\n\
              $ hybridcache -G -n cleaning -i 1 -o csv\n\
              Parameter name,Value\n\
              $ hybridcache -T -i 7\n\
              hybridcache: cache 7 does not exist\n\
              ```\n";
    let mut report = Report::default();
    run_samples("t.md", md, &mut report);
    assert_eq!(report.ran, 5, "{:#?}", report.failures);
    let f = &report.failures;
    assert_eq!(f.len(), 2, "{f:#?}");
    assert!(
        f[0].starts_with(
            "t.md:9: output differs from the doc's sample: the doc's line 2 \
             `Cleaning policy type,acp`, got line 2 `Cleaning policy type,alru`"
        ),
        "{}",
        f[0]
    );
    assert!(
        f[1].starts_with(
            "t.md:12: output differs from the doc's sample: output line 2 \
             `Cleaning policy type,alru` is not in the doc"
        ),
        "{}",
        f[1]
    );
}

#[test]
fn paths_and_uris_are_the_tests() {
    let mut w = World::new();
    let root = w.root().display().to_string();
    let sub = |w: &mut World, s: &str| w.substitute(s, true).expect("substitutes");
    assert_eq!(
        sub(
            &mut w,
            "-d /dev/nvme0n1p1 --control=/run/hybridcache/control.sock"
        ),
        format!("-d {root}/dev/nvme0n1p1 --control={root}/control.sock")
    );
    let dev = w.root().join("dev/nvme0n1p1");
    assert_eq!(
        std::fs::metadata(&dev).map(|m| m.len()).ok(),
        Some(DEVICE_BYTES)
    );
    assert_eq!(
        sub(
            &mut w,
            "'nbd+unix:///cas1-1?socket=/run/hybridcache/nbd.sock' /dev/null"
        ),
        format!("'nbd+unix:///cas1-1?socket={root}/nbd.sock' /dev/null")
    );
    assert_eq!(
        sub(&mut w, "nbdinfo nbd://127.0.0.1:10809/cas1-1"),
        format!("nbdinfo nbd+unix:///cas1-1?socket={root}/nbd.sock")
    );
    assert_eq!(
        sub(&mut w, "file:/tmp/hc/a.img $PWD/target/release"),
        format!("file:{root}/tmp/hc/a.img $PWD/target/release")
    );
    w.last_toml = Some("[[cache]]\ndevice = \"/dev/sdq\"\n".into());
    assert_eq!(
        sub(&mut w, "--config /etc/hybridcache.toml"),
        format!("--config {root}/etc/hybridcache.toml")
    );
    let toml = std::fs::read_to_string(w.root().join("etc/hybridcache.toml")).unwrap_or_default();
    assert_eq!(toml, format!("[[cache]]\ndevice = \"{root}/dev/sdq\"\n"));
    let csv = w.root().join("etc/hybridcache/ioclass-config.csv");
    sub(&mut w, "/etc/hybridcache/ioclass-config.csv");
    assert!(csv.exists(), "a copy of packaging/ioclass-config.csv");
}

#[test]
fn a_hybridcache_command_cannot_hide_in_a_line_that_is_not_run() {
    let mut report = Report::default();
    run_file(
        "t.md",
        "```sh\nhybridcache -L && mount /dev/sdb /mnt\n```\n",
        &mut report,
    );
    assert_eq!(report.failures.len(), 1, "{:#?}", report.failures);
    assert!(
        report.failures[0].starts_with("t.md:2: a hybridcache command in a line that is not run")
    );
}
