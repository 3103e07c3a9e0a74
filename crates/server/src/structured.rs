//! Structured output in requests: OpenAI's `response_format`, vLLM's `structured_outputs`, and
//! tool choices that force a call, read into the [`Structure`] a generation follows and
//! compiled for this model. What cannot be used is a 400 naming the field and the reason.

use std::sync::Arc;

use serde_json::Value;
use strata_engine::{Grammar, Grammars, Structure};

use crate::error::{ApiError, ApiResult};
use crate::parse::tool_calls::call_grammar;
use crate::request::prepare;
use crate::state::AppState;

/// Whether, and which, tool calls the output must be.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ToolChoice {
    /// The model decides (OpenAI `auto`, Anthropic `auto`).
    Auto,
    /// No tools: they are left out of the prompt.
    None,
    /// At least one call (OpenAI `required`, Anthropic `any`).
    Required,
    /// A call of this function (OpenAI `{"type": "function", ...}`, Anthropic `tool`).
    Named(String),
}

impl ToolChoice {
    /// OpenAI's `tool_choice`: "auto", "none", "required" or `{"type": "function",
    /// "function": {"name"}}` (the Responses API's `{"type": "function", "name"}` too).
    pub(crate) fn openai(choice: Option<&Value>) -> ApiResult<Self> {
        let bad = |what: String| ApiError::bad_request(what, Some("tool_choice"));
        match choice {
            None => Ok(Self::Auto),
            Some(Value::String(c)) => match c.as_str() {
                "auto" => Ok(Self::Auto),
                "none" => Ok(Self::None),
                "required" => Ok(Self::Required),
                other => Err(bad(format!("tool_choice `{other}` is not one of \"auto\", \"none\", \"required\""))),
            },
            Some(named) => match named.pointer("/function/name").or_else(|| named.get("name")).and_then(Value::as_str) {
                Some(name) if named.get("type").and_then(Value::as_str) == Some("function") => Ok(Self::Named(name.into())),
                _ => Err(bad(format!("tool_choice {named} is not {{\"type\": \"function\", \"function\": {{\"name\"}}}}"))),
            },
        }
    }

    /// Anthropic's `tool_choice`: `{"type": "auto" | "any" | "none"}` or `{"type": "tool",
    /// "name"}`; also whether several calls may come (`disable_parallel_tool_use`).
    pub(crate) fn anthropic(choice: Option<&Value>) -> ApiResult<(Self, bool)> {
        let Some(choice) = choice else { return Ok((Self::Auto, true)) };
        let parallel = !choice.get("disable_parallel_tool_use").and_then(Value::as_bool).unwrap_or(false);
        let kind = match choice.get("type").and_then(Value::as_str) {
            Some("auto") => Self::Auto,
            Some("none") => Self::None,
            Some("any") => Self::Required,
            Some("tool") => match choice.get("name").and_then(Value::as_str) {
                Some(name) => Self::Named(name.into()),
                None => return Err(ApiError::bad_request("tool_choice of type \"tool\" needs a name", Some("tool_choice.name"))),
            },
            other => {
                return Err(ApiError::bad_request(
                    format!(
                        "tool_choice type {} is not one of \"auto\", \"any\", \"tool\", \"none\"",
                        other.unwrap_or("(missing)")
                    ),
                    Some("tool_choice"),
                ))
            }
        };
        Ok((kind, parallel))
    }

    /// The structure that forces the calls, over `tools` (OpenAI `tools` entries); `None` when
    /// the model may answer as it likes.
    pub(crate) fn structure(&self, tools: &[Value], parallel: bool) -> ApiResult<Option<Structure>> {
        let only = match self {
            Self::Auto | Self::None => return Ok(None),
            Self::Required => None,
            Self::Named(name) => Some(name.as_str()),
        };
        if tools.is_empty() {
            return Err(ApiError::bad_request(
                "tool_choice forces a tool call, but the request has no tools",
                Some("tool_choice"),
            ));
        }
        if let Some(name) =
            only.filter(|&n| !tools.iter().any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(n)))
        {
            return Err(ApiError::bad_request(
                format!("tool_choice names `{name}`, which is not among the tools"),
                Some("tool_choice"),
            ));
        }
        Ok(Some(Structure::Lark(call_grammar(tools, only, parallel))))
    }
}

