//! `strata serve` facing unknown clients: `/stats` shows no paths to clients without the API
//! key.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a")
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// `strata serve` on the fixture with `args`, through `sh` so that `shell` (e.g. a ulimit)
    /// applies to it.
    fn start(shell: &str, args: &[&str]) -> Server {
        let script = format!("{shell} exec \"$0\" \"$@\"");
        let mut command = Command::new("sh");
        command.args(["-c", &script, env!("CARGO_BIN_EXE_strata"), "serve", "--port", "0", "--model"]).arg(fixture()).args(args);
        let (child, url, _) = common::start_server(&mut command);
        Server { child, url }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// With `--api-key`, `/stats` names no file to a client without the key: not the model's
/// folder (given as a path) nor the SSD cache's.
#[test]
fn stats_shows_paths_only_with_the_api_key() {
    let ssd = tempfile::tempdir().unwrap();
    let ssd_path = ssd.path().to_str().unwrap().to_string();
    let server = Server::start("", &["--api-key", "sekrit", "--ssd-cache", &ssd_path]);
    let stats = |authorization: Option<&str>| {
        let mut request = ureq::get(&format!("{}/stats", server.url));
        if let Some(value) = authorization {
            request = request.set("authorization", value);
        }
        request.call().unwrap().into_string().unwrap()
    };
    let fixture = fixture().to_str().unwrap().to_string();
    let open = stats(None);
    assert!(open.contains("\"generated_tokens\"") && open.contains("\"ssd\""), "{open}");
    assert!(!open.contains(&ssd_path) && !open.contains(&fixture), "{open}");
    for key in ["Bearer sekrit", "bearer sekrit"] {
        let full = stats(Some(key));
        assert!(full.contains(&ssd_path) && full.contains(&fixture), "{full}");
    }
}
