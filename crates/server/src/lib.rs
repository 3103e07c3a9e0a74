//! The HTTP server: OpenAI- and Anthropic-compatible endpoints over the engine. The only crate
//! that knows HTTP and the wire schemas.

pub mod parse;
