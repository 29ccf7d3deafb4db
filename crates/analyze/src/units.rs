//! Number formatting shared by the reasons and the report.

/// `4 KiB`, `64 KiB`, `1.5 MiB`, `12 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 1e-9 {
        format!("{} {}", v.round() as u64, UNITS[u])
    } else if v < 10.0 {
        format!("{v:.1} {}", UNITS[u])
    } else {
        format!("{v:.0} {}", UNITS[u])
    }
}

/// `82%` (one decimal below 10%).
pub fn pct(share: f64) -> String {
    let p = share * 100.0;
    if p > 0.0 && p < 10.0 && (p - p.round()).abs() > 0.05 {
        format!("{p:.1}%")
    } else {
        format!("{}%", p.round() as i64)
    }
}

/// A rate with sensible precision: `63`, `929`, `5415`, `0.26`, `2.5`.
pub fn num(v: f64) -> String {
    if v >= 10.0 {
        format!("{}", v.round() as i64)
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A gain factor: `14.7x`.
pub fn factor(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}x")
    } else {
        format!("{v:.1}x")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats() {
        assert_eq!(super::bytes(4096), "4 KiB");
        assert_eq!(super::bytes(1536 * 1024), "1.5 MiB");
        assert_eq!(super::bytes(100), "100 B");
        assert_eq!(super::pct(0.82), "82%");
        assert_eq!(super::pct(0.034), "3.4%");
        assert_eq!(super::num(62.99), "63");
        assert_eq!(super::num(0.258), "0.26");
        assert_eq!(super::factor(14.66), "15x");
    }
}
