//! The IO class file (docs/io-classes.md): read as Open CAS's `casadm --io-class --load-config`
//! reads it (a header naming four columns, ids 0..=33, eviction priority, allocation), each
//! class's name compiled into the rule Open CAS's kernel classifier (`classifier.c`) would build
//! from it; [`IoClasses::to_csv`] writes the table in the form `casadm --io-class --list -o csv`
//! prints, and [`IoClasses::parse`] reads that back to the same table. The classes and the
//! classifier are ioclass.rs.
//!
//! A refused file yields an error naming line and column and builds nothing, so the caller keeps
//! its old table. Conditions that need the file system above the cache (`metadata`,
//! `file_size`, ...) are refused, or under [`LoadOptions::ignore_unsupported`] load as never
//! true.

use std::fmt::Write as _;

use crate::ioclass::{
    default_class, ClassId, Cond, IoClass, IoClassError, IoClasses, Join, LoadOptions, Op, Rule,
    DEFAULT_CLASS_NAME, HEADER, MAX_CLASS_ID, MAX_NAME_LEN, MAX_RULE_CORE_ID, PREFETCH_CLASS_ID,
    PREFETCH_CLASS_NAME,
};

/// Open CAS's `MAX_STRING_SPECIFIER_LEN` (256) less the NUL.
const MAX_STRING_OPERAND: usize = 255;
const ID_RANGE: &str = "expected a number from 0 to 33";
const PRIORITY_RANGE: &str = "expected a number from 0 to 255, or nothing for pinned";
const ALLOCATION_RANGE: &str =
    "expected a decimal from 0.00 to 1.00 with at most two decimal places";
const OPERATORS: &str = "expected eq, ne, lt, gt, le or ge";

fn error(line: usize, column: usize, message: impl Into<String>) -> IoClassError {
    IoClassError {
        line,
        column,
        message: message.into(),
    }
}

impl IoClasses {
    /// Reads an Open CAS IO class file. On error nothing is built.
    ///
    /// A file without class 0 gets the default class 0 (see [`Default`]); Open CAS would keep
    /// whatever class 0 it had before.
    pub fn parse(text: &str, opts: &LoadOptions) -> Result<IoClasses, IoClassError> {
        parse(text, opts)
    }

    /// The table as Open CAS's CSV, standard header and column order, allocation with two
    /// decimals, empty priority for pinned. `parse` reads it back to an equal table (with
    /// `ignore_unsupported: true` if any class [has unsupported
    /// conditions](IoClass::has_unsupported_conditions); that option changes nothing for a table
    /// without them).
    pub fn to_csv(&self) -> String {
        let mut out = String::with_capacity(HEADER.len() + 1 + self.len() * 32);
        out.push_str(HEADER);
        out.push('\n');
        for c in self.iter() {
            let _ = write!(out, "{},{},", c.id, c.name);
            if let Some(p) = c.eviction_priority {
                let _ = write!(out, "{p}");
            }
            let _ = writeln!(out, ",{}", c.allocation_str());
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// The file.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Column {
    Id,
    Name,
    Priority,
    Allocation,
}

const COLUMNS: [(Column, &str); 4] = [
    (Column::Id, "IO class id"),
    (Column::Name, "IO class name"),
    (Column::Priority, "Eviction priority"),
    (Column::Allocation, "Allocation"),
];

#[derive(Debug)]
struct Field {
    text: String,
    /// 1-based character column of the field's first character (after an opening quote).
    column: usize,
}

/// Splits one line like casadm's `csv_read`: fields are trimmed of surrounding whitespace, and a
/// field may be wrapped in double quotes (`""` inside is one quote), which keeps commas in it.
fn split_fields(line: &str, line_no: usize) -> Result<Vec<Field>, IoClassError> {
    let chars: Vec<char> = line.chars().collect();
    let mut fields = Vec::with_capacity(4);
    let mut i = 0;
    loop {
        while i < chars.len() && chars[i] != ',' && chars[i].is_whitespace() {
            i += 1;
        }
        if chars.get(i) == Some(&'"') {
            let open = i;
            i += 1;
            let column = i + 1;
            let mut text = String::new();
            loop {
                match chars.get(i) {
                    None => {
                        return Err(error(
                            line_no,
                            open + 1,
                            "this quotation mark is never closed",
                        ))
                    }
                    Some('"') if chars.get(i + 1) == Some(&'"') => {
                        text.push('"');
                        i += 2;
                    }
                    Some('"') => {
                        i += 1;
                        break;
                    }
                    Some(&c) => {
                        text.push(c);
                        i += 1;
                    }
                }
            }
            while i < chars.len() && chars[i] != ',' {
                if !chars[i].is_whitespace() {
                    return Err(error(
                        line_no,
                        i + 1,
                        "unexpected text after a closing quotation mark; expected a comma",
                    ));
                }
                i += 1;
            }
            fields.push(Field { text, column });
        } else {
            let start = i;
            while i < chars.len() && chars[i] != ',' {
                i += 1;
            }
            let mut end = i;
            while end > start && chars[end - 1].is_whitespace() {
                end -= 1;
            }
            fields.push(Field {
                text: chars[start..end].iter().collect(),
                column: start + 1,
            });
        }
        if i >= chars.len() {
            return Ok(fields);
        }
        i += 1;
    }
}

#[derive(Debug, PartialEq, Eq)]
enum NumError {
    Invalid,
    TooLarge,
}

/// An unsigned decimal as the kernel's `kstrtou64(.., 10, ..)` takes it: an optional `+`, then
/// digits only.
fn parse_u64(s: &str) -> Result<u64, NumError> {
    let digits = s.strip_prefix('+').unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NumError::Invalid);
    }
    digits.parse::<u64>().map_err(|_| NumError::TooLarge)
}

