//! `hybridcache bench device`: a cache hit against the cache device itself (perf.md §4, issue
//! 15's table (a)), in one invocation, on whatever file or block device the user names.
//!
//! For each pattern (4 KiB randread, randwrite) and queue depth (1, 32), three fio runs follow
//! each other, so the machine's drift hits all three alike:
//! - `raw`: fio on the device itself (libaio, O_DIRECT): the physical limit;
//! - `hybridcache`: fio through NBD to a cache on that device (O_DIRECT), write-back, in front of
//!   a null core, cleaning nop, seq cutoff never, warmed first so every request is a hit (the
//!   run's statistics are checked, and a run with misses is flagged);
//! - `nbdkit`: fio through NBD to nbdkit's file plugin with `cache=none` on the same device: the
//!   NBD transport's ceiling over this device.
//!
//! The table gives medians over the repetitions of IOPS and of the per-repetition ratios
//! ours/raw (the target at qd32 is 0.9) and ours/nbdkit (the target at qd1 is 0.9), and the
//! server's CPU per request: the user and system time the daemon (or nbdkit) spent during the
//! run, from /proc/PID/stat, over the requests fio completed (issue 32's target: ours at most
//! nbdkit's).
//!
//! Several hybridcache variants (`--variants`) can be compared in one invocation: each gets its
//! own daemon, warmed anew, and its own raw and nbdkit runs next to it.
//!
//! Every run WRITES to the device, so it is refused when it holds a file system or anything
//! else libblkid knows, another cache (unless `--force`), or is in use (the daemon's claims).
//! The first 2 MiB (where a cache's superblock lives) are zeroed at the end, so the scratch
//! cache the bench leaves does not look like one a daemon could load.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use hybridcache_daemon::{claims, signature};

use super::fio;
use super::procs::{self, CacheCtl, Proc, StopWith};
use super::UsageError;
use crate::protocol::StatsData;

/// The environment variable that chooses a file volume's I/O engine (docs/devices.md).
pub const VOLUME_IO_ENV: &str = "HYBRIDCACHE_VOLUME_IO";

#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// The cache device: a regular file or a block device. Its content is overwritten.
    #[arg(long, value_name = "FILE_OR_DEV")]
    pub cache: PathBuf,
    /// Bytes of the device the runs work on (every one of them cached) [default: what the
    /// cache holds, at most 2G].
    #[arg(long, value_name = "SIZE")]
    pub size: Option<String>,
    /// Seconds per fio run.
    #[arg(long, value_name = "S", default_value_t = 8)]
    pub runtime: u64,
    /// Repetitions (the table shows medians).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub reps: u32,
    /// Patterns: randread, randwrite.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        default_value = "randread,randwrite"
    )]
    pub pattern: Vec<String>,
    /// Queue depths.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        default_value = "1,32"
    )]
    pub iodepth: Vec<u32>,
    /// hybridcache variants to compare, each `default` or `KEY=VALUE` settings joined by `+`:
    /// `workers=N` (the daemon's --nbd-workers), `io=auto|uring|pread` (the cache volume's I/O
    /// engine, HYBRIDCACHE_VOLUME_IO), `bin=PATH` (another hybridcache build, for before and
    /// after in one invocation). Example: `bin=/tmp/old-hybridcache,default`.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        default_value = "default"
    )]
    pub variants: Vec<String>,
    /// Also run on a device that holds a hybridcache or Open CAS cache (never on one that holds
    /// a file system or is in use).
    #[arg(long)]
    pub force: bool,
}

/// One hybridcache configuration under test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variant {
    pub name: String,
    pub workers: Option<usize>,
    pub io: Option<String>,
    /// Another hybridcache binary (an older build, for before/after in one invocation).
    pub bin: Option<PathBuf>,
}

