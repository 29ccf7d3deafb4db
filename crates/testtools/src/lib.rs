//! The one rule for integration tests that drive external programs (fio, nbdkit, qemu-img,
//! nbdinfo, nbdfuse...) or need what a container may lack (loop devices, mounting): on a
//! developer's machine without them the test says so on stderr and returns; in CI (`CI` set) or
//! with `HC_REQUIRE_TOOLS=1` it fails instead, so that a run where the tools were supposed to be
//! installed (`make test` installs them) can never pass a test that did not run.
//!
//! A dev-dependency of the crates whose tests need it, so the rule lives in one place.

use std::ffi::OsStr;
use std::path::Path;

/// Whether an external program is installed: an executable file named `tool` in a directory of
/// `PATH` (or `tool` itself when it is a path). Looked up here rather than by running it, since
/// some tools have no harmless `--version` and a shell's `command -v` would need a shell.
pub fn have(tool: &str) -> bool {
    if tool.contains('/') {
        return is_executable(Path::new(tool));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .filter(|dir| !dir.as_os_str().is_empty())
        .any(|dir| is_executable(&dir.join(OsStr::new(tool))))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether every test must run in full: in CI (`CI` set, as `.ci/run` sets it) or with
/// `HC_REQUIRE_TOOLS=1`.
pub fn tools_required() -> bool {
    std::env::var_os("CI").is_some() || std::env::var("HC_REQUIRE_TOOLS").is_ok_and(|v| v == "1")
}

/// A test (or a part of one) cannot run here (`reason`): panics where [`tools_required`], else
/// says so on stderr and lets the caller return.
pub fn skip(reason: &str) {
    assert!(
        !tools_required(),
        "cannot skip in CI or with HC_REQUIRE_TOOLS=1: {reason}"
    );
    eprintln!("SKIPPED: {reason}");
}

/// Whether all of `tools` are installed; if not, [`skip`]s naming every missing one, so the
/// caller returns: `if !need(&["fio"]) { return; }`.
pub fn need(tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !have(t)).collect();
    if missing.is_empty() {
        return true;
    }
    skip(&format!("{} not installed (make deps)", missing.join(", ")));
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_programs_on_path_and_by_path() {
        assert!(have("sh"));
        assert!(have("/bin/sh"));
        assert!(!have("hybridcache-no-such-tool"));
        assert!(!have("/nonexistent/sh"));
        // A directory named like a tool is not one.
        assert!(!have("/"));
    }
}
