//! blkparse's default text output:
//! `maj,min cpu seq secs.nsecs pid action rwbs [sector + nsectors | sector / newsector] ... [process]`.
//!
//! What follows the RWBS field depends on the action (C carries `[error]`, A carries
//! `<- (maj,min) from`, P/U carry only `[process]` and U a count, m carries free text, flush
//! requests carry no range), so the tail is parsed leniently and only the fixed head is strict.
//! The per-device/per-CPU summary blkparse prints at the end is recognised and skipped.

use std::collections::HashMap;

use crate::trace::{parse_seconds, Action, Builder, Event, LineParser, Outcome, Rwbs, SECTOR};

/// One parsed event line, before interning.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Line<'a> {
    pub major: u32,
    pub minor: u32,
    pub cpu: u32,
    pub time_ns: u64,
    pub pid: u32,
    pub action: Action,
    pub rwbs: Rwbs,
    /// (first sector, sectors).
    pub range: Option<(u64, u64)>,
    /// The bracketed field: the process name, or the error code of a C event.
    pub bracket: Option<&'a str>,
}

pub(crate) fn looks_like_event(l: &str) -> bool {
    parse_line(l).is_ok()
}

pub(crate) fn parse_line(l: &str) -> Result<Line<'_>, String> {
    let mut it = l.split_whitespace();
    let mut next = |what: &str| it.next().ok_or_else(|| format!("missing {what}"));
    let dev = next("device")?;
    let (maj, min) = dev
        .split_once(',')
        .ok_or_else(|| format!("device `{dev}` is not maj,min"))?;
    let major = maj.parse().map_err(|_| format!("bad major `{maj}`"))?;
    let minor = min.parse().map_err(|_| format!("bad minor `{min}`"))?;
    let cpu_s = next("cpu")?;
    let cpu = cpu_s.parse().map_err(|_| format!("bad cpu `{cpu_s}`"))?;
    let seq = next("sequence number")?;
    seq.parse::<u64>()
        .map_err(|_| format!("bad sequence number `{seq}`"))?;
    let t = next("time")?;
    let time_ns = parse_seconds(t).ok_or_else(|| format!("bad time `{t}`"))?;
    let pid_s = next("pid")?;
    let pid = pid_s.parse().map_err(|_| format!("bad pid `{pid_s}`"))?;
    let a = next("action")?;
    let action = Action::from_code(a).ok_or_else(|| format!("unknown action `{a}`"))?;
    let r = next("rwbs")?;
    let rwbs = Rwbs::parse(r).ok_or_else(|| format!("bad rwbs `{r}`"))?;
    // The tail, as text: process names may contain spaces.
    let rest = tail_after(l, 7);
    if action == Action::Message {
        return Ok(Line {
            major,
            minor,
            cpu,
            time_ns,
            pid,
            action,
            rwbs,
            range: None,
            bracket: None,
        });
    }
    let (range, bracket) = parse_tail(rest)?;
    Ok(Line {
        major,
        minor,
        cpu,
        time_ns,
        pid,
        action,
        rwbs,
        range,
        bracket,
    })
}

/// The text after the first `n` whitespace-separated fields.
fn tail_after(l: &str, n: usize) -> &str {
    let mut rest = l.trim_start();
    for _ in 0..n {
        match rest.find(char::is_whitespace) {
            Some(i) => rest = rest[i..].trim_start(),
            None => return "",
        }
    }
    rest
}

type Tail<'a> = (Option<(u64, u64)>, Option<&'a str>);

fn parse_tail(rest: &str) -> Result<Tail<'_>, String> {
    let rest = rest.trim();
    if rest.is_empty() {
        return Ok((None, None));
    }
    let first = rest.chars().next().unwrap_or(' ');
    if first == '[' {
        return Ok((None, bracket(rest)));
    }
    if first == '(' {
        // SCSI payload of a packet command: "(cdb bytes) [process]".
        let close = rest.find(')').ok_or("unclosed `(`")?;
        return Ok((None, bracket(&rest[close + 1..])));
    }
    if !first.is_ascii_digit() {
        return Err(format!(
            "unexpected `{}`",
            rest.chars().take(20).collect::<String>()
        ));
    }
    let mut it = rest.split_whitespace();
    let s0 = it.next().unwrap_or("");
    let sector: u64 = s0.parse().map_err(|_| format!("bad sector `{s0}`"))?;
    let op = it.next().ok_or("sector without length")?;
    let n = it.next().ok_or("sector without length")?;
    let n: u64 = n.parse().map_err(|_| format!("bad length `{n}`"))?;
    let range = match op {
        "+" => (sector, n),
        // X: "sector / new_sector": the first part of the split ends at new_sector.
        "/" => (sector, n.saturating_sub(sector)),
        _ => {
            return Err(format!(
                "expected `+` or `/` after the sector, found `{op}`"
            ))
        }
    };
    let after = tail_after(rest, 3);
    Ok((Some(range), bracket(after)))
}