impl Variant {
    pub fn parse(text: &str) -> Result<Variant> {
        let name = text.trim().to_string();
        let mut v = Variant {
            name: name.clone(),
            workers: None,
            io: None,
            bin: None,
        };
        if name == "default" {
            return Ok(v);
        }
        for part in name.split('+') {
            let Some((k, val)) = part.split_once('=') else {
                bail!(UsageError(format!(
                    "variant '{name}': '{part}' is not KEY=VALUE (workers=N, io=auto|uring|pread) or 'default'"
                )));
            };
            match k {
                "workers" => {
                    let n: usize = val
                        .parse()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| {
                            UsageError(format!(
                                "variant '{name}': workers must be 1 to 256, not '{val}'"
                            ))
                        })?;
                    v.workers = Some(n);
                }
                "io" => {
                    if !matches!(val, "auto" | "uring" | "pread") {
                        bail!(UsageError(format!(
                            "variant '{name}': io must be auto, uring or pread, not '{val}'"
                        )));
                    }
                    v.io = Some(val.to_string());
                }
                "bin" => v.bin = Some(PathBuf::from(val)),
                other => bail!(UsageError(format!(
                    "variant '{name}': unknown setting '{other}' (workers, io, bin)"
                ))),
            }
        }
        Ok(v)
    }
}

/// The checked command line.
#[derive(Debug, Clone)]
pub struct Plan {
    pub size: Option<u64>,
    pub runtime: u64,
    pub reps: u32,
    pub patterns: Vec<String>,
    pub iodepths: Vec<u32>,
    pub variants: Vec<Variant>,
}

const DEFAULT_MAX_SIZE: u64 = 2 << 30;

pub fn plan(a: &DeviceArgs) -> Result<Plan> {
    let usage = |m: String| anyhow!(UsageError(m));
    if a.runtime == 0 {
        return Err(usage("--runtime must be at least 1 second".into()));
    }
    if a.reps == 0 {
        return Err(usage("--reps must be at least 1".into()));
    }
    let size = match &a.size {
        None => None,
        Some(t) => {
            let n = hybridcache_volume::parse_size(t).map_err(|e| usage(format!("--size: {e}")))?;
            if n < (1 << 20) || n % (1 << 20) != 0 {
                return Err(usage(format!(
                    "--size must be a non-zero multiple of 1 MiB, not {t}"
                )));
            }
            Some(n)
        }
    };
    for p in &a.pattern {
        if !matches!(p.as_str(), "randread" | "randwrite") {
            return Err(usage(format!(
                "--pattern: '{p}' is not randread or randwrite"
            )));
        }
    }
    if a.pattern.is_empty() || a.iodepth.is_empty() || a.variants.is_empty() {
        return Err(usage(
            "--pattern, --iodepth and --variants need at least one value".into(),
        ));
    }
    if let Some(qd) = a.iodepth.iter().find(|&&q| q == 0 || q > 1024) {
        return Err(usage(format!("--iodepth must be 1 to 1024, not {qd}")));
    }
    let variants = a
        .variants
        .iter()
        .map(|v| Variant::parse(v))
        .collect::<Result<Vec<_>>>()?;
    Ok(Plan {
        size,
        runtime: a.runtime,
        reps: a.reps,
        patterns: a.pattern.clone(),
        iodepths: a.iodepth.clone(),
        variants,
    })
}

/// Why the bench must not write to `path`, if it must not: in use (the daemon's claims), a file
/// system or other known signature (libblkid), or a cache unless `force`.
pub fn refusal(path: &Path, force: bool) -> Result<Option<String>> {
    let shown = path.display();
    let meta = std::fs::metadata(path).with_context(|| format!("{shown}"))?;
    use std::os::unix::fs::FileTypeExt;
    if !meta.file_type().is_file() && !meta.file_type().is_block_device() {
        return Ok(Some(format!(
            "{shown} is not a regular file or a block device"
        )));
    }
    let spec = path
        .to_str()
        .ok_or_else(|| anyhow!("{shown}: the path is not UTF-8"))?;
    // Taken and released at once: it only asks whether anyone holds the device now (the daemon
    // the bench starts claims it for itself).
    if let Err(why) = claims::claim(spec, false) {
        return Ok(Some(format!("{shown} is in use: {why}")));
    }
    if let Ok(vol) = hybridcache_volume::FileVolume::open(path) {
        if let Ok(sb) = hybridcache_engine::Cache::peek(&vol) {
            if !force {
                return Ok(Some(format!(
                    "{shown} holds hybridcache cache {} (use --force to overwrite it)",
                    sb.cache_id
                )));
            }
            return Ok(None);
        }
    }
    match signature::detect(path).map_err(|e| anyhow!(e))? {
        None => Ok(None),
        Some(found) if force && found.contains("Open CAS") => Ok(None),
        Some(found) => Ok(Some(format!(
            "{shown} holds {found}; the bench writes to the device, so it refuses it"
        ))),
    }
}

