//! What a casadm user sees when a command line is wrong or the control socket is not ours: one
//! line naming the fix (the valid values, the likely meant name) and the verb's own help, exit
//! code 2 for a bad command line and 1 for a daemon that cannot be reached or refuses.

mod common;

use std::io::Write;
use std::os::unix::net::UnixListener;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{file_cache, workdir, BIN};

/// The CLI with no daemon behind it: these fail before any request is sent.
fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env(
            "HYBRIDCACHE_CONTROL",
            "/nonexistent/hybridcache-control.sock",
        )
        .output()
        .expect("run the CLI")
}

/// A bad command line: exit 2, one line on stderr, nothing on stdout; returns that line.
fn usage_error(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: one line expected: {err}");
    assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    err.trim_end().to_string()
}

#[test]
fn usage_errors_point_at_the_verb_s_help_as_typed() {
    let err = usage_error(&["-X", "-n", "seq-cutoff", "--bogus"]);
    assert!(err.starts_with("hybridcache: "), "{err}");
    assert!(err.contains("'--bogus'"), "{err}");
    assert!(err.ends_with("(see 'hybridcache -X -H')"), "{err}");
    let err = usage_error(&["--set-param", "-n", "seq-cutoff", "--bogus"]);
    assert!(err.ends_with("(see 'hybridcache --set-param -H')"), "{err}");
    let err = usage_error(&["set-param", "-n", "seq-cutoff", "--bogus"]);
    assert!(err.ends_with("(see 'hybridcache set-param -H')"), "{err}");
    // --control before the verb is not the verb.
    let err = usage_error(&["--control", "/x.sock", "-T", "--bogus"]);
    assert!(err.ends_with("(see 'hybridcache -T -H')"), "{err}");
    let err = usage_error(&["--control=/x.sock", "-T", "-i", "0"]);
    assert!(err.ends_with("(see 'hybridcache -T -H')"), "{err}");
    // A verb's own verb.
    let err = usage_error(&["trace", "start", "-i", "1", "--bogus"]);
    assert!(err.ends_with("(see 'hybridcache trace start -H')"), "{err}");
    // No verb recognised: the general help.
    let err = usage_error(&["-Y"]);
    assert!(err.ends_with("(see 'hybridcache -H')"), "{err}");
}

#[test]
fn every_verb_s_help_is_shown_as_casadm_shows_it() {
    let verbs = [
        ("-S", "start-cache"),
        ("-T", "stop-cache"),
        ("-A", "add-core"),
        ("-R", "remove-core"),
        ("-L", "list-caches"),
        ("-P", "stats"),
        ("-Z", "reset-counters"),
        ("-Q", "set-cache-mode"),
        ("-E", "flush-core"),
        ("-F", "flush-cache"),
        ("-X", "set-param"),
        ("-G", "get-param"),
        ("-C", "io-class"),
        ("-V", "version"),
    ];
    for (short, name) in verbs {
        let long = format!("--{name}");
        for form in [short, long.as_str(), name] {
            for help in ["-H", "--help"] {
                let out = run(&[form, help]);
                let text = String::from_utf8_lossy(&out.stdout);
                assert_eq!(out.status.code(), Some(0), "{form} {help}: {out:?}");
                assert!(
                    text.contains(&format!("Usage: hybridcache {{{name}|--{name}|{short}}}")),
                    "{form} {help}: {text}"
                );
            }
        }
    }
    for form in [
        &["--remove-inactive"][..],
        &["--zero-metadata"],
        &["daemon"],
        &["stop-daemon"],
        &["analyze"],
        &["trace"],
        &["trace", "start"],
        &["serve"],
        &["bench"],
        &["bench", "run"],
        &["top"],
    ] {
        let mut args = form.to_vec();
        args.push("-H");
        let out = run(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage: hybridcache "),
            "{args:?}: {out:?}"
        );
    }
    // As casadm: -H anywhere after the verb shows its help, whatever else is on the line.
    for args in [
        &["-X", "-n", "-H"][..],
        &["-X", "-n", "seq-cutoff", "--bogus", "-H"],
        &["-S", "-c", "fast", "-H"],
    ] {
        let out = run(args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        assert!(
            text.contains("Usage: hybridcache {") && text.contains(args[0]),
            "{args:?}: {text}"
        );
    }
    // The general help says how to get a verb's.
    let out = run(&["-H"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("hybridcache -S -H"),
        "{out:?}"
    );
}

#[test]
fn invalid_values_list_the_valid_ones() {
    let err = usage_error(&["-P", "-i", "1", "-o", "xml"]);
    assert!(
        err.contains(
            "invalid value 'xml' for '--output-format <OUTPUT>' (valid: table, csv, json)"
        ),
        "{err}"
    );
    let err = usage_error(&["-A", "-i", "1", "-d", "x", "--frontend", "scsi"]);
    assert!(err.contains("(valid: nbd, ublk)"), "{err}");
    assert!(err.ends_with("(see 'hybridcache -A -H')"), "{err}");
    // Our own parsers already name the valid values in their reason.
    let err = usage_error(&["-S", "-d", "x", "-c", "fast"]);
    assert!(
        err.contains("unknown cache mode 'fast' (expected wt, wb, wa, wi, wo or pt)"),
        "{err}"
    );
    let err = usage_error(&["-X", "-n", "nope", "-i", "1"]);
    assert!(
        err.contains("(valid: cache-mode, cache-line-size, cleaning, cleaning-alru,"),
        "{err}"
    );
    // A number where a number is due, said without Rust's words.
    let err = usage_error(&["-P", "-i", "1", "-d", "x"]);
    assert!(!err.contains("invalid digit"), "{err}");
    assert!(err.contains("'x' is not an IO class id (0..33)"), "{err}");
}

#[test]
fn typos_get_a_did_you_mean() {
    let err = usage_error(&["-S", "-d", "x", "--cache-mod", "wb"]);
    assert!(err.contains("did you mean '--cache-mode'?"), "{err}");
    let err = usage_error(&["-L", "-o", "jsn"]);
    assert!(err.contains("did you mean 'json'?"), "{err}");
    let err = usage_error(&["-P", "-i", "1", "-f", "usag"]);
    assert!(err.contains("did you mean 'usage'?"), "{err}");
    // Verbs, long and bare.
    let err = usage_error(&["--stat", "-i", "1"]);
    assert!(err.contains("did you mean '--stats'?"), "{err}");
    let err = usage_error(&["--start-cach", "-d", "x"]);
    assert!(err.contains("did you mean '--start-cache'?"), "{err}");
    let err = usage_error(&["stat", "-i", "1"]);
    assert!(err.contains("did you mean 'stats'"), "{err}");
    // Parameter group names, before any daemon is asked.
    let err = usage_error(&["-X", "-n", "seq-cuttof", "-i", "1", "-p", "never"]);
    assert!(err.contains("did you mean 'seq-cutoff'?"), "{err}");
    assert!(err.ends_with("(see 'hybridcache -X -H')"), "{err}");
    let err = usage_error(&["-G", "-n", "cleaning-alr", "-i", "1"]);
    assert!(err.contains("did you mean 'cleaning-alru'?"), "{err}");
}

#[test]
fn missing_arguments_are_all_named() {
    let err = usage_error(&["-A"]);
    assert!(
        err.contains("--cache-id <ID>") && err.contains("--core-device <DEV>"),
        "{err}"
    );
    assert!(err.ends_with("(see 'hybridcache -A -H')"), "{err}");
}

/// `--control` at the daemon's NBD socket: said so, exit 1, one line.
#[test]
fn the_nbd_socket_is_not_the_control_socket() {
    let fc = file_cache(16 << 20, 64 << 20, &[]);
    let d = &fc.daemon;
    let before = d.ok(&["-L"]);
    for args in [&["-L"][..], &["-P", "-i", "1"], &["-T", "-i", "1"]] {
        let out = Command::new(BIN)
            .args(args)
            .arg("--control")
            .arg(&d.nbd)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!(
                "{} is an NBD socket, not the control socket (the control socket is /run/hybridcache/control.sock by default",
                d.nbd.display()
            )),
            "{err}"
        );
    }
    assert_eq!(d.ok(&["-L"]), before);
}

