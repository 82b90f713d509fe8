//! Result files that several benchmarks write into: each owns one `## ` section of a
//! Markdown file (and one key of its JSON), and a run rewrites only its own. A benchmark
//! may in turn rewrite one `### ` part of its section at a time.

/// How many `#` open a heading line; 0 for any other line.
fn level(line: &str) -> usize {
    let hashes = line.len() - line.trim_start_matches('#').len();
    if hashes > 0 && line[hashes..].starts_with(' ') {
        hashes
    } else {
        0
    }
}

/// The line range of the section under `heading` in `lines`: from the heading to the next
/// heading of its level or above, or the end.
fn span(lines: &[&str], heading: &str) -> Option<(usize, usize)> {
    let start = lines.iter().position(|l| l.trim_end() == heading)?;
    let depth = level(heading);
    let end = lines[start + 1..]
        .iter()
        .position(|l| (1..=depth).contains(&level(l)))
        .map_or(lines.len(), |k| start + 1 + k);
    Some((start, end))
}

/// The section under `heading` (its heading line included), if `document` has one.
pub fn section(document: &str, heading: &str) -> Option<String> {
    let lines: Vec<&str> = document.lines().collect();
    let (start, end) = span(&lines, heading)?;
    Some(lines[start..end].join("\n").trim_end().to_string() + "\n")
}

/// `document` with the section under `heading` (a `## ` or deeper heading line) replaced
/// by `section` (which starts with that heading line); the section is appended when the
/// document has none. A section runs to the next heading of its level or above, or the end.
pub fn replace_section(document: &str, heading: &str, section: &str) -> String {
    let lines: Vec<&str> = document.lines().collect();
    let mut section = section.trim_end().to_string();
    section.push('\n');
    let Some((start, end)) = span(&lines, heading) else {
        let mut out = document.trim_end().to_string();
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        return out + &section;
    };
    let mut out = lines[..start].join("\n");
    if start > 0 {
        out.push('\n');
    }
    out.push_str(&section);
    if end < lines.len() {
        out.push('\n');
        out.push_str(&lines[end..].join("\n"));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_only_its_own_section() {
        let doc = "# T\n\n## A\nold a\n\n## B\nkeep b\n";
        let out = replace_section(doc, "## A", "## A\nnew a\n");
        assert_eq!(out, "# T\n\n## A\nnew a\n\n## B\nkeep b\n");
        let last = replace_section(&out, "## B", "## B\nnew b");
        assert_eq!(last, "# T\n\n## A\nnew a\n\n## B\nnew b\n");
        // A heading that merely starts like another is not it.
        assert_eq!(replace_section("## Ab\nx\n", "## A", "## A\ny"), "## Ab\nx\n\n## A\ny\n");
    }

    #[test]
    fn a_subsection_runs_to_the_next_heading_of_its_level_or_above() {
        let doc = "# T\n\n## A\nintro\n\n### x\nold x\n\n### y\nkeep y\n\n## B\nkeep b\n";
        assert_eq!(section(doc, "### x").unwrap(), "### x\nold x\n");
        assert_eq!(section(doc, "### y").unwrap(), "### y\nkeep y\n");
        assert_eq!(section(doc, "## A").unwrap(), "## A\nintro\n\n### x\nold x\n\n### y\nkeep y\n");
        assert_eq!(section(doc, "### z"), None);
        let out = replace_section(doc, "### y", "### y\nnew y");
        assert_eq!(out, "# T\n\n## A\nintro\n\n### x\nold x\n\n### y\nnew y\n\n## B\nkeep b\n");
        // `#` inside a line, or without the space, is not a heading.
        assert_eq!(section("## A\n#x\na # b\n## B\n", "## A").unwrap(), "## A\n#x\na # b\n");
    }

    #[test]
    fn appends_a_missing_section_and_starts_an_empty_document() {
        assert_eq!(replace_section("# T\n\n## A\na\n", "## C", "## C\nc"), "# T\n\n## A\na\n\n## C\nc\n");
        assert_eq!(replace_section("", "## C", "## C\nc\n\n"), "## C\nc\n");
    }
}
