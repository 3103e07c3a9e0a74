//! Images in requests. Where the messages are read, each image content part (OpenAI
//! `image_url`, Anthropic `image`) becomes its bytes (inline base64) or its URL, and a
//! placeholder in the message's text; off the async threads URLs are fetched (when the server
//! allows it), the images decoded and prepared by the model's processor, the chat template carries the placeholders to where the
//! images stand and they become its vision markup, and each image token is then repeated as many
//! times as its image gives tokens.

use std::io::Read;
use std::time::Duration;

use base64::Engine as _;
use strata_model::images::media_type;
use strata_model::{expand_image_tokens, ImageLimits, PreparedImage};

use crate::error::{ApiError, ApiResult};
use crate::state::Shared;

/// Stands for an image in a message's text until the template has placed it (a Unicode
/// noncharacter: no text is meant to carry one).
pub const PLACEHOLDER: char = '\u{FDD2}';

const MEDIA_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/webp", "image/gif"];

/// What a server takes of images.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageOptions {
    /// Images one request may hold (0: none).
    pub max_per_request: usize,
    /// Pixels an image may declare before it is decoded (a decompression bomb is refused).
    pub max_pixels: u64,
    /// Whether `http(s)` image URLs are fetched (the server then reaches what the client names).
    pub allow_urls: bool,
}

impl Default for ImageOptions {
    fn default() -> Self {
        Self { max_per_request: 8, max_pixels: ImageLimits::default().max_pixels, allow_urls: false }
    }
}

/// Most bytes, and most time, a fetched image may take.
const URL_MAX_BYTES: u64 = 32 << 20;
const URL_TIMEOUT: Duration = Duration::from_secs(20);

/// One image of a request as sent, and the request parameter it came from.
pub struct ImagePart {
    pub source: Source,
    pub param: String,
}

pub enum Source {
    /// The bytes, and the media type the request declared.
    Inline { bytes: Vec<u8>, media_type: String },
    /// An `http(s)` URL, fetched only where the server allows it.
    Url(String),
}

impl ImagePart {
    /// An OpenAI `image_url.url`: a `data:image/…;base64,…` URL, or an `http(s)` one.
    pub fn from_url(url: &str, param: &str) -> ApiResult<Self> {
        let bad = |why: &str| ApiError::bad_request(format!("{param}: {why}"), Some(param));
        if url.starts_with("http://") || url.starts_with("https://") {
            return Ok(Self { source: Source::Url(url.into()), param: param.into() });
        }
        let rest = url.strip_prefix("data:").ok_or_else(|| bad("expected a data: URL (data:image/png;base64,…)"))?;
        let (header, data) = rest.split_once(',').ok_or_else(|| bad("the data: URL has no comma before its data"))?;
        let media_type =
            header.strip_suffix(";base64").ok_or_else(|| bad("the data: URL must be base64 (data:image/png;base64,…)"))?;
        Self::from_base64(media_type, data, param)
    }

    /// An image given as base64 text of the declared media type.
    pub fn from_base64(media_type: &str, data: &str, param: &str) -> ApiResult<Self> {
        let bad = |why: String| ApiError::bad_request(format!("{param}: {why}"), Some(param));
        if !MEDIA_TYPES.contains(&media_type) {
            return Err(bad(format!("media type `{media_type}` is not one of {}", MEDIA_TYPES.join(", "))));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| bad(format!("the image data is not valid base64: {e}")))?;
        Ok(Self { source: Source::Inline { bytes, media_type: media_type.into() }, param: param.into() })
    }

    /// The image's bytes and their media type: inline, or fetched (within [`URL_MAX_BYTES`] and
    /// [`URL_TIMEOUT`]) where `options` allow it.
    fn bytes(&self, options: &ImageOptions) -> Result<(std::borrow::Cow<'_, [u8]>, String), String> {
        let url = match &self.source {
            Source::Inline { bytes, media_type } => return Ok((bytes.into(), media_type.clone())),
            Source::Url(url) if options.allow_urls => url,
            Source::Url(_) => return Err(
                "image URLs are not fetched by this server (start it with --allow-image-urls); send the image inline as base64"
                    .into(),
            ),
        };
        let agent = ureq::AgentBuilder::new().timeout(URL_TIMEOUT).redirects(4).build();
        let response = agent.get(url).call().map_err(|e| format!("cannot fetch {url}: {e}"))?;
        let declared = response.content_type().to_string();
        let mut bytes = Vec::new();
        response.into_reader().take(URL_MAX_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot fetch {url}: {e}"))?;
        if bytes.len() as u64 > URL_MAX_BYTES {
            return Err(format!("{url} is more than {URL_MAX_BYTES} bytes"));
        }
        // A server's declared type is often generic (application/octet-stream): the bytes decide.
        let media_type = media_type(&bytes).map(str::to_string).unwrap_or(declared);
        Ok((bytes.into(), media_type))
    }
}

/// The request's images decoded and prepared with the model's processor (in
/// [`crate::request::prepare`], off the async threads). Each failure names its content part.
pub fn prepare(state: &Shared, parts: &[ImagePart]) -> ApiResult<Vec<PreparedImage>> {
    let Some(first) = parts.first() else { return Ok(Vec::new()) };
    let options = &state.config.images;
    if options.max_per_request == 0 {
        return Err(ApiError::bad_request("this server takes no images (--max-images-per-request 0)", Some(&first.param)));
    }
    let processor = match (&state.image_processor, state.worker.vision()) {
        (Some(processor), Some(_)) => processor,
        _ => return Err(ApiError::bad_request("this model takes no images (it has no vision tower)", Some(&first.param))),
    };
    if let Some(extra) = parts.get(options.max_per_request) {
        return Err(ApiError::bad_request(
            format!(
                "{} images; this server takes at most {} per request (--max-images-per-request)",
                parts.len(),
                options.max_per_request
            ),
            Some(&extra.param),
        ));
    }
    let limits = ImageLimits { max_pixels: options.max_pixels };
    parts
        .iter()
        .map(|part| {
            let bad = |why: String| ApiError::bad_request(format!("{}: {why}", part.param), Some(&part.param));
            let (bytes, declared) = part.bytes(options).map_err(bad)?;
            match media_type(&bytes) {
                Some(found) if found != declared => return Err(bad(format!("the data is {found}, not the declared {declared}"))),
                _ => {}
            }
            processor.prepare(&bytes, limits).map_err(bad)
        })
        .collect()
}

/// The rendered prompt's image tokens, each repeated as many times as its image gives tokens.
pub fn expand(state: &Shared, tokens: Vec<u32>, images: &[PreparedImage]) -> ApiResult<Vec<u32>> {
    let Some(vision) = state.worker.vision().filter(|_| !images.is_empty()) else { return Ok(tokens) };
    expand_image_tokens(&tokens, images, vision).map_err(|e| {
        ApiError::bad_request(
            format!("the chat template did not place every image ({e}); is U+FDD2 in the text?"),
            Some("messages"),
        )
    })
}