fn parse(text: &str, opts: &LoadOptions) -> Result<IoClasses, IoClassError> {
    // Spreadsheets on Windows start their CSV with a byte-order mark.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .enumerate()
        .map(|(i, l)| (i + 1, l));

    let (header_no, header) = lines
        .by_ref()
        .find(|(_, l)| !l.trim().is_empty())
        .ok_or_else(|| {
            error(
                1,
                1,
                format!("the file is empty; expected the header line `{HEADER}`"),
            )
        })?;
    let order = parse_header(header, header_no)?;

    let mut classes: Vec<IoClass> = Vec::new();
    let mut defined_on: [Option<usize>; MAX_CLASS_ID as usize + 1] =
        [None; MAX_CLASS_ID as usize + 1];
    let mut last_line = header_no;
    for (line_no, line) in lines {
        last_line = line_no;
        if line.trim().is_empty() {
            continue;
        }
        let fields = split_fields(line, line_no)?;
        if fields.len() != 4 {
            let column = fields.get(4).map_or(line.chars().count() + 1, |f| f.column);
            let names: Vec<&str> = order.iter().map(|c| column_name(*c)).collect();
            return Err(error(
                line_no,
                column,
                format!(
                    "expected 4 comma-separated fields ({}), found {}",
                    names.join(", "),
                    fields.len()
                ),
            ));
        }
        let field = |col: Column| -> &Field {
            let at = order.iter().position(|c| *c == col).unwrap_or(0);
            &fields[at]
        };

        let id_field = field(Column::Id);
        let id = parse_id(id_field, line_no)?;
        if let Some(first) = defined_on[usize::from(id)] {
            return Err(error(
                line_no,
                id_field.column,
                format!("IO class {id} is defined twice (first on line {first})"),
            ));
        }
        defined_on[usize::from(id)] = Some(line_no);

        let name_field = field(Column::Name);
        check_name(name_field, line_no)?;
        let rule = if id == 0 {
            if name_field.text != DEFAULT_CLASS_NAME {
                return Err(error(
                    line_no,
                    name_field.column,
                    format!(
                        "class 0 must be named `{DEFAULT_CLASS_NAME}`: it takes what no other \
                         class matches, and Open CAS does not let its name change"
                    ),
                ));
            }
            None
        } else if name_field.text == PREFETCH_CLASS_NAME {
            // Open CAS's classifier: `prefetch` is class 33's name, not a rule.
            if id != PREFETCH_CLASS_ID {
                return Err(error(
                    line_no,
                    name_field.column,
                    format!(
                        "`{PREFETCH_CLASS_NAME}` is class {PREFETCH_CLASS_ID}'s name, not a \
                         condition; only class {PREFETCH_CLASS_ID} may use it"
                    ),
                ));
            }
            None
        } else {
            Some(compile_rule(
                &name_field.text,
                name_field.column,
                line_no,
                opts,
            )?)
        };

        let eviction_priority = parse_priority(field(Column::Priority), line_no)?;
        let allocation = parse_allocation(field(Column::Allocation), line_no)?;

        classes.push(IoClass::new(
            id,
            name_field.text.clone(),
            eviction_priority,
            allocation,
            rule,
        ));
    }

    if classes.is_empty() {
        return Err(error(
            last_line + usize::from(last_line == header_no),
            1,
            "expected an IO class after the header, found the end of the file",
        ));
    }
    if defined_on[0].is_none() {
        classes.push(default_class());
    }
    classes.sort_by_key(|c| c.id);
    Ok(IoClasses::from_classes(classes))
}

