//! Load benchmark (issue 15): how long `Cache::load` takes for a cache whose every 4 KiB line
//! is mapped and dirty, after a clean stop and after a crash, and what that extrapolates to
//! for 1 TiB.
//!
//! `cargo bench -p hybridcache-engine --bench load [-- --gib N] [--reps N]` (default 16 GiB,
//! 3 repetitions, medians). The cache is a sparse file under target/tmp (`HC_BENCH_DIR`
//! elsewhere) behind a volume that keeps the metadata region and drops data writes, so the
//! fill writes only metadata (about 2.4 MiB per GiB of cache) and the disk stays free.

use std::sync::Arc;
use std::time::Instant;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, CleaningPolicy, LineSize, SeqCutoff, SeqCutoffPolicy,
};
use hybridcache_volume::{FileVolume, NullVolume, Volume, VolumeRef};

/// A volume that keeps metadata but drops data writes past `data_from`: lets the benchmark
/// fill every line of a 16 GiB cache without writing 16 GiB.
struct MetadataOnly {
    inner: FileVolume,
    data_from: u64,
}

impl Volume for MetadataOnly {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        if offset >= self.data_from {
            return Ok(());
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.inner.discard(offset, len)
    }
}

fn usage(why: &str) -> ! {
    eprintln!("load bench: {why}\nusage: load [--gib N] [--reps N]");
    std::process::exit(2)
}

/// CPU time this thread has used (user + system), in seconds: on a shared machine the wall
/// time also counts waiting for a CPU, this does not.
fn thread_cpu() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut gib: u64 = 16;
    let mut reps: usize = 3;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| usage(&format!("{a} needs a number")))
        };
        match a.as_str() {
            "--bench" => {}
            "--gib" => gib = value(),
            "--reps" => reps = value().max(1) as usize,
            f => usage(&format!("unknown argument {f}")),
        }
    }
    let dir = std::env::var("HC_BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let path = std::path::Path::new(&dir).join("load-bench-cache.img");
    let _ = std::fs::remove_file(&path);
    let size = gib << 30;
    let file = FileVolume::create(&path, size).expect("sparse cache file");
    // The metadata sits below the data region, which starts within the first 1% of the device.
    let vol: VolumeRef = Arc::new(MetadataOnly {
        inner: file,
        data_from: size / 50,
    });
    let core: VolumeRef = Arc::new(NullVolume::new("null-core", size * 2).expect("null"));
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).expect("line size"),
        mode: CacheMode::Wb,
    };
    let cache = Cache::create(vol.clone(), config, true).expect("create");
    // Nothing may clean or bypass the cache while it fills: every line must end up dirty.
    cache.stop_background_cleaner();
    let mut cleaning = cache.cleaning();
    cleaning.policy = CleaningPolicy::Nop;
    cache.set_cleaning(cleaning).expect("cleaning nop");
    cache.add_core(core.clone(), Some(1)).expect("core");
    cache
        .set_seq_cutoff(
            None,
            SeqCutoff {
                policy: SeqCutoffPolicy::Never,
                ..SeqCutoff::default()
            },
        )
        .expect("seq cutoff never");
    let lines = cache.line_count();
    let handle = cache.core(1).expect("core");
    let buf = vec![1u8; 1 << 20];
    let t = Instant::now();
    for off in (0..lines * 4096).step_by(1 << 20) {
        let len = (lines * 4096 - off).min(1 << 20) as usize;
        handle.write(&buf[..len], off).expect("fill");
    }
    handle.flush().expect("commit");
    drop(handle);
    assert_eq!(cache.stats().usage.dirty_lines, lines, "the fill left lines clean");
    eprintln!("filled {lines} lines in {:.1} s", t.elapsed().as_secs_f64());
    cache.stop(false).expect("stop");
    drop(cache);
    let mut clean = Vec::new();
    let mut recovery = Vec::new();
    let (mut clean_cpu, mut recovery_cpu) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        // A clean stop, then a load: the load marks the cache unclean on the device, so
        // dropping it without a stop leaves what a crash leaves.
        let (t, cpu) = (Instant::now(), thread_cpu());
        let cache = Cache::load(vol.clone(), &mut |_| Some(core.clone())).expect("clean load");
        clean.push(t.elapsed().as_secs_f64());
        clean_cpu.push(thread_cpu() - cpu);
        assert_eq!(cache.stats().usage.dirty_lines, lines);
        drop(cache);
        let (t, cpu) = (Instant::now(), thread_cpu());
        let cache = Cache::load(vol.clone(), &mut |_| Some(core.clone())).expect("recovery");
        recovery.push(t.elapsed().as_secs_f64());
        recovery_cpu.push(thread_cpu() - cpu);
        assert_eq!(cache.stats().usage.dirty_lines, lines);
        cache.stop(false).expect("stop");
    }
    let mlines = lines as f64 / 1e6;
    let per_tib = 1024.0 / gib as f64;
    println!("load, {gib} GiB cache, {lines} lines of 4 KiB, all dirty, median of {reps}:");
    for (what, wall, cpu) in [
        ("clean stop", &mut clean, &mut clean_cpu),
        ("after a crash", &mut recovery, &mut recovery_cpu),
    ] {
        let (w, c) = (median(wall), median(cpu));
        println!(
            "  {what}: wall {w:.3} s ({:.3} s per million lines; 1 TiB: {:.1} s), CPU {c:.3} s (1 TiB: {:.1} s)",
            w / mlines,
            w * per_tib,
            c * per_tib
        );
    }
    let _ = std::fs::remove_file(&path);
}
