//! `hybridcache`: the casadm-style management CLI, the bench runner and the analyzer glue, and
//! the entry point of the daemon (`hybridcache daemon`, implemented in crates/daemon), which the
//! CLI talks to over the control socket.
//!
//! Exit codes: 0 on success, 1 when the daemon refuses or fails a command (or cannot be
//! reached), 2 for a bad command line. Errors are one line on stderr (a bad command line's ends
//! with where the verb's help is, see usage.rs). `analyze` needs no daemon
//! and also exits 2 for an unreadable trace or a bad profile (see analyze.rs).

mod analyze;
mod apply;
mod bench;
mod chart;
mod cli;
mod config_cmd;
mod control;
mod flush;
mod format;
mod gen;
mod report_charts;
mod script_cmd;
mod serve;
mod top;
mod trace;
mod usage;

// The daemon and its control protocol live in crates/daemon; the CLI is one of its clients.
use hybridcache_daemon::{daemon, devices, export, params, protocol};

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use serde::de::DeserializeOwned;

use cli::{Cli, Command};
use protocol::{CacheList, ParamValue, Request, Response, StatsReport, VersionInfo};

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => return usage_error(e, &args),
    };
    if let Command::Analyze(args) = &cli.command {
        return match analyze::run(args, &control_path(&cli)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(f) => {
                eprintln!("hybridcache: {}", f.message);
                ExitCode::from(f.code)
            }
        };
    }
    if let Command::Bench(args) = &cli.command {
        return match bench::main(args) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("hybridcache: {}", format!("{e:#}").replace('\n', " "));
                ExitCode::from(if bench::is_usage_error(&e) { 2 } else { 1 })
            }
        };
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("hybridcache: {msg}");
            ExitCode::from(1)
        }
    }
}

/// Help asked for, or a bad command line: exit 0 after help, 2 otherwise (with a line saying
/// what is wrong and where the verb's help is).
fn usage_error(e: clap::Error, args: &[std::ffi::OsString]) -> ExitCode {
    use clap::error::ErrorKind;
    use clap::CommandFactory;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return ExitCode::from(2);
        }
        _ => {}
    }
    let root = Cli::command();
    let verbs = usage::typed_verbs(&root, args);
    if usage::asks_for_help(args, &verbs) {
        // As casadm: -H after the verb shows its help even when the rest of the line is wrong.
        let just_help = args
            .iter()
            .take(1)
            .cloned()
            .chain(verbs.iter().map(Into::into))
            .chain(std::iter::once("-H".into()));
        if let Err(help) = Cli::try_parse_from(just_help) {
            if help.kind() == ErrorKind::DisplayHelp {
                let _ = help.print();
                return ExitCode::SUCCESS;
            }
        }
    }
    eprintln!("hybridcache: {}", usage::message(&e, &root, &verbs));
    ExitCode::from(2)
}

fn control_path(cli: &Cli) -> PathBuf {
    cli.control
        .clone()
        .unwrap_or_else(|| PathBuf::from(daemon::DEFAULT_CONTROL))
}