/// A socket that accepts and says nothing, or answers something that is not ours.
#[test]
fn a_socket_that_is_not_ours_is_named_so_without_a_hang() {
    let dir = workdir();
    let silent = dir.path().join("silent.sock");
    // Bound and listening, never accepting: connections wait in the backlog forever.
    let _silent = UnixListener::bind(&silent).unwrap();
    let chatty = dir.path().join("chatty.sock");
    let listener = UnixListener::bind(&chatty).unwrap();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let _ = s.write_all(b"220 welcome to some other service\r\n");
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    for (sock, want) in [
        (&silent, "answered nothing"),
        (&chatty, "not a hybridcache control socket"),
    ] {
        let t = Instant::now();
        let out = Command::new(BIN)
            .args(["-L", "--control"])
            .arg(sock)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "took {:?}",
            t.elapsed()
        );
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(&sock.display().to_string()), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(err.contains("not a hybridcache control socket"), "{err}");
        assert!(!err.contains("decoding"), "{err}");
    }
}

/// `-P -d` without a class with `-j`: as `-P -d CLASS -j CORE` for each class (that core's
/// share), not every class of the whole cache as if -j were not there; a core that does not
/// exist is refused alike.
#[test]
fn stats_of_every_io_class_with_a_core_do_as_one_class_with_a_core() {
    let fc = file_cache(16 << 20, 64 << 20, &[]);
    let d = &fc.daemon;
    let one = d.fails(&["-P", "-i", "1", "-d", "0", "-j", "2"]);
    assert!(one.contains("core 2 does not exist"), "{one}");
    let every = d.fails(&["-P", "-i", "1", "-d", "-j", "2"]);
    assert_eq!(every, one);
    let one = d.ok(&["-P", "-i", "1", "-d", "0", "-j", "1", "-o", "csv"]);
    let every = d.ok(&["-P", "-i", "1", "-d", "-j", "1", "-o", "csv"]);
    assert_eq!(every, one, "the default table has class 0 only");
    assert!(one.contains("Core Id"), "{one}");
    // Without -j, unchanged: every class.
    let all = d.ok(&["-P", "-i", "1", "-d", "-o", "csv"]);
    assert!(all.lines().count() >= 2, "{all}");
}

/// Errors of every kind leave the setup as it was.
#[test]
fn errors_change_nothing() {
    let fc = file_cache(16 << 20, 64 << 20, &["-c", "wb"]);
    let d = &fc.daemon;
    let before = d.ok(&["-L"]);
    let params = d.ok(&["-G", "-n", "seq-cutoff", "-i", "1"]);
    for args in [
        &["-X", "-n", "seq-cuttof", "-i", "1", "-p", "never"][..],
        &["-X", "-n", "seq-cutoff", "-i", "1", "--bogus"],
        &["-Q", "-c", "xx", "-i", "1"],
        &["-T", "-i", "1", "--forc"],
    ] {
        let out = d.cli(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
    }
    assert_eq!(d.ok(&["-L"]), before);
    assert_eq!(d.ok(&["-G", "-n", "seq-cutoff", "-i", "1"]), params);
}
