//! Miss-ratio curves of a cyclic trace with a known working set, exact and SHARDS-sampled.

use hybridcache_analyze::*;

fn cyclic(w: u64, cycles: u64) -> impl Iterator<Item = u64> {
    (0..cycles).flat_map(move |_| 0..w)
}

#[test]
fn cyclic_exact() {
    let w = 2000;
    let c = MissRatioCurve::exact(cyclic(w, 50));
    assert_eq!(c.sampling_rate, 1.0);
    assert_eq!(c.distinct_blocks, w);
    assert_eq!(c.references, w * 50);
    // LRU on a loop larger than the cache never hits; once it fits, everything but the first
    // pass hits.
    assert_eq!(c.hit_ratio_at(w - 1), 0.0);
    assert!(c.hit_ratio_at(w / 2) < 0.01);
    assert!((c.hit_ratio_at(w) - 0.98).abs() < 1e-9);
    assert!((c.max_hit_ratio() - 0.98).abs() < 1e-9);
    assert_eq!(c.size_for_fraction(0.9), w);
    assert_eq!(c.knee().unwrap().cache_blocks, w);
}

#[test]
fn cyclic_shards() {
    let w = 20_000;
    let c = MissRatioCurve::sampled(cyclic(w, 20), 0.1);
    assert_eq!(c.sampling_rate, 0.1);
    assert_eq!(c.references, w * 20);
    assert!(
        c.hit_ratio_at(w * 9 / 10) < 0.1,
        "{}",
        c.hit_ratio_at(w * 9 / 10)
    );
    assert!(
        c.hit_ratio_at(w * 11 / 10) > 0.85,
        "{}",
        c.hit_ratio_at(w * 11 / 10)
    );
    let est = c.distinct_blocks as f64;
    assert!((est - w as f64).abs() / (w as f64) < 0.1, "{est}");
    let size = c.size_for_fraction(0.9) as f64;
    assert!((size - w as f64).abs() / (w as f64) < 0.1, "{size}");
}

#[test]
fn signature_switches_to_shards_for_large_traces() {
    // A blkparse trace cycling over 3000 blocks; a tiny exact limit forces sampling.
    let mut text = String::new();
    let mut seq = 0;
    for cycle in 0..20u64 {
        for b in 0..3000u64 {
            seq += 1;
            text += &format!(
                "8,0 0 {seq} {}.{:09} 7 Q R {} + 8 [loop]\n",
                cycle,
                b * 1000,
                b * 8
            );
        }
    }
    let t = parse_trace(text.as_bytes(), Format::Auto).unwrap();
    let exact = Signature::from_trace(&t);
    assert_eq!(exact.overall.mrc.sampling_rate, 1.0);
    assert!(exact.overall.mrc.hit_ratio_at(2900) < 0.01);
    // Distances above 1024 are binned 64 per octave: the step lands within 1.6% above W.
    assert!(exact.overall.mrc.hit_ratio_at(3050) > 0.94);
    let opts = SignatureOptions {
        mrc: MrcOptions {
            exact_limit: 10_000,
            min_rate: 0.001,
        },
        ..Default::default()
    };
    let sampled = Signature::from_trace_with(&t, &opts);
    let c = &sampled.overall.mrc;
    assert!(c.sampling_rate < 0.2);
    assert!(c.hit_ratio_at(2500) < 0.1, "{:?}", c.sample_points(10));
    assert!(c.hit_ratio_at(3500) > 0.8, "{}", c.hit_ratio_at(3500));
}