fn column_name(col: Column) -> &'static str {
    COLUMNS
        .iter()
        .find(|(c, _)| *c == col)
        .map_or("", |(_, name)| name)
}

/// Maps each field position to its column. casadm matches header names exactly and accepts
/// them in any order, but wants all four and nothing else.
fn parse_header(line: &str, line_no: usize) -> Result<[Column; 4], IoClassError> {
    let fields = split_fields(line, line_no)?;
    let mut order: Vec<Column> = Vec::with_capacity(4);
    for f in &fields {
        let Some((col, name)) = COLUMNS.iter().find(|(_, name)| *name == f.text) else {
            let hint = if f.text.is_empty() {
                "an empty column name".to_string()
            } else {
                format!("unknown column \"{}\"", f.text)
            };
            return Err(error(
                line_no,
                f.column,
                format!("{hint} in the header; expected the header line `{HEADER}`"),
            ));
        };
        if order.contains(col) {
            return Err(error(
                line_no,
                f.column,
                format!("column \"{name}\" appears twice in the header"),
            ));
        }
        order.push(*col);
    }
    if let Some((_, missing)) = COLUMNS.iter().find(|(c, _)| !order.contains(c)) {
        return Err(error(
            line_no,
            line.chars().count() + 1,
            format!("the header lacks the column \"{missing}\"; expected `{HEADER}`"),
        ));
    }
    Ok([order[0], order[1], order[2], order[3]])
}

fn parse_id(f: &Field, line_no: usize) -> Result<ClassId, IoClassError> {
    let message = match parse_u64(&f.text) {
        Ok(n) if n <= u64::from(MAX_CLASS_ID) => return Ok(n as ClassId),
        Ok(n) => format!("IO class id {n} is out of range; {ID_RANGE}"),
        Err(NumError::TooLarge) => format!("IO class id {} is out of range; {ID_RANGE}", f.text),
        Err(NumError::Invalid) if f.text.is_empty() => format!("missing IO class id; {ID_RANGE}"),
        Err(NumError::Invalid) => format!("invalid IO class id \"{}\"; {ID_RANGE}", f.text),
    };
    Err(error(line_no, f.column, message))
}

/// casadm's `partition_is_name_valid`: 1..=1023 printable ASCII characters, no comma, no quote.
fn check_name(f: &Field, line_no: usize) -> Result<(), IoClassError> {
    if f.text.is_empty() {
        return Err(error(
            line_no,
            f.column,
            "missing IO class name; the name is the class's rule, e.g. request_size:le:4096&done",
        ));
    }
    if let Some((i, c)) = f
        .text
        .chars()
        .enumerate()
        .find(|(_, c)| *c == ',' || *c == '"' || !(' '..='~').contains(c))
    {
        return Err(error(
            line_no,
            f.column + i,
            format!(
                "character {c:?} is not allowed in an IO class name; names are printable ASCII \
                 without commas or quotation marks"
            ),
        ));
    }
    if f.text.len() > MAX_NAME_LEN {
        return Err(error(
            line_no,
            f.column,
            format!(
                "IO class name is {} characters long; at most {MAX_NAME_LEN} are allowed",
                f.text.len()
            ),
        ));
    }
    Ok(())
}

fn parse_priority(f: &Field, line_no: usize) -> Result<Option<u8>, IoClassError> {
    if f.text.is_empty() {
        return Ok(None);
    }
    let message = match parse_u64(&f.text) {
        Ok(n) if n <= 255 => return Ok(Some(n as u8)),
        Ok(_) | Err(NumError::TooLarge) => {
            format!(
                "eviction priority {} is out of range; {PRIORITY_RANGE}",
                f.text
            )
        }
        Err(NumError::Invalid) => {
            format!("invalid eviction priority \"{}\"; {PRIORITY_RANGE}", f.text)
        }
    };
    Err(error(line_no, f.column, message))
}

