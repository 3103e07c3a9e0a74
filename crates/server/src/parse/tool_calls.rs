//! Qwen3.5 tool calls in generated content:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Parameter values are raw text, so the request's tool schemas decide their JSON types. Nothing
//! the model wrote is ever lost: what cannot be read as a call comes back as text.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::partial_marker_start;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One parsed call: the function name verbatim, and its arguments as a JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    Text(String),
    Call(ToolCall),
}

/// Streams text outside tool calls and emits each call whole once its "</tool_call>" arrives.
///
/// Whitespace around calls is layout, not content: it is dropped before a "<tool_call>", after a
/// "</tool_call>" and at the end of an output that made a call. An output without calls streams
/// out verbatim.
pub struct ToolCallParser {
    /// Tool name → its `parameters.properties` (first tool of a name wins).
    schemas: HashMap<String, Map<String, Value>>,
    /// Text received but not yet emitted: inside a call, the call's body so far.
    pending: String,
    /// Inside a call: the whitespace dropped before its "<tool_call>", given back with the block
    /// if the block turns out not to be a call.
    call_gap: Option<String>,
    /// A call has been emitted, so whitespace ending the output is layout.
    seen_call: bool,
    /// Right after a call, until something other than whitespace follows: whitespace is dropped.
    after_call: bool,
}

impl ToolCallParser {
    /// `tools`: the request's OpenAI `tools` array (each `{"type":"function","function":{"name",
    /// "parameters": JSON schema}}`), used to type arguments.
    pub fn new(tools: &[Value]) -> Self {
        let mut schemas = HashMap::new();
        for tool in tools {
            if let Some(name) = tool.pointer("/function/name").and_then(Value::as_str) {
                let properties = tool.pointer("/function/parameters/properties").and_then(Value::as_object);
                schemas.entry(name.to_string()).or_insert_with(|| properties.cloned().unwrap_or_default());
            }
        }
        Self { schemas, pending: String::new(), call_gap: None, seen_call: false, after_call: false }
    }

    /// Feed a delta; returns text outside calls (holding back trailing whitespace and a partial
    /// "<tool_call>") and every call completed by it.
    pub fn push(&mut self, delta: &str) -> Vec<ToolEvent> {
        self.pending.push_str(delta);
        let mut events = Vec::new();
        loop {
            if let Some(gap) = &self.call_gap {
                let Some(end) = self.pending.find(CLOSE) else { return events };
                let body = &self.pending[..end];
                events.push(match self.parse_call(body) {
                    Some(call) => ToolEvent::Call(call),
                    None => ToolEvent::Text(format!("{gap}{OPEN}{body}{CLOSE}")),
                });
                self.pending.drain(..end + CLOSE.len());
                self.call_gap = None;
                self.seen_call = true;
                self.after_call = true;
            } else {
                if self.after_call {
                    let lead = self.pending.len() - self.pending.trim_start().len();
                    self.pending.drain(..lead);
                    self.after_call = self.pending.is_empty();
                }
                if let Some(start) = self.pending.find(OPEN) {
                    let text = self.pending[..start].trim_end();
                    push_text(&mut events, text);
                    self.call_gap = Some(self.pending[text.len()..start].to_string());
                    self.pending.drain(..start + OPEN.len());
                } else {
                    let held = partial_marker_start(&self.pending, &[OPEN]);
                    let emit = self.pending[..held].trim_end().len();
                    push_text(&mut events, &self.pending[..emit]);
                    self.pending.drain(..emit);
                    return events;
                }
            }
        }
    }