/// Which server a run measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Raw,
    Ours,
    Nbdkit,
}

/// Medians are taken over these per (variant, pattern, qd).
#[derive(Debug, Default, Clone)]
struct Cell {
    raw: Vec<f64>,
    ours: Vec<f64>,
    nbdkit: Vec<f64>,
    ours_raw: Vec<f64>,
    ours_nbdkit: Vec<f64>,
    /// Server CPU (user + system) per request, µs.
    ours_cpu: Vec<f64>,
    nbdkit_cpu: Vec<f64>,
    misses: u64,
}

/// User plus system CPU time a process has used so far, in µs (/proc/PID/stat, fields 14
/// and 15, in clock ticks); None if the process is gone or the file unreadable.
fn cpu_us(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its end.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| (utime + stime) * 1e6 / hz as f64)
}

pub fn run(a: &DeviceArgs) -> Result<()> {
    let plan = plan(a)?;
    let path = std::fs::canonicalize(&a.cache)
        .with_context(|| format!("cannot find {}", a.cache.display()))?;
    if let Some(why) = refusal(&path, a.force)? {
        bail!(why);
    }
    for tool in ["fio", "nbdkit"] {
        if !procs::have(tool) {
            bail!("{tool} is needed (Debian: apt-get install {tool}; make deps installs it)");
        }
    }
    procs::install_interrupt_handler();
    let bin = procs::our_binary()?;
    let work = tempfile_dir()?;
    let res = run_in(&plan, &path, &bin, work.path());
    // Whatever happened: no superblock of ours left behind for a daemon to load.
    let wiped = wipe_superblock(&path);
    res?;
    wiped
}

fn tempfile_dir() -> Result<TempDir> {
    // Sockets and logs only: short path (socket names are limited to 107 bytes).
    let base = std::env::temp_dir().join(format!("hc-bench-device-{}", std::process::id()));
    std::fs::create_dir_all(&base).with_context(|| format!("cannot create {}", base.display()))?;
    Ok(TempDir(base))
}

struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The two config slots at the front of a cache device (format.md).
const SUPERBLOCK_AREA: u64 = 2 << 20;

fn wipe_superblock(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open {} to wipe the bench's cache", path.display()))?;
    let zeroes = vec![0u8; SUPERBLOCK_AREA as usize];
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    // A block device reports length 0 here; it is at least 2 MiB (the cache started on it).
    let n = if len == 0 {
        SUPERBLOCK_AREA
    } else {
        len.min(SUPERBLOCK_AREA)
    };
    f.write_all_at(&zeroes[..n as usize], 0)?;
    f.sync_all()?;
    Ok(())
}

/// A daemon with a warmed cache on the device.
struct Ours {
    procs: Vec<Proc>,
    ctl: CacheCtl,
    uri: String,
}