/// casadm takes what `strtof` reads into 0..=1 and rounds to hundredths, but refuses more than
/// four characters, so in practice: `0`, `1`, `.5`, `0.5`, `0.25`, `1.0`, `1.00`. We take that
/// plain decimal form only (no sign, exponent or hex) and refuse a third decimal place rather
/// than let the length limit do it.
fn parse_allocation(f: &Field, line_no: usize) -> Result<u8, IoClassError> {
    let s = f.text.as_str();
    let fail = |message: String| Err(error(line_no, f.column, message));
    if s.is_empty() {
        return fail(format!("missing allocation; {ALLOCATION_RANGE}"));
    }
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if !digits(int) || !digits(frac) || (int.is_empty() && frac.is_empty()) {
        return fail(format!("invalid allocation \"{s}\"; {ALLOCATION_RANGE}"));
    }
    if frac.len() > 2 {
        return fail(format!(
            "allocation {s} has more than two decimal places; {ALLOCATION_RANGE}"
        ));
    }
    let int = int.trim_start_matches('0');
    let whole: u64 = match int {
        "" => 0,
        "1" => 1,
        _ => return fail(format!("allocation {s} is above 1.00; {ALLOCATION_RANGE}")),
    };
    let mut hundredths = whole * 100;
    for (i, b) in frac.bytes().enumerate() {
        hundredths += u64::from(b - b'0') * if i == 0 { 10 } else { 1 };
    }
    if hundredths > 100 {
        return fail(format!("allocation {s} is above 1.00; {ALLOCATION_RANGE}"));
    }
    Ok(hundredths as u8)
}

// ---------------------------------------------------------------------------------------------
// Rules.

enum Parsed {
    Cond(Cond),
    Done,
    Unsupported,
}

/// File-system conditions and the operand each takes, so their syntax is still checked.
enum FsOperand {
    None,
    Numeric,
    /// Non-empty, at most this many characters (`None`: no limit beyond the name's).
    String(Option<usize>),
}

fn fs_condition(token: &str) -> Option<FsOperand> {
    Some(match token {
        "metadata" | "direct" => FsOperand::None,
        "file_size" | "file_offset" | "pid" | "wlth" => FsOperand::Numeric,
        "directory" => FsOperand::String(None),
        "extension" | "file_name_prefix" | "process_name" => {
            FsOperand::String(Some(MAX_STRING_OPERAND))
        }
        _ => return None,
    })
}

fn spaces_hint(s: &str) -> &'static str {
    if s.contains(char::is_whitespace) {
        "; rules may not contain spaces"
    } else {
        ""
    }
}

/// Compiles a class name into its rule. `name` is ASCII (checked by `check_name`), so byte
/// offsets are character offsets and columns are `column + offset`.
fn compile_rule(
    name: &str,
    column: usize,
    line_no: usize,
    opts: &LoadOptions,
) -> Result<Rule, IoClassError> {
    let mut join: Option<u8> = None;
    let mut conds = Vec::new();
    let mut done = false;
    let mut unsupported = false;
    let mut start = 0;
    loop {
        let end = name[start..]
            .find(['&', '|'])
            .map_or(name.len(), |i| start + i);
        let piece = &name[start..end];
        if piece.is_empty() {
            let message = match join {
                Some(op) if start > 0 => format!("expected a condition after `{}`", op as char),
                _ => format!(
                    "expected a condition before `{}`",
                    name.as_bytes().get(end).map_or('&', |b| *b as char)
                ),
            };
            return Err(error(line_no, column + start, message));
        }
        let parsed = parse_condition(piece, column + start, line_no, opts)?;
        // Counted even after `done`, so the caller knows a strict reload would refuse the rule.
        unsupported |= matches!(parsed, Parsed::Unsupported);
        match parsed {
            // Open CAS never evaluates what follows `done` in a rule, but still parses it.
            _ if done => {}
            Parsed::Done => done = true,
            Parsed::Cond(c) => conds.push(c),
            Parsed::Unsupported => conds.push(Cond::Never),
        }
        if end == name.len() {
            break;
        }
        let op = name.as_bytes()[end];
        match join {
            None => join = Some(op),
            Some(j) if j != op => return Err(error(
                line_no,
                column + end,
                "this rule joins conditions with both `&` and `|`; a rule uses one or the other",
            )),
            Some(_) => {}
        }
        start = end + 1;
    }
    let join = if join == Some(b'|') {
        Join::Or
    } else {
        Join::And
    };
    Ok(Rule::new(join, conds.into_boxed_slice(), done, unsupported))
}