    /// End of generation: flush held-back text; an unterminated "<tool_call>" block comes back
    /// as text.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = std::mem::take(&mut self.pending);
        let mut events = Vec::new();
        if let Some(gap) = self.call_gap.take() {
            push_text(&mut events, &format!("{gap}{OPEN}{rest}"));
        } else if self.seen_call {
            push_text(&mut events, rest.trim_end());
        } else {
            push_text(&mut events, &rest);
        }
        events
    }

    /// Reads a call body (between the tags); `None` when it names no function.
    fn parse_call(&self, body: &str) -> Option<ToolCall> {
        let (_, after) = body.split_once("<function=")?;
        let (name, rest) = after.split_once('>')?;
        let rest = rest.split_once("</function>").map_or(rest, |(inside, _)| inside);
        let properties = self.schemas.get(name);
        let mut arguments = Map::new();
        // Each chunk starts with a parameter's name; a missing "</parameter>" ends the value at
        // the next parameter or the end of the function.
        for chunk in rest.split("<parameter=").skip(1) {
            let Some((param, value)) = chunk.split_once('>') else { continue };
            let value = value.split_once("</parameter>").map_or(value, |(v, _)| v);
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            let schema_type = properties.and_then(|p| p.get(param)).and_then(|s| s.get("type"));
            arguments.insert(param.to_string(), typed(value, schema_type));
        }
        Some(ToolCall { name: name.to_string(), arguments: Value::Object(arguments) })
    }
}

fn push_text(events: &mut Vec<ToolEvent>, text: &str) {
    if !text.is_empty() {
        events.push(ToolEvent::Text(text.to_string()));
    }
}

