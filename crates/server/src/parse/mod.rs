//! Turning generated text into API fields: stop strings, thinking blocks, tool calls.
