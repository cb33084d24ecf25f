//! The layering rule of `docs/architecture.md`, checked on the source: every `crate::` path in
//! `src/` (in `use` items and in code) may name only the modules its own module is allowed to
//! import, and no two modules import each other, directly or through others. A violation
//! fails with the file, the line and the rule it breaks, so that the layers cannot rot.
//!
//! Layers, from the bottom: values and errors (`value`, `buffer`, `tensor`, `error`, with the
//! loom switch `sync`) → communicators (`comm`, a service beside the values) → graph
//! description (`dag`) → compilation (`compile`) → runtime (`channel`, `cluster`, `actor`) →
//! driver (`exec`). Inside the runtime, `channel` and `cluster` know nothing of graphs: they
//! import values only.
//!
//! Unit tests (`*tests.rs` files and `#[cfg(test)] mod` blocks) are not read: a test of a
//! lower layer may build its inputs with a higher one.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What each top-level module of `src/` may import (besides itself).
fn allowed(module: &str) -> Option<&'static [&'static str]> {
    const VALUES: &[&str] = &["sync", "clock", "value", "buffer", "tensor", "error"];
    Some(match module {
        "sync" | "clock" => &[],
        "error" => &["value"],
        "value" => &["sync", "error"],
        "buffer" => &["value", "error"],
        "tensor" => &["value", "buffer", "error"],
        "comm" => VALUES,
        "dag" => &[
            "sync", "clock", "value", "buffer", "tensor", "error", "comm",
        ],
        "compile" => &[
            "sync", "clock", "value", "buffer", "tensor", "error", "comm", "dag",
        ],
        "channel" => VALUES,
        "cluster" => VALUES,
        "actor" => &[
            "sync", "clock", "value", "buffer", "tensor", "error", "comm", "dag", "compile",
            "channel", "cluster",
        ],
        "exec" => &[
            "sync", "clock", "value", "buffer", "tensor", "error", "comm", "dag", "compile",
            "channel", "cluster", "actor",
        ],
        // The crate root re-exports everything.
        "lib" => return None,
        _ => return Some(&[]),
    })
}

/// Modules of the channel kinds: only the place that opens channels by kind may name them,
/// so that the executor and the driver see channels through the trait alone.
const KIND_MODULES: &[&str] = &["channel::local", "channel::shm"];
const KIND_OPENERS: &[&str] = &["src/actor/channels.rs", "src/channel/"];

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rs_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`lib` for the crate root).
fn module_of(rel: &str) -> String {
    let rest = rel.trim_start_matches("src/");
    let first = rest.split('/').next().unwrap_or(rest);
    first.trim_end_matches(".rs").to_string()
}

/// The source without comments and string literals, line by line (so that doc comments and
/// messages that mention a path do not count).
fn code_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_block = 0usize;
    for raw in text.lines() {
        let mut out = String::new();
        let chars: Vec<char> = raw.chars().collect();
        let mut i = 0;
        let mut in_str = false;
        while i < chars.len() {
            let c = chars[i];
            let next = chars.get(i + 1).copied();
            if in_block > 0 {
                if c == '*' && next == Some('/') {
                    in_block -= 1;
                    i += 2;
                } else if c == '/' && next == Some('*') {
                    in_block += 1;
                    i += 2;
                } else {
                    i += 1;
                }
                continue;
            }
            if in_str {
                if c == '\\' {
                    i += 2;
                    continue;
                }
                if c == '"' {
                    in_str = false;
                }
                i += 1;
                continue;
            }
            if c == '/' && next == Some('/') {
                break;
            }
            if c == '/' && next == Some('*') {
                in_block += 1;
                i += 2;
                continue;
            }
            if c == '"' {
                in_str = true;
                out.push(' ');
                i += 1;
                continue;
            }
            out.push(c);
            i += 1;
        }
        lines.push(out);
    }
    lines
}

