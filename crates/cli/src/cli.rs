//! The command line: long verbs (`start-cache`) and casadm's short flags (`-S`) for the same
//! commands, so Open CAS habits work; `--control SOCKET` anywhere (or `HYBRIDCACHE_CONTROL`).
//!
//! Parsing only: each management command turns into one control [`Request`].

use std::path::PathBuf;

use clap::{ArgAction, Parser, Subcommand};
use hybridcache_engine::{CacheMode, LineSize};

use crate::format::OutputFormat;
use crate::protocol::Request;

#[derive(Debug, Parser)]
#[command(
    name = "hybridcache",
    about = "User-space hybrid-storage block cache: daemon and casadm-style management",
    disable_help_flag = true,
    disable_version_flag = true,
    disable_help_subcommand = true,
    subcommand_required = true,
    arg_required_else_help = true,
    after_help = "For the options of one command, put -H after it: hybridcache -S -H, hybridcache --set-param -H, hybridcache trace start -H."
)]
pub struct Cli {
    /// Control socket of the daemon.
    #[arg(
        long,
        global = true,
        env = "HYBRIDCACHE_CONTROL",
        value_name = "SOCKET"
    )]
    pub control: Option<PathBuf>,

    /// Print help.
    #[arg(short = 'H', long = "help", action = ArgAction::Help, global = true)]
    help: Option<bool>,

    #[command(subcommand)]
    pub command: Command,
}

pub(crate) fn cache_id(s: &str) -> Result<u16, String> {
    match s.parse::<u32>() {
        Ok(n @ 1..=16384) => Ok(n as u16),
        _ => Err(format!("'{s}' is not a cache id (1..16384)")),
    }
}

fn core_id(s: &str) -> Result<u16, String> {
    match s.parse::<u32>() {
        Ok(n @ 0..=4095) => Ok(n as u16),
        _ => Err(format!("'{s}' is not a core id (0..4095)")),
    }
}

/// A path the daemon will open, made absolute against this process's working directory: the
/// daemon's is not the operator's.
pub(crate) fn from_here(path: &std::path::Path) -> std::io::Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    Ok(std::env::current_dir()?.join(path))
}

/// A device spec as the daemon must see it: a relative path (bare or `file:`) made absolute
/// against ours. Other specs (`ram:`, `nbd://`, emulated devices, with a path inside or not)
/// pass as typed.
fn device_from_here(spec: &str) -> String {
    // The daemon's own reading of a spec tells a path from a volume kind.
    let Some(path) = hybridcache_daemon::claims::spec_path(spec) else {
        return spec.into();
    };
    let prefix = if path == spec {
        ""
    } else if spec.strip_prefix("file:") == Some(path) {
        "file:"
    } else {
        return spec.into();
    };
    match from_here(std::path::Path::new(path)) {
        Ok(p) if !path.is_empty() => format!("{prefix}{}", p.display()),
        _ => spec.into(),
    }
}

/// `-d` of `-P`: an IO class id as casadm numbers them.
fn io_class_id(s: &str) -> Result<u8, String> {
    match s.parse::<u8>() {
        Ok(n @ 0..=33) => Ok(n),
        _ => Err(format!("'{s}' is not an IO class id (0..33)")),
    }
}

/// `-n` of `-X` and `-G`: the daemon's parameter groups, so a typo is caught here with the
/// name probably meant, and `-H` lists them.
fn param_group() -> impl clap::builder::TypedValueParser<Value = String> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(
        crate::params::GROUPS
            .iter()
            .map(|g| PossibleValue::new(g.name).help(g.help)),
    )
    .map(String::from)
}

fn mode(s: &str) -> Result<CacheMode, String> {
    s.parse()
}

fn line_size(s: &str) -> Result<u32, String> {
    let kib: u32 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a cache line size (4, 8, 16, 32 or 64 KiB)"))?;
    LineSize::from_kib(kib).map(|l| l.kib())
}

fn yes_no(s: &str) -> Result<bool, String> {
    match s {
        "yes" => Ok(true),
        "no" => Ok(false),
        _ => Err(format!("'{s}': expected yes or no")),
    }
}

/// The daemon's NBD limits (docs/cli.md, "Limits"); each overrides the file's `nbd_*` key.
#[derive(Debug, Clone, clap::Args)]
pub struct NbdLimitArgs {
    /// NBD connections in all [default: 256].
    #[arg(long, value_name = "N", value_parser = whole::<usize>)]
    pub nbd_max_connections: Option<usize>,
    /// NBD connections per client: a TCP address, or a Unix-socket process [default: 64].
    #[arg(long, value_name = "N", value_parser = whole::<usize>)]
    pub nbd_max_connections_per_client: Option<usize>,
    /// NBD connections of all the Unix-socket processes of one user [default: 192].
    #[arg(long, value_name = "N", value_parser = whole::<usize>)]
    pub nbd_max_connections_per_user: Option<usize>,
    /// NBD connections per export [default: 192].
    #[arg(long, value_name = "N", value_parser = whole::<usize>)]
    pub nbd_max_connections_per_export: Option<usize>,
    /// Seconds a client may take to finish the NBD handshake [default: 10].
    #[arg(long, value_name = "SECONDS", value_parser = whole::<u64>)]
    pub nbd_handshake_timeout: Option<u64>,
    /// Seconds a client may stall mid-request or leave a reply unread; 0 = never [default: 60].
    #[arg(long, value_name = "SECONDS", value_parser = whole::<u64>)]
    pub nbd_stall_timeout: Option<u64>,
    /// Memory the NBD server may hold for connections and requests, e.g. 512M [default: 512M].
    #[arg(long, value_name = "SIZE", value_parser = size_arg)]
    pub nbd_memory_limit: Option<u64>,
}

/// A count or a number of seconds, refused in words rather than Rust's ("invalid digit found in
/// string", "number too large to fit in target type").
pub(crate) fn whole<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.parse().map_err(|_| {
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            format!("{s} is too large")
        } else {
            format!("'{s}' is not a whole number")
        }
    })
}

fn size_arg(s: &str) -> Result<u64, String> {
    hybridcache_volume::parse_size(s)
}

