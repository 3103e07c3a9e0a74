//! Turning generated text into API fields: stop strings, thinking blocks, tool calls.

pub mod stop;
pub mod thinking;
pub mod tool_calls;

/// Byte index where the longest suffix of `text` that is a proper prefix of one of `markers`
/// starts (`text.len()` when there is none). Streaming parsers hold that suffix back because the
/// next delta may complete the marker; holding back anything shorter could leak half a marker.
pub(crate) fn partial_marker_start<S: AsRef<str>>(text: &str, markers: &[S]) -> usize {
    let longest = markers.iter().map(|m| m.as_ref().len()).max().unwrap_or(0);
    let floor = text.len().saturating_sub(longest.saturating_sub(1));
    (floor..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .find(|&i| {
            let tail = &text[i..];
            markers.iter().any(|m| m.as_ref().len() > tail.len() && m.as_ref().starts_with(tail))
        })
        .unwrap_or(text.len())
}

/// Every way the parsers' tests cut one text into deltas: whole, char by char, and at every pair
/// of char boundaries (which covers every single cut too), so a marker or a multi-byte char can
/// land across any delta boundary.
#[cfg(test)]
pub(crate) fn splittings(text: &str) -> Vec<Vec<&str>> {
    let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    let mut all = vec![vec![text], text.char_indices().map(|(i, c)| &text[i..i + c.len_utf8()]).collect()];
    for (n, &i) in cuts.iter().enumerate() {
        for &j in &cuts[n..] {
            all.push(vec![&text[..i], &text[i..j], &text[j..]]);
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_marker_is_the_longest_proper_prefix_suffix() {
        assert_eq!(partial_marker_start("abc<thi", &["<think>"]), 3);
        assert_eq!(partial_marker_start("abc<think>", &["<think>"]), 10, "a whole marker is not partial");
        assert_eq!(partial_marker_start("abc", &["<think>"]), 3);
        assert_eq!(partial_marker_start("xaa", &["aab", "ab"]), 1);
        assert_eq!(partial_marker_start("é", &["éa"]), 0);
        assert_eq!(partial_marker_start("anything", &[] as &[&str]), 8);
    }

    #[test]
    fn splittings_cover_whole_single_cuts_and_chars() {
        let s = splittings("aé");
        assert!(s.contains(&vec!["aé"]));
        assert!(s.contains(&vec!["a", "é"]));
        assert!(s.iter().all(|parts| parts.concat() == "aé"));
    }
}
