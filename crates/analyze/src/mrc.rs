//! Miss-ratio curves: the hit ratio an LRU cache of each size would reach on a stream of 4 KiB
//! block references, from reuse (stack) distances.
//!
//! Exact: Olken's algorithm — a Fenwick tree over reference times holds a 1 at the latest
//! reference of every block, so the number of distinct blocks touched since a block's previous
//! reference is a range sum, O(log n) per reference. Sampled: SHARDS (Waldspurger et al., FAST
//! '15) — only blocks whose hash falls under a threshold (rate R) are fed to the same
//! algorithm and their distances are scaled by 1/R; hashing blocks, not references, keeps every
//! reference of a sampled block, which is what makes the distances right. The SHARDS-adj
//! correction moves the difference between expected and actual sampled references into the
//! smallest bucket.
//!
//! Distances are kept in a histogram that is exact below 1024 and has 64 bins per octave above
//! (relative error < 1.6%), so memory does not grow with the working set.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Bytes per block of the curve.
pub const MRC_BLOCK: u64 = 4096;

/// Hash-space size of SHARDS' sampling condition `hash mod P < T`.
const SHARDS_P: u64 = 1 << 24;

/// Options for building curves.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MrcOptions {
    /// Traces with at most this many block references get an exact curve; larger ones are
    /// sampled at a rate that keeps about this many references.
    pub exact_limit: u64,
    /// Lowest SHARDS rate used (below it the curve gets too noisy to size a cache).
    pub min_rate: f64,
}

impl Default for MrcOptions {
    fn default() -> Self {
        MrcOptions {
            exact_limit: 4_000_000,
            min_rate: 0.001,
        }
    }
}

impl MrcOptions {
    /// The sampling rate for a stream of `refs` references: 1 (exact) up to the limit.
    pub fn rate_for(&self, refs: u64) -> f64 {
        if refs <= self.exact_limit {
            1.0
        } else {
            (self.exact_limit as f64 / refs as f64).max(self.min_rate)
        }
    }
}

/// One point of the curve: an LRU cache of `cache_blocks` 4 KiB blocks hits `hit_ratio` of
/// the references.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MrcPoint {
    pub cache_blocks: u64,
    pub hit_ratio: f64,
}

/// Hit ratio against cache size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MissRatioCurve {
    /// Block references in the stream (all of them, also when sampled).
    pub references: u64,
    /// 1.0 when exact, else the SHARDS rate.
    pub sampling_rate: f64,
    /// Distinct blocks (estimated when sampled): the cache size that reaches the maximum.
    pub distinct_blocks: u64,
    /// Steps of the curve, ascending in size; the hit ratio is constant between steps.
    pub points: Vec<MrcPoint>,
}

impl MissRatioCurve {
    /// Exact curve of a reference stream (block numbers; any u64 key).
    pub fn exact<I: IntoIterator<Item = u64>>(blocks: I) -> MissRatioCurve {
        let mut b = MrcBuilder::new(1.0);
        for x in blocks {
            b.push(x);
        }
        b.finish()
    }

    /// SHARDS-sampled curve at `rate` (0 < rate <= 1).
    pub fn sampled<I: IntoIterator<Item = u64>>(blocks: I, rate: f64) -> MissRatioCurve {
        let mut b = MrcBuilder::new(rate);
        for x in blocks {
            b.push(x);
        }
        b.finish()
    }

    /// The hit ratio reached with an infinite cache (everything but cold misses).
    pub fn max_hit_ratio(&self) -> f64 {
        self.points.last().map_or(0.0, |p| p.hit_ratio)
    }

    /// Hit ratio of a cache of `blocks` 4 KiB blocks.
    pub fn hit_ratio_at(&self, blocks: u64) -> f64 {
        self.points
            .iter()
            .take_while(|p| p.cache_blocks <= blocks)
            .last()
            .map_or(0.0, |p| p.hit_ratio)
    }

    /// Smallest cache (blocks) reaching `fraction` of the maximum hit ratio; 0 when there is
    /// no reuse at all.
    pub fn size_for_fraction(&self, fraction: f64) -> u64 {
        let goal = self.max_hit_ratio() * fraction;
        if goal <= 0.0 {
            return 0;
        }
        self.points
            .iter()
            .find(|p| p.hit_ratio >= goal - 1e-12)
            .map_or(0, |p| p.cache_blocks)
    }

