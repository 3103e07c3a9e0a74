use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, ModelError>;

/// Everything that can be wrong with a model folder or a forward pass. Each variant names the
/// file, tensor or field at fault and what was expected, in one line.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model folder {0} does not exist")]
    MissingFolder(PathBuf),
    #[error("{path}: {what}")]
    File { path: PathBuf, what: String },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: field `{field}`: {what}")]
    Field { path: PathBuf, field: String, what: String },
    #[error("tensor `{name}` {what}")]
    Tensor { name: String, what: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Tokenizing stopped past a limit (see [`crate::tokenizer::Bound`]).
    #[error("the text has more than {0} tokens")]
    TooLong(usize),
    #[error("cancelled")]
    Cancelled,
    #[error("{0}")]
    Invalid(String),
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("state: {0}")]
    State(#[from] strata_state::StateError),
}

impl ModelError {
    pub fn file(path: impl Into<PathBuf>, what: impl std::fmt::Display) -> Self {
        ModelError::File { path: path.into(), what: what.to_string() }
    }

    pub fn field(path: impl Into<PathBuf>, field: impl Into<String>, what: impl std::fmt::Display) -> Self {
        ModelError::Field { path: path.into(), field: field.into(), what: what.to_string() }
    }
}

/// Reads and parses a JSON file, naming it in every error.
pub(crate) fn read_json(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json { path: path.to_path_buf(), source })
}
