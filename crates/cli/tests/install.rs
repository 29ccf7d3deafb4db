//! `make install` and `make deb` as a fresh machine would see them (issue 19): every file in its
//! place under DESTDIR, both man pages render with `man -l` (man-db is in the Makefile's
//! DEB_PACKAGES; a missing `man` fails the test rather than skipping it), the bash completion
//! loads, and the package has the right control fields and contents and installs with
//! `dpkg --root` into a scratch root, where its binary runs. The debug binary is installed
//! (BIN=), so no release build is needed.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn make(args: &[&str]) {
    run(Command::new("make")
        .arg("-s")
        .arg("--no-print-directory")
        .current_dir(workspace())
        .args(args)
        .arg(format!("BIN={}", env!("CARGO_BIN_EXE_hybridcache"))));
}

/// `man -l PAGE` renders without an error or a groff warning.
fn renders(page: &Path, expect: &str) {
    let out = Command::new("man")
        .args(["--warnings", "-l"])
        .arg(page)
        .env("MANWIDTH", "80")
        .env("MAN_KEEP_FORMATTING", "0")
        .output()
        .unwrap_or_else(|e| panic!("cannot run man ({e}): install man-db (make deps)"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "man -l {}: {stderr}", page.display());
    assert!(
        stderr.trim().is_empty(),
        "man -l {}: {stderr}",
        page.display()
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(expect), "{}: {text}", page.display());
}

/// What `make install` puts under `root`; `man_gz`: the pages are gzipped (the package).
fn installed_files(root: &Path, man_gz: bool) {
    let gz = if man_gz { ".gz" } else { "" };
    let man8 = root.join(format!("usr/share/man/man8/hybridcache.8{gz}"));
    let man5 = root.join(format!("usr/share/man/man5/hybridcache.toml.5{gz}"));
    let verb = root.join(format!("usr/share/man/man8/hybridcache-start-cache.8{gz}"));
    for p in [&man8, &man5, &verb] {
        assert!(p.is_file(), "{} is not installed", p.display());
    }
    for f in [
        "usr/bin/hybridcache",
        "usr/lib/systemd/system/hybridcache.service",
        "usr/share/bash-completion/completions/hybridcache",
        "usr/share/zsh/site-functions/_hybridcache",
        "usr/share/fish/vendor_completions.d/hybridcache.fish",
        "usr/share/doc/hybridcache/README.md",
        "usr/share/doc/hybridcache/cli.md",
    ] {
        assert!(root.join(f).is_file(), "{f} is not installed");
    }
    if workspace().join("packaging/ioclass-config.csv").exists() {
        assert!(root
            .join("usr/share/doc/hybridcache/ioclass-config.csv")
            .is_file());
    }
    renders(&man8, "start-cache");
    renders(&man5, "nbd_memory_limit");
    let completion = root.join("usr/share/bash-completion/completions/hybridcache");
    let out = run(Command::new("bash").arg("-c").arg(format!(
        "source '{}' && complete -p hybridcache",
        completion.display()
    )));
    assert!(out.contains("hybridcache"), "{out}");
    let unit =
        std::fs::read_to_string(root.join("usr/lib/systemd/system/hybridcache.service")).unwrap();
    assert!(
        unit.contains("ExecStart=/usr/bin/hybridcache daemon"),
        "{unit}"
    );
    assert!(unit.contains("Type=notify"));
    unit_keeps_state_across_restarts(&unit);
}

/// The unit's settings that keep the daemon's state across a stop, a restart after a crash
/// (`Restart=on-failure`) and a reboot (issue 30): systemd empties a `RuntimeDirectory=` at
/// every stop unless `RuntimeDirectoryPreserve=` says otherwise, so what must outlive a restart
/// (ublk device records) is in the `StateDirectory=`, which it keeps; and the operator's file
/// is never rewritten (no `--save-config`).
fn unit_keeps_state_across_restarts(unit: &str) {
    let setting = |key: &str| -> Vec<String> {
        unit.lines()
            .map(str::trim)
            .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .map(|v| v.trim().to_string())
            .collect()
    };
    assert_eq!(setting("StateDirectory"), ["hybridcache"], "{unit}");
    assert_eq!(setting("RuntimeDirectory"), ["hybridcache"], "{unit}");
    assert_eq!(setting("RuntimeDirectoryPreserve"), ["restart"], "{unit}");
    assert_eq!(setting("Restart"), ["on-failure"], "{unit}");
    let exec = setting("ExecStart");
    assert_eq!(exec.len(), 1, "{unit}");
    assert!(
        exec[0].contains("--config /etc/hybridcache.toml") && !exec[0].contains("--save-config"),
        "{}",
        exec[0]
    );
    // The state directory is not named on the command line: the daemon takes systemd's
    // $STATE_DIRECTORY, so StateDirectory= alone says where it is.
    assert!(!exec[0].contains("--state-dir"), "{}", exec[0]);
}

#[test]
fn the_shipped_unit_keeps_the_state_across_restarts() {
    let unit = std::fs::read_to_string(workspace().join("packaging/hybridcache.service")).unwrap();
    unit_keeps_state_across_restarts(&unit);
}

#[test]
fn make_install_puts_everything_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("dest");
    make(&[
        "install",
        &format!("DESTDIR={}", dest.display()),
        "PREFIX=/usr",
    ]);
    installed_files(&dest, false);
    let help = run(Command::new(dest.join("usr/bin/hybridcache")).arg("-H"));
    assert!(help.contains("start-cache"), "{help}");
}

