//! Stop strings matched on decoded text. Tokens rarely line up with a stop string, so matching
//! happens on text, and whatever might be the start of a stop string is held back until the next
//! delta settles it: a stop string never reaches the client, even when it spans deltas.

use super::partial_marker_start;

/// Finds the first stop string in a stream of text deltas.
///
/// When stop strings overlap, the one that *ends* first wins (ties go to the one starting first).
/// That is what a token-by-token check sees, and it makes the result independent of where the
/// deltas were cut.
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted: a suffix that could still grow into a stop string.
    pending: String,
    /// Index in `stops` of the stop string hit; everything after it is discarded.
    hit: Option<usize>,
}

impl StopMatcher {
    /// Empty strings are ignored: they would match before any text.
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self { stops, pending: String::new(), hit: None }
    }

    /// Feed a delta; returns (text safe to emit now, true if a stop string was hit).
    /// On a hit, the returned text is everything before the stop string; nothing after is ever
    /// emitted, and later calls return `("", true)`.
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        if self.hit.is_some() {
            return (String::new(), true);
        }
        self.pending.push_str(delta);
        // Every match that ended in earlier text was already found, and none can start in text
        // already emitted, so the earliest-ending match in `pending` is the earliest overall.
        let first = self.stops.iter().enumerate();
        let hit = first.filter_map(|(i, s)| self.pending.find(s.as_str()).map(|start| (start + s.len(), start, i))).min();
        if let Some((_, start, i)) = hit {
            self.hit = Some(i);
            self.pending.truncate(start);
            return (std::mem::take(&mut self.pending), true);
        }
        let keep = partial_marker_start(&self.pending, &self.stops);
        let rest = self.pending.split_off(keep);
        (std::mem::replace(&mut self.pending, rest), false)
    }

    /// The stop string that was hit, if any: APIs report it (Anthropic's `stop_sequence`).
    pub fn matched(&self) -> Option<&str> {
        self.hit.map(|i| self.stops[i].as_str())
    }

    /// End of generation without a hit: the held-back remainder (empty after a hit).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::splittings;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    /// Runs `deltas` through, checking that nothing is emitted after a hit; returns the whole
    /// emitted text and the stop string hit.
    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<String>) {
        let mut m = matcher(stops);
        let mut out = String::new();
        let mut hit = false;
        for d in deltas {
            let (text, now) = m.push(d);
            assert!(!hit || text.is_empty(), "text emitted after the stop: {text:?}");
            out.push_str(&text);
            hit |= now;
            assert_eq!(hit, m.matched().is_some());
        }
        if !hit {
            out.push_str(&m.finish());
        }
        (out, m.matched().map(str::to_string))
    }

    /// Every way of cutting `text` gives `expected`, and the emitted text never contains a stop.
    fn check(stops: &[&str], text: &str, expected: (&str, Option<&str>)) {
        for deltas in splittings(text) {
            let (out, hit) = run(stops, &deltas);
            assert_eq!((out.as_str(), hit.as_deref()), expected, "deltas {deltas:?}");
            assert!(stops.iter().all(|s| s.is_empty() || !out.contains(s)), "stop leaked: {out:?}");
        }
    }

    #[test]
    fn stop_inside_text_cuts_before_it() {
        check(&["STOP"], "Hello world STOP and more", ("Hello world ", Some("STOP")));
    }

    #[test]
    fn no_stop_passes_everything_through() {
        check(&["STOP"], "Hello STO world ST", ("Hello STO world ST", None));
        check(&[], "plain text", ("plain text", None));
    }

    #[test]
    fn stop_spanning_deltas_never_leaks() {
        let (out, hit) = run(&["</answer>"], &["the answer is 4</an", "sw", "er> tail"]);
        assert_eq!((out.as_str(), hit.as_deref()), ("the answer is 4", Some("</answer>")));
    }

    #[test]
    fn only_a_possible_stop_prefix_is_held_back() {
        let mut m = matcher(&["abc"]);
        assert_eq!(m.push("xxab"), ("xx".to_string(), false));
        assert_eq!(m.push("x"), ("abx".to_string(), false));
        assert_eq!(m.push("a"), (String::new(), false));
        assert_eq!(m.finish(), "a");
    }

    #[test]
    fn earliest_ending_stop_wins_when_stops_overlap() {
        check(&["abcd", "bc"], "xabcd", ("xa", Some("bc")));
        check(&["abc", "bc"], "xabc", ("x", Some("abc")));
        check(&["\n\n", "\n"], "one\n\ntwo", ("one", Some("\n")));
    }

    #[test]
    fn unicode_near_cuts_and_inside_stops() {
        check(&["é!"], "café é? déjà é! après", ("café é? déjà ", Some("é!")));
        check(&["🙂🙃"], "smile 🙂 then 🙂🙃 done", ("smile 🙂 then ", Some("🙂🙃")));
        check(&["🙂🙃"], "ends with 🙂", ("ends with 🙂", None));
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        check(&["", "END"], "text END", ("text ", Some("END")));
    }

    #[test]
    fn calls_after_a_hit_emit_nothing() {
        let mut m = matcher(&["x"]);
        assert_eq!(m.matched(), None);
        assert_eq!(m.push("ax b"), ("a".to_string(), true));
        assert_eq!(m.matched(), Some("x"));
        assert_eq!(m.push("more"), (String::new(), true));
        assert_eq!(m.finish(), "");
    }
}
