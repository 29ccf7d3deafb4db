//! Issue 30, cases 1, 2 and 8b, and the safety table: no command destroys acknowledged data
//! (dirty lines), clients' exports, a device's content or a cache without the consent that names
//! exactly that loss, a refusal's hint never points to a flag that loses more, and every accepted
//! loss is printed and logged with its size. The table test reads docs/cli.md's "What a command
//! can destroy" table, so the documentation is what is tested.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{need, sparse_file, workdir, Daemon};
use hybridcache_nbd::client::Client;

const MIB: u64 = 1 << 20;
/// What the tests write through a client: 8 MiB, i.e. 2,048 dirty lines of 4 KiB, as the issue.
const WRITTEN: u64 = 8 * MIB;

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// A pattern no sparse file holds, different per `seed`, so a lost write shows.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

fn hash(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A write-back cache (cache id `cache`, core id `core`) on files, cleaning off so that what a
/// client writes stays dirty until something flushes it.
struct Setup {
    dir: tempfile::TempDir,
    cache_file: PathBuf,
    core_file: PathBuf,
    spec: String,
    cache: u16,
    core: u16,
    daemon: Option<Daemon>,
}

impl Setup {
    fn new(cache: u16, core: u16) -> Setup {
        let dir = workdir();
        let cache_file = dir.path().join("cache.img");
        let core_file = dir.path().join("core.img");
        sparse_file(&cache_file, 64 * MIB);
        sparse_file(&core_file, 32 * MIB);
        let spec = format!("file:{}", cache_file.display());
        let daemon = Daemon::start(dir.path());
        let s = Setup {
            dir,
            cache_file,
            core_file,
            spec,
            cache,
            core,
            daemon: Some(daemon),
        };
        let (i, spec) = (s.i(), s.spec.clone());
        s.d().ok(&["-S", "-d", &spec, "-i", &i, "-c", "wb"]);
        s.add_core();
        s
    }

    fn d(&self) -> &Daemon {
        self.daemon.as_ref().expect("daemon running")
    }

    fn i(&self) -> String {
        self.cache.to_string()
    }

    fn j(&self) -> String {
        self.core.to_string()
    }

    fn export(&self) -> String {
        format!("cas{}-{}", self.cache, self.core)
    }

    fn add_core(&self) {
        let (i, j) = (self.i(), self.j());
        self.d()
            .ok(&["-A", "-i", &i, "-j", &j, "-d", path_str(&self.core_file)]);
        self.d()
            .ok(&["-X", "-n", "cleaning", "-i", &i, "-p", "nop"]);
    }

    /// Connect to the core's export and write `WRITTEN` bytes of pattern `seed`, flushed (so a
    /// crash keeps them on the cache device); the connection stays open while the client lives.
    fn write_dirty(&self, seed: u8) -> Client {
        let mut c = Client::connect_unix(&self.d().nbd, &self.export()).expect("NBD connection");
        let data = pattern(seed, WRITTEN as usize);
        for (k, chunk) in data.chunks(MIB as usize).enumerate() {
            c.write(chunk, k as u64 * MIB, false).expect("write");
        }
        c.flush().expect("NBD flush");
        assert_eq!(self.dirty_lines(), WRITTEN / 4096, "the writes stay dirty");
        c
    }

    fn dirty_lines(&self) -> u64 {
        self.d().stats_json(self.cache, Some(self.core))["usage"]["dirty"]["count"]
            .as_u64()
            .expect("dirty lines in -P's JSON")
    }

    /// Whether the core file holds what pattern `seed` wrote.
    fn core_has(&self, seed: u8) -> bool {
        let core = hash(&self.core_file);
        core[..WRITTEN as usize] == pattern(seed, WRITTEN as usize)[..]
    }

    fn crash(&mut self) {
        if let Some(d) = self.daemon.as_mut() {
            d.kill();
        }
        self.daemon = None;
        self.daemon = Some(Daemon::start(self.dir.path()));
    }
}

/// The `--flags` a refusal names.
fn flags_in(message: &str) -> Vec<String> {
    message
        .split(|c: char| c.is_whitespace() || c == ',' || c == ';' || c == ')' || c == '(')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(['.', ':']).to_string())
        .collect()
}

