//! Open CAS IO classes: the classes a loaded file defines, and the classifier that puts each
//! request into one (domain.md §7; the operator's guide is docs/io-classes.md). The file itself,
//! read and written as casadm does and each class name compiled into its rule, is
//! ioclass_file.rs.
//!
//! Job: evaluate the compiled rules per request the way Open CAS's `cas_cls_classify` does:
//! classes in id order, a later match overrides an earlier one, a matching rule containing
//! `done` ends the walk.
//!
//! Boundaries: pure and self-contained. No IO, no statistics, no locking; what a priority or an
//! allocation does to eviction and insertion is the engine's business. Conditions that need the
//! file system above the cache (`metadata`, `file_size`, ...) cannot be evaluated on a block
//! export: loaded under [`LoadOptions::ignore_unsupported`], they are never true.
//!
//! Invariants of a table (`IoClasses`): sorted by id, ids unique, class 0 present and without a
//! rule; only the file's reader builds one (`from_classes` checks it), so `classify` and `get`
//! can rely on it.

/// An IO class id, 0..=[`MAX_CLASS_ID`].
pub type ClassId = u8;

/// The highest id casadm accepts: `OCF_IO_CLASS_ID_MAX` = `OCF_USER_IO_CLASS_MAX - 1` = 33 in
/// OCF master (34 classes, 0..=33; older releases had 33 classes, 0..=32, and refused 33). A
/// table saved by a build whose limit was 32 loads unchanged.
pub const MAX_CLASS_ID: ClassId = 33;
/// The id OCF gives its prefetch class (`OCF_IO_CLASS_PREFETCH`).
pub const PREFETCH_CLASS_ID: ClassId = 33;
/// The prefetch class's name (`OCF_IO_CLASS_PREFETCH_NAME`): like `unclassified`, a name that is
/// not parsed as a rule, allowed on class 33 only.
pub const PREFETCH_CLASS_NAME: &str = "prefetch";
/// The longest class name: Open CAS keeps names in 1024-byte buffers that end in a NUL.
pub const MAX_NAME_LEN: usize = 1023;
/// The highest value a `core_id` condition may name (`OCF_CORE_ID_MAX`).
pub const MAX_RULE_CORE_ID: u64 = 4095;
/// The header line Open CAS ships and prints; `parse` also takes its columns in any order.
pub const HEADER: &str = "IO class id,IO class name,Eviction priority,Allocation";
/// Class 0's name. Open CAS never parses it as a rule and refuses to change it.
pub const DEFAULT_CLASS_NAME: &str = "unclassified";
/// Class 0's eviction priority when no file was loaded (`OCF_IO_CLASS_PRIO_LOWEST`).
pub const DEFAULT_PRIORITY: u8 = 255;

/// What the classifier looks at in a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IoRequest {
    pub core_id: u16,
    /// First 512-byte sector of the request on its core (Open CAS tests `bi_sector` only).
    pub lba: u64,
    /// Bytes.
    pub size: u64,
    pub write: bool,
}

/// How strict [`IoClasses::parse`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LoadOptions {
    /// Load file-system conditions (`metadata`, `file_size`, ...) as conditions that are never
    /// true, instead of refusing the file.
    pub ignore_unsupported: bool,
}

/// Why a file was refused: where (1-based line and character column) and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}, column {column}: {message}")]
pub struct IoClassError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Eq,
    Ne,
    Lt,
    Gt,
    Le,
    Ge,
}

