//! The invariants ARCHITECTURE.md states, checked over the library crates' sources: no module
//! imports another that imports it back (directly or around a loop), no library function
//! longer than a reader can hold, and no library message that names one of the `flatpipe`
//! command's flags (the libraries name their fields; the command line maps fields to flags).

use petgraph::algo::tarjan_scc;
use petgraph::graphmap::DiGraphMap;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The library crates: (crate directory, source root).
pub(crate) const LIBRARIES: [&str; 5] = ["profiles", "simulator", "planner", "executor", "python"];

/// The longest a library function may be, in lines from `fn` to its closing brace.
const MAX_FUNCTION_LINES: usize = 150;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, sorted.
pub(crate) fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The library's `.rs` files under `src`, sorted: every file but the unit-test files, those a
/// parent declares as `#[cfg(test)] mod name;` (`name.rs` or `name/mod.rs` beside the parent's
/// own module) and every file under them.
fn library_files(src: &Path) -> Vec<PathBuf> {
    let files = rust_files(src);
    let mut tests: Vec<PathBuf> = vec![];
    for file in &files {
        let own_dir = match file.file_stem().and_then(|s| s.to_str()) {
            Some("lib" | "mod" | "main") => file.parent().unwrap().to_path_buf(),
            _ => file.with_extension(""),
        };
        let text = std::fs::read_to_string(file).unwrap();
        let mut lines = text.lines().map(str::trim).peekable();
        while let Some(l) = lines.next() {
            if l.starts_with("#[cfg(test)]")
                && let Some(name) = lines
                    .peek()
                    .and_then(|n| n.strip_prefix("mod "))
                    .and_then(|n| n.strip_suffix(';'))
            {
                tests.push(own_dir.join(name.trim()));
            }
        }
    }
    files
        .into_iter()
        .filter(|f| {
            !tests
                .iter()
                .any(|t| f.with_extension("") == *t || f.starts_with(t))
        })
        .collect()
}

/// The module path of a source file relative to its crate's `src/`: `lib.rs` is the root
/// (`[]`), `a.rs` and `a/mod.rs` are `[a]`, `a/b.rs` is `[a, b]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("lib" | "mod" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The file's code without its unit tests (`#[cfg(test)] mod tests` to the end, by the house
/// layout) and without comment lines.
pub(crate) fn code_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = vec![];
    let mut lines = text.lines().enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        let l = line.trim_start();
        if l.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|(_, n)| n.trim_start().starts_with("mod tests"))
        {
            break;
        }
        if !l.starts_with("//") {
            out.push((i + 1, line));
        }
    }
    out
}

/// Expands a `use` tree's text (`{a::b, c::{d, e}}` or `a::b`) into its full paths.
fn expand_use_tree(prefix: &[String], text: &str, out: &mut Vec<Vec<String>>) {
    let text = text.trim();
    if let Some(inner) = text.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
        // Split at top-level commas.
        let (mut depth, mut start) = (0, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand_use_tree(prefix, &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand_use_tree(prefix, &inner[start..], out);
        return;
    }
    if text.is_empty() {
        return;
    }
    match text.find("::") {
        Some(k) if !text[..k].contains('{') => {
            let mut p = prefix.to_vec();
            p.push(text[..k].trim().to_string());
            expand_use_tree(&p, &text[k + 2..], out);
        }
        _ => {
            let mut p = prefix.to_vec();
            let name = text.split(" as ").next().unwrap().trim();
            if name != "*" && name != "self" {
                p.push(name.to_string());
            }
            out.push(p);
        }
    }
}

/// The paths a file names through `crate::` or `super::`, resolved to absolute module paths.
fn referenced_paths(module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = vec![];
    // `super` of a file `a/b.rs` (module a::b) is `a`; of `a/mod.rs` (module a) it is the root.
    let parent: Vec<String> = module[..module.len().saturating_sub(1)].to_vec();
    for (anchor, base) in [("crate::", Vec::new()), ("super::", parent)] {
        let mut rest = code;
        while let Some(k) = rest.find(anchor) {
            let before = rest[..k].chars().last();
            rest = &rest[k + anchor.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            // The path or use tree that follows: up to the end of its braces, or of the path.
            let mut depth = 0;
            let mut end = rest.len();
            for (i, c) in rest.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth > 0 => depth -= 1,
                    c if depth == 0 && !(c.is_alphanumeric() || c == '_' || c == ':') => {
                        end = i;
                        break;
                    }
                    _ => {}
                }
                if depth == 0 && c == '}' {
                    end = i + 1;
                    break;
                }
            }
            expand_use_tree(&base, &rest[..end], &mut out);
        }
    }
    out
}

