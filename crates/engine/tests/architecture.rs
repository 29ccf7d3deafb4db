//! The engine's rooms and the arrows between them (docs/architecture.md).
//!
//! Reads crates/engine/src/*.rs (test modules left out), builds the module dependency graph and
//! fails when
//! - the graph has a cycle (the cycle is printed), or
//! - a struct of the engine exposes fields to other rooms: an internal struct (not `pub`) with
//!   `pub`/`pub(crate)`/`pub(super)` fields, or a public one with `pub(crate)`/`pub(super)`
//!   fields, except the plain values in `VALUE_RECORDS` below, which carry no state of a room.
//!   (A public struct's `pub` fields are the library's API: statistics, policy parameters.)
//!
//! An arrow `a -> b` means a.rs names b: `crate::b`, `super::b` or a `use crate::{b, ...}`
//! group. A room can also lean on another without naming it: a method defined in b.rs called
//! as `x.f(` from a.rs (through a field of a struct that b.rs defines, or an `impl Holder` block
//! in b.rs). Those calls are resolved too, by method name when the name is defined only once
//! in the crate, and `self.f(` inside a struct's impls by the struct, so neither fields nor
//! methods of one struct spread over files can hide a circle. lib.rs is the crate root: it declares the modules and holds the shared error
//! and mode types every room uses, so it is left out of the graph.
//!
//! `cargo test -p hybridcache-engine --test architecture -- --nocapture` prints the graph;
//! with `HC_ENGINE_SRC=DIR` it reads another tree's sources (e.g. an older commit's).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Structs whose fields other rooms may name: values handed between rooms (a request's
/// segments and device runs, a read's plan, a queued read-ahead job), not the state of a room.
/// Their fields are the value; an accessor per field would say nothing more.
const VALUE_RECORDS: &[&str] = &[
    // One core line's part of a request: made by `lines`, read by read, write and cleaning.
    "Seg",
    // A merged piece of device I/O: made by every room that does I/O, consumed by `devices`.
    "Run",
    // A batch read's locked segments and runs, built and finished by the read room.
    "ReadPlan",
    // A queued read-ahead request.
    "Job",
    // A request's IO class and its allocation, as classified once per request.
    "ReqClass",
    // The on-disk format's records (format.rs): decoded from and encoded to the device as a
    // whole, checked by the decoder, never updated field by field.
    "Entry",
    "Geometry",
    "CommitRecord",
    // The scratch arrays of one batched hash lookup (meta.rs `lookup_many`), owned by the
    // caller for the call.
    "Walks",
];

/// Structs that still expose fields to other rooms, each with what keeps it so. The list may
/// only shrink: the test fails when a struct not listed exposes a field, and when a listed one
/// no longer does (then take it off). The next step for each is the plan: a subsystem
/// struct with private fields that the rooms reach through methods or narrow handles.
const NOT_YET_PRIVATE: &[(&str, &str)] = &[
    (
        "CacheInner",
        "the holder: its fields are the rooms themselves (devices, lines, cores, persist, \
         cleaner signal, policies' state), each with private fields of its own. Read, \
         read-ahead, write (and its batched hits), the cleaner and the cleaning policies, \
         commit and admission run on structs of references it lends (`Reader`, `ReadAhead`, \
         `Writer`, `Cleaner`, `Commit`, `Admission`). What keeps the fields `pub(crate)`: \
         those lenders (`reader`, `writer`, `cleaner_room`, `drain_prefetch`, `admission`, \
         `committer`) live in the rooms that use them, above the holder; purge \
         (invalidate.rs) is still an `impl CacheInner` block, since its per-core flush \
         threads hold the `Arc<CacheInner>`; recovery's load builds the holder and fills its \
         rooms; the facade (cache.rs, settings.rs) reads the policies' fields to set and show \
         them; and unit tests of other modules read the rooms through it. The next step is the \
         lenders moved into inner.rs (the holder then above the acting rooms, as the facade \
         is), the per-core flush threads and the cleaner thread moved above the holder, and \
         methods of the holder for the load and the facade",
    ),
    (
        "Cache",
        "the facade: its run-time setters (settings.rs, split from cache.rs by size) and \
         unit tests of other modules reach the holder through `Cache::inner` (the field is \
         the facade's only state besides its threads)",
    ),
];