impl Op {
    pub(crate) fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "eq" => Op::Eq,
            "ne" => Op::Ne,
            "lt" => Op::Lt,
            "gt" => Op::Gt,
            "le" => Op::Le,
            "ge" => Op::Ge,
            _ => return None,
        })
    }

    #[inline]
    fn test(self, value: u64, operand: u64) -> bool {
        match self {
            Op::Eq => value == operand,
            Op::Ne => value != operand,
            Op::Lt => value < operand,
            Op::Gt => value > operand,
            Op::Le => value <= operand,
            Op::Ge => value >= operand,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cond {
    RequestSize(Op, u64),
    Lba(Op, u64),
    CoreId(Op, u64),
    /// Tests the class assigned so far, as Open CAS's `io_class` does.
    IoClass(Op, u64),
    Write(bool),
    /// A file-system condition loaded under `ignore_unsupported`.
    Never,
}

impl Cond {
    #[inline]
    fn test(self, req: &IoRequest, current: ClassId) -> bool {
        match self {
            Cond::RequestSize(op, n) => op.test(req.size, n),
            Cond::Lba(op, n) => op.test(req.lba, n),
            Cond::CoreId(op, n) => op.test(u64::from(req.core_id), n),
            Cond::IoClass(op, n) => op.test(u64::from(current), n),
            Cond::Write(write) => req.write == write,
            Cond::Never => false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Join {
    And,
    Or,
}

/// A compiled rule. Open CAS walks the conditions left to right: under `&` it stops at the first
/// false one, under `|` it never short-circuits, and reaching `done` matches and stops. With one
/// kind of join that reduces to: `&` matches when every condition before the first `done` holds;
/// `|` matches when any condition holds or `done` is present. Conditions after `done` are parsed
/// and validated but never evaluated, so they are not kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rule {
    join: Join,
    conds: Box<[Cond]>,
    done: bool,
    unsupported: bool,
}

impl Rule {
    pub(crate) fn new(join: Join, conds: Box<[Cond]>, done: bool, unsupported: bool) -> Rule {
        Rule {
            join,
            conds,
            done,
            unsupported,
        }
    }

    /// Returns (matched, stop).
    #[inline]
    pub(crate) fn eval(&self, req: &IoRequest, current: ClassId) -> (bool, bool) {
        let matched = match self.join {
            Join::And => self.conds.iter().all(|c| c.test(req, current)),
            Join::Or => self.done || self.conds.iter().any(|c| c.test(req, current)),
        };
        (matched, matched && self.done)
    }
}

/// One IO class: its id, its name (which is its rule), and what the engine does with its lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoClass {
    pub id: ClassId,
    pub name: String,
    /// 0 = evicted last, 255 = evicted first; `None` = pinned (never evicted by other classes).
    pub eviction_priority: Option<u8>,
    /// The share of the cache the class may occupy, in hundredths: 0 = never cached, 100 = all.
    pub allocation: u8,
    /// `None` for class 0 and for class 33 named `prefetch`, whose names Open CAS never parses
    /// (no request is classified into them by a rule).
    rule: Option<Rule>,
}

impl IoClass {
    /// A class as the file defines it; `rule` None for class 0 and for `prefetch` (class 33).
    pub(crate) fn new(
        id: ClassId,
        name: String,
        eviction_priority: Option<u8>,
        allocation: u8,
        rule: Option<Rule>,
    ) -> IoClass {
        IoClass {
            id,
            name,
            eviction_priority,
            allocation,
            rule,
        }
    }

    pub fn is_pinned(&self) -> bool {
        self.eviction_priority.is_none()
    }

    /// Whether the rule holds file-system conditions that were loaded as never true.
    pub fn has_unsupported_conditions(&self) -> bool {
        self.rule.as_ref().is_some_and(|r| r.unsupported)
    }

    /// The allocation as Open CAS prints it: `0.50`, `1.00`.
    pub fn allocation_str(&self) -> String {
        format!("{}.{:02}", self.allocation / 100, self.allocation % 100)
    }
}

/// A loaded IO class table, sorted by id. Class 0 is always present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoClasses {
    classes: Vec<IoClass>,
}

impl Default for IoClasses {
    /// What Open CAS has before any file is loaded (OCF's `__init_partitions`): class 0
    /// `unclassified`, priority 255, allocation 1.00.
    fn default() -> Self {
        IoClasses {
            classes: vec![default_class()],
        }
    }
}

pub(crate) fn default_class() -> IoClass {
    IoClass {
        id: 0,
        name: DEFAULT_CLASS_NAME.to_string(),
        eviction_priority: Some(DEFAULT_PRIORITY),
        allocation: 100,
        rule: None,
    }
}

impl IoClasses {
    /// The table of `classes`, which the reader hands over sorted by id, without duplicates,
    /// class 0 among them (the invariants `classify` and `get` rely on).
    pub(crate) fn from_classes(classes: Vec<IoClass>) -> IoClasses {
        assert!(
            classes
                .first()
                .is_some_and(|c| c.id == 0 && c.rule.is_none())
                && classes.windows(2).all(|w| w[0].id < w[1].id),
            "an IO class table is sorted by id, without duplicates, and starts with class 0"
        );
        IoClasses { classes }
    }

    /// The class of one request. Allocation-free; a table with only class 0 returns at once.
    #[inline]
    pub fn classify(&self, req: &IoRequest) -> ClassId {
        if self.classes.len() == 1 {
            return 0;
        }
        let mut current = 0;
        for class in &self.classes {
            let Some(rule) = &class.rule else { continue };
            let (matched, stop) = rule.eval(req, current);
            if matched {
                current = class.id;
            }
            if stop {
                break;
            }
        }
        current
    }

    pub fn get(&self, id: ClassId) -> Option<&IoClass> {
        self.classes
            .binary_search_by_key(&id, |c| c.id)
            .ok()
            .map(|i| &self.classes[i])
    }

    /// The classes in id order.
    pub fn iter(&self) -> std::slice::Iter<'_, IoClass> {
        self.classes.iter()
    }

    /// Number of classes, class 0 included (so never 0).
    pub fn len(&self) -> usize {
        self.classes.len()
    }

    /// Always false: class 0 always exists. Here because `len` is.
    pub fn is_empty(&self) -> bool {
        self.classes.is_empty()
    }
}

impl<'a> IntoIterator for &'a IoClasses {
    type Item = &'a IoClass;
    type IntoIter = std::slice::Iter<'a, IoClass>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}