/// The modules a line of code names through `crate::`: the module after `crate::`, or, for a
/// `use crate::{a, b::c}` group, each group member's first segment. Names the crate root
/// re-exports (`crate::Buffer`) resolve through `reexports`. Each comes with its full path
/// up to the second segment (for the kind rule).
fn crate_paths(code: &str, reexports: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `$crate::`, `adag_crate::` and the like
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for member in group[..end].split(',') {
                let member = member.trim();
                if !member.is_empty() {
                    found.push(resolve(member, reexports));
                }
            }
        } else {
            found.push(resolve(rest, reexports));
        }
    }
    found
}

fn resolve(path: &str, reexports: &BTreeMap<String, String>) -> (String, String) {
    // A module's own name wins over a re-export of the same name (`adag_macros::actor`).
    let segs: Vec<&str> = path
        .split("::")
        .map(|s| {
            s.trim()
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
                .unwrap_or("")
        })
        .collect();
    let first = segs.first().copied().unwrap_or("").to_string();
    let is_module = first.chars().next().is_some_and(|c| c.is_lowercase())
        && reexports.get(&first).is_none_or(|m| m == "adag_macros");
    let module = if is_module {
        first.clone()
    } else {
        reexports.get(&first).cloned().unwrap_or(first.clone())
    };
    let full = match segs.get(1) {
        Some(second) if !second.is_empty() => format!("{module}::{second}"),
        _ => module.clone(),
    };
    (module, full)
}

/// Names the crate root re-exports, and the module each comes from (`pub use x::...`).
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let code = code_lines(lib).join("\n");
    for item in code.split(';') {
        let item = item.trim();
        let Some(path) = item.strip_prefix("pub use ") else {
            continue;
        };
        let module = path.split("::").next().unwrap_or("").trim().to_string();
        let names = match (path.find('{'), path.rfind('}')) {
            (Some(a), Some(b)) => path[a + 1..b].to_string(),
            _ => path.rsplit("::").next().unwrap_or("").to_string(),
        };
        for name in names.split(',') {
            let name = name.trim();
            let name = name.rsplit(" as ").next().unwrap_or(name);
            let name = name.rsplit("::").next().unwrap_or(name).trim();
            if !name.is_empty() {
                map.insert(name.to_string(), module.clone());
            }
        }
    }
    map
}

struct Violation {
    at: String,
    text: String,
    why: String,
}

fn check(root: &Path) -> (Vec<Violation>, BTreeMap<String, BTreeSet<String>>) {
    let src = root.join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    files.sort();
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read src/lib.rs");
    let reexports = root_reexports(&lib);
    let mut violations = Vec::new();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in files {
        let rel = path
            .strip_prefix(root)
            .expect("a file under the root")
            .to_string_lossy()
            .replace('\\', "/");
        let module = module_of(&rel);
        if rel.ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read a source file");
        let raw: Vec<&str> = text.lines().collect();
        // `use crate::{...}` groups may span lines: join each `use` item before reading it.
        let lines = code_outside_tests(&text);
        let mut i = 0;
        while i < lines.len() {
            let start = i;
            let mut code = lines[i].clone();
            if code.trim_start().starts_with("use ")
                || code.trim_start().starts_with("pub use ")
                || code.trim_start().starts_with("pub(crate) use ")
            {
                while !code.contains(';') && i + 1 < lines.len() {
                    i += 1;
                    code.push_str(&lines[i]);
                }
            }
            i += 1;
            for (target, full) in crate_paths(&code, &reexports) {
                if target == module || target.is_empty() || target == "__private" {
                    continue;
                }
                if module != "lib" {
                    graph
                        .entry(module.clone())
                        .or_default()
                        .insert(target.clone());
                }
                let at = format!("{rel}:{}", start + 1);
                let text = raw.get(start).copied().unwrap_or("").trim().to_string();
                match allowed(&module) {
                    Some(ok) if !ok.contains(&target.as_str()) => violations.push(Violation {
                        at,
                        text,
                        why: format!(
                            "module `{module}` may import only {ok:?}, not `{target}`; move the code to the layer that owns it, or invert the dependency (a trait or plain data in the lower layer)"
                        ),
                    }),
                    _ => {
                        if KIND_MODULES.contains(&full.as_str())
                            && !KIND_OPENERS.iter().any(|o| rel.starts_with(o))
                        {
                            violations.push(Violation {
                                at,
                                text,
                                why: format!(
                                    "`{full}` is a channel kind: only src/actor/channels.rs opens channels by kind; use the ChannelWriter/ChannelReader traits"
                                ),
                            });
                        }
                    }
                }
            }
        }
    }
    (violations, graph)
}

