//! The `strata` binary. Only this crate reads arguments and the environment.

mod bench;
mod cache;
mod common;
mod demo;
mod draft;
mod generate;
mod hub;
mod logits;
mod perplexity;
mod serve;
mod serving;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Inference engine and server for language models: hybrid Qwen3.5, dense, Gemma 3; safetensors and GGUF"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it as it is produced.
    Generate(generate::Args),
    /// Write the logits of a token sequence to a safetensors file.
    Logits(logits::Args),
    /// Measure prefill and decode tokens/s, or (--request-rate) a server under load over HTTP.
    Bench(bench::Args),
    /// Serve the OpenAI- and Anthropic-compatible HTTP API.
    Serve(serve::Args),
    /// Perplexity of a model over a text file, with tokens/s.
    Perplexity(perplexity::Args),
    /// List the tokens a text uses most, for `--draft-vocab FILE`.
    DraftVocab(draft::VocabArgs),
}

fn main() {
    // candle runs its quantized matmuls (the GGUF formats strata has no kernel of its own for) on
    // a second thread pool whose workers spin while waiting; beside rayon's, which runs strata's
    // kernels, the two pools starve each other on small machines (Gemma 3 270M decode on 2 cores:
    // 6 vs 19 tok/s). Unless the user chose otherwise, candle's share runs on the calling thread.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Logits(args) => logits::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::DraftVocab(args) => draft::run_vocab(args),
    };
    if let Err(e) = result {
        eprintln!("error: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, as anyhow's `{:#}` writes them, less any cause an outer
/// message already shows: many errors include their source in their own text ("DIR: Permission
/// denied (os error 13)") and also return it as their source, which `{:#}` would print again.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain().map(ToString::to_string) {
        if line.contains(&cause) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&cause);
    }
    line
}