    /// The knee: the point farthest above the straight line from (0, 0) to the point where the
    /// maximum is reached (Kneedle on linear axes) — past it, more cache buys little.
    pub fn knee(&self) -> Option<MrcPoint> {
        let last = *self.points.last()?;
        if last.hit_ratio <= 0.0 || last.cache_blocks == 0 {
            return None;
        }
        let full = self.size_for_fraction(1.0).max(1) as f64;
        self.points
            .iter()
            .filter(|p| (p.cache_blocks as f64) <= full)
            .map(|p| {
                let gap = p.hit_ratio / last.hit_ratio - p.cache_blocks as f64 / full;
                (gap, *p)
            })
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, p)| p)
    }

    /// About `rows` points for a table or a chart: geometric sizes from the first step to the
    /// size reaching the maximum, each with its hit ratio.
    pub fn sample_points(&self, rows: usize) -> Vec<MrcPoint> {
        let (Some(first), Some(_)) = (self.points.first(), self.points.last()) else {
            return Vec::new();
        };
        let lo = first.cache_blocks.max(1) as f64;
        let hi = self.size_for_fraction(1.0).max(first.cache_blocks).max(1) as f64;
        let rows = rows.max(2);
        let mut out: Vec<MrcPoint> = Vec::new();
        for i in 0..rows {
            let s = (lo * (hi / lo).powf(i as f64 / (rows - 1) as f64)).round() as u64;
            if out.last().is_some_and(|p| p.cache_blocks >= s) {
                continue;
            }
            out.push(MrcPoint {
                cache_blocks: s,
                hit_ratio: self.hit_ratio_at(s),
            });
        }
        out
    }
}

/// Incremental builder (one reference at a time), used by the signature code to build one
/// curve per job and one overall in a single pass.
pub struct MrcBuilder {
    rate: f64,
    threshold: u64,
    /// All references seen (sampled or not).
    references: u64,
    olken: Olken,
}

impl MrcBuilder {
    pub fn new(rate: f64) -> MrcBuilder {
        let rate = if rate.is_finite() {
            rate.clamp(1e-6, 1.0)
        } else {
            1.0
        };
        MrcBuilder {
            rate,
            threshold: (rate * SHARDS_P as f64).round().max(1.0) as u64,
            references: 0,
            olken: Olken::default(),
        }
    }

    pub fn push(&mut self, block: u64) {
        self.references += 1;
        if self.rate < 1.0 && mix(block) % SHARDS_P >= self.threshold {
            return;
        }
        self.olken.push(block);
    }

    pub fn finish(self) -> MissRatioCurve {
        let Olken {
            hist,
            cold,
            refs: sampled,
            ..
        } = self.olken;
        let rate = self.rate;
        let mut weights: Vec<(u64, f64)> = Vec::new();
        // SHARDS-adj: expected sampled references minus actual ones, into the first bucket.
        let adjust = if rate < 1.0 {
            self.references as f64 * rate - sampled as f64
        } else {
            0.0
        };
        let mut scaled: HashMap<usize, f64> = HashMap::new();
        for (bin, &n) in hist.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let d = bin_upper(bin);
            let d = if rate < 1.0 {
                (d as f64 / rate) as u64
            } else {
                d
            };
            *scaled.entry(bin_of(d)).or_default() += n as f64;
        }
        if adjust != 0.0 {
            *scaled.entry(0).or_default() += adjust;
        }
        let mut bins: Vec<(usize, f64)> = scaled.into_iter().collect();
        bins.sort_by_key(|b| b.0);
        for (bin, n) in bins {
            weights.push((bin_upper(bin) + 1, n));
        }
        let total = self.references as f64 * rate;
        let mut points = Vec::with_capacity(weights.len());
        let mut cum = 0.0;
        for (size, n) in weights {
            cum += n;
            let hit = if total > 0.0 {
                (cum / total).clamp(0.0, 1.0)
            } else {
                0.0
            };
            // Keep the curve monotone even when the adjustment was negative.
            let hit = points
                .last()
                .map_or(hit, |p: &MrcPoint| hit.max(p.hit_ratio));
            points.push(MrcPoint {
                cache_blocks: size,
                hit_ratio: hit,
            });
        }
        MissRatioCurve {
            references: self.references,
            sampling_rate: rate,
            distinct_blocks: (cold as f64 / rate).round() as u64,
            points,
        }
    }
}

/// Olken's algorithm over a growing Fenwick tree (the builder does not know the stream length
/// in advance, so the tree is extended one slot per reference).
#[derive(Default)]
struct Olken {
    /// Fenwick tree over reference times; 1 marks the latest reference of some block.
    tree: Vec<i64>,
    last: HashMap<u64, usize>,
    hist: Vec<u64>,
    cold: u64,
    refs: u64,
}