/// The text between the first `[` and the last `]`.
fn bracket(s: &str) -> Option<&str> {
    let open = s.find('[')?;
    let close = s.rfind(']')?;
    (close > open).then(|| &s[open + 1..close])
}

fn is_summary_header(l: &str) -> bool {
    let t = l.trim_start();
    (t.starts_with("CPU") && t[3..].starts_with(|c: char| c.is_ascii_digit()))
        || t.starts_with("Total (")
        || t.starts_with("Throughput (")
        || t.starts_with("Events (")
        || t.starts_with("Skips:")
}

#[derive(Default)]
pub(crate) struct Parser {
    in_summary: bool,
    /// pid -> (job index, process name seen on a request event).
    pids: HashMap<u32, (u32, Option<String>)>,
}

impl LineParser for Parser {
    fn line(&mut self, _no: u64, text: &str, out: &mut Builder) -> Outcome {
        let l = match parse_line(text) {
            Ok(l) => l,
            Err(why) => {
                if self.in_summary || is_summary_header(text) {
                    self.in_summary = true;
                    return Outcome::Summary;
                }
                if text.trim_start().starts_with("Input file ") {
                    return Outcome::Header;
                }
                return Outcome::Bad(why);
            }
        };
        let device = out.device(&format!("{},{}", l.major, l.minor));
        let entry = self.pids.entry(l.pid).or_insert_with(|| {
            let job = out.job(&format!("pid {}", l.pid));
            (job, None)
        });
        // C events carry the error code in brackets, not a process name.
        if entry.1.is_none() && l.action != Action::Complete {
            if let Some(name) = l.bracket.filter(|b| !b.is_empty()) {
                entry.1 = Some(name.to_string());
            }
        }
        let (offset, len) = l
            .range
            .map(|(s, n)| (s.saturating_mul(SECTOR), n.saturating_mul(SECTOR)))
            .unwrap_or((0, 0));
        out.events.push(Event {
            time_ns: l.time_ns,
            device,
            job: entry.0,
            cpu: l.cpu,
            action: l.action,
            rwbs: l.rwbs,
            offset,
            len,
        });
        Outcome::Events
    }

    fn finish(&mut self, out: &mut Builder) {
        for (pid, (job, name)) in &self.pids {
            if let Some(name) = name {
                out.jobs[*job as usize] = format!("{name} (pid {pid})");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_line() {
        let l = parse_line(
            "  8,0    3        1     0.000000000  4162  Q  WS 1569536 + 8 [jbd2/sda1-8]",
        )
        .unwrap();
        assert_eq!((l.major, l.minor, l.cpu, l.pid), (8, 0, 3, 4162));
        assert_eq!(l.action, Action::Queue);
        assert_eq!(l.range, Some((1569536, 8)));
        assert_eq!(l.bracket, Some("jbd2/sda1-8"));
    }

    #[test]
    fn tails() {
        let c = parse_line("8,0 0 5 0.2 0 C W 100 + 8 (   1234) [0]").unwrap();
        assert_eq!(c.range, Some((100, 8)));
        assert_eq!(c.bracket, Some("0"));
        let a = parse_line("253,0 1 2 0.1 77 A W 2048 + 8 <- (8,1) 4096").unwrap();
        assert_eq!(a.range, Some((2048, 8)));
        let x = parse_line("8,0 1 2 0.1 77 X W 100 / 164 [dd]").unwrap();
        assert_eq!(x.range, Some((100, 64)));
        let u = parse_line("8,0 1 2 0.1 77 UT N [kworker/1:1] 3").unwrap();
        assert_eq!(
            (u.action, u.range, u.bracket),
            (Action::TimerUnplug, None, Some("kworker/1:1"))
        );
        let f = parse_line("8,0 1 2 0.1 77 Q FWS [jbd2/sda1-8]").unwrap();
        assert_eq!(f.range, None);
        let m = parse_line("8,0 1 0 0.1 77 m N cfq77 alloced").unwrap();
        assert_eq!(m.action, Action::Message);
        let p = parse_line("8,0 1 2 0.1 77 D R (12 00 00 00 24 00) [scsi_id]").unwrap();
        assert_eq!(p.bracket, Some("scsi_id"));
        let sp = parse_line("8,0 1 2 0.1 77 Q R 8 + 8 [my proc]").unwrap();
        assert_eq!(sp.bracket, Some("my proc"));
    }

    #[test]
    fn bad_lines() {
        assert!(parse_line("8,0 1 2 0.1 77 Z W 100 + 8 [x]").is_err());
        assert!(parse_line("8,0 1 2 0.1 77 Q W 100 - 8 [x]").is_err());
        assert!(parse_line("8.0 1 2 0.1 77 Q W 100 + 8 [x]").is_err());
        assert!(parse_line("8,0 1 2 0.1 77 Q W 100").is_err());
        assert!(parse_line("8,0 1 2 0.1 77 Q W abc").is_err());
        assert!(parse_line("8,0 1 2").is_err());
    }
}