/// A crate's module graph from its `src/` folder, at every level of the module tree: when
/// module a's code names module b (or an item in b) and neither contains the other, the edge
/// joins the two children of their closest common ancestor (`run::step -> batching::policy`
/// is the edge `run -> batching`; `run::step -> run::config` is itself), so a cycle between
/// two folders counts as well as one between two files.
fn module_graph(src: &Path) -> BTreeSet<(Vec<String>, Vec<String>)> {
    let files = library_files(src);
    let modules: Vec<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let mut edges = BTreeSet::new();
    for (a, file) in files.iter().enumerate() {
        let text = std::fs::read_to_string(file).unwrap();
        let code: String = code_lines(&text)
            .into_iter()
            .map(|(_, l)| format!("{l}\n"))
            .collect::<String>();
        for path in referenced_paths(&modules[a], &code) {
            // The longest module that prefixes the path.
            let Some(b) = (0..modules.len())
                .filter(|&b| path.starts_with(&modules[b]))
                .max_by_key(|&b| modules[b].len())
            else {
                continue;
            };
            let (ma, mb) = (&modules[a], &modules[b]);
            if ma.starts_with(mb) || mb.starts_with(ma) {
                continue;
            }
            let c = ma.iter().zip(mb).take_while(|(x, y)| x == y).count();
            edges.insert((ma[..=c].to_vec(), mb[..=c].to_vec()));
        }
    }
    edges
}

/// The strongly connected components of more than one module: each is a cycle of imports,
/// written as its edges.
fn module_cycles(krate: &str, src: &Path) -> Vec<String> {
    let edges = module_graph(src);
    let nodes: Vec<&Vec<String>> = edges
        .iter()
        .flat_map(|(a, b)| [a, b])
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let id = |m: &Vec<String>| nodes.binary_search(&m).unwrap();
    let graph: DiGraphMap<usize, ()> = edges.iter().map(|(a, b)| (id(a), id(b), ())).collect();
    let name = |m: &Vec<String>| format!("{krate}::{}", m.join("::"));
    tarjan_scc(&graph)
        .into_iter()
        .filter(|scc| scc.len() > 1)
        .map(|scc| {
            let set: BTreeSet<usize> = scc.into_iter().collect();
            let inner: Vec<String> = edges
                .iter()
                .filter(|(a, b)| set.contains(&id(a)) && set.contains(&id(b)))
                .map(|(a, b)| format!("{} -> {}", name(a), name(b)))
                .collect();
            inner.join(", ")
        })
        .collect()
}

#[test]
fn the_checker_finds_use_trees_and_cycles() {
    // The use-tree expansion, by hand.
    let mut out = vec![];
    expand_use_tree(
        &[],
        "{ir::{Action, sub::X}, costs::CostModel as C, Result}",
        &mut out,
    );
    let want: Vec<Vec<String>> = [
        vec!["ir", "Action"],
        vec!["ir", "sub", "X"],
        vec!["costs", "CostModel"],
        vec!["Result"],
    ]
    .iter()
    .map(|v| v.iter().map(|s| s.to_string()).collect())
    .collect();
    assert_eq!(out, want);
    let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let got = referenced_paths(
        &m("run::step"),
        "use super::montecarlo::X;\nlet y = crate::ir::Rank(0);\nfoo::crate::z",
    );
    assert_eq!(got, vec![m("ir::Rank"), m("run::montecarlo::X")]);
    // A planted cycle is found: a -> b -> a, through a temporary crate layout.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("b")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\n").unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::c::Y;\n").unwrap();
    std::fs::write(src.join("b/mod.rs"), "mod c;\n").unwrap();
    std::fs::write(src.join("b/c.rs"), "use crate::{a::X};\n").unwrap();
    let files = rust_files(&src);
    let modules: Vec<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    assert_eq!(modules, vec![m("a"), m("b::c"), m("b"), vec![]]);
    let cycles = module_cycles("t", &src);
    assert_eq!(cycles.len(), 1, "{cycles:?}");
    // a -> b::c is the edge a -> b (the folders' level): the cycle is a <-> b.
    assert_eq!(cycles[0], "t::a -> t::b, t::b -> t::a");
    // Without the back edge, none.
    std::fs::write(
        src.join("b/c.rs"),
        "use super::super::Z;
",
    )
    .unwrap();
    assert!(module_cycles("t", &src).is_empty());
    // A unit-test file's imports are no edge: b's tests may use a while a uses b.
    std::fs::write(src.join("b/mod.rs"), "mod c;\n#[cfg(test)]\nmod tests;\n").unwrap();
    std::fs::write(src.join("b/tests.rs"), "use crate::a::X;\n").unwrap();
    assert!(module_cycles("t", &src).is_empty());
    std::fs::write(src.join("b/mod.rs"), "mod c;\nmod tests;\n").unwrap();
    assert_eq!(module_cycles("t", &src).len(), 1);
}