fn run(cli: Cli) -> Result<()> {
    let control = control_path(&cli);
    match &cli.command {
        Command::Daemon {
            config,
            nbd_socket,
            nbd_listen,
            nbd_workers,
            save_config,
            metrics_listen,
            cleaning_stall_warn,
            core_flush_timeout,
            nbd_limits,
            frontend,
            ublk_queues,
            state_dir,
        } => {
            return daemon::run(daemon::DaemonOptions {
                config: config.clone(),
                control: cli.control.clone(),
                nbd_socket: nbd_socket.clone(),
                nbd_listen: nbd_listen.clone(),
                nbd_workers: *nbd_workers,
                save_config: *save_config,
                metrics_listen: metrics_listen.clone(),
                nbd_limits: daemon::NbdLimits {
                    max_connections: nbd_limits.nbd_max_connections,
                    max_connections_per_client: nbd_limits.nbd_max_connections_per_client,
                    max_connections_per_user: nbd_limits.nbd_max_connections_per_user,
                    max_connections_per_export: nbd_limits.nbd_max_connections_per_export,
                    handshake_timeout: nbd_limits.nbd_handshake_timeout,
                    stall_timeout: nbd_limits.nbd_stall_timeout,
                    memory_limit: nbd_limits.nbd_memory_limit,
                },
                frontend: frontend.clone(),
                ublk_queues: *ublk_queues,
                state_dir: state_dir.clone(),
                cleaning_stall_warn: *cleaning_stall_warn,
                core_flush_timeout: *core_flush_timeout,
            })
        }
        Command::Serve(args) => return serve::run(args),
        Command::FlushCache { id, core } => return flush::run(&control, *id, *core),
        Command::FlushCore { id, core } => return flush::run(&control, *id, Some(*core)),
        Command::Top(args) => return top::run(args, &control),
        Command::Gen(args) => return gen::run(args),
        Command::Trace(args) => return trace::run_cli(args, &control),
        Command::Config(args) => return config_cmd::run(args, &control),
        Command::Casctl(args) => {
            return script_cmd::casctl(args, &control, call::<serde_json::Value>)
        }
        Command::Version { output } => {
            let cli = env!("CARGO_PKG_VERSION");
            // As casadm with its module not loaded: a daemon that is not running is a row that
            // says so ("Not Loaded"), and exit 0. A daemon that runs but cannot be asked (the
            // socket refuses this user, or something else answers) is still an error.
            let not_running = matches!(
                std::os::unix::net::UnixStream::connect(&control),
                Err(e) if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                )
            );
            let daemon = if not_running {
                None
            } else {
                Some(call::<VersionInfo>(&control, &Request::Version)?.version)
            };
            print!("{}", format::version(cli, daemon.as_deref(), *output));
            return Ok(());
        }
        Command::StopDaemon => {
            let v: protocol::Stopped = call(&control, &Request::Shutdown)?;
            if !v.clean {
                return Err(anyhow!(
                    "the daemon stopped, but some dirty data could not be flushed; it is kept on the cache devices where they are persistent (see the daemon's log)"
                ));
            }
            println!(
                "daemon stopped: {} {} flushed and stopped",
                v.caches,
                if v.caches == 1 { "cache" } else { "caches" }
            );
            return Ok(());
        }
        Command::IoClass {
            load,
            id,
            file,
            ignore_unsupported,
            output,
            ..
        } => {
            if *load {
                let path = file.as_ref().context("--load-config needs -f FILE")?;
                let csv = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let req = Request::LoadIoClasses {
                    cache: *id,
                    csv,
                    ignore_unsupported: *ignore_unsupported,
                };
                let _: serde_json::Value =
                    call(&control, &req).with_context(|| format!("{}", path.display()))?;
                println!("IO classes of cache {id} loaded from {}", path.display());
            } else {
                let l: protocol::IoClassList =
                    call(&control, &Request::ListIoClasses { cache: *id })?;
                print!("{}", format::io_classes(&l, *output));
            }
            return Ok(());
        }
        _ => {}
    }
    let Some(req) = cli.command.request() else {
        return Ok(());
    };
    match &cli.command {
        Command::ListCaches { output, by_id_path } => {
            let mut list: CacheList = call(&control, &req)?;
            if *by_id_path {
                list.caches.iter_mut().for_each(format::by_id_paths);
            }
            print!(
                "{}",
                format::list_with_pool(&list.caches, &list.core_pool, *output)
            );
        }
        Command::Stats {
            id,
            core,
            io_class: Some(None),
            filter,
            output,
            by_id_path,
        } => {
            // `-d` without a value: every IO class in force, one after the other, each asked
            // as `-d CLASS` would be (with -j too, so the daemon answers as it does there).
            let list: protocol::IoClassList =
                call(&control, &Request::ListIoClasses { cache: *id })?;
            let mut reports = Vec::new();
            for class in &list.classes {
                let mut r: StatsReport = call(
                    &control,
                    &Request::Stats {
                        cache: *id,
                        core: *core,
                        io_class: Some(class.id),
                    },
                )?;
                if *by_id_path {
                    format::by_id_paths(&mut r.cache);
                }
                reports.push(r);
            }
            print!("{}", format::stats_many(&reports, filter, *output));
        }
        Command::Stats {
            filter,
            output,
            by_id_path,
            ..
        } => {
            let mut report: StatsReport = call(&control, &req)?;
            if *by_id_path {
                format::by_id_paths(&mut report.cache);
                if let Some(core) = &mut report.core {
                    core.device = format::by_id_path_in(Path::new(format::BY_ID), &core.device);
                }
            }
            print!("{}", format::stats_many(&[report], filter, *output));
        }
        Command::GetParam { output, .. } => {
            let p: ParamValue = call(&control, &req)?;
            print!("{}", format::params(&p, *output));
        }
        Command::StartCache { .. } => {
            let v: protocol::Started = call(&control, &req)?;
            if v.loaded {
                println!("cache {} loaded", v.id);
                for core in &v.inactive {
                    let why = v
                        .why_inactive
                        .get(core)
                        .map_or("its device is missing", String::as_str);
                    println!(
                        "core {core} of cache {} is inactive: {why} (attach it with add-core -i {} -j {core} -d DEVICE)",
                        v.id, v.id
                    );
                }
            } else {
                println!("cache {} started", v.id);
                if let Some(m) = &v.mirror {
                    println!("{m}");
                }
            }
        }
        Command::Script { add_core: true, .. } => match &req {
            Request::UpdateCorePath { cache, core, .. } => {
                let v: serde_json::Value = call(&control, &req)?;
                println!(
                    "core {core} of cache {cache} is now recorded on {} (was {})",
                    v["device"].as_str().unwrap_or("?"),
                    v["was"].as_str().unwrap_or("?")
                );
            }
            Request::TryAddCore { cache, device, .. } => {
                let v: serde_json::Value = call(&control, &req)?;
                if v.get("pooled").and_then(serde_json::Value::as_bool) == Some(true) {
                    println!("{device} added to the core pool: cache {cache} is not running; it is attached when the cache starts");
                } else {
                    let v: protocol::CoreAdded = serde_json::from_value(v)?;
                    println!(
                        "core {} attached again to cache {}, exported as {}",
                        v.core, v.cache, v.export
                    );
                }
            }
            _ => {
                let v: protocol::CoreAdded = call(&control, &req)?;
                println!(
                    "core {} added to cache {}, exported as {}",
                    v.core, v.cache, v.export
                );
            }
        },
        Command::AttachMirror { id, device, .. } => {
            let v: protocol::MirrorAttached = call(&control, &req)?;
            println!(
                "cache {id} is redundant{}: its mirror {device} holds every dirty line ({} dirty lines, {}, copied in {:.1} s)",
                if v.first { "" } else { " again" },
                hybridcache_daemon::safety::count_text(v.dirty_lines),
                hybridcache_daemon::safety::size_text(v.dirty_bytes),
                v.seconds
            );
        }
        Command::RemoveDetached { device } => {
            let _: serde_json::Value = call(&control, &req)?;
            println!("{device} removed from the core pool");
        }
        Command::Script {
            remove_core: true,
            detach: true,
            id: Some(id),
            core: Some(core),
            ..
        } => {
            let v: serde_json::Value = call(&control, &req)?;
            let lines = v["dirty_lines"].as_u64().unwrap_or(0);
            let bytes = v["dirty_bytes"].as_u64().unwrap_or(0);
            println!(
                "core {core} of cache {id} detached: kept in the cache's metadata, inactive, with {} dirty lines ({}) on the cache device; attach it again with -A -i {id} -j {core} -d DEVICE",
                hybridcache_daemon::safety::count_text(lines),
                hybridcache_daemon::safety::size_text(bytes)
            );
        }
        Command::Script {
            check_cache_device: true,
            ..
        } => {
            let v: protocol::CacheDeviceCheck = call(&control, &req)?;
            print!("{}", script_cmd::cache_device_check(&v));
        }
        Command::Script {
            purge_cache: true,
            id: Some(id),
            ..
        } => {
            let v: protocol::Purged = call(&control, &req)?;
            println!("cache {id} purged: {}", script_cmd::purged(&v));
        }
        Command::Script {
            purge_core: true,
            id: Some(id),
            core: Some(core),
            ..
        } => {
            let v: protocol::Purged = call(&control, &req)?;
            println!(
                "core {core} of cache {id} purged: {}",
                script_cmd::purged(&v)
            );
        }
        Command::Script {
            disconnect_cache: true,
            id: Some(id),
            pass_through,
            ..
        } => {
            let _: serde_json::Value = call(&control, &req)?;
            println!(
                "cache {id} disconnected; its exports stay, their requests {} until --script --connect-cache",
                if *pass_through {
                    "go to the cores"
                } else {
                    "wait"
                }
            );
        }
        Command::Script {
            device: Some(device),
            ..
        } => {
            let v: protocol::Connected = call(&control, &req)?;
            println!(
                "cache {} connected: {}; its exports are served by it again",
                v.id,
                connected_on(&v, device)
            );
        }
        Command::DetachCache { id } => {
            let _: serde_json::Value = call(&control, &req)?;
            println!(
                "cache {id} detached; its cores are served directly until a cache device is attached with --attach-cache -i {id} -d DEVICE"
            );
        }
        Command::AttachCache { device, .. } => {
            let v: serde_json::Value = call(&control, &req)?;
            // A mirrored cache whose primary was lost got a new one; a detached cache, a device.
            if v.get("mirror").is_some() {
                let v: protocol::PrimaryAttached = serde_json::from_value(v)?;
                println!(
                    "cache {} is redundant again: its new primary {} holds every dirty line ({} dirty lines, {}, copied from the mirror {} in {:.1} s)",
                    v.cache,
                    v.device,
                    hybridcache_daemon::safety::count_text(v.dirty_lines),
                    hybridcache_daemon::safety::size_text(v.dirty_bytes),
                    v.mirror,
                    v.seconds
                );
            } else {
                let v: protocol::Connected = serde_json::from_value(v)?;
                println!("cache {} attached: {}", v.id, connected_on(&v, device));
            }
        }
        Command::AddCore { .. } => {
            let v: protocol::CoreAdded = call(&control, &req)?;
            let verb = if v.reattached {
                "attached again"
            } else {
                "added"
            };
            println!(
                "core {} {verb} to cache {}, exported as {}{}",
                v.core,
                v.cache,
                v.export,
                v.block_device
                    .map(|d| format!(" on {d}"))
                    .unwrap_or_default()
            );
        }
        _ => {
            let _: serde_json::Value = call(&control, &req)?;
        }
    }
    Ok(())
}