/// A source file with comments, string and char literals blanked and `#[cfg(test)]` items
/// removed, so only code that ships is looked at.
fn clean(src: &str) -> String {
    drop_test_items(&blank(src))
}

/// Non-blank lines of `src` outside `#[cfg(test)]` items, comments included: what an engineer
/// reads of the code that ships.
fn shipped_lines(src: &str) -> usize {
    let blanked = blank(src);
    // `blank` keeps every newline, so a line of `blanked` is the same line of `src`.
    let mut in_test = vec![false; src.lines().count() + 1];
    for item in test_items(&blanked) {
        let first = blanked[..item.start].matches('\n').count();
        let last = blanked[..item.end].matches('\n').count();
        for l in in_test.iter_mut().take(last + 1).skip(first) {
            *l = true;
        }
    }
    src.lines()
        .enumerate()
        .filter(|(i, l)| !in_test[*i] && !l.trim().is_empty())
        .count()
}

/// `src` with comments, string and char literals blanked, every newline kept.
fn blank(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == b'\n' {
                        out.push(b'\n');
                    }
                    i += 1;
                }
            }
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == b'\n' {
                    out.push(b'\n');
                }
                j += 1;
            }
            out.extend_from_slice(b"\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                if i < b.len() && b[i] == b'\n' {
                    out.push(b'\n');
                }
                i += 1;
            }
            i += 1;
            out.extend_from_slice(b"\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): only the former is blanked.
            if b.get(i + 1) == Some(&b'\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                out.extend_from_slice(b"' '");
                i = j + 1;
            } else if b.get(i + 2) == Some(&b'\'') {
                out.extend_from_slice(b"' '");
                i += 3;
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).expect("sources are UTF-8")
}

/// Remove every item under `#[cfg(test)]` (its braces, or up to its `;`).
fn drop_test_items(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut from = 0;
    for item in test_items(text) {
        out.push_str(&text[from..item.start]);
        // Keep the line count so messages can point at lines.
        out.extend(text[item.clone()].chars().filter(|&c| c == '\n'));
        from = item.end;
    }
    out.push_str(&text[from..]);
    out
}

