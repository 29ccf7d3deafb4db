//! Synthetic blkparse traces of known shape: closed-loop jobs that keep `qd` requests in
//! flight, each completion followed by the next queue event (what fio does).
#![allow(dead_code)]

/// A job to synthesise.
#[derive(Clone)]
pub struct JobSpec {
    pub pid: u32,
    pub name: &'static str,
    pub device: &'static str,
    pub size: u64,
    pub qd: usize,
    pub requests: usize,
    /// Share of reads (0.0 = all writes).
    pub read_share: f64,
    pub sequential: bool,
    /// Byte offset of the job's region.
    pub base: u64,
    /// Region length for random offsets.
    pub span: u64,
    /// Time per completion, ns.
    pub service_ns: u64,
    pub seed: u64,
    /// Skew: this share of random requests goes to the first `hot_span` bytes of the region.
    pub hot_share: f64,
    pub hot_span: u64,
}

impl JobSpec {
    pub fn new(pid: u32, name: &'static str) -> JobSpec {
        JobSpec {
            pid,
            name,
            device: "8,0",
            size: 4096,
            qd: 1,
            requests: 2000,
            read_share: 0.0,
            sequential: false,
            base: 0,
            span: 10 << 30,
            service_ns: 1_000_000,
            seed: pid as u64 * 7919 + 1,
            hot_share: 0.0,
            hot_span: 0,
        }
    }
}

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// (time ns, line without seq number) events of one job.
fn job_events(j: &JobSpec) -> Vec<(u64, String, bool)> {
    let mut rng = Rng(j.seed | 1);
    let mut out = Vec::new();
    let mut next_seq = j.base;
    let mut in_flight: std::collections::VecDeque<(u64, u64, char)> = Default::default();
    let mut issued = 0;
    let mut t = 0u64;
    let mut issue =
        |t: u64,
         out: &mut Vec<(u64, String, bool)>,
         in_flight: &mut std::collections::VecDeque<(u64, u64, char)>| {
            let op = if rng.unit() < j.read_share { 'R' } else { 'W' };
            let off = if j.sequential {
                let o = next_seq;
                next_seq += j.size;
                o
            } else if j.hot_span > 0 && rng.unit() < j.hot_share {
                j.base + (rng.next() % (j.hot_span / j.size)) * j.size
            } else {
                j.base + (rng.next() % (j.span / j.size)) * j.size
            };
            let sector = off / 512;
            let n = j.size / 512;
            out.push((
                t,
                format!("{} Q {op}S {sector} + {n} [{}]", j.pid, j.name),
                false,
            ));
            out.push((
                t + 1000,
                format!("{} D {op}S {sector} + {n} [{}]", j.pid, j.name),
                false,
            ));
            in_flight.push_back((sector, n, op));
        };
    while issued < j.qd.min(j.requests) {
        issue(t, &mut out, &mut in_flight);
        issued += 1;
    }
    while let Some((sector, n, op)) = in_flight.pop_front() {
        t += j.service_ns;
        out.push((t, format!("0 C {op}S {sector} + {n} [0]"), true));
        if issued < j.requests {
            issue(t + 500, &mut out, &mut in_flight);
            issued += 1;
        }
    }
    out
}

/// blkparse text of the jobs interleaved by time.
pub fn blkparse(jobs: &[JobSpec]) -> String {
    let mut all: Vec<(u64, usize, usize, String)> = Vec::new();
    for (ji, j) in jobs.iter().enumerate() {
        for (k, (t, l, _)) in job_events(j).into_iter().enumerate() {
            all.push((t, ji, k, format!("{} {}", j.device, l)));
        }
    }
    all.sort_by_key(|e| (e.0, e.1, e.2));
    let mut s = String::new();
    for (i, (t, ji, _, l)) in all.iter().enumerate() {
        // "dev cpu seq time pid action ..." — split dev from the rest.
        let (dev, rest) = l.split_once(' ').unwrap();
        s += &format!(
            "{dev:>5} {:>2} {:>8} {:>5}.{:09} {}\n",
            ji % 4,
            i + 1,
            t / 1_000_000_000,
            t % 1_000_000_000,
            rest
        );
    }
    s
}
