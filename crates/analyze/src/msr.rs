//! SNIA / MSR Cambridge block traces: CSV rows
//! `Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime` with the timestamp and the
//! response time in Windows FILETIME ticks (100 ns) and offset/size in bytes.
//!
//! Each row becomes a queue event at its timestamp and a completion event at timestamp +
//! response time, so queue depth comes out of the same code as for blkparse. Rows are not
//! sorted by completion, hence [`Parser::finish`] sorts the events by time.

use crate::trace::{Action, Builder, Event, LineParser, Op, Outcome, Rwbs};

/// FILETIME ticks per ns.
const TICK_NS: u64 = 100;

pub(crate) struct Row<'a> {
    pub ticks: u64,
    pub host: &'a str,
    pub disk: u32,
    pub op: Op,
    pub offset: u64,
    pub size: u64,
    pub response_ticks: u64,
}

pub(crate) fn parse_row(l: &str) -> Result<Row<'_>, String> {
    let f: Vec<&str> = l.trim().split(',').map(str::trim).collect();
    if f.len() != 7 {
        return Err(format!("{} fields, expected 7", f.len()));
    }
    let num = |i: usize, what: &str| -> Result<u64, String> {
        f[i].parse::<u64>()
            .map_err(|_| format!("bad {what} `{}`", f[i]))
    };
    let op = if f[3].eq_ignore_ascii_case("read") {
        Op::Read
    } else if f[3].eq_ignore_ascii_case("write") {
        Op::Write
    } else {
        return Err(format!("type `{}` is neither Read nor Write", f[3]));
    };
    Ok(Row {
        ticks: num(0, "timestamp")?,
        host: f[1],
        disk: num(2, "disk number")? as u32,
        op,
        offset: num(4, "offset")?,
        size: num(5, "size")?,
        response_ticks: num(6, "response time")?,
    })
}

pub(crate) fn looks_like_row(l: &str) -> bool {
    parse_row(l).is_ok()
}

#[derive(Default)]
pub(crate) struct Parser;

impl LineParser for Parser {
    fn line(&mut self, _no: u64, text: &str, out: &mut Builder) -> Outcome {
        if text.trim_start().starts_with("Timestamp,") {
            return Outcome::Header;
        }
        let r = match parse_row(text) {
            Ok(r) => r,
            Err(why) => return Outcome::Bad(why),
        };
        let name = format!("{}/{}", r.host, r.disk);
        let device = out.device(&name);
        let job = out.job(&name);
        let t = r.ticks.saturating_mul(TICK_NS);
        let ev = Event {
            time_ns: t,
            device,
            job,
            cpu: 0,
            action: Action::Queue,
            rwbs: Rwbs::from_op(r.op),
            offset: r.offset,
            len: r.size,
        };
        out.events.push(ev);
        out.events.push(Event {
            time_ns: t.saturating_add(r.response_ticks.saturating_mul(TICK_NS)),
            action: Action::Complete,
            ..ev
        });
        Outcome::Events
    }

    fn finish(&mut self, out: &mut Builder) {
        // Stable: a queue event stays before its own completion when the response time is 0.
        out.events.sort_by_key(|e| e.time_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row() {
        let r = parse_row("128166372003061629,hm,1,Read,3154152448,4096,3233").unwrap();
        assert_eq!(
            (r.host, r.disk, r.op, r.offset, r.size),
            ("hm", 1, Op::Read, 3154152448, 4096)
        );
        assert!(parse_row("1,hm,1,Trim,0,4096,1").is_err());
        assert!(parse_row("1,hm,1,Read,0,4096").is_err());
        assert!(parse_row("x,hm,1,Read,0,4096,1").is_err());
    }
}
