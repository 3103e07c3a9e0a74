//! Helpers shared by the CLI's integration tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Spawns `strata serve` as `command` describes (with `--port 0`), waits until it listens and
/// returns it with its base URL and its "listening" log line. The rest of its log is drained
/// on a thread, so the server never blocks on a full pipe.
pub fn start_server(command: &mut Command) -> (Child, String, String) {
    let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let (url, line) = loop {
        let line = lines.next().expect("the server starts").unwrap();
        if let Some(rest) = line.split("address=").nth(1) {
            break (format!("http://{}", rest.split_whitespace().next().unwrap()), line);
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (child, url, line)
}
