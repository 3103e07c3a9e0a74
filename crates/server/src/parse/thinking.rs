//! Splitting `<think>…</think>` reasoning from content, Qwen3.5 style. The chat template usually
//! opens the think block itself (its generation prompt ends with "<think>\n"), so the output starts
//! mid-reasoning; a model may also open the block in its own output. Tags never reach either field.

use super::partial_marker_start;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Text emitted by one step of a [`ThinkingSplitter`].
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Start of an output outside a think block: whitespace and a partial "<think>" are held
    /// back, since the output may still turn out to open a block.
    Start,
    /// Inside the block. `fresh` while nothing of the reasoning is out yet: leading newlines
    /// (the template's "<think>\n") are dropped.
    Thinking { fresh: bool },
    /// Just after "</think>": leading newlines are dropped (Qwen emits "</think>\n\n").
    AfterThinking,
    /// Plain content until the end.
    Content,
}

/// Routes streamed text to `reasoning` or `content`, holding back a partial tag across deltas.
pub struct ThinkingSplitter {
    phase: Phase,
    /// Text received but not yet routed.
    pending: String,
}

impl ThinkingSplitter {
    /// `starts_in_thinking`: true when the rendered prompt ends inside an open think block (the
    /// chat template's generation prompt ended with "<think>\n"); then output up to "</think>" is
    /// reasoning.
    pub fn new(starts_in_thinking: bool) -> Self {
        let phase = if starts_in_thinking { Phase::Thinking { fresh: true } } else { Phase::Start };
        Self { phase, pending: String::new() }
    }

    /// Feed a delta; returns what can be emitted now.
    pub fn push(&mut self, delta: &str) -> Split {
        self.pending.push_str(delta);
        let mut out = Split::default();
        // Each pass either changes phase or leaves the loop, and phases only move forward.
        loop {
            match self.phase {
                Phase::Start => {
                    let body = self.pending.trim_start();
                    if let Some(rest) = body.strip_prefix(OPEN) {
                        self.pending = rest.to_string();
                        self.phase = Phase::Thinking { fresh: true };
                    } else if OPEN.starts_with(body) {
                        return out;
                    } else {
                        self.phase = Phase::Content;
                    }
                }
                Phase::Thinking { fresh } => {
                    if fresh {
                        self.drop_leading_newlines();
                        if self.pending.is_empty() {
                            return out;
                        }
                        self.phase = Phase::Thinking { fresh: false };
                    }
                    if let Some(end) = self.pending.find(CLOSE) {
                        out.reasoning.push_str(&self.pending[..end]);
                        self.pending.drain(..end + CLOSE.len());
                        self.phase = Phase::AfterThinking;
                    } else {
                        let keep = partial_marker_start(&self.pending, &[CLOSE]);
                        out.reasoning.extend(self.pending.drain(..keep));
                        return out;
                    }
                }
                Phase::AfterThinking => {
                    self.drop_leading_newlines();
                    if self.pending.is_empty() {
                        return out;
                    }
                    self.phase = Phase::Content;
                }
                Phase::Content => {
                    out.content.push_str(&std::mem::take(&mut self.pending));
                    return out;
                }
            }
        }
    }

    /// End of generation: flush held-back text (a partial tag is plain text after all).
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        match self.phase {
            Phase::Thinking { .. } => Split { reasoning: rest, content: String::new() },
            Phase::Start | Phase::AfterThinking | Phase::Content => Split { reasoning: String::new(), content: rest },
        }
    }

    fn drop_leading_newlines(&mut self) {
        let newlines = self.pending.len() - self.pending.trim_start_matches('\n').len();
        self.pending.drain(..newlines);
    }
}

/// True when `prompt` ends inside an open think block: its last "<think>" comes after its last
/// "</think>".
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    match (prompt.rfind(OPEN), prompt.rfind(CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::splittings;

    fn run(starts_in_thinking: bool, deltas: &[&str]) -> Split {
        let mut s = ThinkingSplitter::new(starts_in_thinking);
        let mut all = Split::default();
        let mut parts: Vec<Split> = deltas.iter().map(|d| s.push(d)).collect();
        parts.push(s.finish());
        for part in parts {
            all.reasoning.push_str(&part.reasoning);
            all.content.push_str(&part.content);
        }
        all
    }

    /// Every way of cutting `text` gives the same (reasoning, content).
    fn check(starts_in_thinking: bool, text: &str, reasoning: &str, content: &str) {
        let expected = Split { reasoning: reasoning.to_string(), content: content.to_string() };
        for deltas in splittings(text) {
            assert_eq!(run(starts_in_thinking, &deltas), expected, "deltas {deltas:?}");
        }
    }

    #[test]
    fn prompt_opened_block_closes_into_content() {
        check(true, "\nLet me think.\nOK.\n</think>\n\nThe answer is 4.", "Let me think.\nOK.\n", "The answer is 4.");
    }

    #[test]
    fn output_opening_its_own_block() {
        check(false, "  \n<think>\nhmm</think>\n\nHi", "hmm", "Hi");
        check(false, "<think>\n\n</think>\n\nHi", "", "Hi");
    }

    #[test]
    fn no_block_is_all_content() {
        check(false, "  Hello <think> is just text", "", "  Hello <think> is just text");
        check(false, "\n\nHi </think> there", "", "\n\nHi </think> there");
        check(false, "", "", "");
    }

    #[test]
    fn unterminated_block_is_all_reasoning() {
        check(true, "\nstill thinking </thi", "still thinking </thi", "");
        check(false, "<think>\nhalf", "half", "");
    }

    #[test]
    fn partial_open_tag_at_the_end_is_content() {
        check(false, " <thi", "", " <thi");
    }

    #[test]
    fn tags_split_across_deltas_are_held_back() {
        let mut s = ThinkingSplitter::new(false);
        assert_eq!(s.push("<thi"), Split::default());
        assert_eq!(s.push("nk>\nab</th"), Split { reasoning: "ab".into(), content: String::new() });
        assert_eq!(s.push("ink>\n"), Split::default());
        assert_eq!(s.push("\nok"), Split { reasoning: String::new(), content: "ok".into() });
        assert_eq!(s.finish(), Split::default());
    }

    #[test]
    fn only_leading_newlines_are_dropped() {
        check(true, "\n\n a\n\nb\n</think>\n\n c\n\nd\n", " a\n\nb\n", " c\n\nd\n");
    }

    #[test]
    fn unicode_near_tags() {
        check(true, "é🙂\n</think>\n🙂é", "é🙂\n", "🙂é");
        check(false, "🙂<think>é</think>x", "", "🙂<think>é</think>x");
    }

    #[test]
    fn prompt_detection_uses_the_last_tags() {
        assert!(prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(prompt_opens_thinking("<think>a</think> b <think>\n"));
        assert!(!prompt_opens_thinking("no tags at all"));
        assert!(!prompt_opens_thinking("stray </think>"));
    }
}
