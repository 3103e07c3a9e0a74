//! The CUDA kernels' launch contract, checked in their sources (no GPU needed): strata launches
//! every kernel as a programmatic dependent of the one before it (crates/kernels/src/cuda.rs),
//! so each must call `await_previous_kernel()` before it reads another kernel's output or
//! writes anything, in every thread. A kernel that skipped it would race the kernel before it,
//! and, ending early, the kernel after it too — rarely, silently. Checked here: every
//! `__global__` body starts with the call, or is one call of a device function that makes it
//! unconditionally at its top level (the decode matmul, which first loads weights).

use std::path::Path;

/// The text between the brace at `open` and its matching closing brace.
fn braced(src: &str, open: usize) -> &str {
    let mut depth = 0;
    for (i, c) in src[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &src[open + 1..open + i];
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced braces after byte {open}");
}

/// Statements of a body as written, macro line continuations and comments dropped.
fn statements(body: &str) -> Vec<String> {
    let text: String = body
        .lines()
        .map(|line| line.split("//").next().unwrap_or("").trim_end().trim_end_matches('\\'))
        .collect::<Vec<_>>()
        .join(" ");
    text.split(';').map(|s| s.split_whitespace().collect::<Vec<_>>().join(" ")).filter(|s| !s.is_empty()).collect()
}

/// Whether `body`'s top level (not inside a nested block) calls `await_previous_kernel()`.
fn awaits_at_top_level(body: &str) -> bool {
    let mut depth = 0;
    let mut top = String::new();
    for c in body.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ if depth == 0 => top.push(c),
            _ => {}
        }
    }
    top.contains("await_previous_kernel();")
}

/// The body of device function `name` in `src`.
fn device_function<'a>(src: &'a str, name: &str) -> Option<&'a str> {
    let at = src.match_indices(&format!(" {name}(")).map(|(i, _)| i).find(|&i| src[..i].trim_end().ends_with("void"))?;
    let open = at + src[at..].find('{')?;
    Some(braced(src, open))
}

#[test]
fn every_kernel_waits_for_the_one_before_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let mut kernels = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let src = std::fs::read_to_string(&path).unwrap();
        for (at, _) in src.match_indices("__global__") {
            let open = at + src[at..].find('{').unwrap();
            let header = src[at..open].split_whitespace().collect::<Vec<_>>().join(" ");
            let body = statements(braced(&src, open));
            let first = body.first().map(String::as_str).unwrap_or("");
            let waits = if first == "await_previous_kernel()" {
                true
            } else if body.len() == 1 {
                // One call of a device template: `name<...>(...)`.
                let callee = first.trim_start_matches("return ").split(['<', '(']).next().unwrap_or("").trim();
                device_function(&src, callee).is_some_and(awaits_at_top_level)
            } else {
                false
            };
            assert!(waits, "{}: kernel `{header}` does not start by awaiting the kernel before it", path.display());
            kernels += 1;
        }
    }
    // The kernel files hold 16 `__global__` definitions (some instantiated per dtype by macro).
    assert!(kernels >= 16, "found only {kernels} kernels under {}", dir.display());
}