#[test]
fn make_deb_builds_a_package_that_installs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("deb");
    make(&[
        "deb",
        &format!("DEB_DIR={}", out.display()),
        // xz of the debug binary takes most of a minute; the format is what is tested here.
        "DEB_COMPRESS=none",
    ]);
    let debs: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(debs.len(), 1, "{debs:?}");
    let deb = &debs[0];
    let arch = run(Command::new("dpkg").arg("--print-architecture"));
    let name = format!(
        "hybridcache_{}_{}.deb",
        env!("CARGO_PKG_VERSION"),
        arch.trim()
    );
    assert_eq!(deb.file_name().unwrap().to_string_lossy(), name);

    let info = run(Command::new("dpkg-deb").arg("--info").arg(deb));
    for field in [
        "Package: hybridcache".to_string(),
        format!("Version: {}", env!("CARGO_PKG_VERSION")),
        format!("Architecture: {}", arch.trim()),
        "Depends: ".to_string(),
        "libc6".to_string(),
        "Description: ".to_string(),
    ] {
        assert!(info.contains(&field), "no {field:?} in:\n{info}");
    }
    let contents = run(Command::new("dpkg-deb").arg("-c").arg(deb));
    for f in [
        "./usr/bin/hybridcache",
        "./usr/lib/systemd/system/hybridcache.service",
        "./usr/share/man/man8/hybridcache.8.gz",
        "./usr/share/man/man5/hybridcache.toml.5.gz",
        "./usr/share/bash-completion/completions/hybridcache",
    ] {
        assert!(contents.contains(f), "{f} not in the package:\n{contents}");
    }
    assert!(contents.contains("root/root"), "{contents}");

    // Install into a scratch root with its own dpkg database: no maintainer scripts, no
    // systemctl, nothing touches the machine's own /usr. Depends are the host's libraries,
    // which the scratch root lacks.
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("var/lib/dpkg/info")).unwrap();
    std::fs::create_dir_all(root.join("var/lib/dpkg/updates")).unwrap();
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    run(Command::new("dpkg")
        .arg(format!("--root={}", root.display()))
        .args(["--force-depends", "--force-script-chrootless", "-i"])
        .arg(deb));
    installed_files(&root, true);
    let help = run(Command::new(root.join("usr/bin/hybridcache")).arg("-H"));
    assert!(help.contains("start-cache"), "{help}");
}

/// The unit's Type=notify: started as systemd would (NOTIFY_SOCKET set), the daemon sends
/// READY=1, and by then its control socket answers.
#[test]
fn the_daemon_tells_systemd_it_is_ready() {
    use std::os::unix::net::UnixDatagram;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let listener = UnixDatagram::bind(&notify).unwrap();
    listener
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let control = dir.path().join("control.sock");
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hybridcache"))
        .arg("daemon")
        .arg("--control")
        .arg(&control)
        .arg("--nbd-socket")
        .arg(dir.path().join("nbd.sock"))
        .arg("--state-dir")
        .arg(dir.path())
        .env("NOTIFY_SOCKET", &notify)
        .env_remove("HYBRIDCACHE_CONTROL")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut buf = [0u8; 256];
    let got = listener.recv(&mut buf);
    let listed = Command::new(env!("CARGO_BIN_EXE_hybridcache"))
        .arg("--control")
        .arg(&control)
        .arg("-L")
        .output()
        .unwrap();
    // SIGTERM: the daemon stops as systemd stops it.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default();
    let n = got.unwrap_or_else(|e| panic!("no READY=1 within 30 s ({e}): {log}"));
    assert_eq!(&buf[..n], b"READY=1", "{log}");
    assert!(
        listed.status.success(),
        "-L after READY=1: {}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(log.contains("told systemd the daemon is ready"), "{log}");
    assert!(status.success(), "{status}: {log}");
}