/// Case 1: `-R` with a client connected and dirty data; following the refusal's hint never
/// loses the acknowledged writes.
#[test]
fn removing_a_core_with_a_client_never_loses_data_by_following_the_hint() {
    let s = Setup::new(2, 3);
    let client = s.write_dirty(7);
    let e = s.d().fails(&["-R", "-i", "2", "-j", "3"]);
    assert!(e.contains("cas2-3 has 1 NBD connection open"), "{e}");
    let hint = flags_in(&e);
    assert!(!hint.is_empty(), "the refusal names a flag: {e}");
    let mut args: Vec<&str> = vec!["-R", "-i", "2", "-j", "3"];
    args.extend(hint.iter().map(String::as_str));
    s.d().ok(&args);
    drop(client);
    assert!(
        s.core_has(7),
        "following the hint {hint:?} of \"{e}\" lost acknowledged writes"
    );
    assert!(
        !e.contains("--force"),
        "a refusal about clients points to the flag that discards dirty data: {e}"
    );
    let log = s.d().log_text();
    assert!(!log.contains("discarded"), "{log}");
}

/// Case 1, second half: `-R -f` names what it discards (stdout and the log at WARN); with a
/// client connected too, `-f` alone is refused for the client.
#[test]
fn forced_removal_names_the_discarded_lines() {
    let s = Setup::new(2, 3);
    let client = s.write_dirty(9);
    let e = s.d().fails(&["-R", "-i", "2", "-j", "3", "--force"]);
    assert!(e.contains("cas2-3 has 1 NBD connection open"), "{e}");
    assert!(e.contains("--disconnect-clients"), "{e}");
    drop(client);
    let out = s.d().ok(&["-R", "-i", "2", "-j", "3", "--force"]);
    let said = "discarded 2,048 dirty lines (8 MiB) of core 3 of cache 2";
    assert!(out.contains(said), "stdout: {out}");
    let log = s.d().log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN") && l.contains(said)),
        "{log}"
    );
    assert!(!s.core_has(9));
    // Both consents together: the client's export and the dirty data, each printed.
    s.add_core();
    let _client = s.write_dirty(11);
    let out = s.d().ok(&[
        "-R",
        "-i",
        "2",
        "-j",
        "3",
        "--force",
        "--disconnect-clients",
    ]);
    assert!(out.contains(said), "{out}");
    assert!(out.contains("closed 1 NBD connection of cas2-3"), "{out}");
}

/// `-T` with a client: the same consent flag as `-R`; its old `--force` stays an alias.
#[test]
fn stopping_with_a_client_names_the_client_consent_and_flushes() {
    let s = Setup::new(1, 1);
    let _client = s.write_dirty(5);
    let e = s.d().fails(&["-T", "-i", "1"]);
    assert!(e.contains("cas1-1 has 1 NBD connection open"), "{e}");
    assert!(e.contains("--disconnect-clients"), "{e}");
    assert!(!e.contains("--force"), "{e}");
    let out = s.d().ok(&["-T", "-i", "1", "--disconnect-clients"]);
    assert!(out.contains("closed 1 NBD connection of cas1-1"), "{out}");
    assert!(s.core_has(5), "-T --disconnect-clients flushes");
}