// Parsed once per invocation: set-param's many optional flags make one variant large, which
// costs nothing here, while boxing them would split the flags from the command clap documents.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground.
    Daemon {
        /// Configuration file (TOML) applied at start.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// NBD Unix socket [default: /run/hybridcache/nbd.sock].
        #[arg(long, value_name = "SOCKET")]
        nbd_socket: Option<PathBuf>,
        /// Also serve NBD over TCP: PORT (loopback) or ADDRESS:PORT.
        #[arg(long, value_name = "ADDR:PORT")]
        nbd_listen: Option<String>,
        /// Requests in flight per NBD connection [default: 16].
        #[arg(long, value_name = "N", value_parser = whole::<usize>)]
        nbd_workers: Option<usize>,
        /// Serve Prometheus metrics at http://ADDR:PORT/metrics: PORT (loopback) or ADDRESS:PORT.
        #[arg(long, value_name = "ADDR:PORT")]
        metrics_listen: Option<String>,
        /// Log a WARN when cleaning is due but has cleaned nothing for this long (a failing or
        /// blocked core) [default: 30].
        #[arg(long, value_name = "SECONDS", value_parser = whole::<u64>)]
        cleaning_stall_warn: Option<u64>,
        /// Give up on a core's flush when its device completes no outstanding write or flush
        /// for this long (a hung core), so the other cores' flushes go on [default: 30].
        #[arg(long, value_name = "SECONDS", value_parser = whole::<u64>)]
        core_flush_timeout: Option<u64>,
        /// Accepted for older units; does nothing but a WARN: the --config file is never
        /// written (run-time changes are kept in --state-dir; see `config export`).
        #[arg(long)]
        save_config: bool,
        #[command(flatten)]
        nbd_limits: NbdLimitArgs,
        /// How cores that name no front-end are served: over NBD, or as /dev/ublkbN [default: nbd].
        #[arg(long, value_name = "nbd|ublk", value_parser = ["nbd", "ublk"])]
        frontend: Option<String>,
        /// Queues of each /dev/ublkbN, each with its own thread and ring [default: one per CPU].
        #[arg(long, value_name = "N", value_parser = whole::<u16>)]
        ublk_queues: Option<u16>,
        /// The daemon's state directory: the run-time setup, front-ends and ublk devices, kept
        /// across restarts [default: /var/lib/hybridcache].
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },

    /// Start a cache on a device.
    #[command(short_flag = 'S', long_flag = "start-cache")]
    StartCache {
        /// Cache device: a path, file:PATH, ram:SIZE, null:SIZE or an NBD URI.
        #[arg(short = 'd', long = "cache-device", value_name = "DEV")]
        device: String,
        /// Cache id (1..16384) [default: the lowest free].
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: Option<u16>,
        /// Cache mode [default: wt].
        #[arg(short = 'c', long = "cache-mode", value_parser = mode, value_name = "wt|wb|wa|wi|wo|pt")]
        mode: Option<CacheMode>,
        /// Cache line size in KiB [default: 4].
        #[arg(short = 'x', long = "cache-line-size", value_parser = line_size, value_name = "4|8|16|32|64")]
        line_size: Option<u32>,
        /// Start even if the device holds a cache (destroyed with its dirty data, whose size
        /// is printed), a file system or another signature (overwritten). A device in use is
        /// refused even so.
        #[arg(short = 'f', long)]
        force: bool,
        /// Load the cache the device holds (its id, mode, line size and cores).
        #[arg(short = 'l', long)]
        load: bool,
        /// A second device that keeps a copy of the dirty data and metadata (write-back
        /// survives the loss of either device; docs/cli.md "Mirrored caches"). With --load:
        /// the mirror of the cache loaded.
        #[arg(long, value_name = "DEV", conflicts_with = "load_mirror")]
        mirror: Option<String>,
        /// Bring the cache up from its mirror (-d) alone: every dirty line it recorded; clean
        /// lines come from the cores again (failover, or a lost primary).
        #[arg(long, conflicts_with_all = ["load", "force"])]
        load_mirror: bool,
        /// When the mirror is lost: drain the dirty data and serve write-through (`drain`,
        /// the default), or stay write-back unprotected (`keep`).
        #[arg(long, value_name = "drain|keep", requires = "mirror")]
        mirror_lost: Option<String>,
        /// Fallback pass-through: cache-device errors within the window that turn new I/O
        /// pass-through (0 = off; as `-X -n fallback-pt -t`).
        #[arg(long, value_name = "ERRORS")]
        fallback_pt_threshold: Option<u32>,
        /// Fallback pass-through's window in seconds (0 = never forget; as `--window`).
        #[arg(long, value_name = "SECONDS")]
        fallback_pt_window: Option<u32>,
    },

    /// Stop a cache (flushing its dirty data first).
    #[command(short_flag = 'T', long_flag = "stop-cache")]
    StopCache {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Keep dirty data on the cache device instead of flushing it (loaded again by
        /// `-S --load`).
        #[arg(short = 'n', long)]
        no_data_flush: bool,
        /// Stop even while clients are connected to its exports: they lose them and get I/O
        /// errors. The dirty data is still flushed (or kept with -n).
        #[arg(long)]
        disconnect_clients: bool,
        /// Old name of --disconnect-clients, kept for scripts (it never discarded data).
        #[arg(short = 'f', long)]
        force: bool,
    },

    /// Add a core device to a cache (exported as cas<cache>-<core>), or attach an inactive core again.
    #[command(short_flag = 'A', long_flag = "add-core")]
    AddCore {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core device: a path, file:PATH, ram:SIZE, null:SIZE or an NBD URI.
        #[arg(short = 'd', long = "core-device", value_name = "DEV")]
        device: String,
        /// Core id (0..4095) [default: the lowest free from 1].
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
        /// Take a core device even though it is mounted (without an exclusive claim), or attach
        /// an inactive core to a device that is not the one it was added as.
        #[arg(short = 'f', long)]
        force: bool,
        /// Serve the exported volume over NBD or as a block device /dev/ublkbN (Linux ublk
        /// driver) [default: the daemon's --frontend].
        #[arg(long, value_name = "nbd|ublk", value_parser = ["nbd", "ublk"])]
        frontend: Option<String>,
    },

    /// Remove a core from a cache.
    #[command(short_flag = 'R', long_flag = "remove-core")]
    RemoveCore {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core id (0..4095).
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: u16,
        /// As casadm: remove without flushing; the core's dirty data is discarded (the count
        /// and size are printed). Connected clients still need --disconnect-clients.
        #[arg(short = 'f', long)]
        force: bool,
        /// Remove even while clients are connected to its export: they lose it and get I/O
        /// errors. The dirty data is still flushed first (unless --force).
        #[arg(long)]
        disconnect_clients: bool,
    },

    /// Remove a core whose device is missing (Inactive or Waiting for device); an active core
    /// is refused (use --remove-core).
    #[command(long_flag = "remove-inactive")]
    RemoveInactive {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core id (0..4095).
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: u16,
        /// Remove it even though the cache holds dirty data of it (that data is lost; the
        /// count and size are printed).
        #[arg(short = 'f', long)]
        force: bool,
    },

    /// Give a cache a mirror while clients are served: a new one for a mirrored cache whose
    /// mirror is lost, or a first one for a cache started without (write-back's dirty lines
    /// then have a second copy). The dirty lines and the metadata are copied onto it, and the
    /// cache is redundant when this returns (`-L` shows the progress meanwhile).
    #[command(long_flag = "attach-mirror")]
    AttachMirror {
        /// The cache whose mirror is lost, or that has none.
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// The new mirror: at least the size of the cache device's metadata and lines.
        #[arg(short = 'd', long = "device")]
        device: String,
        /// Overwrite what the device holds (a file system, another cache: named and sized in
        /// the refusal without it).
        #[arg(short = 'f', long)]
        force: bool,
    },

    /// Take a core device out of the core pool, where --script --add-core --try-add keeps a
    /// core whose cache does not run yet.
    #[command(long_flag = "remove-detached")]
    RemoveDetached {
        /// The pooled core device.
        #[arg(short = 'd', long = "device")]
        device: String,
    },

    /// Wipe a cache device's hybridcache metadata so it no longer loads (refused while a
    /// cache or another program holds the device).
    #[command(long_flag = "zero-metadata")]
    ZeroMetadata {
        /// The cache device.
        #[arg(short = 'd', long = "device")]
        device: String,
        /// Zero it even though its cache holds dirty data (lost; the size is printed), or it
        /// holds no hybridcache metadata (its first 2 MiB are zeroed), as casadm's -f.
        #[arg(short = 'f', long)]
        force: bool,
    },

    /// casadm's hidden script commands: `--script --disconnect-cache -i ID [--no-flush]
    /// [--pass-through]` stops a cache but keeps its exports (their requests wait, or go to the
    /// cores with --pass-through); `--script --connect-cache -d DEV` brings it back;
    /// `--script --check-cache-device -d DEV` says whether DEV holds a cache, clean or dirty;
    /// `--script --purge-cache -i ID` and `--script --purge-core -i ID -j CORE` flush, then
    /// invalidate what the cache holds (of the cache, or of one core).
    #[command(long_flag = "script", hide = true)]
    #[command(group(clap::ArgGroup::new("script_command").required(true).args(["disconnect_cache", "connect_cache", "check_cache_device", "purge_cache", "purge_core", "add_core", "remove_core"])))]
    Script {
        /// Add a core (as -A); with --try-add, attach a core the cache records as inactive, or
        /// keep it in the core pool until its cache runs.
        #[arg(long, requires_all = ["id", "core_device"], conflicts_with_all = ["device", "no_flush", "pass_through"])]
        add_core: bool,
        /// The core device of --add-core.
        #[arg(long, value_name = "DEV", requires = "add_core")]
        core_device: Option<String>,
        /// With --add-core: attach a known core, or keep it in the core pool (needs --core-id).
        #[arg(long, requires_all = ["add_core", "core"])]
        try_add: bool,
        /// With --add-core: record DEV as the new path of active core --core-id, which must be
        /// the device it is on (a renamed node, another link to it).
        #[arg(long, requires_all = ["add_core", "core"], conflicts_with = "try_add")]
        update_path: bool,
        /// With --remove-core: keep the core in the cache's metadata, inactive with its lines,
        /// instead of removing it (flushed first unless --no-flush, which keeps the dirty data
        /// on the cache device); -A -j or --try-add attaches it again.
        #[arg(long, requires = "remove_core")]
        detach: bool,
        /// Remove a core (as -R): its dirty data is flushed first; --no-flush (or --force)
        /// discards it instead.
        #[arg(long, requires_all = ["id", "core"], conflicts_with_all = ["device", "pass_through"])]
        remove_core: bool,
        /// With --remove-core: casadm's --no-flush under our safety model's name.
        #[arg(short = 'f', long, requires = "remove_core")]
        force: bool,
        /// Whether the device holds a hybridcache cache, stopped cleanly or not, dirty or not
        /// (casadm's `Is cache,Clean Shutdown,Cache dirty`).
        #[arg(long, requires = "device", conflicts_with_all = ["id", "core", "no_flush", "pass_through"])]
        check_cache_device: bool,
        /// Flush the cache, then invalidate every line it holds; its exports stay.
        #[arg(long, requires = "id", conflicts_with_all = ["device", "core", "no_flush", "pass_through"])]
        purge_cache: bool,
        /// Flush one core, then invalidate its lines; its export stays.
        #[arg(long, requires_all = ["id", "core"], conflicts_with_all = ["device", "no_flush", "pass_through"])]
        purge_core: bool,
        /// Core id (0..4095), of --purge-core.
        #[arg(short = 'j', long = "core-id", value_parser = core_id, conflicts_with_all = ["disconnect_cache", "connect_cache", "purge_cache", "check_cache_device"])]
        core: Option<u16>,
        /// Stop the cache but keep its exported volumes.
        #[arg(long, requires = "id")]
        disconnect_cache: bool,
        /// Bring a disconnected cache back under its kept exports.
        #[arg(long, requires = "device")]
        connect_cache: bool,
        /// Cache id (1..16384): the cache to disconnect; with --connect-cache, the disconnected
        /// cache a device without hybridcache metadata is to serve.
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: Option<u16>,
        /// The cache device to connect.
        #[arg(
            short = 'd',
            long = "cache-device",
            value_name = "DEV",
            conflicts_with = "disconnect_cache"
        )]
        device: Option<String>,
        /// With --disconnect-cache: keep dirty data on the cache device instead of flushing it
        /// (the same device must be connected again). With --remove-core: remove the core
        /// without flushing, its dirty data discarded (the count and size are printed).
        #[arg(long, conflicts_with = "connect_cache")]
        no_flush: bool,
        /// Serve the exports from the cores directly while disconnected (flushes first).
        #[arg(long, conflicts_with = "connect_cache")]
        pass_through: bool,
    },

    /// Detach the cache device of a running cache (casadm's --detach-cache): dirty data is
    /// flushed, the cache's contents dropped, and its cores are served directly (pass-through)
    /// under their kept exports until a cache device is attached with --attach-cache.
    #[command(long_flag = "detach-cache")]
    DetachCache {
        /// The cache to detach (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
    },

    /// Attach a cache device to a detached (or disconnected) cache (casadm's --attach-cache):
    /// the cache starts on it with the settings, IO classes and cores it had, and serves its
    /// kept exports again. On a mirrored cache whose primary is lost, the device becomes its
    /// new primary: the dirty lines are copied onto it from the mirror while clients are
    /// served, and the cache is redundant again.
    #[command(long_flag = "attach-cache")]
    AttachCache {
        /// The detached cache, or the mirrored cache whose primary is lost (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// The cache device to attach.
        #[arg(short = 'd', long = "cache-device", value_name = "DEV")]
        device: String,
        /// Attach even though the device holds a file system, a partition table or another
        /// cache's metadata (it is formatted).
        #[arg(short = 'f', long)]
        force: bool,
    },

    /// List caches and their cores.
    #[command(short_flag = 'L', long_flag = "list-caches")]
    ListCaches {
        /// Show a disk by its /dev/disk/by-id path instead of the short form (/dev/sdx).
        #[arg(short = 'b', long = "by-id-path")]
        by_id_path: bool,
        /// Output format.
        #[arg(
            short = 'o',
            long = "output-format",
            value_enum,
            default_value = "table"
        )]
        output: OutputFormat,
    },

    /// Print statistics of a cache or one core.
    #[command(short_flag = 'P', long_flag = "stats")]
    Stats {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core id (0..4095) [default: every core of the cache].
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
        /// Statistics of one IO class (usage and requests of that class, across cores; with
        /// -j, that core's share); `-d` without a value: of every IO class.
        #[arg(short = 'd', long = "io-class-id", num_args = 0..=1, value_parser = io_class_id)]
        io_class: Option<Option<u8>>,
        /// Sections to show, comma-separated: all, conf, usage, req, blk, err [default: all].
        #[arg(short = 'f', long = "filter", value_delimiter = ',', value_enum)]
        filter: Vec<crate::format::StatsFilter>,
        /// Show a disk by its /dev/disk/by-id path instead of the short form (/dev/sdx).
        #[arg(short = 'b', long = "by-id-path")]
        by_id_path: bool,
        /// Output format.
        #[arg(
            short = 'o',
            long = "output-format",
            value_enum,
            default_value = "table"
        )]
        output: OutputFormat,
    },

    /// Reset the statistics counters.
    #[command(short_flag = 'Z', long_flag = "reset-counters")]
    ResetCounters {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core id (0..4095) [default: every core of the cache].
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
    },

    /// Switch the cache mode.
    #[command(short_flag = 'Q', long_flag = "set-cache-mode")]
    SetCacheMode {
        /// The new cache mode.
        #[arg(short = 'c', long = "cache-mode", value_parser = mode, value_name = "wt|wb|wa|wi|wo|pt")]
        mode: CacheMode,
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// When leaving wb/wo: yes flushes dirty data first, no lets cleaning drain it; required
        /// when leaving wb or wo for wt, wa, wi or pt.
        #[arg(short = 'f', long = "flush-cache", value_parser = yes_no, value_name = "yes|no")]
        flush: Option<bool>,
    },

    /// Write dirty data of one core to it (casadm's -E; the same as -F -j).
    #[command(short_flag = 'E', long_flag = "flush-core")]
    FlushCore {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core id (0..4095).
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: u16,
    },

    /// Write dirty data of a cache (or one core) to the core(s).
    #[command(short_flag = 'F', long_flag = "flush-cache")]
    FlushCache {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core id (0..4095) [default: every core of the cache].
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
    },

    /// Set parameters of a group: cache-mode (-v), cleaning (-p), cleaning-alru (-w -s -b -t -d),
    /// cleaning-acp (-w -b), cleaning-io, seq-cutoff (-j; -p -t), promotion (-p),
    /// promotion-nhit (-t -o), lazy-flush (-p on|off), prefetch (-p readahead|none),
    /// prefetch-readahead (-t --distance --max-in-flight), offload (-p on|off),
    /// offload-queue (--share -t), fallback-pt (-t --window). See docs/policies.md.
    #[command(short_flag = 'X', long_flag = "set-param")]
    SetParam {
        /// Parameter group (see above).
        #[arg(short = 'n', long = "name", value_parser = param_group(), value_name = "GROUP")]
        name: String,
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core (seq-cutoff; all cores when omitted).
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
        /// New value (cache-mode).
        #[arg(short = 'v', long = "value")]
        value: Option<String>,
        /// Policy: cleaning nop|alru|acp|alru-very-aggressive|acp-very-aggressive|alru-lazy;
        /// seq-cutoff always|full|never; promotion always|nhit; lazy-flush on|off;
        /// prefetch readahead|none.
        #[arg(short = 'p', long = "policy")]
        policy: Option<String>,
        /// Wake-up: seconds (alru) or milliseconds (acp).
        #[arg(short = 'w', long = "wake-up")]
        wake_up: Option<String>,
        /// alru staleness time, seconds.
        #[arg(short = 's', long = "staleness-time")]
        staleness_time: Option<String>,
        /// Lines cleaned per run (alru, acp).
        #[arg(short = 'b', long = "flush-max-buffers")]
        flush_max_buffers: Option<String>,
        /// alru activity threshold (ms); seq-cutoff threshold (KiB); nhit threshold (accesses);
        /// prefetch-readahead threshold (KiB); fallback-pt threshold (cache-device errors).
        #[arg(short = 't', long = "threshold", visible_alias = "activity-threshold")]
        threshold: Option<String>,
        /// alru dirty ratio threshold, percent (100 = off).
        #[arg(short = 'd', long = "dirty-ratio-threshold")]
        dirty_ratio_threshold: Option<String>,
        /// alru dirty ratio inertia, MiB.
        #[arg(long = "dirty-ratio-inertia")]
        dirty_ratio_inertia: Option<String>,
        /// nhit trigger: occupancy percent above which nhit applies.
        #[arg(short = 'o', long = "trigger")]
        trigger: Option<String>,
        /// seq-cutoff, seq-detect: sequential requests before a stream counts.
        #[arg(long = "promotion-count")]
        promotion_count: Option<String>,
        /// seq-detect (casadm master): KiB a stream moves before it counts, 0 for none.
        #[arg(long = "promotion-threshold")]
        promotion_threshold: Option<String>,
        /// cleaning-io: largest cleaning write, KiB.
        #[arg(long = "merge-max")]
        merge_max: Option<String>,
        /// cleaning-io: cleaning bandwidth cap, MiB/s (0 = none).
        #[arg(long = "max-bandwidth")]
        max_bandwidth: Option<String>,
        /// prefetch-readahead: how far ahead of a stream to read, KiB.
        #[arg(long = "distance")]
        distance: Option<String>,
        /// prefetch-readahead: prefetch requests queued or running at most.
        #[arg(long = "max-in-flight")]
        max_in_flight: Option<String>,
        /// offload-queue: percent of eligible requests sent to the core.
        #[arg(long = "share")]
        share: Option<String>,
        /// fallback-pt: seconds a cache-device error counts towards the threshold (0: until
        /// the counters are reset).
        #[arg(long = "window")]
        window: Option<String>,
    },

    /// Print a parameter group (names as for set-param, and cache-line-size).
    #[command(short_flag = 'G', long_flag = "get-param")]
    GetParam {
        /// Parameter group: those of set-param, and cache-line-size.
        #[arg(short = 'n', long = "name", value_parser = param_group(), value_name = "GROUP")]
        name: String,
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// Core id (0..4095) [default: every core of the cache].
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
        /// Output format.
        #[arg(
            short = 'o',
            long = "output-format",
            value_enum,
            default_value = "table"
        )]
        output: OutputFormat,
    },

    /// IO classes: load Open CAS's CSV class file (`-C -C -i ID -f FILE`) or list the classes
    /// in force (`-C -L -i ID`). See docs/io-classes.md.
    #[command(
        short_flag = 'C',
        long_flag = "io-class",
        group(clap::ArgGroup::new("action").args(["load", "list"]).required(true))
    )]
    IoClass {
        /// Load a class file (replaces the classes in force; a refused file changes nothing).
        #[arg(short = 'C', long = "load-config")]
        load: bool,
        /// List the classes in force.
        #[arg(short = 'L', long = "list")]
        list: bool,
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = cache_id)]
        id: u16,
        /// The CSV file (with --load-config).
        #[arg(
            short = 'f',
            long = "file",
            value_name = "FILE",
            required_if_eq("load", "true")
        )]
        file: Option<PathBuf>,
        /// Accept rules that need file-system knowledge (metadata, file_size, ...); they never
        /// match on a block export. Without it such a file is refused.
        #[arg(long)]
        ignore_unsupported: bool,
        /// Output format.
        #[arg(
            short = 'o',
            long = "output-format",
            value_enum,
            default_value = "table"
        )]
        output: OutputFormat,
    },

    /// Print the version of this program and of the running daemon.
    #[command(short_flag = 'V', long_flag = "version")]
    Version {
        /// Output format.
        #[arg(
            short = 'o',
            long = "output-format",
            value_enum,
            default_value = "table"
        )]
        output: OutputFormat,
    },

    /// Stop the daemon as SIGTERM does: every cache is flushed and stopped, the sockets removed.
    /// Waits for the outcome; fails if some dirty data could not be flushed.
    StopDaemon,

    /// Analyse a block trace and recommend a cache configuration (no daemon needed).
    Analyze(crate::analyze::AnalyzeArgs),

    /// Record the requests on exported volumes as a blkparse trace (start, stop, status).
    Trace(crate::trace::TraceArgs),

    /// The running setup as a configuration file (export).
    Config(crate::config_cmd::ConfigArgs),

    /// Export a device over NBD with no cache (a bare core, e.g. for benchmarks).
    Serve(crate::serve::ServeArgs),

    /// Benchmarks: fio over a matrix (run), the emulated RAID's calibration (calibration), the
    /// engine alone (engine), a hit against the cache device itself (device).
    Bench(crate::bench::BenchArgs),

    /// A live view of the caches: IOPS, MB/s, hit ratio, dirty %, cleaning, latency (q quits).
    Top(crate::top::TopArgs),

    /// Write the man pages or the shell completions (for `make install`; hidden).
    #[command(hide = true)]
    Gen(crate::gen::GenArgs),

    /// Open CAS's casctl verbs over the running caches: `casctl stop [--flush]`.
    Casctl(crate::script_cmd::CasctlArgs),
}

