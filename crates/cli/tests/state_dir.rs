//! The operator's configuration file is never written, and what changes at run time survives a
//! restart in the daemon's state directory (issue 30, cases 3 and 4; docs/cli.md, "State
//! directory").

mod common;

use std::path::Path;

use common::{sparse_file, workdir, Daemon};

const MIB: u64 = 1 << 20;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i / 512) as u8))
        .collect()
}

fn write_at(d: &Daemon, export: &str, data: &[u8], offset: u64) {
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, export).expect("connect");
    c.write(data, offset, false).expect("write");
    c.flush().expect("flush");
    c.disconnect().expect("disconnect");
}

fn read_at(d: &Daemon, export: &str, len: usize, offset: u64) -> Vec<u8> {
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, export).expect("connect");
    let mut buf = vec![0u8; len];
    c.read(&mut buf, offset).expect("read");
    c.disconnect().expect("disconnect");
    buf
}

fn dirty(d: &Daemon, cache: u16) -> u64 {
    d.stats_json(cache, None)["usage"]["dirty"]["count"]
        .as_u64()
        .expect("dirty count")
}

/// A configuration file as an operator writes it: comments, odd spacing, a default said
/// explicitly, two cores.
fn hand_edited(cache: &Path, core1: &Path, core2: &Path) -> String {
    format!(
        "# hybridcache on this host -- edited by hand, keep the comments\n\
         \n\
         [daemon]\n\
         cleaning_stall_warn   =  30      # the default, said explicitly\n\
         \n\
         [[cache]]\n\
         id = 1\n\
         device = \"file:{}\"\n\
         mode = \"wt\"    # write-through until the RAID is rebuilt\n\
         \n\
         [[core]]\n\
         cache = 1\n\
         id = 1\n\
         device = \"{}\"\n\
         \n\
         [[core]]\n\
         cache   = 1\n\
         id      = 2\n\
         device  = \"{}\"\n",
        cache.display(),
        core1.display(),
        core2.display()
    )
}

struct Setup {
    dir: tempfile::TempDir,
    cfg: std::path::PathBuf,
    text: String,
}

fn setup() -> Setup {
    let dir = workdir();
    let p = dir.path();
    for (name, size) in [("cache.img", 64 * MIB), ("core1.img", 64 * MIB)] {
        sparse_file(&p.join(name), size);
    }
    sparse_file(&p.join("core2.img"), 64 * MIB);
    sparse_file(&p.join("core3.img"), 64 * MIB);
    let text = hand_edited(
        &p.join("cache.img"),
        &p.join("core1.img"),
        &p.join("core2.img"),
    );
    let cfg = p.join("hybridcache.toml");
    std::fs::write(&cfg, &text).expect("write the file");
    Setup { cfg, text, dir }
}