#[test]
fn no_module_cycles_in_the_library_crates() {
    let cycles: Vec<String> = LIBRARIES
        .iter()
        .flat_map(|k| module_cycles(k, &root().join(k).join("src")))
        .collect();
    assert!(
        cycles.is_empty(),
        "module import cycles (each line one cycle's edges):\n{}",
        cycles.join("\n")
    );
}

/// `(function, lines)` of every function in a file's text, from `fn` to the closing brace at
/// the same indentation (rustfmt's layout); unit tests and bodiless declarations excluded.
fn function_lengths_in(text: &str) -> Vec<(String, usize)> {
    let lines = code_lines(text);
    let mut out = vec![];
    for (k, &(start, line)) in lines.iter().enumerate() {
        let l = line.trim_start();
        let Some(name) = fn_name(l) else { continue };
        let close = format!("{}}}", &line[..line.len() - l.len()]);
        if l.contains('{') && l.trim_end().ends_with('}') {
            out.push((name.to_string(), 1));
            continue;
        }
        let mut opened = false;
        for &(end, x) in &lines[k..] {
            if opened && x.starts_with(&close) {
                out.push((name.to_string(), end - start + 1));
                break;
            }
            opened |= x.contains('{');
            if !opened && x.trim_end().ends_with(';') {
                break;
            }
        }
    }
    out
}

/// `(file, function, lines)` of every library function.
fn function_lengths() -> Vec<(String, String, usize)> {
    let mut out = vec![];
    for krate in LIBRARIES {
        for file in library_files(&root().join(krate).join("src")) {
            let rel = file.strip_prefix(root()).unwrap().display().to_string();
            let text = std::fs::read_to_string(&file).unwrap();
            for (name, lines) in function_lengths_in(&text) {
                out.push((rel.clone(), name, lines));
            }
        }
    }
    out
}

/// The name in a line that starts a function item (`pub(crate) async fn name<..>(`).
fn fn_name(line: &str) -> Option<&str> {
    let mut l = line;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
        "extern \"C\" ",
    ] {
        l = l.strip_prefix(prefix).unwrap_or(l);
    }
    let rest = l.strip_prefix("fn ")?;
    let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_'))?;
    Some(&rest[..end])
}

#[test]
fn library_functions_fit_on_a_screen_or_two() {
    let over: Vec<String> = function_lengths()
        .into_iter()
        .filter(|(_, _, lines)| *lines > MAX_FUNCTION_LINES)
        .map(|(file, name, lines)| format!("{file}: fn {name} is {lines} lines"))
        .collect();
    assert!(
        over.is_empty(),
        "library functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n{}",
        over.join("\n")
    );
}

/// The longest a file of the command line (`src/cli/`) may be, in lines.
const MAX_CLI_FILE_LINES: usize = 500;

/// The command line reads as the libraries do: each subcommand resolves, calls the library and
/// renders in functions of at most [`MAX_FUNCTION_LINES`] lines, in files of at most
/// [`MAX_CLI_FILE_LINES`].
#[test]
fn the_command_line_fits_on_a_screen_or_two() {
    let mut over = vec![];
    for file in rust_files(&root().join("src").join("cli")) {
        let rel = file.strip_prefix(root()).unwrap().display().to_string();
        let text = std::fs::read_to_string(&file).unwrap();
        let lines = text.lines().count();
        if lines > MAX_CLI_FILE_LINES {
            over.push(format!(
                "{rel} is {lines} lines (at most {MAX_CLI_FILE_LINES})"
            ));
        }
        for (name, n) in function_lengths_in(&text) {
            if n > MAX_FUNCTION_LINES {
                over.push(format!(
                    "{rel}: fn {name} is {n} lines (at most {MAX_FUNCTION_LINES})"
                ));
            }
        }
    }
    assert!(
        over.is_empty(),
        "split into named steps:\n{}",
        over.join("\n")
    );
}

#[test]
fn the_function_counter_measures_by_hand() {
    assert_eq!(
        fn_name("pub(crate) fn step_time<C>(x: u32) {"),
        Some("step_time")
    );
    assert_eq!(fn_name("let f = 1;"), None);
    let text = "trait T {\n    fn decl(&self);\n    fn body(&self) {\n        // }\n        x();\n    }\n}\n\npub fn free(\n    a: u32,\n) -> u32 {\n    a\n}\n#[cfg(test)]\nmod tests {\n    fn hidden() {\n    }\n}\n";
    // body: lines 3-6 (4 lines); free: lines 9-13 (5); decl has no body; tests are skipped.
    assert_eq!(
        function_lengths_in(text),
        vec![("body".to_string(), 4), ("free".to_string(), 5)]
    );
}