/// Lines of code, comments and strings removed, with the lines of unit-test modules
/// (`#[cfg(test)] mod ... { ... }`) left empty, so that line numbers stay.
fn code_outside_tests(text: &str) -> Vec<String> {
    let mut lines = code_lines(text);
    let mut i = 0;
    let mut test_attr = false;
    while i < lines.len() {
        let trimmed = lines[i].trim();
        if trimmed.starts_with("#[cfg(") && trimmed.contains("test") {
            test_attr = true;
            i += 1;
            continue;
        }
        if test_attr && trimmed.contains("mod ") && trimmed.contains('{') {
            // Blank the test module: up to its closing brace.
            let mut depth = 0i64;
            loop {
                depth += lines[i].matches('{').count() as i64;
                depth -= lines[i].matches('}').count() as i64;
                lines[i].clear();
                i += 1;
                if depth <= 0 || i >= lines.len() {
                    break;
                }
            }
            test_attr = false;
            continue;
        }
        if !trimmed.is_empty() && !trimmed.starts_with("#[") {
            test_attr = false;
        }
        i += 1;
    }
    lines
}

/// Inside each folder of `src/`, which file imports which of its siblings (`super::x`, or
/// `crate::folder::x`), by path: `src/actor/host.rs` -> `src/actor/call.rs`. A folder's
/// `mod.rs` is its door (shared types, re-exports): it is neither counted nor counts.
fn sibling_graph(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let src = root.join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    files.sort();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in files {
        let stem = path
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let Some(dir) = path.parent() else { continue };
        if stem == "mod" || stem.ends_with("tests") || dir == src {
            continue;
        }
        // The folder's modules: its other files and its subfolders.
        let siblings: BTreeMap<String, String> = std::fs::read_dir(dir)
            .expect("read a folder of src/")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter_map(|p| {
                let name = p.file_stem()?.to_string_lossy().to_string();
                let is_module = p.is_dir() || p.extension().is_some_and(|e| e == "rs");
                let target = if p.is_dir() {
                    p.join("mod.rs")
                } else {
                    p.clone()
                };
                (is_module && name != "mod" && name != stem && target.exists()).then(|| {
                    let rel = target.strip_prefix(root).unwrap_or(&target);
                    (name, rel.to_string_lossy().replace('\\', "/"))
                })
            })
            .collect();
        let folder = dir
            .strip_prefix(&src)
            .unwrap_or(dir)
            .to_string_lossy()
            .replace('\\', "/")
            .replace('/', "::");
        let prefixes = [String::from("super::"), format!("crate::{folder}::")];
        let rel = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(&path).expect("read a source file");
        let code = code_outside_tests(&text).join("\n");
        for prefix in &prefixes {
            let mut rest = code.as_str();
            while let Some(at) = rest.find(prefix.as_str()) {
                let before = rest[..at].chars().last();
                rest = &rest[at + prefix.len()..];
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                // `super::x::...` or a group `super::{x::..., y, ...}` (members' first names).
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(group) => group[..group.find('}').unwrap_or(group.len())]
                        .split(',')
                        .map(str::trim)
                        .collect(),
                    None => vec![rest],
                };
                for name in names {
                    let first = name
                        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .next()
                        .unwrap_or("");
                    if let Some(target) = siblings.get(first) {
                        graph.entry(rel.clone()).or_default().insert(target.clone());
                    }
                }
            }
        }
    }
    graph
}