/// The shipped unit's command line before issue 30: `--save-config` must no longer rewrite the
/// operator's file, whatever changes at run time.
#[test]
fn the_operators_file_is_byte_identical_after_run_time_changes() {
    let s = setup();
    let p = s.dir.path();
    let cfg = s.cfg.to_str().expect("UTF-8");
    let d = Daemon::start_with(p, &["--config", cfg, "--save-config"]);
    let core3 = p.join("core3.img");
    let core3 = core3.to_str().expect("UTF-8");
    let steps: [(&str, &[&str]); 5] = [
        ("-X", &["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]),
        ("-Q", &["-Q", "-c", "wb", "-i", "1"]),
        ("-A", &["-A", "-i", "1", "-d", core3, "-j", "3"]),
        ("-R", &["-R", "-i", "1", "-j", "2"]),
        ("-T -n", &["-T", "-n", "-i", "1"]),
    ];
    for (name, args) in steps {
        if name == "-T -n" {
            write_at(&d, "cas1-1", &pattern(1, 64 << 10), 0);
        }
        d.ok(args);
        let now = std::fs::read_to_string(&s.cfg).expect("the file is still there");
        assert_eq!(
            now,
            s.text,
            "the configuration file changed after {name}; log:\n{}",
            d.log_text()
        );
    }
    let log = d.log_text();
    assert!(
        log.contains("WARN") && log.contains("no longer write") && log.contains("config export"),
        "the WARN about --save-config: {log}"
    );
}

/// A cache stopped with `-T -n` keeps its dirty data on its device only: the next start
/// loads it again, so its core is never left without its newest data. A core removed at run
/// time does not come back, though the file still names it; one added at run time does.
#[test]
fn a_cache_stopped_with_dirty_data_is_loaded_again_at_the_next_start() {
    let s = setup();
    let p = s.dir.path();
    let cfg = s.cfg.to_str().expect("UTF-8");
    let args = ["--config", cfg, "--save-config"];
    let mut d = Daemon::start_with(p, &args);
    let core3 = p.join("core3.img");
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    d.ok(&["-Q", "-c", "wb", "-i", "1"]);
    d.ok(&["-R", "-i", "1", "-j", "2"]);
    d.ok(&[
        "-A",
        "-i",
        "1",
        "-d",
        core3.to_str().expect("UTF-8"),
        "-j",
        "3",
    ]);
    let data = pattern(7, 256 << 10);
    write_at(&d, "cas1-1", &data, MIB);
    let before = dirty(&d, 1);
    assert!(before > 0, "wb with cleaning nop keeps the writes dirty");
    d.ok(&["-T", "-n", "-i", "1"]);
    assert!(d.stop(), "clean stop: {}", d.log_text());
    let core1 = std::fs::read(p.join("core1.img")).expect("core file");
    assert_ne!(
        &core1[MIB as usize..MIB as usize + data.len()],
        &data[..],
        "-T -n left the data dirty, not on the core"
    );

    let d = Daemon::start_with(p, &args);
    let list = d.ok(&["-L"]);
    assert!(
        list.contains("cas1-1"),
        "cache 1 is loaded again: {list}\n{}",
        d.log_text()
    );
    assert_eq!(dirty(&d, 1), before, "with its dirty lines");
    assert_eq!(read_at(&d, "cas1-1", data.len(), MIB), data);
    assert!(
        list.contains("cas1-3"),
        "the core added at run time: {list}"
    );
    assert!(
        !list.contains("cas1-2"),
        "the core removed at run time: {list}"
    );
    assert!(list.contains("wb"), "{list}");
    let log = d.log_text();
    assert!(
        log.contains("cache 1: from ") && log.contains("stopped with dirty data by -T -n"),
        "the log says where cache 1 came from: {log}"
    );
}

/// Run-time changes survive a restart without `--save-config`: a mode set with -Q on a cache
/// of the file (in RAM, so nothing on a device remembers it), a cache created with -S. And
/// `config export` writes that setup as a file that starts it again.
#[test]
fn run_time_changes_survive_a_restart_and_config_export_writes_them() {
    let dir = workdir();
    let p = dir.path();
    sparse_file(&p.join("core1.img"), 64 * MIB);
    sparse_file(&p.join("core2.img"), 64 * MIB);
    let cfg = p.join("hybridcache.toml");
    let text = format!(
        "[[cache]]\nid = 1\ndevice = \"ram:16M\"\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\n",
        p.join("core1.img").display()
    );
    std::fs::write(&cfg, &text).expect("config");
    let cfg_s = cfg.to_str().expect("UTF-8");
    let mut d = Daemon::start_with(p, &["--config", cfg_s]);
    d.ok(&["-Q", "-c", "wb", "-i", "1"]);
    d.ok(&["-S", "-d", "ram:8M", "-i", "2", "-c", "wa"]);
    d.ok(&[
        "-A",
        "-i",
        "2",
        "-d",
        p.join("core2.img").to_str().expect("UTF-8"),
    ]);
    assert!(d.stop(), "{}", d.log_text());

    let d = Daemon::start_with(p, &["--config", cfg_s]);
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L json");
    let caches = json["caches"].as_array().expect("caches");
    assert_eq!(caches.len(), 2, "{json}");
    assert_eq!(caches[0]["mode"], "wb", "the mode set with -Q: {json}");
    assert_eq!(caches[1]["mode"], "wa", "the cache created with -S: {json}");
    assert_eq!(caches[1]["cores"][0]["export"], "cas2-1", "{json}");
    let log = d.log_text();
    assert!(
        log.contains("cache 1: from ") && log.contains("mode wb from the state directory"),
        "{log}"
    );
    assert!(
        log.contains("cache 2: from the state directory (created at run time)"),
        "{log}"
    );
    assert_eq!(std::fs::read_to_string(&cfg).expect("config"), text);

    // The export: to stdout, and to a file the operator names, which starts the same setup.
    let printed = d.ok(&["config", "export"]);
    assert!(
        printed.contains("mode = \"wb\"") && printed.contains("ram:8M"),
        "{printed}"
    );
    assert!(
        !printed.contains("line_size = 4"),
        "defaults are left out: {printed}"
    );
    let exported = p.join("exported.toml");
    let out = d.ok(&["config", "export", "-o", exported.to_str().expect("UTF-8")]);
    assert!(out.contains("exported.toml"), "{out}");
    assert_eq!(
        std::fs::read_to_string(&exported).expect("exported"),
        printed
    );
    drop(d);
    let other = workdir();
    let d = Daemon::start_with(
        other.path(),
        &["--config", exported.to_str().expect("UTF-8")],
    );
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L json");
    assert_eq!(json["caches"][0]["mode"], "wb", "{json}");
    assert_eq!(json["caches"][1]["mode"], "wa", "{json}");
}

/// systemd removes the runtime directory (`RuntimeDirectory=`, /run/hybridcache) whenever the
/// service stops, restarts after a crash included, and passes `StateDirectory=` as
/// `$STATE_DIRECTORY`. Here a daemon started as the unit starts it is killed, its runtime
/// directory removed, and the next one still finds what it needs: the cache (from the run-time
/// setup) and the front-end of each core (`frontends.json`), though its default is another.
#[test]
fn the_state_survives_a_simulated_systemd_restart() {
    let dir = workdir();
    let p = dir.path();
    let run = p.join("run");
    let state = p.join("state");
    std::fs::create_dir_all(&run).expect("runtime dir");
    let cache = p.join("cache.img");
    let core = p.join("core.img");
    sparse_file(&cache, 16 * MIB);
    sparse_file(&core, 64 * MIB);
    let cfg = p.join("hybridcache.toml");
    std::fs::write(&cfg, "# no cache yet\n").expect("config");
    let cfg_s = cfg.to_str().expect("UTF-8");
    let state_s = state.to_str().expect("UTF-8");
    let env = [("STATE_DIRECTORY", state_s)];
    let mut d = Daemon::start_with_env(&run, &["--config", cfg_s, "--save-config"], &env);
    d.ok(&["-S", "-d", cache.to_str().expect("UTF-8"), "-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    d.ok(&[
        "-A",
        "-i",
        "1",
        "-d",
        core.to_str().expect("UTF-8"),
        "--frontend",
        "nbd",
    ]);
    let data = pattern(3, 64 << 10);
    write_at(&d, "cas1-1", &data, 0);
    d.kill();
    let left: Vec<String> = std::fs::read_dir(&run)
        .expect("runtime dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    assert!(
        left.is_empty(),
        "state left in the runtime directory: {left:?}"
    );
    for kept in ["setup.json", "frontends.json"] {
        assert!(state.join(kept).exists(), "{kept} in the state directory");
    }
    std::fs::remove_dir_all(&run).expect("systemd removes the runtime directory");
    // ... and makes it again, empty, before it starts the service.
    std::fs::create_dir_all(&run).expect("runtime dir");

    let d = Daemon::start_with_env(&run, &["--config", cfg_s, "--frontend", "ublk"], &env);
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L json");
    assert_eq!(
        json["caches"][0]["cores"][0]["frontend"],
        "nbd",
        "{json}\n{}",
        d.log_text()
    );
    assert!(dirty(&d, 1) > 0, "the dirty data came back with the cache");
    assert_eq!(read_at(&d, "cas1-1", data.len(), 0), data);
    assert_eq!(
        std::fs::read_to_string(&cfg).expect("config"),
        "# no cache yet\n"
    );
}

/// The operator's edit of the file made while the daemon was stopped is newer than the
/// run-time change it contradicts, and wins; a cache created at run time and stopped cleanly
/// with `-T` does not come back.
#[test]
fn an_edit_made_while_stopped_wins_and_a_cleanly_stopped_cache_stays_stopped() {
    let dir = workdir();
    let p = dir.path();
    let cfg = p.join("hybridcache.toml");
    std::fs::write(&cfg, "[[cache]]\nid = 1\ndevice = \"ram:16M\"\n").expect("config");
    let cfg_s = cfg.to_str().expect("UTF-8");
    let mut d = Daemon::start_with(p, &["--config", cfg_s]);
    d.ok(&["-Q", "-c", "wb", "-i", "1"]);
    d.ok(&["-X", "-n", "promotion", "-i", "1", "-p", "nhit"]);
    d.ok(&["-S", "-d", "ram:8M", "-i", "2"]);
    d.ok(&["-T", "-i", "2"]);
    assert!(d.stop(), "{}", d.log_text());
    std::fs::write(
        &cfg,
        "[[cache]]\nid = 1\ndevice = \"ram:16M\"\nmode = \"wa\"   # edited while stopped\n",
    )
    .expect("edit");

    let d = Daemon::start_with(p, &["--config", cfg_s]);
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L json");
    let caches = json["caches"].as_array().expect("caches");
    assert_eq!(caches.len(), 1, "cache 2 was stopped cleanly: {json}");
    assert_eq!(caches[0]["mode"], "wa", "the file's edit wins: {json}");
    assert_eq!(
        caches[0]["promotion"], "nhit",
        "the run-time change the file does not contradict stays: {json}"
    );
}

/// A cache created at run time, disconnected with its dirty data kept (`--script
/// --disconnect-cache --no-flush`) and then stopped with `-T`: its dirty data stays on the cache
/// device, so the next start must load it, as after `-T -n` of a running cache. The stop of a
/// disconnected cache dropped it from the recorded setup, and the next start left its core
/// without its newest data.
#[test]
fn a_disconnected_cache_stopped_with_dirty_data_is_loaded_again() {
    let s = setup();
    let p = s.dir.path();
    let cfg = s.cfg.to_str().expect("UTF-8");
    let args = ["--config", cfg];
    for name in ["cache2.img", "core4.img"] {
        sparse_file(&p.join(name), 64 * MIB);
    }
    let cache2 = format!("file:{}", p.join("cache2.img").display());
    let mut d = Daemon::start_with(p, &args);
    d.ok(&["-S", "-d", &cache2, "-i", "2", "-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "2", "-p", "nop"]);
    d.ok(&[
        "-A",
        "-i",
        "2",
        "-d",
        p.join("core4.img").to_str().expect("UTF-8"),
        "-j",
        "1",
    ]);
    let data = pattern(9, 256 << 10);
    write_at(&d, "cas2-1", &data, MIB);
    let before = dirty(&d, 2);
    assert!(before > 0, "wb with cleaning nop keeps the writes dirty");
    d.ok(&["--script", "--disconnect-cache", "-i", "2", "--no-flush"]);
    d.ok(&["-T", "-i", "2"]);
    assert!(d.stop(), "clean stop: {}", d.log_text());

    let d = Daemon::start_with(p, &args);
    let list = d.ok(&["-L"]);
    assert!(
        list.contains("cas2-1"),
        "cache 2 is loaded again: {list}\n{}",
        d.log_text()
    );
    assert_eq!(dirty(&d, 2), before, "with its dirty lines");
    assert_eq!(read_at(&d, "cas2-1", data.len(), MIB), data);
}