/// Case 2: `--zero-metadata` refuses a cache with dirty data, after `-T -n` and after a crash,
/// and leaves the device as it was; `-f` wipes it and says what was destroyed.
#[test]
fn zero_metadata_refuses_a_cache_with_dirty_data() {
    let mut s = Setup::new(1, 1);
    drop(s.write_dirty(3));
    s.d().ok(&["-T", "-i", "1", "-n"]);
    let before = hash(&s.cache_file);
    let e = s.d().fails(&["--zero-metadata", "-d", &s.spec]);
    assert!(e.contains("2,048 dirty lines (8 MiB)"), "{e}");
    assert!(e.contains("--force"), "{e}");
    assert!(e.contains("--load"), "{e}");
    assert!(
        hash(&s.cache_file) == before,
        "a refusal changed the device"
    );
    // After a crash: the same.
    s.d().ok(&["-S", "-d", &s.spec, "--load"]);
    let _c = s.write_dirty(4);
    drop(_c);
    s.crash();
    let before = hash(&s.cache_file);
    let e = s.d().fails(&["--zero-metadata", "-d", &s.spec]);
    assert!(e.contains("dirty line"), "{e}");
    assert!(
        hash(&s.cache_file) == before,
        "a refusal changed the device"
    );
    let out = s.d().ok(&["--zero-metadata", "-d", &s.spec, "--force"]);
    assert!(
        out.contains("destroyed cache 1 on") && out.contains("2,048 dirty lines (8 MiB)"),
        "{out}"
    );
    assert!(s
        .d()
        .log_text()
        .lines()
        .any(|l| l.contains("WARN") && l.contains("destroyed cache 1")));
    let e = s.d().fails(&["-S", "-d", &s.spec, "--load"]);
    assert!(e.contains("no hybridcache cache found"), "{e}");
}

/// Case 8b: `-S` on a device holding a cache with dirty data names the dirty count, `--load`,
/// and what `--force` destroys; `-S -f` prints what it discarded.
#[test]
fn start_over_a_dirty_cache_names_the_dirty_data_and_load() {
    let s = Setup::new(1, 1);
    drop(s.write_dirty(6));
    s.d().ok(&["-T", "-i", "1", "-n"]);
    let before = hash(&s.cache_file);
    let e = s.d().fails(&["-S", "-d", &s.spec]);
    assert!(e.contains("2,048 dirty lines (8 MiB)"), "{e}");
    assert!(e.contains("--load"), "{e}");
    assert!(e.contains("--force"), "{e}");
    assert!(hash(&s.cache_file) == before);
    let out = s.d().ok(&["-S", "-d", &s.spec, "--force"]);
    assert!(
        out.contains("destroyed cache 1 on") && out.contains("2,048 dirty lines (8 MiB)"),
        "{out}"
    );
    assert!(out.contains("cache 1 started"), "{out}");
}

/// A damaged superblock is destroyed by `-S --force` only, and said so.
#[test]
fn start_over_a_damaged_superblock_names_it() {
    let s = Setup::new(1, 1);
    s.d().ok(&["-T", "-i", "1"]);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&s.cache_file)
            .expect("open the cache file");
        for slot in [0, MIB] {
            f.write_all_at(&[0xee; 32], slot + 100)
                .expect("damage a slot");
        }
    }
    let before = hash(&s.cache_file);
    let e = s.d().fails(&["-S", "-d", &s.spec]);
    assert!(e.contains("a damaged hybridcache superblock"), "{e}");
    assert!(e.contains("give --force"), "{e}");
    assert!(hash(&s.cache_file) == before);
    let out = s.d().ok(&["-S", "-d", &s.spec, "--force"]);
    assert!(
        out.contains("overwrote a damaged hybridcache superblock"),
        "{out}"
    );
}

// ---- the table test --------------------------------------------------------------------------

/// One row of docs/cli.md's safety table.
#[derive(Debug)]
struct Row {
    command: String,
    situation: String,
    consent: String,
    without: String,
    printed: String,
}

fn table() -> Vec<Row> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cli.md"))
        .expect("docs/cli.md");
    let start = doc
        .find("## What a command can destroy")
        .expect("docs/cli.md has the safety section");
    let section = &doc[start..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    let cell = |c: &str| c.trim().trim_matches('`').replace("\\|", "|").to_string();
    let mut rows = Vec::new();
    for line in section[..end].lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<String> = line.trim_matches('|').split(" | ").map(cell).collect();
        if cells.len() != 6 || cells[0] == "Command" || cells[0].starts_with("---") {
            continue;
        }
        rows.push(Row {
            command: cells[0].clone(),
            situation: cells[1].clone(),
            consent: cells[3].split('`').next().unwrap_or("").trim().to_string(),
            without: cells[4].clone(),
            printed: cells[5].clone(),
        });
    }
    rows
}