fn start_ours(
    v: &Variant,
    path: &Path,
    size: Option<u64>,
    bin: &Path,
    work: &Path,
) -> Result<(Ours, u64)> {
    let control = work.join("control.sock");
    let nbd = work.join("hc.sock");
    let _ = std::fs::remove_file(&control);
    let _ = std::fs::remove_file(&nbd);
    let log = work.join("daemon.log");
    let bin = v.bin.as_deref().unwrap_or(bin);
    let mut cmd = procs::command(bin, &log)?;
    cmd.arg("daemon")
        .arg("--control")
        .arg(&control)
        .arg("--nbd-socket")
        .arg(&nbd)
        // The run's own state directory, not the host's /var/lib/hybridcache.
        .arg("--state-dir")
        .arg(work);
    if let Some(w) = v.workers {
        cmd.arg("--nbd-workers").arg(w.to_string());
    }
    if let Some(io) = &v.io {
        cmd.env(VOLUME_IO_ENV, io);
    }
    let mut daemon = Proc::spawn("hybridcache daemon", cmd, &log, StopWith::Kill)?;
    procs::wait_for_socket(&mut daemon, &control)?;
    let ctl = CacheCtl {
        bin: bin.to_path_buf(),
        control,
        id: 1,
    };
    let ours = Ours {
        procs: vec![daemon],
        ctl,
        uri: format!("nbd+unix:///cas1-1?socket={}", nbd.display()),
    };
    // --force: the refusal check ran before anything was written; what the device holds now is
    // an earlier variant's scratch cache.
    ours.ctl.run(&[
        "-S".into(),
        "-d".into(),
        format!("file:{}", path.display()),
        "-i".into(),
        "1".into(),
        "-c".into(),
        "wb".into(),
        "--force".into(),
    ])?;
    ours.ctl.set_cleaning("nop")?;
    let st = ours.ctl.stats()?;
    let capacity = st.total_lines * u64::from(st.line_size);
    let region = match size {
        Some(s) if s > capacity => bail!(UsageError(format!(
            "--size {s} is more than the cache on {} holds ({capacity} bytes)",
            path.display()
        ))),
        Some(s) => s,
        None => (capacity.min(DEFAULT_MAX_SIZE) >> 20) << 20,
    };
    if region == 0 {
        bail!(
            "{} is too small: the cache on it holds {capacity} bytes",
            path.display()
        );
    }
    ours.ctl.run(&[
        "-A".into(),
        "-i".into(),
        "1".into(),
        "-d".into(),
        format!("null:{region}"),
    ])?;
    ours.ctl
        .set_params("seq-cutoff", &[("-j", "1".into()), ("-p", "never".into())])?;
    // Warm: every line of the region written once, so every later request hits.
    let json = work.join("warm.json");
    let args = vec![
        "--name=warm".to_string(),
        "--ioengine=nbd".into(),
        format!("--uri={}", ours.uri),
        "--rw=write".into(),
        "--bs=1M".into(),
        "--iodepth=4".into(),
        format!("--size={region}"),
        "--output-format=json".into(),
        format!("--output={}", json.display()),
    ];
    fio_run(&args, &json, work)?;
    let st = ours.ctl.stats()?;
    let cached = st.occupancy_lines * u64::from(st.line_size);
    if cached < region {
        bail!(
            "after warming, the cache holds {cached} of the region's {region} bytes; hits cannot be measured"
        );
    }
    Ok((ours, region))
}

fn start_nbdkit(path: &Path, work: &Path) -> Result<(Proc, String)> {
    let sock = work.join("nbdkit.sock");
    let _ = std::fs::remove_file(&sock);
    let log = work.join("nbdkit.log");
    let mut cmd = procs::command(Path::new("nbdkit"), &log)?;
    cmd.arg("-f")
        .arg("--exit-with-parent")
        .arg("-U")
        .arg(&sock)
        .arg("file")
        .arg(path)
        .arg("cache=none");
    let mut p = Proc::spawn("nbdkit", cmd, &log, StopWith::Term)?;
    procs::wait_for_socket(&mut p, &sock)?;
    Ok((p, format!("nbd+unix:///?socket={}", sock.display())))
}

fn fio_run(args: &[String], json: &Path, work: &Path) -> Result<fio::FioResult> {
    let log = work.join("fio.log");
    let mut cmd = procs::command(Path::new("fio"), &log)?;
    cmd.args(args);
    let mut p = Proc::spawn("fio", cmd, &log, StopWith::Kill)?;
    let status = p.wait()?;
    if !status.success() {
        bail!("fio failed ({status}): {}", p.log_tail());
    }
    let text = std::fs::read_to_string(json)
        .with_context(|| format!("fio wrote no {}", json.display()))?;
    fio::parse_json(&text)
}