/// How a connect or attach brought the cache back on `device`.
fn connected_on(v: &protocol::Connected, device: &str) -> String {
    let how = if v.loaded {
        "loaded from"
    } else {
        "a new cache started on"
    };
    format!("{how} {device}")
}

/// Send one request to the daemon and decode the result.
fn call<T: DeserializeOwned>(control: &Path, req: &Request) -> Result<T> {
    let mut line = serde_json::to_string(req).context("encoding the request")?;
    line.push('\n');
    let reply = control::exchange(control, &line)?;
    let resp: Response = serde_json::from_str(&reply).map_err(|_| {
        anyhow!(
            "{} is not a hybridcache control socket: its reply is not the daemon's (the control socket is {} by default)",
            control.display(),
            daemon::DEFAULT_CONTROL
        )
    })?;
    if !resp.ok {
        return Err(anyhow!(
            "{}",
            resp.error.unwrap_or_else(|| "request failed".into())
        ));
    }
    let value = resp.result.unwrap_or(serde_json::Value::Null);
    // Every loss the operator accepted is said, whatever the verb (hybridcache_daemon::safety).
    for line in hybridcache_daemon::safety::printed(&value) {
        println!("{line}");
    }
    // A reply of another shape comes from a daemon of another version, not from bad input.
    serde_json::from_value(value).map_err(|e| {
        anyhow!(
            "the daemon's reply is not what this CLI expects ({e}); is the daemon another version? (see 'hybridcache -V')"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    /// A server answering every connection with `reply`.
    fn answering(reply: &'static [u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("c.sock");
        let l = UnixListener::bind(&sock).unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let mut b = [0u8; 256];
                let _ = s.read(&mut b);
                let _ = s.write_all(reply);
            }
        });
        (dir, sock)
    }

    #[test]
    fn replies_that_are_not_the_daemon_s_are_said_in_words() {
        let (_d, sock) = answering(b"{\"ok\":true,\"result\":{\"list\":3}}\n");
        let e = call::<CacheList>(&sock, &Request::List).unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains("is the daemon another version?"), "{e}");
        let (_d, sock) = answering(b"{\"hello\":\"world\"}\n");
        let e = call::<CacheList>(&sock, &Request::List).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("is not a hybridcache control socket: its reply is not the daemon's"),
            "{e}"
        );
    }
}