/// Bring a fresh setup into the row's situation; what it returns must outlive the command.
fn situation(s: &Setup, what: &str) -> Vec<Client> {
    match what {
        "an NBD connection open" => {
            vec![Client::connect_unix(&s.d().nbd, &s.export()).expect("client")]
        }
        "dirty data on the core" => {
            drop(s.write_dirty(21));
            vec![]
        }
        "the device holds a stopped cache with dirty data" => {
            drop(s.write_dirty(22));
            s.d().ok(&["-T", "-i", &s.i(), "-n"]);
            vec![]
        }
        "the core is inactive with dirty data" => {
            drop(s.write_dirty(23));
            s.d().ok(&["-T", "-i", &s.i(), "-n"]);
            // Moved away for good: a device coming back under its name is attached again.
            let moved = s.core_file.with_extension("away");
            std::fs::rename(&s.core_file, &moved).expect("move the core away");
            let out = s.d().ok(&["-S", "-d", &s.spec, "--load"]);
            assert!(out.contains("is inactive"), "{out}");
            vec![]
        }
        "the device holds an ext4 file system" => {
            let (i, j) = (s.i(), s.j());
            s.d().ok(&["-R", "-i", &i, "-j", &j]);
            s.d().ok(&["-T", "-i", &i]);
            // A file system made over nothing else, as on a fresh disk.
            std::fs::remove_file(&s.cache_file).expect("remove the cache file");
            sparse_file(&s.cache_file, 64 * MIB);
            let out = Command::new("mkfs.ext4")
                .args(["-q", "-F"])
                .arg(&s.cache_file)
                .output()
                .expect("mkfs.ext4");
            assert!(out.status.success(), "{out:?}");
            vec![]
        }
        "the device holds no hybridcache metadata" => {
            let (i, j) = (s.i(), s.j());
            s.d().ok(&["-R", "-i", &i, "-j", &j]);
            s.d().ok(&["-T", "-i", &i]);
            std::fs::write(&s.cache_file, pattern(1, (4 * MIB) as usize)).expect("fill");
            vec![]
        }
        other => panic!(
            "docs/cli.md's safety table names a situation this test does not know: {other:?}"
        ),
    }
}

fn words(command: &str, s: &Setup) -> Vec<String> {
    command
        .split_whitespace()
        .map(|w| match w {
            "DEV" => s.spec.clone(),
            other => other.to_string(),
        })
        .collect()
}

#[test]
fn every_row_of_the_safety_table_is_refused_without_its_consent_and_accepted_with_it() {
    if !need(&["mkfs.ext4"]) {
        return;
    }
    let rows = table();
    assert!(rows.len() >= 6, "the safety table: {rows:?}");
    for row in &rows {
        let s = Setup::new(1, 1);
        let held = situation(&s, &row.situation);
        let files = |s: &Setup| -> BTreeMap<&'static str, Option<Vec<u8>>> {
            [
                ("cache", std::fs::read(&s.cache_file).ok()),
                ("core", std::fs::read(&s.core_file).ok()),
            ]
            .into()
        };
        let before = files(&s);
        let args = words(&row.command, &s);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let e = s.d().fails(&args);
        assert!(
            e.contains(&row.consent),
            "{row:?}: the refusal does not name {}: {e}",
            row.consent
        );
        assert_eq!(row.without, "refused", "{row:?}");
        assert!(
            files(&s) == before,
            "{row:?}: a refused command changed a device"
        );
        let mut with = args.clone();
        with.push(&row.consent);
        let out = s.d().ok(&with);
        assert!(
            out.contains(&row.printed),
            "{row:?}: accepted, but not printed as documented: {out}"
        );
        drop(held);
    }
}