fn parse_condition(
    piece: &str,
    column: usize,
    line_no: usize,
    opts: &LoadOptions,
) -> Result<Parsed, IoClassError> {
    let err = |col: usize, message: String| Err(error(line_no, col, message));
    let (token, operand) = match piece.split_once(':') {
        Some((t, o)) => (t, Some(o)),
        None => (piece, None),
    };
    let operand_column = column + token.len() + 1;
    let numeric = || parse_numeric(token, operand, operand_column, line_no);
    match token {
        "done" => {
            if operand.is_some() {
                return err(column + token.len(), "`done` takes no value".to_string());
            }
            Ok(Parsed::Done)
        }
        "request_size" => numeric().map(|(op, n)| Parsed::Cond(Cond::RequestSize(op, n))),
        "lba" => numeric().map(|(op, n)| Parsed::Cond(Cond::Lba(op, n))),
        "io_class" => numeric().map(|(op, n)| Parsed::Cond(Cond::IoClass(op, n))),
        "core_id" => {
            let (op, n) = numeric()?;
            if n > MAX_RULE_CORE_ID {
                let value_col =
                    operand_column + operand.map_or(0, |o| o.rfind(':').map_or(0, |i| i + 1));
                return err(
                    value_col,
                    format!("core id {n} is out of range; expected 0 to {MAX_RULE_CORE_ID}"),
                );
            }
            Ok(Parsed::Cond(Cond::CoreId(op, n)))
        }
        "io_direction" => match operand {
            Some("read") => Ok(Parsed::Cond(Cond::Write(false))),
            Some("write") => Ok(Parsed::Cond(Cond::Write(true))),
            None | Some("") => err(
                operand_column.min(column + piece.len()),
                "`io_direction` needs a value: io_direction:read or io_direction:write".to_string(),
            ),
            Some(other) => err(
                operand_column,
                format!(
                    "invalid direction \"{other}\"; expected read or write{}",
                    spaces_hint(other)
                ),
            ),
        },
        "unclassified" => err(
            column,
            "`unclassified` is class 0's name, not a condition; only class 0 may use it"
                .to_string(),
        ),
        _ => {
            let Some(kind) = fs_condition(token) else {
                let shown = if token.is_empty() { piece } else { token };
                return err(
                    column,
                    format!(
                        "unknown condition \"{shown}\"{}; expected request_size, lba, core_id, \
                         io_direction, io_class or done",
                        spaces_hint(shown)
                    ),
                );
            };
            if !opts.ignore_unsupported {
                return err(
                    column,
                    format!(
                        "condition \"{piece}\" needs the file system above the cache, which a \
                         block export cannot see; remove it, or load with ignore_unsupported to \
                         treat it as never true"
                    ),
                );
            }
            match kind {
                FsOperand::None if operand.is_some() => {
                    err(column + token.len(), format!("`{token}` takes no value"))
                }
                FsOperand::None => Ok(Parsed::Unsupported),
                FsOperand::Numeric => numeric().map(|_| Parsed::Unsupported),
                FsOperand::String(limit) => match operand {
                    None | Some("") => err(
                        operand_column.min(column + piece.len()),
                        format!("`{token}` needs a value, e.g. {token}:something"),
                    ),
                    Some(s) if limit.is_some_and(|l| s.len() > l) => err(
                        operand_column,
                        format!(
                            "the value of `{token}` is {} characters long; at most {} are allowed",
                            s.len(),
                            limit.unwrap_or(0)
                        ),
                    ),
                    Some(_) => Ok(Parsed::Unsupported),
                },
            }
        }
    }
}