/// The structure OpenAI's `response_format` or vLLM's `structured_outputs` asks for (at most
/// one of the two may), with the field that asked.
pub(crate) fn requested(
    response_format: Option<&Value>,
    structured_outputs: Option<&Value>,
) -> ApiResult<Option<(Structure, &'static str)>> {
    let from_format = response_format.map(read_response_format).transpose()?.flatten();
    let from_outputs = structured_outputs.map(read_structured_outputs).transpose()?;
    match (from_format, from_outputs) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "response_format and structured_outputs both constrain the output: give one",
            Some("structured_outputs"),
        )),
        (Some(s), None) => Ok(Some((s, "response_format"))),
        (None, s) => Ok(s.map(|s| (s, "structured_outputs"))),
    }
}

/// `{"type": "text" | "json_object"}` or `{"type": "json_schema", "json_schema": {"name",
/// "schema", "strict"}}` (also the Responses API's `text.format`, whose schema sits beside the type).
fn read_response_format(format: &Value) -> ApiResult<Option<Structure>> {
    let bad = |what: &str, field: &str| ApiError::bad_request(what.to_string(), Some(field));
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Structure::JsonObject)),
        Some("json_schema") => {
            let schema = format.pointer("/json_schema/schema").or_else(|| format.get("schema"));
            match schema {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(Structure::JsonSchema(schema.clone()))),
                Some(_) => Err(bad(
                    "response_format.json_schema.schema must be a JSON schema object",
                    "response_format.json_schema.schema",
                )),
                None => Err(bad("response_format of type json_schema needs json_schema.schema", "response_format.json_schema")),
            }
        }
        _ => Err(bad("response_format.type must be one of text, json_object, json_schema", "response_format.type")),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema, or its text), `regex`,
/// `choice`, `grammar` (Lark) or `json_object: true`.
fn read_structured_outputs(outputs: &Value) -> ApiResult<Structure> {
    let field = |name: &str| format!("structured_outputs.{name}");
    let bad = |what: String, name: &str| ApiError::bad_request(what, Some(&field(name)));
    let Some(object) = outputs.as_object() else {
        return Err(ApiError::bad_request("structured_outputs must be an object", Some("structured_outputs")));
    };
    let given: Vec<(&String, &Value)> = object.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(name, value)] = given[..] else {
        return Err(ApiError::bad_request(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
            Some("structured_outputs"),
        ));
    };
    match (name.as_str(), value) {
        ("json", Value::String(text)) => match serde_json::from_str(text) {
            Ok(schema) => Ok(Structure::JsonSchema(schema)),
            Err(e) => Err(bad(format!("structured_outputs.json is not JSON: {e}"), "json")),
        },
        ("json", schema) => Ok(Structure::JsonSchema(schema.clone())),
        ("regex", Value::String(rx)) => Ok(Structure::Regex(rx.clone())),
        ("grammar", Value::String(lark)) => Ok(Structure::Lark(lark.clone())),
        ("choice", Value::Array(items)) => items
            .iter()
            .map(|c| c.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .map(Structure::Choice)
            .ok_or_else(|| bad("structured_outputs.choice must be a list of strings".into(), "choice")),
        ("json_object", Value::Bool(true)) => Ok(Structure::JsonObject),
        ("regex" | "grammar", _) => Err(bad(format!("structured_outputs.{name} must be a string"), name)),
        ("choice", _) => Err(bad("structured_outputs.choice must be a list of strings".into(), "choice")),
        ("json_object", _) => Err(bad("structured_outputs.json_object must be true".into(), "json_object")),
        (other, _) => Err(bad(
            format!("structured_outputs.{other} is not supported: use json, regex, choice, grammar or json_object"),
            other,
        )),
    }
}

/// Compiles `structure` for this model, off the async threads (the first use also builds the
/// vocabulary's token trie). `after_thinking`: the prompt opened a thinking block, so the
/// structure holds from its end on. A structure that does not compile is a 400 naming `field`.
pub(crate) async fn compile(
    state: &AppState,
    structure: Structure,
    after_thinking: bool,
    field: &'static str,
) -> ApiResult<Arc<Grammar>> {
    let state = state.clone();
    prepare(move |_| {
        let grammars = state.grammars.get_or_init(|| {
            let eos = *state.eos_token_ids.first().ok_or("the model declares no end token")?;
            Grammars::new(&state.tokenizer, state.vocab_size, eos)
        });
        let grammars = grammars.as_ref().map_err(|e| ApiError::internal(format!("structured output is unavailable: {e}")))?;
        let starts_after = match after_thinking {
            true => Some(state.tokenizer.token_id("</think>").ok_or_else(|| {
                ApiError::internal("the prompt opens a thinking block, but the tokenizer has no `</think>` token")
            })?),
            false => None,
        };
        grammars
            .compile(&structure, starts_after)
            .map_err(|e| ApiError::bad_request(format!("{field} cannot be used: {e}"), Some(field)))
    })
    .await
}