#[allow(clippy::too_many_arguments)]
fn measure(
    target: Target,
    path: &Path,
    uri: &str,
    rw: &str,
    qd: u32,
    region: u64,
    runtime: u64,
    work: &Path,
) -> Result<f64> {
    let json = work.join("run.json");
    let mut args = vec![
        "--name=bench".to_string(),
        format!("--rw={rw}"),
        "--bs=4k".into(),
        format!("--iodepth={qd}"),
        format!("--size={region}"),
        "--time_based".into(),
        format!("--runtime={runtime}"),
        "--randrepeat=0".into(),
        "--norandommap".into(),
        "--output-format=json".into(),
        format!("--output={}", json.display()),
    ];
    match target {
        Target::Raw => {
            args.push("--ioengine=libaio".into());
            args.push("--direct=1".into());
            args.push(format!("--filename={}", path.display()));
        }
        Target::Ours | Target::Nbdkit => {
            args.push("--ioengine=nbd".into());
            args.push(format!("--uri={uri}"));
        }
    }
    let r = fio_run(&args, &json, work)?;
    Ok(if rw == "randread" {
        r.read.iops
    } else {
        r.write.iops
    })
}

/// A run's IOPS and the server's CPU per request in µs (0 without a server or a reading).
fn measure_cpu(
    server: Option<i32>,
    runtime: u64,
    run: impl FnOnce() -> Result<f64>,
) -> Result<(f64, f64)> {
    let before = server.and_then(cpu_us);
    let iops = run()?;
    let after = server.and_then(cpu_us);
    let requests = iops * runtime as f64;
    let per = match (before, after) {
        (Some(b), Some(a)) if requests > 0.0 => (a - b) / requests,
        _ => 0.0,
    };
    Ok((iops, per))
}

fn misses(s: &StatsData) -> u64 {
    s.read_partial_misses
        + s.read_full_misses
        + s.write_partial_misses
        + s.write_full_misses
        + s.pass_through_reads
        + s.pass_through_writes
}

