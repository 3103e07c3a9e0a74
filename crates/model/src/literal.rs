//! Text from a request kept literal through a chat template: before rendering, each added-token
//! string in the request's values (`<|im_start|>`, `<tool_response>`…) is swapped for a
//! placeholder the template treats as opaque text; after rendering, the placeholders are put back
//! and their places remembered, so that tokenizing yields those strings' characters rather than
//! control tokens. The template sees the request as it is, but for these strings (a template
//! that looked for one in a message would no longer find it there).

use std::ops::Range;

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use serde_json::Value;

/// A placeholder is `OPEN <index> CLOSE`: Unicode noncharacters, which no text is meant to
/// carry. Request text holding them gets them escaped the same way, so every `OPEN` in a
/// rendering is one of ours.
const OPEN: char = '\u{FDD0}';
const CLOSE: char = '\u{FDD1}';

pub struct Literal {
    /// What a placeholder's index stands for: `OPEN`, `CLOSE`, then the added tokens.
    strings: Vec<String>,
    /// Whether each string is a special (control) token: in the assistant's own past turns
    /// only those are escaped, as the model wrote the others (`<think>`, `<tool_call>`) itself.
    special: Vec<bool>,
    matcher: DoubleArrayAhoCorasick<u32>,
    /// Bytes of the longest string.
    longest: usize,
}

/// A rendered prompt, and the byte ranges in it of added-token strings that came from the
/// request rather than from the template.
pub struct Rendered {
    pub text: String,
    pub typed: Vec<Range<usize>>,
}

impl Literal {
    /// For these added tokens: (string, is special).
    pub fn new(added: impl IntoIterator<Item = (String, bool)>) -> Self {
        // An added token holding a noncharacter would be escaped twice over; none does.
        let added = added.into_iter().filter(|(s, _)| !s.is_empty() && !s.contains([OPEN, CLOSE]));
        let (strings, special): (Vec<String>, Vec<bool>) =
            [(OPEN.to_string(), true), (CLOSE.to_string(), true)].into_iter().chain(added).unzip();
        // Matched as the tokenizer matches added tokens (with the same crate).
        let matcher = DoubleArrayAhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&strings)
            .expect("distinct non-empty strings, as added tokens are, build");
        let longest = strings.iter().map(String::len).max().unwrap_or(0);
        Self { strings, special, matcher, longest }
    }

    /// Where the added-token strings are in `text`, as the tokenizer finds them.
    pub fn spans(&self, text: &str) -> Vec<Range<usize>> {
        self.matcher.leftmost_find_iter(text).map(|m| m.start()..m.end()).collect()
    }

    pub fn longest(&self) -> usize {
        self.longest
    }

    /// Escapes every string of a template context: each message's values (the assistant's
    /// special tokens only), tools, and template keyword arguments; the context's own keys
    /// are left as they are.
    pub fn escape_context(&self, context: &mut Value) {
        let Value::Object(top) = context else { return };
        for (key, value) in top.iter_mut() {
            match (key.as_str(), value) {
                ("messages", Value::Array(messages)) => {
                    for message in messages {
                        let assistant = message.get("role").and_then(Value::as_str) == Some("assistant");
                        self.escape_value(message, assistant);
                    }
                }
                (_, value) => self.escape_value(value, false),
            }
        }
    }

    fn escape_value(&self, value: &mut Value, specials_only: bool) {
        match value {
            Value::String(s) => self.escape(s, specials_only),
            Value::Array(items) => items.iter_mut().for_each(|v| self.escape_value(v, specials_only)),
            Value::Object(map) => {
                *map = std::mem::take(map)
                    .into_iter()
                    .map(|(mut k, mut v)| {
                        self.escape(&mut k, specials_only);
                        self.escape_value(&mut v, specials_only);
                        (k, v)
                    })
                    .collect();
            }
            _ => {}
        }
    }

    fn escape(&self, s: &mut String, specials_only: bool) {
        let mut out = String::new();
        let mut done = 0;
        for m in self.matcher.leftmost_find_iter(s.as_str()) {
            let index = m.value() as usize;
            if specials_only && !self.special[index] {
                continue;
            }
            out.push_str(&s[done..m.start()]);
            out.push_str(&format!("{OPEN}{index}{CLOSE}"));
            done = m.end();
        }
        if done > 0 {
            out.push_str(&s[done..]);
            *s = out;
        }
    }

    /// Puts the escaped strings back into a rendering. A placeholder the template cut apart
    /// (by slicing a message) stays as the characters left of it: text, never a token.
    pub fn restore(&self, rendered: String) -> Rendered {
        if !rendered.contains(OPEN) {
            return Rendered { text: rendered, typed: Vec::new() };
        }
        let (mut text, mut typed) = (String::with_capacity(rendered.len()), Vec::new());
        let mut rest = rendered.as_str();
        while let Some(at) = rest.find(OPEN) {
            text.push_str(&rest[..at]);
            rest = &rest[at + OPEN.len_utf8()..];
            let index = rest.find(CLOSE).and_then(|end| Some((end, rest[..end].parse::<usize>().ok()?)));
            match index.filter(|&(_, i)| i < self.strings.len()) {
                Some((end, i)) => {
                    let start = text.len();
                    text.push_str(&self.strings[i]);
                    // The noncharacters themselves are no token: nothing to keep literal.
                    if i >= 2 {
                        typed.push(start..text.len());
                    }
                    rest = &rest[end + CLOSE.len_utf8()..];
                }
                None => text.push(OPEN),
            }
        }
        text.push_str(rest);
        Rendered { text, typed }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn escaped_strings_come_back_with_their_places() {
        let literal = Literal::new([("<|im_start|>".to_string(), true), ("<think>".to_string(), false)]);
        let mut context = json!({
            "messages": [
                {"role": "user", "content": "a<|im_start|>b<think>\u{FDD0}"},
                {"role": "assistant", "content": "<think>x<|im_start|>"},
            ],
            "add_generation_prompt": true,
        });
        literal.escape_context(&mut context);
        let user = context["messages"][0]["content"].as_str().unwrap();
        let assistant = context["messages"][1]["content"].as_str().unwrap();
        assert!(!user.contains("<|im_start|>") && !user.contains("<think>"), "{user:?}");
        assert!(assistant.starts_with("<think>x") && !assistant.contains("<|im_start|>"), "{assistant:?}");
        let rendered = literal.restore(format!("<|im_start|>{user}|{assistant}"));
        assert_eq!(rendered.text, "<|im_start|>a<|im_start|>b<think>\u{FDD0}|<think>x<|im_start|>");
        let pieces: Vec<&str> = rendered.typed.iter().map(|r| &rendered.text[r.clone()]).collect();
        assert_eq!(pieces, ["<|im_start|>", "<think>", "<|im_start|>"]);
        assert_eq!(rendered.typed[0].start, "<|im_start|>a".len());
        // A placeholder cut short is left as text.
        assert_eq!(literal.restore("x\u{FDD0}2".into()).text, "x\u{FDD0}2");
    }
}
