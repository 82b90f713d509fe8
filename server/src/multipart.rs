//! Bounds on what the multipart parser holds for an upload. The parser (`multer`, under
//! axum's `Multipart`) buffers a part's headers until their blank line and the preamble
//! until the first boundary, however long; this module watches the raw body on its way
//! in and stops it once a part's headers, the bytes around the parts or the number of
//! parts pass the limits below. Part bodies stream on: their sizes are the handlers'
//! budgets (`TESSERA_MAX_UPLOAD_BYTES`), text fields are read with a cap of their own.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::header::CONTENT_TYPE;
use futures_util::Stream;

/// Most parts one upload may have: a model folder has at most 15 allowed files besides
/// its `name`; a checkpoint a handful of files.
pub const MAX_PARTS: usize = 64;

/// Most bytes of one part's headers (its `Content-Disposition` with the file's path,
/// `Content-Type`, …), and of the preamble and epilogue around the parts.
pub const MAX_PART_HEADER_BYTES: usize = 8 << 10;

/// Most bytes of a text field (`name`, `step`).
pub const MAX_TEXT_FIELD_BYTES: usize = 4 << 10;

/// An upload passed one of the limits; the body stops there and the client gets a 413
/// with this sentence.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MultipartLimit {
    #[error("A part's headers (or the bytes before the first part) are longer than {MAX_PART_HEADER_BYTES} bytes; send short part headers: a field name and a file name.")]
    PartHeader,
    #[error("The upload has more than {MAX_PARTS} parts; send one part per file and one per text field.")]
    Parts,
    #[error(
        "The text field '{field}' is longer than {MAX_TEXT_FIELD_BYTES} bytes; send a short value."
    )]
    TextField { field: String },
}

/// The request with its body watched by a [`Scanner`]. A request that names no boundary
/// is returned as it is: axum's extractor refuses it.
pub fn bounded(request: Request) -> Request {
    let Some(boundary) = request
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(boundary)
    else {
        return request;
    };
    let (parts, body) = request.into_parts();
    let scanner = Scanner::new(body.into_data_stream(), &boundary);
    Request::from_parts(parts, Body::from_stream(scanner))
}

/// The `boundary` parameter of a `multipart/form-data` content type, read as the parser
/// reads it (a quoted boundary may hold `;`), so both follow the same delimiter.
fn boundary(content_type: &str) -> Option<String> {
    multer::parse_boundary(content_type).ok()
}

/// Where in the multipart framing the bytes seen so far end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Before the first `--boundary`.
    Preamble,
    /// After a boundary, before the line break that ends its line.
    BoundaryLine,
    /// After a boundary line, before the blank line that ends the part's headers (or,
    /// after the closing boundary, in the epilogue). The parser looks for that blank line
    /// only past the boundary line's own line break, so this does too: `--B\r\n\r\n` is
    /// not an empty header block to either.
    Headers,
    /// In a part's body, until the next `\r\n--boundary`.
    Body,
}

/// Follows the framing of a multipart body through its chunks, counting what the parser
/// would buffer; the searched delimiters may straddle chunks, so the last few bytes of
/// each chunk are carried to the next.
struct Framer {
    first_delimiter: Vec<u8>,
    delimiter: Vec<u8>,
    framing: Framing,
    /// Bytes seen in the current preamble or header block.
    held: usize,
    /// Boundaries seen (the closing one included).
    boundaries: usize,
    carry: Vec<u8>,
}

const LINE_END: &[u8] = b"\r\n";
const HEADERS_END: &[u8] = b"\r\n\r\n";

impl Framer {
    fn new(boundary: &str) -> Framer {
        Framer {
            first_delimiter: format!("--{boundary}").into_bytes(),
            delimiter: format!("\r\n--{boundary}").into_bytes(),
            framing: Framing::Preamble,
            held: 0,
            boundaries: 0,
            carry: Vec::new(),
        }
    }

    fn pattern(&self) -> &[u8] {
        match self.framing {
            Framing::Preamble => &self.first_delimiter,
            Framing::BoundaryLine => LINE_END,
            Framing::Headers => HEADERS_END,
            Framing::Body => &self.delimiter,
        }
    }

    /// Follows `chunk`; an error once a limit is passed.
    fn feed(&mut self, mut chunk: &[u8]) -> Result<(), MultipartLimit> {
        loop {
            let pattern = self.pattern().to_vec();
            match find_across(&self.carry, chunk, &pattern) {
                Some(end) => {
                    self.hold(end)?;
                    self.carry.clear();
                    chunk = &chunk[end..];
                    self.framing = match self.framing {
                        Framing::Preamble | Framing::Body => {
                            self.boundaries += 1;
                            // The closing boundary is one more than the parts.
                            if self.boundaries > MAX_PARTS + 1 {
                                return Err(MultipartLimit::Parts);
                            }
                            Framing::BoundaryLine
                        }
                        Framing::BoundaryLine => Framing::Headers,
                        Framing::Headers => Framing::Body,
                    };
                    if self.framing != Framing::Headers {
                        self.held = 0;
                    }
                }
                None => {
                    self.hold(chunk.len())?;
                    let keep = pattern.len() - 1;
                    let mut joined = std::mem::take(&mut self.carry);
                    joined.extend_from_slice(&chunk[chunk.len().saturating_sub(keep)..]);
                    self.carry = joined[joined.len().saturating_sub(keep)..].to_vec();
                    return Ok(());
                }
            }
        }
    }