/// The byte ranges of the items under `#[cfg(test)]` in `text` (blanked: no brace of a comment
/// or a literal can mislead the count).
fn test_items(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut base = 0;
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        let item = &rest[at..];
        let b = item.as_bytes();
        let mut i = "#[cfg(test)]".len();
        while i < b.len() && b[i] != b'{' && b[i] != b';' {
            i += 1;
        }
        if i < b.len() && b[i] == b'{' {
            let mut depth = 0;
            while i < b.len() {
                match b[i] {
                    b'{' => depth += 1,
                    b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        let end = (i + 1).min(item.len());
        out.push(base + at..base + at + end);
        base += at + end;
        rest = &item[end..];
    }
    out
}

fn ident_at(s: &str, from: usize) -> &str {
    let end = s[from..]
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(s.len(), |e| from + e);
    &s[from..end]
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The first segments of the paths in a `{...}` use group starting at `open` (a `{`).
fn group_heads(s: &str, open: usize) -> Vec<String> {
    let b = s.as_bytes();
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut i = open;
    let mut expect_head = false;
    while i < b.len() {
        match b[i] {
            b'{' => {
                depth += 1;
                expect_head = depth == 1;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            b',' if depth == 1 => expect_head = true,
            c if expect_head && is_ident_byte(c) => {
                heads.push(ident_at(s, i).to_string());
                expect_head = false;
            }
            _ => {}
        }
        i += 1;
    }
    heads
}

/// The modules a cleaned source names through `crate::` and `super::` paths.
fn named_modules(code: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for prefix in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(prefix) {
            let start = from + at;
            from = start + prefix.len();
            if start > 0 && is_ident_byte(code.as_bytes()[start - 1]) {
                continue;
            }
            let heads = if code.as_bytes().get(from) == Some(&b'{') {
                group_heads(code, from)
            } else {
                vec![ident_at(code, from).to_string()]
            };
            found.extend(heads.into_iter().filter(|h| modules.contains(h)));
        }
    }
    found
}

/// Inherent impl blocks: (type name, body) for every `impl Type {` / `impl<..> Type<..> {`.
fn inherent_impls(code: &str) -> Vec<(String, String)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("impl") {
        let start = from + at;
        from = start + 4;
        if (start > 0 && is_ident_byte(b[start - 1]))
            || b.get(from).is_some_and(|&c| is_ident_byte(c))
        {
            continue;
        }
        let Some(open) = code[from..].find('{').map(|o| from + o) else {
            break;
        };
        let head = &code[from..open];
        if head.contains(" for ") || head.contains(';') || head.contains("fn ") {
            continue;
        }
        // Strip the impl's own generics, then take the type's name.
        let mut h = head.trim();
        if h.starts_with('<') {
            let mut depth = 0;
            let mut cut = 0;
            for (i, c) in h.char_indices() {
                match c {
                    '<' => depth += 1,
                    '>' => {
                        depth -= 1;
                        if depth == 0 {
                            cut = i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            h = h[cut..].trim();
        }
        let name = ident_at(h, 0).to_string();
        let mut depth = 0;
        let mut end = open;
        for (i, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((name, code[open..end].to_string()));
    }
    out
}

/// Names of the `fn`s at the top level of an impl body.
fn fns_of(body: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut depth = 0;
    let b = body.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b'f' if depth == 1
                && body[i..].starts_with("fn ")
                && (i == 0 || !is_ident_byte(b[i - 1])) =>
            {
                names.push(ident_at(body, i + 3).to_string());
            }
            _ => {}
        }
    }
    names
}

/// Every `fn NAME` in a cleaned source, with how often.
fn all_fns(code: &str, into: &mut BTreeMap<String, usize>) {
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("fn ") {
        let start = from + at;
        from = start + 3;
        if start > 0 && is_ident_byte(b[start - 1]) {
            continue;
        }
        *into.entry(ident_at(code, from).to_string()).or_default() += 1;
    }
}

/// Whether the struct whose `struct` keyword is at `at` is part of the public API (`pub
/// struct`, not `pub(crate) struct`).
fn public_struct(code: &str, at: usize) -> bool {
    let before = code[..at].trim_end();
    before.ends_with("pub")
        && !before[..before.len() - 3].ends_with(|c: char| is_ident_byte(c as u8))
}

/// Structs defined in a cleaned source and their fields visible to other rooms (see the
/// module doc for which count).
fn exposed_fields(code: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("struct ") {
        let start = from + at;
        from = start + 7;
        if start > 0 && is_ident_byte(code.as_bytes()[start - 1]) {
            continue;
        }
        let public = public_struct(code, start);
        let exposes = |vis: &str| !public || vis.starts_with("pub(");
        let name = ident_at(code, from).to_string();
        let rest = &code[from..];
        let (Some(open), semi) = (rest.find('{'), rest.find(';')) else {
            continue;
        };
        let paren = rest.find('(');
        if semi.is_some_and(|s| s < open) || paren.is_some_and(|p| p < open) {
            // A unit or tuple struct: `struct X(pub(crate) T);` counts too.
            if let (Some(p), Some(s)) = (paren, semi) {
                if p < s && rest[p..s].contains("pub") && (!public || rest[p..s].contains("pub(")) {
                    out.push((name, vec!["0".to_string()]));
                }
            }
            continue;
        }
        let mut depth = 0;
        let mut fields = Vec::new();
        let body = &rest[open..];
        let mut end = body.len();
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        for line in body[1..end].lines() {
            let t = line.trim_start();
            if let Some(after) = t.strip_prefix("pub").filter(|_| exposes(t)) {
                let after = after
                    .trim_start_matches("(crate)")
                    .trim_start_matches("(super)")
                    .trim_start();
                fields.push(ident_at(after, 0).to_string());
            }
        }
        if !fields.is_empty() {
            out.push((name, fields));
        }
    }
    out
}

/// The named fields of the structs in a cleaned source: (field, its type's text).
fn struct_fields(code: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("struct ") {
        let start = from + at;
        from = start + 7;
        if start > 0 && is_ident_byte(code.as_bytes()[start - 1]) {
            continue;
        }
        let rest = &code[from..];
        let Some(open) = rest.find('{') else { break };
        if rest[..open].contains(';') || rest[..open].contains('(') {
            continue;
        }
        let Some(close) = rest[open..].find("\n}") else {
            break;
        };
        for line in rest[open + 1..open + close].lines() {
            let t = line.trim_start();
            let t = t
                .strip_prefix("pub(crate) ")
                .or_else(|| t.strip_prefix("pub "))
                .unwrap_or(t);
            if let Some((name, ty)) = t.split_once(": ") {
                if name.chars().all(|ch| ch.is_ascii_lowercase() || ch == '_') {
                    out.push((name.to_string(), ty.trim_end_matches(',').to_string()));
                }
            }
        }
    }
    out
}

/// A cycle in `graph`, if any, as the list of modules along it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // 0 unseen, 1 on the path, 2 done.
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = path.iter().position(|p| p == m).expect("on the path");
                    let mut cycle = path[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, graph, state, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The groups of modules that reach each other (strongly connected, more than one module).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for m in graph.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for n in graph.keys() {
        if done.contains(n) || !reaches[n].contains(n) {
            continue;
        }
        let group: Vec<String> = graph
            .keys()
            .filter(|m| reaches[n].contains(*m) && reaches[*m].contains(n))
            .cloned()
            .collect();
        done.extend(group.iter().cloned());
        out.push(group);
    }
    out
}

/// Rooms in an order where every arrow points to an earlier one (lowest first), if acyclic.
fn layers(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut level: BTreeMap<String, usize> = BTreeMap::new();
    let mut changed = true;
    let mut rounds = 0;
    while changed && rounds <= graph.len() {
        changed = false;
        rounds += 1;
        for (n, deps) in graph {
            let l = deps
                .iter()
                .map(|d| level.get(d).map_or(1, |l| l + 1))
                .max()
                .unwrap_or(0);
            if level.get(n) != Some(&l) {
                level.insert(n.clone(), l);
                changed = true;
            }
        }
    }
    let mut out: Vec<Vec<String>> = Vec::new();
    for (n, l) in level {
        if out.len() <= l {
            out.resize(l + 1, Vec::new());
        }
        out[l].push(n);
    }
    out
}

struct Engine {
    /// Module -> modules it depends on.
    graph: BTreeMap<String, BTreeSet<String>>,
    /// Of those arrows, the ones found only through method calls: (from, to) -> a method.
    by_call: BTreeMap<(String, String), String>,
    /// Struct -> (module, exposed fields).
    exposed: Vec<(String, String, Vec<String>)>,
    /// Module -> non-blank lines of code that ships, comments included (test items left out).
    lines: BTreeMap<String, usize>,
}

fn engine() -> Engine {
    // HC_ENGINE_SRC draws another tree's graph (an older commit's, checked out elsewhere).
    let dir = std::env::var_os("HC_ENGINE_SRC")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let mut code = BTreeMap::new();
    let mut shipped = BTreeMap::new();
    for e in std::fs::read_dir(&dir).expect("engine src") {
        let p = e.expect("dir entry").path();
        if p.extension().is_some_and(|x| x == "rs") {
            let name = p.file_stem().unwrap().to_string_lossy().to_string();
            let src = std::fs::read_to_string(&p).expect("read source");
            shipped.insert(name.clone(), shipped_lines(&src));
            code.insert(name, clean(&src));
        }
    }
    assert!(
        code.len() > 5,
        "found the engine's sources in {}",
        dir.display()
    );
    code.remove("lib");
    let modules: BTreeSet<String> = code.keys().cloned().collect();

    let mut fn_count = BTreeMap::new();
    for c in code.values() {
        all_fns(c, &mut fn_count);
    }
    // Which struct is defined where.
    let mut defined_in = BTreeMap::new();
    for (m, c) in &code {
        let mut from = 0;
        while let Some(at) = c[from..].find("struct ") {
            let s = from + at;
            from = s + 7;
            if s == 0 || !is_ident_byte(c.as_bytes()[s - 1]) {
                defined_in.insert(ident_at(c, from).to_string(), m.clone());
            }
        }
    }
    // Methods, by the file of their impl block: method name -> that file (for names defined
    // once in the crate, in impls away from their struct), and (struct, method) -> that file
    // (for `self.name(` inside the struct's own impls, and `.field.name(` on a field of that
    // struct's type).
    let mut foreign_methods = BTreeMap::new();
    let mut methods_of: BTreeMap<(String, String), String> = BTreeMap::new();
    for (m, c) in &code {
        for (ty, body) in inherent_impls(c) {
            if !defined_in.contains_key(&ty) {
                continue;
            }
            let foreign = defined_in.get(&ty).is_some_and(|d| d != m);
            for f in fns_of(&body) {
                // Only for impls away from their struct: a name defined once may still be a
                // std method's (`.len(`), so it is trusted only where the complaint is.
                if foreign && fn_count.get(&f) == Some(&1) {
                    foreign_methods.insert(f.clone(), m.clone());
                }
                methods_of.insert((ty.clone(), f), m.clone());
            }
        }
    }

    // Fields whose type is one of the engine's structs (`lines: Lines`, `persist:
    // Option<Persist>`): field name -> struct. A name used for fields of two types is skipped.
    let mut field_types: BTreeMap<String, String> = BTreeMap::new();
    let mut ambiguous = BTreeSet::new();
    for c in code.values() {
        for (name, ty) in struct_fields(c) {
            let name = name.as_str();
            let Some(st) = ty
                .split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                .find(|w| defined_in.contains_key(*w))
            else {
                continue;
            };
            match field_types.get(name) {
                Some(prev) if prev != st => {
                    ambiguous.insert(name.to_string());
                }
                _ => {
                    field_types.insert(name.to_string(), st.to_string());
                }
            }
        }
    }
    for a in &ambiguous {
        field_types.remove(a);
    }
    let mut graph = BTreeMap::new();
    let mut by_call = BTreeMap::new();
    let mut exposed = Vec::new();
    let mut lines = BTreeMap::new();
    for (m, c) in &code {
        let mut deps = named_modules(c, &modules);
        for (f, home) in &foreign_methods {
            if home != m && !deps.contains(home) && c.contains(&format!(".{f}(")) {
                deps.insert(home.clone());
                by_call.insert((m.clone(), home.clone()), f.clone());
            }
        }
        // `.field.f(`: a method of the struct the field holds (a room reached through the
        // holder's field).
        for (field, ty) in &field_types {
            for ((t, f), home) in &methods_of {
                if t == ty
                    && home != m
                    && !deps.contains(home)
                    && c.contains(&format!(".{field}.{f}("))
                {
                    deps.insert(home.clone());
                    by_call.insert((m.clone(), home.clone()), f.clone());
                }
            }
        }
        // Inside `impl T`, `self.f(` is T's own method, wherever it is defined.
        for (ty, body) in inherent_impls(c) {
            for ((t, f), home) in &methods_of {
                if *t == ty
                    && home != m
                    && !deps.contains(home)
                    && body.contains(&format!("self.{f}("))
                {
                    deps.insert(home.clone());
                    by_call.insert((m.clone(), home.clone()), f.clone());
                }
            }
        }
        deps.remove(m);
        graph.insert(m.clone(), deps);
        for (s, fields) in exposed_fields(c) {
            exposed.push((s, m.clone(), fields));
        }
        lines.insert(m.clone(), shipped[m]);
    }
    Engine {
        graph,
        by_call,
        exposed,
        lines,
    }
}

fn print_graph(e: &Engine) {
    println!("engine module graph (a -> b: a depends on b; '~b(f)' marks an arrow made only by");
    println!("calls to b's method f; [n] = non-blank lines that ship, comments included):");
    for (m, deps) in &e.graph {
        let deps: Vec<String> = deps
            .iter()
            .map(|d| match e.by_call.get(&(m.clone(), d.clone())) {
                Some(f) => format!("~{d}({f})"),
                None => d.clone(),
            })
            .collect();
        println!("  {m} [{}] -> {}", e.lines[m], deps.join(", "));
    }
}

#[test]
fn the_engine_module_graph_has_no_cycle() {
    let e = engine();
    print_graph(&e);
    match find_cycle(&e.graph) {
        Some(cycle) => panic!(
            "the engine's modules depend on each other in a circle: {}\n\
             (each arrow: the left file names the right one, or calls a method it defines)\n\
             modules caught in circles (each group reaches every other member): {}",
            cycle.join(" -> "),
            circles(&e.graph)
                .iter()
                .map(|c| format!("{{{}}}", c.join(", ")))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        None => {
            println!("layers, lowest first (a room depends only on rooms of lower layers):");
            for (i, l) in layers(&e.graph).iter().enumerate() {
                println!("  {i}: {}", l.join(" "));
            }
        }
    }
}

#[test]
fn no_room_exposes_its_fields() {
    let e = engine();
    let listed = |s: &str| NOT_YET_PRIVATE.iter().any(|(n, _)| *n == s);
    let exposing: Vec<&(String, String, Vec<String>)> = e
        .exposed
        .iter()
        .filter(|(s, _, _)| !VALUE_RECORDS.contains(&s.as_str()))
        .collect();
    println!("structs that still expose fields (NOT_YET_PRIVATE):");
    for (s, m, f) in exposing.iter().filter(|(s, _, _)| listed(s)) {
        println!("  {m}.rs: {s} {{ {} }}", f.join(", "));
    }
    let offenders: Vec<String> = exposing
        .iter()
        .filter(|(s, _, _)| !listed(s))
        .map(|(s, m, f)| format!("{m}.rs: {s} {{ {} }}", f.join(", ")))
        .collect();
    assert!(
        offenders.is_empty(),
        "structs of the engine expose fields to other rooms (make them private and give the \
         room methods, or, for a plain value handed between rooms, add it to VALUE_RECORDS with \
         why):\n  {}",
        offenders.join("\n  ")
    );
    let private_now: Vec<&str> = NOT_YET_PRIVATE
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| !exposing.iter().any(|(s, _, _)| s == n))
        .collect();
    assert!(
        private_now.is_empty(),
        "these structs no longer expose fields: take them off NOT_YET_PRIVATE: {private_now:?}"
    );
}

/// Most non-blank lines of shipped code (comments included, test items left out) in one engine
/// file: the "no file over about 900 lines of non-test code".
const MAX_FILE_LINES: usize = 900;

#[test]
fn no_engine_file_is_too_long() {
    let e = engine();
    let long: Vec<String> = e
        .lines
        .iter()
        .filter(|(_, &n)| n > MAX_FILE_LINES)
        .map(|(m, n)| format!("{m}.rs: {n}"))
        .collect();
    assert!(
        long.is_empty(),
        "engine files over {MAX_FILE_LINES} non-blank lines of shipped code, comments included \
         (split them by what their parts own): {}",
        long.join(", ")
    );
}

#[test]
fn the_parser_sees_what_it_must() {
    let modules: BTreeSet<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    let code = clean(
        "use crate::{a::X, b::{Y, Z}};\n// crate::c in a comment\nlet s = \"crate::c\";\n\
         fn f() { super::d::g() }\n#[cfg(test)]\nmod tests { use crate::c; }\n",
    );
    let want: BTreeSet<String> = ["a", "b", "d"].iter().map(|s| s.to_string()).collect();
    assert_eq!(named_modules(&code, &modules), want);
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    assert!(find_cycle(&g).is_some());
    g.insert("b".to_string(), BTreeSet::new());
    assert!(find_cycle(&g).is_none());
    let s = clean("pub(crate) struct S<'a> {\n    pub(crate) x: &'a u8,\n    y: u8,\n}\n");
    assert_eq!(
        exposed_fields(&s),
        vec![("S".to_string(), vec!["x".to_string()])]
    );
    // Comments count, test items do not, whatever braces their literals hold.
    assert_eq!(
        shipped_lines(
            "//! doc\nfn a() {}\n\n#[cfg(test)]\nmod t {\n    // x\n    const S: &str = \"}\";\n}\nfn b() {}\n"
        ),
        3
    );
    let i = inherent_impls("impl<'a> Holder<'a> {\n fn one(&self) {}\n fn two() { {} }\n}");
    assert_eq!(i[0].0, "Holder");
    assert_eq!(fns_of(&i[0].1), vec!["one", "two"]);
}