/// A grammar (llguidance's Lark dialect) for output that is tool calls alone, in the syntax
/// [`ToolCallParser`] reads: one or more calls (`parallel`), or exactly one, of the function
/// named `only` or of any of `tools` (OpenAI `tools` entries). Each call's parameters come in
/// the schema's order, the required ones always, the others optionally. Values are written as
/// the template writes them: strings (of an enum of strings, or of a type that allows a string)
/// as raw text up to the closing tag, within `minLength` and `maxLength`; anything else as JSON
/// valid under its schema.
pub fn call_grammar(tools: &[Value], only: Option<&str>, parallel: bool) -> String {
    let quote = |text: &str| Value::String(text.to_string()).to_string();
    let mut rules = Vec::new();
    let mut calls = Vec::new();
    let mut named = std::collections::HashSet::new();
    for (t, tool) in tools.iter().enumerate() {
        let Some(name) = tool.pointer("/function/name").and_then(Value::as_str) else { continue };
        // The first tool of a name is the one the parser types arguments by.
        if only.is_some_and(|only| only != name) || !named.insert(name) {
            continue;
        }
        let parameters = tool.pointer("/function/parameters");
        let required: Vec<&str> = parameters
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let properties = parameters.and_then(|p| p.get("properties")).and_then(Value::as_object);
        let mut body = vec![quote(&format!("{OPEN}\n<function={name}>\n"))];
        for (p, (param, schema)) in properties.into_iter().flatten().enumerate() {
            let rule = format!("call{t}_param{p}");
            let open = quote(&format!("<parameter={param}>\n"));
            let end = quote("\n</parameter>\n");
            let strings: Option<Vec<&str>> =
                schema.get("enum").and_then(Value::as_array).map(|e| e.iter().filter_map(Value::as_str).collect());
            let types: Vec<&str> = match schema.get("type") {
                Some(Value::String(t)) => vec![t],
                Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            let value = match strings {
                // Strings go as raw text (as the template writes them, and `typed` reads them).
                Some(options) if !options.is_empty() && Some(options.len()) == schema["enum"].as_array().map(Vec::len) => {
                    format!("({}) {end}", options.iter().map(|o| quote(o)).collect::<Vec<_>>().join(" | "))
                }
                _ if types.contains(&"string") => {
                    let length = |key: &str| schema.get(key).and_then(Value::as_u64);
                    let repeat = match (length("minLength").unwrap_or(0), length("maxLength")) {
                        (0, None) => "*".to_string(),
                        (min, max) => format!("{{{min},{}}}", max.map(|m| m.to_string()).unwrap_or_default()),
                    };
                    rules.push(format!("{rule}_text[suffix={end}]: /(.|\\n){repeat}/"));
                    format!("{rule}_text")
                }
                _ => {
                    // The tool's shared definitions travel with each parameter's schema.
                    let mut schema = schema.clone();
                    if let (Some(object), Some(defs)) = (schema.as_object_mut(), parameters.and_then(|p| p.get("$defs"))) {
                        object.insert("$defs".into(), defs.clone());
                    }
                    if let Some(object) = schema.as_object_mut() {
                        object.insert("x-guidance".into(), serde_json::json!({"whitespace_flexible": false}));
                    }
                    format!("%json {schema} {end}")
                }
            };
            rules.push(format!("{rule}: {open} {value}"));
            let optional = if required.contains(&param.as_str()) { "" } else { "?" };
            body.push(format!("{rule}{optional}"));
        }
        body.push(quote(&format!("</function>\n{CLOSE}")));
        rules.push(format!("call{t}: {}", body.join(" ")));
        calls.push(format!("call{t}"));
    }
    let start = if parallel { "start: call (\"\\n\" call)*" } else { "start: call" };
    let mut grammar = vec![start.to_string(), format!("call: {}", calls.join(" | "))];
    grammar.extend(rules);
    grammar.join("\n")
}

/// What makes `schema` (a tool's `parameters` or `input_schema`, named `field`) unusable as the
/// JSON schema the template shows the model and arguments are typed by, if anything: a schema
/// that is not an object, a `type` that is not a name or a list of names, `properties` that
/// are not schemas, `required` that is not a list of names. Anything else is the schema's own
/// business.
pub fn schema_problem(schema: &Value, field: &str) -> Option<String> {
    let Some(schema) = schema.as_object() else { return Some(format!("{field} must be a JSON schema object")) };
    let type_ok = |t: Option<&Value>| match t {
        None | Some(Value::String(_)) => true,
        Some(Value::Array(names)) => names.iter().all(Value::is_string),
        Some(_) => false,
    };
    let bad_type = |at: &str| Some(format!("{at}.type must be a type name or a list of type names"));
    if !type_ok(schema.get("type")) {
        return bad_type(field);
    }
    match schema.get("properties") {
        None => {}
        Some(Value::Object(properties)) => {
            for (name, property) in properties {
                match property {
                    Value::Bool(_) => {}
                    Value::Object(p) if type_ok(p.get("type")) => {}
                    Value::Object(_) => return bad_type(&format!("{field}.properties.{name}")),
                    _ => return Some(format!("{field}.properties.{name} must be a JSON schema object")),
                }
            }
        }
        Some(_) => return Some(format!("{field}.properties must be an object of property schemas")),
    }
    if schema.get("required").is_some_and(|r| !r.as_array().is_some_and(|names| names.iter().all(Value::is_string))) {
        return Some(format!("{field}.required must be a list of property names"));
    }
    None
}

/// Converts a raw value by its schema `type` (a name or a list of names, tried in order); a value
/// that fits none, or has no schema, stays a string: a call is never dropped over a bad value.
fn typed(raw: &str, schema_type: Option<&Value>) -> Value {
    let names: Vec<&str> = match schema_type {
        Some(Value::String(name)) => vec![name],
        Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let text = raw.trim();
    names
        .into_iter()
        .find_map(|name| match name {
            "string" => Some(Value::String(raw.to_string())),
            "integer" => text.parse::<i64>().ok().map(Value::from),
            "number" => text.parse::<f64>().ok().and_then(serde_json::Number::from_f64).map(Value::Number),
            "boolean" => text.to_ascii_lowercase().parse().ok().map(Value::Bool),
            "object" => serde_json::from_str(text).ok().filter(Value::is_object),
            "array" => serde_json::from_str(text).ok().filter(Value::is_array),
            "null" => (text == "null").then_some(Value::Null),
            _ => None,
        })
        .unwrap_or_else(|| Value::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::splittings;
    use serde_json::json;

    fn tools() -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
            "metric": {"type": "boolean"}, "hours": {"type": "array"}, "filter": {"type": "object"},
            "note": {"type": ["integer", "string"]}, "nothing": {"type": "null"}
        }}}})]
    }

    /// All events of one run, adjacent texts merged (how text is chunked depends on the cuts).
    fn run(deltas: &[&str]) -> Vec<ToolEvent> {
        let mut parser = ToolCallParser::new(&tools());
        let mut merged: Vec<ToolEvent> = Vec::new();
        let mut events: Vec<ToolEvent> = deltas.iter().flat_map(|d| parser.push(d)).collect();
        events.extend(parser.finish());
        for event in events {
            match (merged.last_mut(), event) {
                (Some(ToolEvent::Text(last)), ToolEvent::Text(more)) => last.push_str(&more),
                (_, event) => merged.push(event),
            }
        }
        merged
    }

    /// Every way of cutting `text` gives the same events.
    fn check(text: &str) -> Vec<ToolEvent> {
        let expected = run(&[text]);
        for deltas in splittings(text) {
            assert_eq!(run(&deltas), expected, "deltas {deltas:?}");
        }
        expected
    }

    fn text(s: &str) -> ToolEvent {
        ToolEvent::Text(s.to_string())
    }

    fn call(name: &str, arguments: Value) -> ToolEvent {
        ToolEvent::Call(ToolCall { name: name.to_string(), arguments })
    }

    fn block(name: &str, params: &[(&str, &str)]) -> String {
        let params: String = params.iter().map(|(p, v)| format!("<parameter={p}>\n{v}\n</parameter>\n")).collect();
        format!("<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    }

    #[test]
    fn text_then_call() {
        let out = check(&format!("Let me check.\n{}", block("get_weather", &[("city", "Paris"), ("days", "2")])));
        assert_eq!(out, [text("Let me check."), call("get_weather", json!({"city": "Paris", "days": 2}))]);
    }

    #[test]
    fn arguments_are_typed_by_schema() {
        let params = [("city", "New York\n\nNY"), ("days", "x7"), ("scale", "1.5"), ("metric", "True"), ("hours", "[1, 2]")];
        let more = [("filter", "{\"rain\": true}"), ("note", "12"), ("nothing", "null"), ("unknown", "42")];
        let out = check(&block("get_weather", &[&params[..], &more[..]].concat()));
        let args = json!({"city": "New York\n\nNY", "days": "x7", "scale": 1.5, "metric": true, "hours": [1, 2],
            "filter": {"rain": true}, "note": 12, "nothing": null, "unknown": "42"});
        assert_eq!(out, [call("get_weather", args)]);
    }

    #[test]
    fn unknown_tool_keeps_strings_and_values_keep_inner_newlines() {
        let out = check(&block("other", &[("n", "5"), ("body", "\nline1\n\nline2\n")]));
        assert_eq!(out, [call("other", json!({"n": "5", "body": "\nline1\n\nline2\n"}))]);
    }

    #[test]
    fn several_calls_drop_the_whitespace_between_them() {
        let (a, b) = (block("get_weather", &[("days", "1")]), block("get_weather", &[("days", "3")]));
        let out = check(&format!("{a}\n\n{b}\n"));
        assert_eq!(out, [call("get_weather", json!({"days": 1})), call("get_weather", json!({"days": 3}))]);
        let out = check(&format!("{a}\n and then \n{b}\n done \n"));
        let expected =
            [call("get_weather", json!({"days": 1})), text("and then"), call("get_weather", json!({"days": 3})), text("done")];
        assert_eq!(out, expected);
    }

    #[test]
    fn unterminated_call_is_flushed_as_text() {
        let out = check("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar");
        assert_eq!(out, [text("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")]);
    }

    #[test]
    fn block_without_a_function_is_text() {
        assert_eq!(check("a \n<tool_call>oops</tool_call>"), [text("a \n<tool_call>oops</tool_call>")]);
    }

    #[test]
    fn missing_closing_parameter_tag_ends_at_the_next_parameter() {
        let out = check("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n</tool_call>");
        assert_eq!(out, [call("f", json!({"a": "1", "b": "2"}))]);
    }

    #[test]
    fn text_without_calls_is_verbatim() {
        assert_eq!(check("  Hello,\n world <tool\n"), [text("  Hello,\n world <tool\n")]);
        assert_eq!(check(""), []);
    }

    #[test]
    fn partial_open_tag_is_held_back() {
        let mut parser = ToolCallParser::new(&[]);
        assert_eq!(parser.push("Hi <tool_"), [text("Hi")]);
        assert_eq!(parser.push("ca"), []);
        assert_eq!(parser.push("ll>\n<function=f>\n</function>\n</tool_call>"), [call("f", json!({}))]);
        assert_eq!(parser.finish(), []);
    }

    #[test]
    fn unicode_around_and_inside_calls() {
        let out = check(&format!("Météo 🙂 {}é", block("get_weather", &[("city", "Zürich 🏔")])));
        assert_eq!(out, [text("Météo 🙂"), call("get_weather", json!({"city": "Zürich 🏔"})), text("é")]);
    }
}