fn run_in(plan: &Plan, path: &Path, bin: &Path, work: &Path) -> Result<()> {
    let (mut nbdkit, nbdkit_uri) = start_nbdkit(path, work)?;
    let mut cells: Vec<Vec<Cell>> = vec![vec![]; plan.variants.len()];
    let keys: Vec<(String, u32)> = plan
        .patterns
        .iter()
        .flat_map(|p| plan.iodepths.iter().map(move |q| (p.clone(), *q)))
        .collect();
    for c in cells.iter_mut() {
        c.resize(keys.len(), Cell::default());
    }
    let mut region_used = 0;
    for rep in 1..=plan.reps {
        for (vi, v) in plan.variants.iter().enumerate() {
            let (mut ours, region) = start_ours(v, path, plan.size, bin, work)
                .with_context(|| format!("variant {}", v.name))?;
            region_used = region;
            for (ki, (rw, qd)) in keys.iter().enumerate() {
                let one = |t: Target, uri: &str| -> Result<f64> {
                    let iops = measure(t, path, uri, rw, *qd, region, plan.runtime, work)?;
                    eprintln!(
                        "rep {rep} {} {rw} qd{qd} {}: {iops:.0} IOPS",
                        v.name,
                        match t {
                            Target::Raw => "raw",
                            Target::Ours => "hybridcache",
                            Target::Nbdkit => "nbdkit",
                        }
                    );
                    Ok(iops)
                };
                let raw = one(Target::Raw, "")?;
                let before_ours = ours.ctl.stats()?;
                let daemon = ours.procs.first().map(Proc::pid);
                let (ours_iops, ours_cpu) =
                    measure_cpu(daemon, plan.runtime, || one(Target::Ours, &ours.uri))?;
                let after = ours.ctl.stats()?;
                let (nbk, nbdkit_cpu) = measure_cpu(Some(nbdkit.pid()), plan.runtime, || {
                    one(Target::Nbdkit, &nbdkit_uri)
                })?;
                let cell = &mut cells[vi][ki];
                cell.misses += misses(&after) - misses(&before_ours);
                cell.raw.push(raw);
                cell.ours.push(ours_iops);
                cell.nbdkit.push(nbk);
                cell.ours_raw.push(ratio(ours_iops, raw));
                cell.ours_nbdkit.push(ratio(ours_iops, nbk));
                cell.ours_cpu.push(ours_cpu);
                cell.nbdkit_cpu.push(nbdkit_cpu);
            }
            for p in ours.procs.iter_mut().rev() {
                p.stop();
            }
        }
    }
    nbdkit.stop();
    print!(
        "{}",
        table(
            plan,
            path,
            region_used,
            &keys,
            &cells,
            &procs::tool_version("fio")
        )
    );
    Ok(())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn kilo(iops: f64) -> String {
    format!("{:.1}k", iops / 1000.0)
}

fn table(
    plan: &Plan,
    path: &Path,
    region: u64,
    keys: &[(String, u32)],
    cells: &[Vec<Cell>],
    fio_version: &str,
) -> String {
    let mut out = format!(
        "device {} ({} MiB region), 4 KiB, {} s per run, {} rep(s), {fio_version}; medians\n\n",
        path.display(),
        region >> 20,
        plan.runtime,
        plan.reps
    );
    out.push_str(
        "| variant | pattern | raw (libaio, direct) | hybridcache (NBD, hits) | nbdkit file cache=none | ours/raw | ours/nbdkit | CPU µs/req ours | CPU µs/req nbdkit |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut notes = Vec::new();
    for (vi, v) in plan.variants.iter().enumerate() {
        for (ki, (rw, qd)) in keys.iter().enumerate() {
            let c = &cells[vi][ki];
            out.push_str(&format!(
                "| {} | {rw} qd{qd} | {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.1} |\n",
                v.name,
                kilo(median(&c.raw)),
                kilo(median(&c.ours)),
                kilo(median(&c.nbdkit)),
                median(&c.ours_raw),
                median(&c.ours_nbdkit),
                median(&c.ours_cpu),
                median(&c.nbdkit_cpu)
            ));
            if c.misses > 0 {
                notes.push(format!(
                    "{} {rw} qd{qd}: {} requests missed the cache (not a pure hit measurement)",
                    v.name, c.misses
                ));
            }
            let target = match qd {
                32 => Some(("ours/raw", median(&c.ours_raw))),
                1 => Some(("ours/nbdkit", median(&c.ours_nbdkit))),
                _ => None,
            };
            if let Some((what, r)) = target {
                notes.push(format!(
                    "{} {rw} qd{qd}: {what} {r:.2} {} (target 0.9, docs/performance.md §6)",
                    v.name,
                    if r >= 0.9 { "met" } else { "MISSED" }
                ));
            }
        }
    }
    out.push('\n');
    for n in notes {
        out.push_str(&n);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse() {
        assert_eq!(
            Variant::parse("workers=32+io=pread").unwrap(),
            Variant {
                name: "workers=32+io=pread".into(),
                workers: Some(32),
                io: Some("pread".into()),
                bin: None,
            }
        );
        assert_eq!(Variant::parse("default").unwrap().workers, None);
        for bad in ["workers=0", "workers=x", "io=aio", "speed=1", "workers"] {
            let e = Variant::parse(bad).unwrap_err();
            assert!(super::super::is_usage_error(&e), "{bad}: {e}");
        }
    }

    #[test]
    fn cpu_time_of_a_process() {
        let me = std::process::id() as i32;
        let t0 = cpu_us(me).expect("own /proc/PID/stat");
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(200) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(
            cpu_us(me).unwrap() > t0,
            "200 ms of spinning used no CPU time"
        );
        assert_eq!(cpu_us(-1), None);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}
