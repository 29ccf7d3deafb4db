//! fio iologs. v2: `fio version 2 iolog`, then `file action [offset length]`; v3:
//! `fio version 3 iolog`, then `msecs file action [offset length]`.
//!
//! Actions: read, write, trim, sync, datasync (requests); add, open, close (file handling,
//! skipped); wait (v2 pacing: advances the clock by the given µs). iologs record no
//! completions, so queue depth stays unknown for them. v2 has no timestamps: events get the
//! time of the last `wait`, which keeps per-second figures meaningful only for paced logs.

use crate::trace::{Action, Builder, Event, LineParser, Op, Outcome, Rwbs};

pub(crate) struct Parser {
    v3: bool,
    clock_ns: u64,
}

impl Parser {
    pub fn new(v3: bool) -> Parser {
        Parser { v3, clock_ns: 0 }
    }
}

impl LineParser for Parser {
    fn line(&mut self, _no: u64, text: &str, out: &mut Builder) -> Outcome {
        let t = text.trim();
        if t.starts_with("fio version ") || t.starts_with('#') {
            return Outcome::Header;
        }
        let mut f: Vec<&str> = t.split_whitespace().collect();
        let mut time_ns = self.clock_ns;
        if self.v3 {
            let Some(first) = f.first() else {
                return Outcome::Bad("empty".into());
            };
            match first.parse::<u64>() {
                Ok(ms) => time_ns = ms.saturating_mul(1_000_000),
                Err(_) => return Outcome::Bad(format!("bad timestamp `{first}`")),
            }
            f.remove(0);
        }
        if f.len() < 2 {
            return Outcome::Bad("expected `file action [offset length]`".into());
        }
        let (file, action) = (f[0], f[1]);
        let op = match action {
            "add" | "open" | "close" => return Outcome::Header,
            "wait" => {
                // v2 pacing; the value is the first number after the action.
                return match f.get(2).and_then(|v| v.parse::<u64>().ok()) {
                    Some(us) => {
                        self.clock_ns = self.clock_ns.saturating_add(us.saturating_mul(1000));
                        Outcome::Header
                    }
                    None => Outcome::Bad("wait without a time".into()),
                };
            }
            "read" => Op::Read,
            "write" => Op::Write,
            "trim" => Op::Discard,
            "sync" | "datasync" => Op::Flush,
            other => return Outcome::Bad(format!("unknown action `{other}`")),
        };
        let (offset, len) = if op == Op::Flush && f.len() == 2 {
            (0, 0)
        } else if f.len() == 4 {
            match (f[2].parse::<u64>(), f[3].parse::<u64>()) {
                (Ok(o), Ok(l)) => (o, l),
                _ => return Outcome::Bad(format!("bad offset/length `{} {}`", f[2], f[3])),
            }
        } else {
            return Outcome::Bad(format!("{} fields after the file, expected 3", f.len() - 1));
        };
        let device = out.device(file);
        let job = out.job(file);
        out.events.push(Event {
            time_ns,
            device,
            job,
            cpu: 0,
            action: Action::Queue,
            rwbs: Rwbs::from_op(op),
            offset,
            len,
        });
        Outcome::Events
    }
}
