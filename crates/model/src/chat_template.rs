//! Chat templates as Hugging Face writes them (Jinja), rendered with minijinja configured the
//! way transformers configures Jinja: trim_blocks, lstrip_blocks, loop controls, Python string
//! methods, `raise_exception`, `strftime_now` and a Python-compatible `tojson`.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::literal::Rendered;
use crate::tokenizer::Bound;
use crate::Tokenizer;

pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token` / `eos_token`, which transformers passes to every template.
    special_tokens: serde_json::Map<String, serde_json::Value>,
}

impl ChatTemplate {
    /// The template of a model folder: `chat_template.jinja`, else `chat_template` in
    /// `tokenizer_config.json` (a string, or a list of named templates whose `default` is used).
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let file = dir.join("chat_template.jinja");
        if file.exists() {
            let source = std::fs::read_to_string(&file).map_err(|e| ModelError::file(&file, format!("cannot read: {e}")))?;
            return Self::new(&source).map(Some).map_err(|e| ModelError::file(&file, e));
        }
        let cfg = dir.join("tokenizer_config.json");
        if !cfg.exists() {
            return Ok(None);
        }
        let json = crate::error::read_json(&cfg)?;
        let source = match json.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_string)
                .ok_or_else(|| ModelError::field(&cfg, "chat_template", "a list without a template named \"default\""))?,
            Some(other) => return Err(ModelError::field(&cfg, "chat_template", format!("expected a string, found {other}"))),
        };
        Self::new(&source).map(Some).map_err(|e| ModelError::field(&cfg, "chat_template", e))
    }

    pub fn new(source: &str) -> std::result::Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| chrono::Local::now().format(&fmt).to_string());
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_string()).map_err(|e| describe(&e))?;
        Ok(Self { env, special_tokens: serde_json::Map::new() })
    }

    /// Makes the tokenizer's BOS and EOS strings available as `bos_token` and `eos_token`.
    pub fn with_special_tokens(mut self, tokenizer: &Tokenizer) -> Self {
        if let Some((bos, _)) = tokenizer.bos() {
            self.special_tokens.insert("bos_token".into(), bos.into());
        }
        if let Some(eos) = tokenizer.eos_text() {
            self.special_tokens.insert("eos_token".into(), eos.into());
        }
        self
    }

    /// Renders `context` (messages, tools, add_generation_prompt, template kwargs…); the
    /// special tokens are there unless the context sets them.
    pub fn render<S: Serialize>(&self, context: S) -> Result<String> {
        let template = self.env.get_template("chat").map_err(|e| ModelError::Template(describe(&e)))?;
        let context = Value::from_serialize(&context);
        let defaults = Value::from_serialize(&self.special_tokens);
        template.render(minijinja::context! { ..context, ..defaults }).map_err(|e| ModelError::Template(describe(&e)))
    }

    /// Renders a chat prompt and tokenizes it. With `content_as_text`, the request's text
    /// (messages, tool results, tools, keyword arguments) is only ever text: an added-token
    /// string typed in it becomes the tokens of its characters, and only the template's own
    /// markup yields added tokens (see [`crate::literal`]). Without, as transformers'
    /// `apply_chat_template` does: `<|im_start|>` in a message is the control token.
    ///
    /// With `images` (a placeholder character and its markup), each placeholder the rendering
    /// carries from the messages becomes that markup as the template's own (an image's tokens).
    pub fn render_tokens(
        &self,
        mut context: serde_json::Value,
        tokenizer: &Tokenizer,
        content_as_text: bool,
        bound: &Bound,
        images: Option<(char, &str)>,
    ) -> Result<(String, Vec<u32>)> {
        let render = |context: &serde_json::Value| -> Result<String> {
            let text = self.render(context)?;
            Ok(match images {
                Some((placeholder, markup)) => text.replace(placeholder, markup),
                None => text,
            })
        };
        let rendered = if content_as_text {
            let literal = tokenizer.literal();
            literal.escape_context(&mut context);
            let restore = |text| literal.restore(text).text;
            literal.restore(render(&context).map_err(|e| match e {
                ModelError::Template(message) => ModelError::Template(restore(message)),
                other => other,
            })?)
        } else {
            Rendered { text: render(&context)?, typed: Vec::new() }
        };
        let ids = tokenizer.encode_rendered(&rendered.text, &rendered.typed, bound)?;
        Ok((rendered.text, ids))
    }
}

fn describe(e: &Error) -> String {
    match (e.kind(), e.detail(), e.line()) {
        (ErrorKind::InvalidOperation, Some(detail), _) => detail.to_string(),
        (_, _, Some(line)) => format!("{e} (template line {line})"),
        _ => e.to_string(),
    }
}

/// `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)` as Python writes
/// it: `", "` and `": "` separators, insertion order, no HTML escaping.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    if sort_keys == Some(true) {
        json = sorted(json);
    }
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(&pad));
            json.serialize(&mut ser)
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter)),
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

fn sorted(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        serde_json::Value::Array(items) => serde_json::Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// Compact JSON with Python's default separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn helpers_behave_like_transformers() {
        let t = ChatTemplate::new(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.skip %}{% continue %}{% endif %}\
             {% set ns.n = ns.n + 1 %}{{ m.content.strip() | upper }}{% if loop.index == 3 %}{% break %}{% endif %}\
             {% endfor %}|{{ ns.n }}|{{ tools | tojson }}|{{ strftime_now('%Y') | length }}",
        )
        .unwrap();
        let out = t
            .render(json!({
                "messages": [{"content": " a "}, {"content": "b", "skip": true}, {"content": "c"}, {"content": "d"}],
                "tools": [{"name": "f", "é": [1, 2], "a": null}],
            }))
            .unwrap();
        assert_eq!(out, "AC|2|[{\"name\": \"f\", \"é\": [1, 2], \"a\": null}]|4");
        let err = ChatTemplate::new("{{ raise_exception('Bad role: ' + r) }}").unwrap().render(json!({"r": "x"})).unwrap_err();
        assert_eq!(err.to_string(), "chat template: Bad role: x");
    }
}