impl Command {
    /// The control request for a management command (None for `daemon`, `version` and
    /// `analyze`, which the CLI handles itself).
    pub fn request(&self) -> Option<Request> {
        Some(match self {
            Command::Daemon { .. }
            | Command::Version { .. }
            | Command::StopDaemon
            | Command::Analyze(_)
            | Command::IoClass { .. }
            | Command::Trace(_)
            | Command::Config(_)
            | Command::Serve(_)
            | Command::Top(_)
            | Command::Gen(_)
            | Command::Casctl(_)
            | Command::Bench(_) => return None,
            Command::StartCache {
                device,
                id,
                mode,
                line_size,
                force,
                load,
                mirror,
                load_mirror,
                mirror_lost,
                fallback_pt_threshold,
                fallback_pt_window,
            } => Request::StartCache {
                device: device_from_here(device),
                id: *id,
                mode: mode.map(|m| m.to_string()),
                line_size_kib: *line_size,
                force: *force,
                load: *load,
                mirror: mirror.as_deref().map(device_from_here),
                load_mirror: *load_mirror,
                mirror_lost: mirror_lost.clone(),
                fallback_pt_threshold: *fallback_pt_threshold,
                fallback_pt_window: *fallback_pt_window,
            },
            Command::StopCache {
                id,
                no_data_flush,
                disconnect_clients,
                force,
            } => Request::StopCache {
                id: *id,
                no_data_flush: *no_data_flush,
                force: false,
                disconnect_clients: *disconnect_clients || *force,
            },
            Command::AddCore {
                id,
                device,
                core,
                force,
                frontend,
            } => Request::AddCore {
                cache: *id,
                device: device_from_here(device),
                core: *core,
                force: *force,
                frontend: frontend.clone(),
            },
            Command::RemoveCore {
                id,
                core,
                force,
                disconnect_clients,
            } => Request::RemoveCore {
                cache: *id,
                core: *core,
                force: *force,
                disconnect_clients: *disconnect_clients,
                inactive_only: false,
                detach: false,
            },
            Command::RemoveInactive { id, core, force } => Request::RemoveCore {
                cache: *id,
                core: *core,
                force: *force,
                disconnect_clients: false,
                inactive_only: true,
                detach: false,
            },
            Command::ZeroMetadata { device, force } => Request::ZeroMetadata {
                device: device_from_here(device),
                force: *force,
            },
            Command::AttachMirror { id, device, force } => Request::AttachMirror {
                cache: *id,
                device: device_from_here(device),
                force: *force,
            },
            Command::RemoveDetached { device } => Request::RemoveDetached {
                device: device_from_here(device),
            },
            Command::Script {
                add_core: true,
                id: Some(id),
                core_device: Some(device),
                core,
                try_add,
                update_path,
                ..
            } => match (try_add, core) {
                (false, Some(core)) if *update_path => Request::UpdateCorePath {
                    cache: *id,
                    core: *core,
                    device: device_from_here(device),
                },
                (true, Some(core)) => Request::TryAddCore {
                    cache: *id,
                    core: *core,
                    device: device_from_here(device),
                },
                _ => Request::AddCore {
                    cache: *id,
                    device: device_from_here(device),
                    core: *core,
                    force: false,
                    frontend: None,
                },
            },
            Command::Script {
                remove_core: true,
                id: Some(id),
                core: Some(core),
                no_flush,
                force,
                detach,
                ..
            } => Request::RemoveCore {
                cache: *id,
                core: *core,
                force: *no_flush || *force,
                disconnect_clients: false,
                inactive_only: false,
                detach: *detach,
            },
            Command::Script {
                check_cache_device: true,
                device: Some(device),
                ..
            } => Request::CheckCacheDevice {
                device: device_from_here(device),
            },
            Command::Script {
                purge_cache: true,
                id: Some(id),
                ..
            } => Request::PurgeCache { cache: *id },
            Command::Script {
                purge_core: true,
                id: Some(id),
                core: Some(core),
                ..
            } => Request::PurgeCore {
                cache: *id,
                core: *core,
            },
            Command::Script {
                disconnect_cache: true,
                id: Some(id),
                no_flush,
                pass_through,
                ..
            } => Request::DisconnectCache {
                id: *id,
                no_flush: *no_flush,
                pass_through: *pass_through,
                detach: false,
            },
            Command::DetachCache { id } => Request::DisconnectCache {
                id: *id,
                no_flush: false,
                pass_through: true,
                detach: true,
            },
            Command::AttachCache { id, device, force } => Request::ConnectCache {
                device: device_from_here(device),
                id: Some(*id),
                force: *force,
            },
            Command::Script {
                device: Some(device),
                id,
                ..
            } => Request::ConnectCache {
                device: device_from_here(device),
                id: *id,
                force: false,
            },
            // clap's group and `requires` leave no other shape.
            Command::Script { .. } => return None,
            Command::ListCaches { .. } => Request::List,
            Command::Stats {
                id, core, io_class, ..
            } => Request::Stats {
                cache: *id,
                core: *core,
                io_class: io_class.flatten(),
            },
            Command::ResetCounters { id, core } => Request::ResetCounters {
                cache: *id,
                core: *core,
            },
            Command::SetCacheMode { mode, id, flush } => Request::SetCacheMode {
                cache: *id,
                mode: mode.to_string(),
                flush: *flush,
            },
            Command::FlushCache { id, core } => Request::Flush {
                cache: *id,
                core: *core,
            },
            Command::FlushCore { id, core } => Request::Flush {
                cache: *id,
                core: Some(*core),
            },
            Command::SetParam {
                name,
                id,
                core,
                value,
                policy,
                wake_up,
                staleness_time,
                flush_max_buffers,
                threshold,
                dirty_ratio_threshold,
                dirty_ratio_inertia,
                trigger,
                promotion_count,
                promotion_threshold,
                merge_max,
                max_bandwidth,
                distance,
                max_in_flight,
                share,
                window,
            } => {
                let given = [
                    ("-v", value),
                    ("-p", policy),
                    ("-w", wake_up),
                    ("-s", staleness_time),
                    ("-b", flush_max_buffers),
                    ("-t", threshold),
                    ("-d", dirty_ratio_threshold),
                    ("--dirty-ratio-inertia", dirty_ratio_inertia),
                    ("-o", trigger),
                    ("--promotion-count", promotion_count),
                    ("--promotion-threshold", promotion_threshold),
                    ("--merge-max", merge_max),
                    ("--max-bandwidth", max_bandwidth),
                    ("--distance", distance),
                    ("--max-in-flight", max_in_flight),
                    ("--share", share),
                    ("--window", window),
                ];
                let group = crate::params::find(name).ok();
                let mut values = std::collections::BTreeMap::new();
                for (flag, v) in given {
                    let Some(v) = v else { continue };
                    // A flag the group does not have goes as itself; the daemon names it in
                    // its refusal.
                    let key = group
                        .and_then(|g| g.fields.iter().find(|f| f.flag == flag))
                        .map_or(flag.to_string(), |f| f.key.to_string());
                    values.insert(key, v.clone());
                }
                Request::SetParam {
                    cache: *id,
                    core: *core,
                    name: name.clone(),
                    value: String::new(),
                    values,
                }
            }
            Command::GetParam { name, id, core, .. } => Request::GetParam {
                cache: *id,
                core: *core,
                name: name.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("hybridcache").chain(args.iter().copied()))
    }

    fn req(args: &[&str]) -> Request {
        parse(args)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .command
            .request()
            .expect("a management command")
    }

    #[test]
    fn script_disconnect_and_connect_take_casadm_s_options() {
        match req(&["--script", "--disconnect-cache", "--cache-id", "3"]) {
            Request::DisconnectCache {
                id: 3,
                no_flush: false,
                pass_through: false,
                detach: false,
            } => {}
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--disconnect-cache",
            "-i",
            "3",
            "--pass-through",
        ]) {
            Request::DisconnectCache {
                pass_through: true,
                no_flush: false,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        match req(&["--script", "--disconnect-cache", "-i", "3", "--no-flush"]) {
            Request::DisconnectCache { no_flush: true, .. } => {}
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--connect-cache",
            "--cache-device",
            "/dev/nvme1n1",
        ]) {
            Request::ConnectCache {
                device,
                id: None,
                force: false,
            } => assert_eq!(device, "/dev/nvme1n1"),
            other => panic!("{other:?}"),
        }
        // casadm's --detach-cache / --attach-cache: the pass-through disconnect and the connect.
        match req(&["--detach-cache", "-i", "4"]) {
            Request::DisconnectCache {
                id: 4,
                no_flush: false,
                pass_through: true,
                detach: true,
            } => {}
            other => panic!("{other:?}"),
        }
        match req(&["--attach-cache", "-i", "4", "-d", "/dev/nvme1n1", "-f"]) {
            Request::ConnectCache {
                device,
                id: Some(4),
                force: true,
            } => assert_eq!(device, "/dev/nvme1n1"),
            other => panic!("{other:?}"),
        }
        assert!(parse(&["--attach-cache", "-i", "4"]).is_err());
        assert!(parse(&["--detach-cache"]).is_err());
        // A sub-command is required, one at a time, each with what it needs.
        for bad in [
            &["--script"][..],
            &["--script", "--disconnect-cache"],
            &["--script", "--connect-cache"],
            &[
                "--script",
                "--connect-cache",
                "--disconnect-cache",
                "-i",
                "1",
            ],
            &["--script", "--connect-cache", "-d", "x", "--no-flush"],
            &["--script", "--disconnect-cache", "-i", "1", "-d", "x"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn script_check_purge_add_remove_take_casadm_s_options() {
        match req(&[
            "--script",
            "--check-cache-device",
            "--cache-device",
            "/dev/sdb",
        ]) {
            Request::CheckCacheDevice { device } => assert_eq!(device, "/dev/sdb"),
            other => panic!("{other:?}"),
        }
        match req(&["--script", "--purge-cache", "--cache-id", "2"]) {
            Request::PurgeCache { cache: 2 } => {}
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--purge-core",
            "--cache-id",
            "2",
            "--core-id",
            "0",
        ]) {
            Request::PurgeCore { cache: 2, core: 0 } => {}
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--add-core",
            "--try-add",
            "--cache-id",
            "2",
            "--core-id",
            "3",
            "--core-device",
            "/dev/sdc",
        ]) {
            Request::TryAddCore {
                cache: 2,
                core: 3,
                device,
            } => assert_eq!(device, "/dev/sdc"),
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--add-core",
            "-i",
            "2",
            "--core-device",
            "/dev/sdc",
        ]) {
            Request::AddCore {
                cache: 2,
                core: None,
                force: false,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--remove-core",
            "-i",
            "2",
            "-j",
            "3",
            "--no-flush",
        ]) {
            Request::RemoveCore {
                cache: 2,
                core: 3,
                force: true,
                disconnect_clients: false,
                inactive_only: false,
                detach: false,
            } => {}
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--remove-core",
            "-i",
            "2",
            "-j",
            "3",
            "--detach",
        ]) {
            Request::RemoveCore {
                cache: 2,
                core: 3,
                force: false,
                detach: true,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        match req(&[
            "--script",
            "--add-core",
            "--update-path",
            "-i",
            "2",
            "-j",
            "3",
            "--core-device",
            "/dev/disk/by-id/wwn-1",
        ]) {
            Request::UpdateCorePath {
                cache: 2,
                core: 3,
                device,
            } => assert_eq!(device, "/dev/disk/by-id/wwn-1"),
            other => panic!("{other:?}"),
        }
        match req(&["--remove-detached", "-d", "/dev/sdc"]) {
            Request::RemoveDetached { device } => assert_eq!(device, "/dev/sdc"),
            other => panic!("{other:?}"),
        }
        for bad in [
            &["--script", "--check-cache-device"][..],
            &["--script", "--check-cache-device", "-d", "x", "-i", "1"],
            &["--script", "--purge-cache"],
            &["--script", "--purge-cache", "-i", "1", "-j", "1"],
            &["--script", "--purge-core", "-i", "1"],
            &[
                "--script",
                "--purge-cache",
                "--purge-core",
                "-i",
                "1",
                "-j",
                "1",
            ],
            &["--script", "--add-core", "-i", "1"],
            &[
                "--script",
                "--add-core",
                "--try-add",
                "-i",
                "1",
                "--core-device",
                "x",
            ],
            &["--script", "--remove-core", "-i", "1"],
            &["--script", "--disconnect-cache", "-i", "1", "-j", "1"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    /// Every option of every verb says what it is for in `-H` (casadm users read the help to
    /// find out which of its flags we take).
    #[test]
    fn every_option_has_a_help_line() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &str, blank: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                if arg.is_hide_set() || arg.get_id() == "help" {
                    continue;
                }
                if !matches!(arg.get_help(), Some(h) if !h.to_string().trim().is_empty()) {
                    blank.push(format!("{path} --{}", arg.get_id()));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), blank);
            }
        }
        let mut blank = Vec::new();
        walk(&Cli::command(), "hybridcache", &mut blank);
        assert!(blank.is_empty(), "options without help: {blank:#?}");
    }

    /// `-H` after any verb, in each of its forms (name, `--long`, casadm's `-X`), and after a
    /// verb's own verb, shows that verb's help: what every usage error points at.
    #[test]
    fn every_verb_has_its_help_in_every_form() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, typed: &[String], checked: &mut usize) {
            for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
                let mut forms = vec![sub.get_name().to_string()];
                forms.extend(sub.get_long_flag().map(|l| format!("--{l}")));
                forms.extend(sub.get_short_flag().map(|c| format!("-{c}")));
                for form in forms {
                    let mut args: Vec<String> = typed.to_vec();
                    args.push(form);
                    for help in ["-H", "--help"] {
                        let argv = std::iter::once("hybridcache")
                            .chain(args.iter().map(String::as_str))
                            .chain([help]);
                        let e = Cli::try_parse_from(argv).unwrap_err();
                        assert_eq!(e.kind(), ErrorKind::DisplayHelp, "{args:?} {help}: {e}");
                        assert!(
                            e.to_string()
                                .contains(&format!("Usage: hybridcache {}", typed.join(" "))),
                            "{args:?}: {e}"
                        );
                        *checked += 1;
                    }
                    walk(sub, &args, checked);
                }
            }
        }
        let mut checked = 0;
        walk(&Cli::command(), &[], &mut checked);
        assert!(checked > 60, "{checked}");
    }

    #[test]
    fn relative_device_paths_are_resolved_against_the_cli_s_directory() {
        let here = std::env::current_dir().unwrap();
        let abs = |p: &str| here.join(p).display().to_string();
        assert_eq!(device_from_here("cache.img"), abs("cache.img"));
        assert_eq!(device_from_here("./d/core.img"), abs("./d/core.img"));
        assert_eq!(device_from_here("../x:y.img"), abs("../x:y.img"));
        assert_eq!(
            device_from_here("file:core.img"),
            format!("file:{}", abs("core.img"))
        );
        for kept in [
            "/dev/sdb",
            "file:/srv/core.img",
            "ram:1G",
            "null:64G",
            "nbd+unix:///cas1-1?socket=n.sock",
            "raid:preset=study60,disk_size=64G,nodata",
        ] {
            assert_eq!(device_from_here(kept), kept);
        }
        match req(&["-A", "-i", "1", "-d", "core.img"]) {
            Request::AddCore { device, .. } => assert_eq!(device, abs("core.img")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn short_and_long_verbs_agree() {
        let want = Request::StartCache {
            device: "ram:1G".into(),
            id: Some(3),
            mode: Some("wb".into()),
            line_size_kib: Some(16),
            force: true,
            load: false,
            mirror: None,
            load_mirror: false,
            mirror_lost: None,
            fallback_pt_threshold: None,
            fallback_pt_window: None,
        };
        assert_eq!(
            req(&["-S", "-d", "ram:1G", "-i", "3", "-c", "wb", "-x", "16", "--force"]),
            want
        );
        assert_eq!(
            req(&[
                "--start-cache",
                "--cache-device",
                "ram:1G",
                "--cache-id",
                "3",
                "--cache-mode",
                "write-back",
                "--cache-line-size",
                "16",
                "-f"
            ]),
            want
        );
        assert_eq!(
            req(&["start-cache", "-d", "ram:1G", "-i3", "-cwb", "-x16", "-f"]),
            want
        );
    }

    #[test]
    fn every_verb_maps_to_its_request() {
        assert_eq!(
            req(&["-T", "-i", "1", "-n"]),
            Request::StopCache {
                id: 1,
                no_data_flush: true,
                force: false,
                disconnect_clients: false
            }
        );
        // -T's --force is the old name of --disconnect-clients.
        for flag in ["--force", "-f", "--disconnect-clients"] {
            assert_eq!(
                req(&["-T", "-i", "1", flag]),
                Request::StopCache {
                    id: 1,
                    no_data_flush: false,
                    force: false,
                    disconnect_clients: true
                }
            );
        }
        assert_eq!(
            req(&["-A", "-i", "1", "-d", "/dev/sdb", "-j", "2"]),
            Request::AddCore {
                cache: 1,
                device: "/dev/sdb".into(),
                core: Some(2),
                force: false,
                frontend: None
            }
        );
        assert_eq!(
            req(&["-A", "-i", "1", "-d", "/dev/sdb", "--frontend", "ublk"]),
            Request::AddCore {
                cache: 1,
                device: "/dev/sdb".into(),
                core: None,
                force: false,
                frontend: Some("ublk".into())
            }
        );
        assert!(Cli::try_parse_from([
            "hybridcache",
            "-A",
            "-i",
            "1",
            "-d",
            "/x",
            "--frontend",
            "scsi"
        ])
        .is_err());
        assert_eq!(
            req(&["-A", "-i", "1", "-d", "/dev/sdb", "-f"]),
            Request::AddCore {
                cache: 1,
                device: "/dev/sdb".into(),
                core: None,
                force: true,
                frontend: None
            }
        );
        assert_eq!(
            req(&["-R", "-i", "1", "-j", "2", "--force"]),
            Request::RemoveCore {
                cache: 1,
                core: 2,
                force: true,
                disconnect_clients: false,
                inactive_only: false,
                detach: false
            }
        );
        assert_eq!(
            req(&["-R", "-i", "1", "-j", "2", "--disconnect-clients"]),
            Request::RemoveCore {
                cache: 1,
                core: 2,
                force: false,
                disconnect_clients: true,
                inactive_only: false,
                detach: false
            }
        );
        assert_eq!(
            req(&["--remove-inactive", "-i", "1", "-j", "2"]),
            Request::RemoveCore {
                cache: 1,
                core: 2,
                force: false,
                disconnect_clients: false,
                inactive_only: true,
                detach: false
            }
        );
        assert_eq!(
            req(&["-E", "-i", "1", "-j", "3"]),
            req(&["-F", "-i", "1", "-j", "3"])
        );
        assert_eq!(
            req(&["--flush-core", "-i", "1", "-j", "3"]),
            req(&["-F", "-i", "1", "-j", "3"])
        );
        assert!(parse(&["-E", "-i", "1"]).is_err(), "-E needs a core");
        assert_eq!(req(&["-L"]), Request::List);
        assert_eq!(
            req(&["-P", "-i", "1", "-j", "1", "-o", "json"]),
            Request::Stats {
                cache: 1,
                core: Some(1),
                io_class: None
            }
        );
        assert_eq!(
            req(&["-Z", "-i", "1"]),
            Request::ResetCounters {
                cache: 1,
                core: None
            }
        );
        assert_eq!(
            req(&["-Q", "-c", "pt", "-i", "1", "-f", "yes"]),
            Request::SetCacheMode {
                cache: 1,
                mode: "pt".into(),
                flush: Some(true)
            }
        );
        assert_eq!(
            req(&["-F", "-i", "1", "-j", "4"]),
            Request::Flush {
                cache: 1,
                core: Some(4)
            }
        );
        assert_eq!(
            req(&["-X", "-n", "cache-mode", "-i", "1", "-v", "wa"]),
            Request::SetParam {
                cache: 1,
                core: None,
                name: "cache-mode".into(),
                value: String::new(),
                values: [("mode".to_string(), "wa".to_string())].into()
            }
        );
        assert_eq!(
            req(&["-G", "-n", "cache-line-size", "-i", "1"]),
            Request::GetParam {
                cache: 1,
                core: None,
                name: "cache-line-size".into()
            }
        );
        assert!(parse(&["-V"]).unwrap().command.request().is_none());
    }

    #[test]
    fn analyze_parses_its_options() {
        let cli = parse(&[
            "analyze",
            "t.blk",
            "--format",
            "fio",
            "--profile",
            "nvme",
            "--markdown",
            "-o",
            "r.md",
            "--commands",
            "c.sh",
            "--config-out",
            "c.toml",
            "-i",
            "7",
        ])
        .unwrap();
        let Command::Analyze(a) = &cli.command else {
            panic!("not analyze: {:?}", cli.command)
        };
        assert_eq!(a.trace, PathBuf::from("t.blk"));
        assert_eq!(a.format, crate::analyze::TraceFormat::Fio);
        assert_eq!(a.profile.as_deref(), Some("nvme"));
        assert!(a.markdown && !a.apply);
        assert_eq!(a.output, Some(PathBuf::from("r.md")));
        assert_eq!(a.commands, Some(PathBuf::from("c.sh")));
        assert_eq!(a.config_out, Some(PathBuf::from("c.toml")));
        assert_eq!(a.id, Some(7));
        assert!(cli.command.request().is_none());
        let a = match parse(&["analyze", "t"]).unwrap().command {
            Command::Analyze(a) => a,
            other => panic!("{other:?}"),
        };
        assert_eq!(a.format, crate::analyze::TraceFormat::Auto);
        assert_eq!(a.id, None);
        let msg = |args: &[&str]| parse(args).unwrap_err().to_string();
        assert!(msg(&["analyze", "t", "--format", "xml"]).contains("unknown trace format"));
        assert!(msg(&["analyze", "t", "--apply"]).contains("--cache-id"));
        assert_eq!(
            parse(&["analyze"]).unwrap_err().kind(),
            ErrorKind::MissingRequiredArgument
        );
    }

    #[test]
    fn control_socket_before_or_after_the_verb() {
        let a = parse(&["--control", "/x.sock", "-L"]).unwrap();
        let b = parse(&["-L", "--control", "/x.sock"]).unwrap();
        assert_eq!(a.control, Some(PathBuf::from("/x.sock")));
        assert_eq!(b.control, a.control);
    }

    #[test]
    fn bad_arguments_are_refused_clearly() {
        let msg = |args: &[&str]| parse(args).unwrap_err().to_string();
        assert!(msg(&["-S", "-d", "x", "-c", "fast"]).contains("unknown cache mode 'fast'"));
        assert!(msg(&["-S", "-d", "x", "-x", "12"]).contains("not supported"));
        assert!(msg(&["-S", "-d", "x", "-i", "0"]).contains("not a cache id"));
        assert!(msg(&["-S", "-d", "x", "-i", "99999"]).contains("not a cache id"));
        assert!(msg(&["-A", "-i", "1", "-d", "x", "-j", "4096"]).contains("not a core id"));
        assert!(msg(&["-Q", "-c", "wt", "-i", "1", "-f", "maybe"]).contains("expected yes or no"));
        assert!(msg(&["-P", "-i", "1", "-o", "xml"]).contains("xml"));
        assert!(msg(&["daemon", "--nbd-workers", "four"]).contains("'four' is not a whole number"));
        assert!(msg(&["daemon", "--ublk-queues", "70000"]).contains("70000 is too large"));
        assert!(msg(&["daemon", "--nbd-stall-timeout=-1"]).contains("'-1' is not a whole number"));
        assert_eq!(
            parse(&["-S"]).unwrap_err().kind(),
            ErrorKind::MissingRequiredArgument
        );
        assert_eq!(
            parse(&["-T", "-i", "1", "--bogus"]).unwrap_err().kind(),
            ErrorKind::UnknownArgument
        );
        assert_eq!(parse(&["-H"]).unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert_eq!(
            parse(&["--frobnicate"]).unwrap_err().kind(),
            ErrorKind::UnknownArgument
        );
    }
}