/// An operand `N` (meaning eq) or `OP:N`, as Open CAS's `_cas_cls_numeric_ctr` reads it.
fn parse_numeric(
    token: &str,
    operand: Option<&str>,
    column: usize,
    line_no: usize,
) -> Result<(Op, u64), IoClassError> {
    let operand = match operand {
        Some(o) if !o.is_empty() => o,
        _ => {
            return Err(error(
                line_no,
                // Point just past the token, or past its colon.
                column - usize::from(operand.is_none()),
                format!("`{token}` needs a value, e.g. {token}:ge:4096 or {token}:4096"),
            ));
        }
    };
    let (op, value, value_column) = match operand.split_once(':') {
        Some((op_text, value)) => {
            let Some(op) = Op::parse(op_text) else {
                return Err(error(
                    line_no,
                    column,
                    format!(
                        "unknown operator \"{op_text}\" in `{token}`; {OPERATORS}{}",
                        spaces_hint(op_text)
                    ),
                ));
            };
            (op, value, column + op_text.len() + 1)
        }
        None => (Op::Eq, operand, column),
    };
    match parse_u64(value) {
        Ok(n) => Ok((op, n)),
        Err(_) if value.is_empty() => Err(error(
            line_no,
            value_column,
            format!("`{token}` needs a number after its operator"),
        )),
        Err(NumError::TooLarge) => Err(error(
            line_no,
            value_column,
            format!("number {value} is too large; the largest is {}", u64::MAX),
        )),
        Err(NumError::Invalid) => Err(error(
            line_no,
            value_column,
            format!(
                "invalid number \"{value}\" in `{token}`; expected an unsigned decimal integer{}",
                spaces_hint(value)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ioclass::IoRequest;

    fn req(size: u64, lba: u64, core_id: u16, write: bool) -> IoRequest {
        IoRequest {
            core_id,
            lba,
            size,
            write,
        }
    }

    fn rule(name: &str) -> Rule {
        compile_rule(name, 1, 1, &LoadOptions::default()).unwrap()
    }

    #[test]
    fn operators_compare_the_request_value_to_the_operand() {
        let r = req(4096, 0, 1, false);
        for (name, expected) in [
            ("request_size:eq:4096", true),
            ("request_size:4096", true),
            ("request_size:ne:4096", false),
            ("request_size:lt:4096", false),
            ("request_size:le:4096", true),
            ("request_size:gt:4095", true),
            ("request_size:ge:4097", false),
        ] {
            assert_eq!(rule(name).eval(&r, 0).0, expected, "{name}");
        }
    }

    #[test]
    fn done_stops_only_when_the_conditions_before_it_hold() {
        let small = req(512, 0, 1, false);
        let big = req(1 << 20, 0, 1, false);
        let r = rule("request_size:le:4096&done");
        assert_eq!(r.eval(&small, 0), (true, true));
        assert_eq!(r.eval(&big, 0), (false, false));
        // What follows done is never evaluated.
        assert_eq!(
            rule("done&request_size:gt:1").eval(&req(0, 0, 1, false), 0),
            (true, true)
        );
        // Under `|`, reaching done always matches.
        assert_eq!(
            rule("request_size:le:4096|done").eval(&big, 0),
            (true, true)
        );
    }

    #[test]
    fn fields_are_trimmed_and_may_be_quoted() {
        let f = split_fields(" 1 ,\"a,b\"\"c\" , ,x", 1).unwrap();
        let texts: Vec<&str> = f.iter().map(|f| f.text.as_str()).collect();
        assert_eq!(texts, ["1", "a,b\"c", "", "x"]);
        assert_eq!(f[0].column, 2);
        assert_eq!(f[1].column, 6);
        assert!(split_fields("1,\"abc", 7).is_err());
    }

    #[test]
    fn allocation_forms() {
        let alloc = |s: &str| {
            parse_allocation(
                &Field {
                    text: s.to_string(),
                    column: 1,
                },
                1,
            )
        };
        for (s, v) in [
            ("0", 0),
            ("1", 100),
            (".5", 50),
            ("0.5", 50),
            ("0.25", 25),
            ("1.", 100),
            ("1.0", 100),
            ("1.00", 100),
            ("00.07", 7),
        ] {
            assert_eq!(alloc(s).unwrap(), v, "{s}");
        }
        for s in [
            "", ".", "1.01", "2", "0.123", "-1", "+1", "1e0", "0,5", "abc",
        ] {
            assert!(alloc(s).is_err(), "{s}");
        }
    }

    #[test]
    fn numbers_follow_kstrtou64() {
        assert_eq!(parse_u64("+7"), Ok(7));
        assert_eq!(parse_u64("007"), Ok(7));
        assert_eq!(parse_u64("18446744073709551616"), Err(NumError::TooLarge));
        assert_eq!(parse_u64("-1"), Err(NumError::Invalid));
        assert_eq!(parse_u64(" 1"), Err(NumError::Invalid));
    }

    #[test]
    fn only_class_zero_short_circuits() {
        let t = IoClasses::default();
        assert_eq!(t.classify(&req(1, 1, 1, true)), 0);
        assert_eq!(t.len(), 1);
        assert_eq!(t.get(0).map(|c| c.allocation), Some(100));
    }
}