impl Olken {
    fn prefix(&self, mut i: usize) -> i64 {
        // Sum of slots [0, i).
        let mut s = 0;
        while i > 0 {
            s += self.tree[i - 1];
            i &= i - 1;
        }
        s
    }

    fn add(&mut self, i: usize, v: i64) {
        let mut i = i + 1;
        while i <= self.tree.len() {
            self.tree[i - 1] += v;
            i += i & i.wrapping_neg();
        }
    }

    /// Appends slot `n` holding `v`: node n covers (n - lowbit, n], so its value is the sum of
    /// the slots it covers before this one plus `v`.
    fn append(&mut self, v: i64) {
        let n = self.tree.len() + 1;
        let low = n & n.wrapping_neg();
        let covered = self.prefix(n - 1) - self.prefix(n - low);
        self.tree.push(covered + v);
    }

    fn push(&mut self, block: u64) {
        let t = self.tree.len();
        self.refs += 1;
        match self.last.insert(block, t) {
            Some(prev) => {
                // Distinct blocks referenced strictly between prev and now.
                let d = (self.prefix(t) - self.prefix(prev + 1)) as u64;
                self.add(prev, -1);
                let bin = bin_of(d);
                if self.hist.len() <= bin {
                    self.hist.resize(bin + 1, 0);
                }
                self.hist[bin] += 1;
            }
            None => self.cold += 1,
        }
        self.append(1);
    }
}

const EXACT_BINS: u64 = 1024;
const SUB_BITS: u32 = 6;

/// Histogram bin of a distance: exact below 1024, then 64 bins per power of two.
fn bin_of(d: u64) -> usize {
    if d < EXACT_BINS {
        return d as usize;
    }
    let e = 63 - d.leading_zeros(); // >= 10
    let sub = (d >> (e - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    (EXACT_BINS + (e as u64 - 10) * (1 << SUB_BITS) + sub) as usize
}

/// Largest distance falling into `bin` (a reference hits in a cache larger than this).
fn bin_upper(bin: usize) -> u64 {
    let bin = bin as u64;
    if bin < EXACT_BINS {
        return bin;
    }
    let k = bin - EXACT_BINS;
    let e = 10 + k / (1 << SUB_BITS);
    let sub = k % (1 << SUB_BITS);
    let lo = (1u64 << e) + (sub << (e - SUB_BITS as u64));
    lo + (1u64 << (e - SUB_BITS as u64)) - 1
}

/// splitmix64's finaliser: a cheap hash that spreads sequential block numbers uniformly.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_round_trip() {
        for d in [0u64, 1, 1023, 1024, 1500, 65_535, 1 << 40, u64::MAX >> 1] {
            let b = bin_of(d);
            assert!(bin_upper(b) >= d, "{d}");
            if d >= 1024 {
                assert!(
                    (bin_upper(b) - d) as f64 / d as f64 <= 1.0 / 64.0 + 1e-9,
                    "{d}"
                );
            } else {
                assert_eq!(bin_upper(b), d);
            }
        }
    }

    #[test]
    fn tiny_exact() {
        // a b a: the second a has distance 1 (b in between): hit with 2 blocks, not with 1.
        let c = MissRatioCurve::exact([1, 2, 1]);
        assert_eq!(c.references, 3);
        assert_eq!(c.distinct_blocks, 2);
        assert_eq!(c.hit_ratio_at(1), 0.0);
        assert!((c.hit_ratio_at(2) - 1.0 / 3.0).abs() < 1e-9);
        // Repeats of the same block hit with a single-block cache.
        let c = MissRatioCurve::exact([5, 5, 5, 5]);
        assert!((c.hit_ratio_at(1) - 0.75).abs() < 1e-9);
    }

    #[test]
    fn olken_matches_naive_lru() {
        // Pseudo-random stream over 50 blocks against a naive LRU stack.
        let mut x = 12345u64;
        let mut refs = Vec::new();
        for _ in 0..3000 {
            x = mix(x);
            refs.push(x % 50);
        }
        let c = MissRatioCurve::exact(refs.iter().copied());
        for size in [1usize, 5, 10, 25, 49, 50] {
            let mut stack: Vec<u64> = Vec::new();
            let mut hits = 0;
            for &r in &refs {
                if let Some(p) = stack.iter().position(|&b| b == r) {
                    hits += 1;
                    stack.remove(p);
                }
                stack.insert(0, r);
                stack.truncate(size);
            }
            let want = hits as f64 / refs.len() as f64;
            assert!(
                (c.hit_ratio_at(size as u64) - want).abs() < 1e-9,
                "size {size}"
            );
        }
    }
}