    fn hold(&mut self, bytes: usize) -> Result<(), MultipartLimit> {
        if self.framing != Framing::Body {
            self.held += bytes;
            if self.held > MAX_PART_HEADER_BYTES {
                return Err(MultipartLimit::PartHeader);
            }
        }
        Ok(())
    }
}

/// Where the first match of `pattern` in `carry` followed by `chunk` ends, as an index
/// into `chunk`. `carry` is shorter than `pattern`.
fn find_across(carry: &[u8], chunk: &[u8], pattern: &[u8]) -> Option<usize> {
    if !carry.is_empty() {
        let mut head = carry.to_vec();
        head.extend_from_slice(&chunk[..chunk.len().min(pattern.len() - 1)]);
        if let Some(start) = memchr::memmem::find(&head, pattern) {
            if start < carry.len() {
                return Some(start + pattern.len() - carry.len());
            }
        }
    }
    memchr::memmem::find(chunk, pattern).map(|start| start + pattern.len())
}

/// A body stream that fails once the framing it follows passes a limit.
pub struct Scanner<S> {
    inner: S,
    framer: Framer,
    failed: bool,
}

impl<S> Scanner<S> {
    fn new(inner: S, boundary: &str) -> Scanner<S> {
        Scanner {
            inner,
            framer: Framer::new(boundary),
            failed: false,
        }
    }
}

impl<S, E> Stream for Scanner<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Into<axum::BoxError>,
{
    type Item = Result<Bytes, axum::BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.failed {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => match self.framer.feed(&chunk) {
                Ok(()) => Poll::Ready(Some(Ok(chunk))),
                Err(limit) => {
                    self.failed = true;
                    Poll::Ready(Some(Err(limit.into())))
                }
            },
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(error.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The limit behind a multipart error, when the error came from a [`Scanner`].
pub fn limit_behind<'e>(
    error: &'e (dyn std::error::Error + 'static),
) -> Option<&'e MultipartLimit> {
    let mut current = Some(error);
    while let Some(error) = current {
        if let Some(limit) = error.downcast_ref::<MultipartLimit>() {
            return Some(limit);
        }
        current = error.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_in_chunks(body: &[u8], size: usize) -> Result<Framer, MultipartLimit> {
        let mut framer = Framer::new("XyZ");
        for chunk in body.chunks(size) {
            framer.feed(chunk)?;
        }
        Ok(framer)
    }

    fn form(parts: usize, header_pad: usize) -> Vec<u8> {
        let mut body = Vec::new();
        for i in 0..parts {
            body.extend_from_slice(b"--XyZ\r\nContent-Disposition: form-data; name=\"files\"");
            body.extend_from_slice(&vec![b'a'; header_pad]);
            body.extend_from_slice(
                format!("\r\n\r\nbody {i} with \r\n--XyY near misses\r\n").as_bytes(),
            );
        }
        body.extend_from_slice(b"--XyZ--\r\n");
        body
    }

    #[test]
    fn follows_parts_across_any_chunking() {
        for size in [1, 2, 3, 5, 7, 64, 4096] {
            let framer = feed_in_chunks(&form(3, 10), size).unwrap();
            assert_eq!(framer.boundaries, 4, "chunks of {size}");
            assert_eq!(framer.framing, Framing::Headers);
        }
    }

    #[test]
    fn stops_long_part_headers_too_many_parts_and_long_preambles() {
        for size in [3, 1000] {
            assert!(matches!(
                feed_in_chunks(&form(1, MAX_PART_HEADER_BYTES), size),
                Err(MultipartLimit::PartHeader)
            ));
            assert!(matches!(
                feed_in_chunks(&form(MAX_PARTS + 1, 0), size),
                Err(MultipartLimit::Parts)
            ));
            assert!(feed_in_chunks(&form(MAX_PARTS, 0), size).is_ok());
            let mut preamble = vec![b'x'; MAX_PART_HEADER_BYTES + 1];
            preamble.extend_from_slice(&form(1, 0));
            assert!(matches!(
                feed_in_chunks(&preamble, size),
                Err(MultipartLimit::PartHeader)
            ));
        }
    }

    #[test]
    fn a_blank_line_right_after_the_boundary_is_not_an_empty_header_block() {
        // The parser holds everything after `--XyZ\r\n` until a blank line, so this is
        // one endless header block, not a part body.
        let mut body = b"--XyZ\r\n\r\n".to_vec();
        body.extend_from_slice(&vec![b'A'; MAX_PART_HEADER_BYTES]);
        for size in [1, 3, 1000] {
            assert!(matches!(feed_in_chunks(&body, size), Err(MultipartLimit::PartHeader)), "chunks of {size}");
        }
        // A part whose headers are the boundary line's break and one blank line streams on.
        let mut body = b"--XyZ\r\n\r\n\r\n".to_vec();
        body.extend_from_slice(&vec![b'A'; 2 * MAX_PART_HEADER_BYTES]);
        assert_eq!(feed_in_chunks(&body, 7).unwrap().framing, Framing::Body);
    }

    #[test]
    fn reads_the_boundary_parameter() {
        assert_eq!(
            boundary("multipart/form-data; boundary=abc").as_deref(),
            Some("abc")
        );
        assert_eq!(
            boundary("Multipart/Form-Data;charset=utf-8; Boundary=\"a b\"").as_deref(),
            Some("a b")
        );
        assert_eq!(boundary("multipart/form-data; boundary=\"a;b\"").as_deref(), Some("a;b"));
        assert_eq!(boundary("text/plain; boundary=abc"), None);
        assert_eq!(boundary("multipart/form-data"), None);
    }
}
