//! Result files that several benchmarks write into: each owns one `## ` section of a
//! Markdown file (and one key of its JSON), and a run rewrites only its own.

/// `document` with the section under `heading` (a `## ` line) replaced by `section`
/// (which starts with that heading line); the section is appended when the document has
/// none. A section runs to the next `## ` heading or the end.
pub fn replace_section(document: &str, heading: &str, section: &str) -> String {
    let lines: Vec<&str> = document.lines().collect();
    let mut section = section.trim_end().to_string();
    section.push('\n');
    let Some(start) = lines.iter().position(|l| l.trim_end() == heading) else {
        let mut out = document.trim_end().to_string();
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        return out + &section;
    };
    let end = lines[start + 1..].iter().position(|l| l.starts_with("## ")).map_or(lines.len(), |k| start + 1 + k);
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
    fn appends_a_missing_section_and_starts_an_empty_document() {
        assert_eq!(replace_section("# T\n\n## A\na\n", "## C", "## C\nc"), "# T\n\n## A\na\n\n## C\nc\n");
        assert_eq!(replace_section("", "## C", "## C\nc\n\n"), "## C\nc\n");
    }
}