/// A cycle in the module graph, if any, as a path that returns to its start.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(c) = visit(node, graph, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn imports_point_one_way() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (violations, graph) = check(root);
    let report: Vec<String> = violations
        .iter()
        .map(|v| format!("{}: `{}`\n    {}", v.at, v.text, v.why))
        .collect();
    assert!(
        violations.is_empty(),
        "{} forbidden import(s) (docs/architecture.md):\n{}",
        violations.len(),
        report.join("\n")
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "modules import each other in a circle: {}",
            cycle.join(" -> ")
        );
    }
    // The check reads what it should: the graph has the layers' arrows.
    assert!(graph["exec"].contains("actor"), "{graph:?}");
    assert!(graph["compile"].contains("dag"), "{graph:?}");
}

/// Inside a folder too, files import one way: a circle of files (`host.rs` needs `worker.rs`
/// needs `host.rs`) is one concept split over files, or two concepts tangled.
#[test]
fn files_of_a_folder_import_one_way() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let graph = sibling_graph(root);
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "files of one folder import each other in a circle: {}; move what both need into a file below them both, or invert the dependency (a trait)",
            cycle.join(" -> ")
        );
    }
    // The check reads what it should: known arrows inside the folders are there.
    assert!(
        graph["src/actor/host.rs"].contains("src/actor/call.rs"),
        "{graph:?}"
    );
    assert!(
        graph["src/exec/gather.rs"].contains("src/exec/refs.rs"),
        "{graph:?}"
    );
}

/// The checker itself catches what it must: a forbidden import in a `use` group spread over
/// lines, a path in code, a root re-export, a channel kind named outside its opener, and a
/// circle; and it ignores comments and strings.
#[test]
fn the_checker_finds_what_it_must() {
    let dir = std::env::temp_dir().join(format!("adag-layering-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src/dag")).unwrap();
    std::fs::create_dir_all(dir.join("src/channel")).unwrap();
    std::fs::create_dir_all(dir.join("src/exec")).unwrap();
    std::fs::write(
        dir.join("src/lib.rs"),
        "pub use exec::{CompiledGraph, get_all};\npub use value::Value;\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("src/dag/mod.rs"),
        "//! crate::exec is named in a comment\nuse crate::{\n    value::Value,\n    exec::Thing,\n};\nfn f() { let s = \"crate::actor::X\"; crate::CompiledGraph::new(); }\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("src/channel/mod.rs"),
        "use crate::compile::plan::GraphPlan;\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("src/exec/mod.rs"),
        "use crate::channel::shm::ShmTx;\nuse crate::dag::Node;\n",
    )
    .unwrap();
    let (violations, graph) = check(&dir);
    let at: Vec<&str> = violations.iter().map(|v| v.at.as_str()).collect();
    assert_eq!(
        at,
        [
            "src/channel/mod.rs:1",
            "src/dag/mod.rs:2",
            "src/dag/mod.rs:6",
            "src/exec/mod.rs:1"
        ],
        "{:?}",
        violations.iter().map(|v| &v.why).collect::<Vec<_>>()
    );
    let cycle = find_cycle(&graph).expect("dag -> exec -> dag is a circle");
    assert!(cycle.contains(&"dag".to_string()) && cycle.contains(&"exec".to_string()));
    // Files of one folder: a -> b through a `super::` group spread over lines, b -> a through
    // a `crate::` path in code; a mention in a comment and a test module do not count.
    std::fs::write(
        dir.join("src/exec/a.rs"),
        "use super::{\n    b::B,\n    Other,\n};\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("src/exec/b.rs"),
        "// super::c::C\nfn f() { crate::exec::a::g(); }\n#[cfg(test)]\nmod tests {\n    use super::super::c;\n}\n",
    )
    .unwrap();
    std::fs::write(dir.join("src/exec/c.rs"), "use super::a::A;\n").unwrap();
    let files = sibling_graph(&dir);
    assert_eq!(
        files.get("src/exec/b.rs"),
        Some(&BTreeSet::from(["src/exec/a.rs".to_string()])),
        "{files:?}"
    );
    let cycle = find_cycle(&files).expect("a -> b -> a is a circle");
    assert!(cycle.contains(&"src/exec/a.rs".to_string()), "{cycle:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
