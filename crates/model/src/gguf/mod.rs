//! GGUF files (llama.cpp's single-file format): metadata read into the Hugging Face config the
//! architectures already parse, tensors served under their Hugging Face names and conventions and
//! kept quantized for the matrix multiplies, and the tokenizer rebuilt from metadata.

pub mod tokenizer;

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use serde_json::{json, Map};
use strata_kernels::quant::{BlockFormat, QuantMatrix};

use crate::error::{ModelError, Result};
use crate::qwen3_5::layers::Matrix;
use crate::source::WeightSource;

/// Architectures (`general.architecture`) strata reads from GGUF, by the `model_type` their
/// Hugging Face config carries.
const ARCHITECTURES: [(&str, &str); 6] = [
    ("gemma3", "gemma3_text"),
    ("llama", "llama"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("qwen35", "qwen3_5_text"),
    ("qwen35moe", "qwen3_5_moe_text"),
];

/// Qwen3.5, dense (`qwen35`) or mixture-of-experts (`qwen35moe`): the same decoder, converter
/// transforms and tensor names but for the feed-forward.
fn is_qwen35(arch: &str) -> bool {
    arch == "qwen35" || arch == "qwen35moe"
}

pub struct GgufFile {
    pub path: PathBuf,
    mmap: Mmap,
    content: Content,
    arch: String,
}

impl GgufFile {
    /// Reads the header (metadata and tensor table) and checks every tensor lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::file(path, format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only; strata never writes model files while serving them.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::file(path, format!("cannot map: {e}")))?;
        let content = Content::read(&mut Cursor::new(&mmap[..]))
            .map_err(|e| ModelError::file(path, format!("not a valid GGUF file (truncated or corrupt?): {e}")))?;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            let bytes = (elems / block) as u64 * info.ggml_dtype.type_size() as u64;
            let end = content.tensor_data_offset.checked_add(info.offset).and_then(|at| at.checked_add(bytes));
            if !elems.is_multiple_of(block) || end.is_none_or(|end| end > mmap.len() as u64) {
                return Err(ModelError::file(path, format!("tensor `{name}` runs past the end of the file (truncated?)")));
            }
        }
        let arch = match content.metadata.get("general.architecture") {
            Some(Value::String(a)) => a.clone(),
            _ => return Err(ModelError::file(path, "metadata `general.architecture` is missing")),
        };
        Ok(Self { path: path.to_path_buf(), mmap, content, arch })
    }

    pub fn architecture(&self) -> &str {
        &self.arch
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// `tokenizer.chat_template`, when the file carries one.
    pub fn chat_template(&self) -> Option<&str> {
        match self.metadata().get("tokenizer.chat_template") {
            Some(Value::String(t)) => Some(t),
            _ => None,
        }
    }

    /// The Hugging Face `config.json` equivalent of the metadata, so the architectures parse
    /// (and validate) one format. Values llama.cpp fixes in code rather than metadata are filled
    /// in as llama.cpp does.
    pub fn hf_config(&self) -> Result<serde_json::Value> {
        let model_type = ARCHITECTURES.iter().find(|(a, _)| *a == self.arch).map(|(_, t)| *t).ok_or_else(|| {
            let known: Vec<&str> = ARCHITECTURES.iter().map(|(a, _)| *a).collect();
            ModelError::file(
                &self.path,
                format!("GGUF architecture `{}` is not supported (supported: {})", self.arch, known.join(", ")),
            )
        })?;
        let md = Metadata { file: self, prefix: format!("{}.", self.arch) };
        if is_qwen35(&self.arch) {
            return self.qwen35_config(&md, model_type);
        }
        let hidden = md.usize("embedding_length")?;
        let heads = md.usize("attention.head_count")?;
        let head_dim = md.opt_usize("attention.key_length")?.unwrap_or(hidden / heads.max(1));
        let vocab = self.tensor_rows("token_embd.weight")?;
        let mut c = Map::new();
        c.insert("model_type".into(), json!(model_type));
        c.insert("vocab_size".into(), json!(vocab));
        c.insert("hidden_size".into(), json!(hidden));
        c.insert("intermediate_size".into(), json!(md.usize("feed_forward_length")?));
        c.insert("num_hidden_layers".into(), json!(md.usize("block_count")?));
        c.insert("num_attention_heads".into(), json!(heads));
        c.insert("num_key_value_heads".into(), json!(md.opt_usize("attention.head_count_kv")?.unwrap_or(heads)));
        c.insert("head_dim".into(), json!(head_dim));
        c.insert("rms_norm_eps".into(), json!(md.f64("attention.layer_norm_rms_epsilon")?));
        c.insert("max_position_embeddings".into(), json!(md.usize("context_length")?));
        c.insert("rope_theta".into(), json!(md.opt_f64("rope.freq_base")?.unwrap_or(10_000.0)));
        c.insert("tie_word_embeddings".into(), json!(!self.content.tensor_infos.contains_key("output.weight")));
        if let Some(eos) = md.global_usize("tokenizer.ggml.eos_token_id")? {
            c.insert("eos_token_id".into(), json!(eos));
        }
        match md.opt_string("rope.scaling.type")?.as_deref() {
            None | Some("none") => {}
            Some("linear") => {
                c.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": md.f64("rope.scaling.factor")?}));
            }
            Some(other) => return Err(md.err("rope.scaling.type", format!("`{other}` is not supported"))),
        }
        if self.content.tensor_infos.contains_key("rope_freqs.weight") {
            return Err(ModelError::file(&self.path, "per-frequency RoPE factors (`rope_freqs.weight`) are not supported"));
        }
        if self.arch == "gemma3" {
            c.insert("sliding_window".into(), json!(md.usize("attention.sliding_window")?));
            // llama.cpp fixes these for Gemma 3: every sixth layer global, local RoPE base 10000,
            // and queries scaled by 1/sqrt(head_dim) except in the 27B model (hidden / heads).
            c.insert("sliding_window_pattern".into(), json!(6));
            c.insert("rope_local_base_freq".into(), json!(10_000.0));
            let is_27b = md.usize("block_count")? == 62;
            c.insert("query_pre_attn_scalar".into(), json!(if is_27b { hidden / heads } else { head_dim }));
            if let Some(cap) = md.opt_f64("final_logit_softcapping")? {
                c.insert("final_logit_softcapping".into(), json!(cap));
            }
        }
        Ok(serde_json::Value::Object(c))
    }

    /// Qwen3.5 (`qwen35`, hybrid Gated DeltaNet / gated attention; `qwen35moe` with a
    /// mixture of experts) as the flat `qwen3_5_text` / `qwen3_5_moe_text` config, from the keys
    /// llama.cpp's converter writes (`Qwen3_5TextModel`, `Qwen3_5MoeTextModel`): the `ssm.*`
    /// keys carry the linear-attention heads, `full_attention_interval` (or llama.cpp's
    /// `attention.recurrent_layers` flags) the layer pattern, the multi-token-prediction
    /// layers (`nextn_predict_layers`) are counted in `block_count`, and `expert_*` keys size
    /// the experts.
    fn qwen35_config(&self, md: &Metadata, model_type: &str) -> Result<serde_json::Value> {
        let blocks = md.usize("block_count")?;
        let mtp = md.opt_usize("nextn_predict_layers")?.unwrap_or(0);
        let layers = blocks
            .checked_sub(mtp)
            .filter(|&n| n > 0)
            .ok_or_else(|| md.err("nextn_predict_layers", format!("{mtp} leaves no decoder layers of block_count {blocks}")))?;
        let recurrent: Vec<bool> = match md.raw("attention.recurrent_layers") {
            Some(Value::Array(flags)) => flags
                .iter()
                .take(layers)
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    v => integer(v).map(|i| i != 0),
                })
                .collect::<std::result::Result<_, _>>()
                .map_err(|what| md.err("attention.recurrent_layers", what))?,
            Some(other) => {
                return Err(md.err("attention.recurrent_layers", format!("expected an array, found {:?}", other.value_type())))
            }
            // llama.cpp's default when the interval is absent too.
            None => {
                let interval = md.opt_usize("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(md.err("full_attention_interval", "must be at least 1"));
                }
                (0..layers).map(|i| (i + 1) % interval != 0).collect()
            }
        };
        if recurrent.len() != layers {
            return Err(md.err("attention.recurrent_layers", format!("has {} flags for {layers} layers", recurrent.len())));
        }
        let layer_types: Vec<&str> = recurrent.iter().map(|&r| if r { "linear_attention" } else { "full_attention" }).collect();
        let head_dim = md.usize("attention.key_length")?;
        let value_heads = md.usize("ssm.time_step_rank")?;
        let inner = md.usize("ssm.inner_size")?;
        if value_heads == 0 || !inner.is_multiple_of(value_heads) {
            return Err(md.err("ssm.inner_size", format!("{inner} is not a multiple of ssm.time_step_rank {value_heads}")));
        }
        let rope_dims = md.usize("rope.dimension_count")?;
        let sections: Vec<usize> = match md.raw("rope.dimension_sections") {
            None => vec![11, 11, 10],
            Some(Value::Array(v)) => v
                .iter()
                .take(3)
                .map(|x| integer(x).ok().and_then(|i| usize::try_from(i).ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| md.err("rope.dimension_sections", "expected non-negative integers"))?,
            Some(other) => {
                return Err(md.err("rope.dimension_sections", format!("expected an array, found {:?}", other.value_type())))
            }
        };
        // The first full-attention layer says whether the projections carry biases.
        let attention_bias = recurrent
            .iter()
            .position(|&r| !r)
            .is_some_and(|i| self.content.tensor_infos.contains_key(&format!("blk.{i}.attn_q.bias")));
        let mut c = Map::new();
        c.insert("model_type".into(), json!(model_type));
        c.insert("vocab_size".into(), json!(self.tensor_rows("token_embd.weight")?));
        c.insert("hidden_size".into(), json!(md.usize("embedding_length")?));
        if self.arch == "qwen35moe" {
            // As llama.cpp reads them: routing is softmax, top-k renormalized (fixed in its code,
            // no key); an absent expert size is `feed_forward_length` over the experts used, an
            // absent shared-expert size `feed_forward_length`.
            let used = md.usize("expert_used_count")?;
            let expert_ff = match md.opt_usize("expert_feed_forward_length")? {
                Some(n) => n,
                None => md.opt_usize("feed_forward_length")?.map(|n| n / used.max(1)).ok_or_else(|| {
                    md.err("expert_feed_forward_length", "missing (and no feed_forward_length to derive it from)")
                })?,
            };
            let shared_ff = match md.opt_usize("expert_shared_feed_forward_length")? {
                Some(n) => n,
                None => md.opt_usize("feed_forward_length")?.ok_or_else(|| {
                    md.err("expert_shared_feed_forward_length", "missing (and no feed_forward_length to fall back on)")
                })?,
            };
            c.insert("num_experts".into(), json!(md.usize("expert_count")?));
            c.insert("num_experts_per_tok".into(), json!(used));
            c.insert("moe_intermediate_size".into(), json!(expert_ff));
            c.insert("shared_expert_intermediate_size".into(), json!(shared_ff));
            c.insert("norm_topk_prob".into(), json!(true));
        } else {
            c.insert("intermediate_size".into(), json!(md.usize("feed_forward_length")?));
        }
        c.insert("num_hidden_layers".into(), json!(layers));
        c.insert("layer_types".into(), json!(layer_types));
        c.insert("num_attention_heads".into(), json!(md.usize("attention.head_count")?));
        c.insert("num_key_value_heads".into(), json!(md.usize("attention.head_count_kv")?));
        c.insert("head_dim".into(), json!(head_dim));
        c.insert("attention_bias".into(), json!(attention_bias));
        c.insert("linear_conv_kernel_dim".into(), json!(md.usize("ssm.conv_kernel")?));
        c.insert("linear_key_head_dim".into(), json!(md.usize("ssm.state_size")?));
        c.insert("linear_num_key_heads".into(), json!(md.usize("ssm.group_count")?));
        c.insert("linear_num_value_heads".into(), json!(value_heads));
        c.insert("linear_value_head_dim".into(), json!(inner / value_heads));
        c.insert("rms_norm_eps".into(), json!(md.f64("attention.layer_norm_rms_epsilon")?));
        c.insert("max_position_embeddings".into(), json!(md.usize("context_length")?));
        c.insert(
            "rope_parameters".into(),
            json!({
                "rope_type": "default",
                "rope_theta": md.opt_f64("rope.freq_base")?.unwrap_or(10_000.0),
                "partial_rotary_factor": rope_dims as f64 / head_dim.max(1) as f64,
                "mrope_section": sections,
                "mrope_interleaved": true,
            }),
        );
        c.insert("tie_word_embeddings".into(), json!(!self.content.tensor_infos.contains_key("output.weight")));
        c.insert("mtp_num_hidden_layers".into(), json!(mtp));
        if let Some(eos) = md.global_usize("tokenizer.ggml.eos_token_id")? {
            c.insert("eos_token_id".into(), json!(eos));
        }
        if let Some(kind) = md.opt_string("rope.scaling.type")?.filter(|k| k != "none") {
            return Err(md.err("rope.scaling.type", format!("`{kind}` is not supported for {}", self.arch)));
        }
        Ok(serde_json::Value::Object(c))
    }

    fn tensor_rows(&self, name: &str) -> Result<usize> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::Tensor { name: name.into(), what: format!("is missing from {}", self.path.display()) })?;
        info.shape.dims().first().copied().ok_or_else(|| ModelError::Tensor {
            name: name.into(),
            what: format!("in {} has no dimensions", self.path.display()),
        })
    }

    /// The tensors under Hugging Face names on `device`; matrices stay quantized unless
    /// `dequantize`, which turns everything into plain `dtype` tensors (for exact comparison
    /// against a reference that dequantizes).
    pub fn source(&self, device: &Device, dequantize: bool) -> Result<GgufSource<'_>> {
        let heads = |key: &str| match self.metadata().get(&format!("{}.{key}", self.arch)) {
            Some(v) => v.to_u32().map(|n| n as usize).map_err(|e| ModelError::file(&self.path, format!("{key}: {e}"))),
            None => Err(ModelError::file(&self.path, format!("metadata `{}.{key}` is missing", self.arch))),
        };
        // llama.cpp's converter interleaves the RoPE halves of Llama's q/k rows; undo it.
        let permuted_heads = if self.arch == "llama" {
            let q = heads("attention.head_count")?;
            Some((q, self.metadata().get("llama.attention.head_count_kv").map_or(Ok(q), |_| heads("attention.head_count_kv"))?))
        } else {
            None
        };
        // llama.cpp's converter puts Qwen3.5's value heads in tiled order where key heads are fewer.
        let value_heads = if is_qwen35(&self.arch) {
            let (k, v) = (heads("ssm.group_count")?, heads("ssm.time_step_rank")?);
            let inner = heads("ssm.inner_size")?;
            if k == 0 || v == 0 || !v.is_multiple_of(k) || !inner.is_multiple_of(v) {
                return Err(ModelError::file(
                    &self.path,
                    format!(
                        "{}: ssm.time_step_rank {v} is not a multiple of ssm.group_count {k} (or of ssm.inner_size {inner})",
                        self.arch
                    ),
                ));
            }
            let key_dim = heads("ssm.state_size")?;
            (k != v).then_some(ValueHeads { key_heads: k, per_key: v / k, value_dim: inner / v, qk_rows: 2 * k * key_dim })
        } else {
            None
        };
        let mtp_block = self.mtp_block()?;
        Ok(GgufSource { file: self, device: device.clone(), dequantize, permuted_heads, value_heads, mtp_block })
    }

    /// The block llama.cpp's converter wrote Qwen3.5's multi-token-prediction head to
    /// (`blk.{N}`, N the decoder layers, holding `nextn.eh_proj` beside a decoder layer's
    /// tensors), where the file has one.
    pub fn mtp_block(&self) -> Result<Option<usize>> {
        if !is_qwen35(&self.arch) {
            return Ok(None);
        }
        let md = Metadata { file: self, prefix: format!("{}.", self.arch) };
        let mtp = md.opt_usize("nextn_predict_layers")?.unwrap_or(0);
        let Some(layers) = md.usize("block_count")?.checked_sub(mtp) else { return Ok(None) };
        Ok((mtp > 0 && self.content.tensor_infos.contains_key(&format!("blk.{layers}.nextn.eh_proj.weight"))).then_some(layers))
    }

    fn qtensor(&self, gguf_name: &str, device: &Device) -> Result<QTensor> {
        self.content
            .tensor(&mut Cursor::new(&self.mmap[..]), gguf_name, device)
            .map_err(|e| ModelError::Tensor { name: gguf_name.into(), what: format!("in {}: {e}", self.path.display()) })
    }
}

/// Typed reads of `{arch}.*` metadata, naming the key in every error.
struct Metadata<'a> {
    file: &'a GgufFile,
    prefix: String,
}

impl Metadata<'_> {
    fn err(&self, key: &str, what: impl std::fmt::Display) -> ModelError {
        ModelError::file(&self.file.path, format!("metadata `{}{key}`: {what}", self.prefix))
    }

    fn raw(&self, key: &str) -> Option<&Value> {
        self.file.metadata().get(&format!("{}{key}", self.prefix))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.raw(key) else { return Ok(None) };
        let n = integer(v).map_err(|what| self.err(key, what))?;
        usize::try_from(n).map(Some).map_err(|_| self.err(key, format!("{n} is out of range")))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    fn global_usize(&self, key: &str) -> Result<Option<usize>> {
        Metadata { file: self.file, prefix: String::new() }.opt_usize(key)
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.raw(key) {
            None => Ok(None),
            // The f32 nearest the config's decimal (1e-6 for `rms_norm_eps`), back to that
            // decimal rather than the f32's exact binary value.
            Some(Value::F32(x)) => Ok(Some(x.to_string().parse().unwrap_or(*x as f64))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(_) => self.opt_usize(key).map(|n| n.map(|n| n as f64)),
        }
    }

    fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    fn opt_string(&self, key: &str) -> Result<Option<String>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.err(key, format!("expected a string, found {:?}", other.value_type()))),
        }
    }
}

/// A metadata value of any integer type, widened; the error says what it is instead.
pub(crate) fn integer(v: &Value) -> std::result::Result<i64, String> {
    Ok(match v {
        Value::U8(i) => *i as i64,
        Value::I8(i) => *i as i64,
        Value::U16(i) => *i as i64,
        Value::I16(i) => *i as i64,
        Value::U32(i) => *i as i64,
        Value::I32(i) => *i as i64,
        Value::U64(i) => i64::try_from(*i).map_err(|_| format!("{i} is out of range"))?,
        Value::I64(i) => *i,
        v => return Err(format!("expected an integer, found {:?}", v.value_type())),
    })
}

/// A GGUF file's tensors under Hugging Face names and conventions.
pub struct GgufSource<'a> {
    file: &'a GgufFile,
    device: Device,
    dequantize: bool,
    /// `(query heads, KV heads)` whose q/k rows llama.cpp's converter interleaved (Llama).
    permuted_heads: Option<(usize, usize)>,
    /// Qwen3.5's linear-attention value heads, which llama.cpp's converter reorders when there
    /// are more of them than key heads.
    value_heads: Option<ValueHeads>,
    /// The block holding Qwen3.5's multi-token-prediction head (`mtp.*`), where there is one.
    mtp_block: Option<usize>,
}

/// llama.cpp's converter (`_LinearAttentionVReorderBase`) stores value heads "tiled"
/// (`[v0 of k0, v0 of k1, …, v1 of k0, …]`) where Hugging Face groups them by key head
/// (`[v0 of k0, v1 of k0, …, v0 of k1, …]`).
#[derive(Clone, Copy, Debug)]
struct ValueHeads {
    key_heads: usize,
    /// Value heads per key head.
    per_key: usize,
    value_dim: usize,
    /// Rows of `in_proj_qkv` (channels of `conv1d`) before the value rows: q and k.
    qk_rows: usize,
}

impl ValueHeads {
    /// Where Hugging Face value head `h` is stored.
    fn stored_head(&self, h: usize) -> usize {
        let (k, j) = (h / self.per_key, h % self.per_key);
        j * self.key_heads + k
    }

    /// The stored index of Hugging Face index `i` along a dimension of `[skip, heads × dim]`
    /// (the value heads after `skip` leading entries, `dim` wide each).
    fn stored_index(&self, i: usize, skip: usize, dim: usize) -> usize {
        if i < skip {
            return i;
        }
        let (h, within) = ((i - skip) / dim, (i - skip) % dim);
        skip + self.stored_head(h) * dim + within
    }
}

impl GgufSource<'_> {
    /// The name the rest of the source reads `name` under: Qwen3.5's multi-token-prediction
    /// head (`mtp.*`) as the converter renamed it before its transforms, a decoder layer
    /// `layers.{N}.*` (so its norms get the same `1 + w` undone) and `layers.{N}.nextn.*` for
    /// `fc` (`eh_proj`, stored as is), the two pre-`fc` norms (`enorm`, `hnorm`) and the final
    /// norm (`shared_head_norm`), all of which the converter stores as `1 + w`.
    fn alias<'n>(&self, name: &'n str) -> Cow<'n, str> {
        let (Some(block), Some(rest)) = (self.mtp_block, name.strip_prefix("mtp.")) else { return Cow::Borrowed(name) };
        if let Some(rest) = rest.strip_prefix("layers.0.") {
            return Cow::Owned(format!("layers.{block}.{rest}"));
        }
        let nextn = match rest {
            "fc.weight" => "eh_proj.weight",
            "pre_fc_norm_embedding.weight" => "enorm.weight",
            "pre_fc_norm_hidden.weight" => "hnorm.weight",
            "norm.weight" => "shared_head_norm.weight",
            _ => return Cow::Borrowed(name),
        };
        Cow::Owned(format!("layers.{block}.nextn.{nextn}"))
    }

    fn gguf_name(&self, name: &str) -> Result<String> {
        gguf_name(&self.file.arch, name).ok_or_else(|| ModelError::Tensor {
            name: name.into(),
            what: format!("has no GGUF counterpart for architecture {}", self.file.arch),
        })
    }

    /// The stored tensor with the shape checked and the row order the Hugging Face layout has
    /// (columns too where whole quantization blocks move; [`GgufSource::get`] and
    /// [`GgufSource::matrix`] finish the rest).
    fn stored(&self, name: &str, shape: &[usize]) -> Result<QTensor> {
        if let Some(expert) = ExpertMatrix::parse(&self.file.arch, name) {
            return self.expert_matrix(name, expert, shape);
        }
        let gguf = self.gguf_name(name)?;
        if !self.file.content.tensor_infos.contains_key(&gguf) {
            return Err(ModelError::Tensor {
                name: gguf,
                what: format!("(Hugging Face `{name}`) is missing from {}", self.file.path.display()),
            });
        }
        let q = self.file.qtensor(&gguf, &Device::Cpu)?;
        // llama.cpp's converter squeezes Qwen3.5's `[channels, 1, kernel]` conv weight.
        let expected: Vec<usize> = match shape {
            [c, 1, k] if is_qwen35(&self.file.arch) && name.ends_with("linear_attn.conv1d.weight") => vec![*c, *k],
            _ => shape.to_vec(),
        };
        if q.shape().dims() != expected {
            return Err(ModelError::Tensor {
                name: gguf,
                what: format!("in {} has shape {:?}, expected {:?}", self.file.path.display(), q.shape().dims(), expected),
            });
        }
        if let Some(heads) = self.rope_heads(name) {
            return deinterleave_rope_rows(&q, heads);
        }
        let Some(v) = self.value_heads else { return Ok(q) };
        if name.ends_with("linear_attn.in_proj_qkv.weight") || name.ends_with("linear_attn.conv1d.weight") {
            permute_rows(&q, |r| v.stored_index(r, v.qk_rows, v.value_dim))
        } else if name.ends_with("linear_attn.in_proj_z.weight") {
            permute_rows(&q, |r| v.stored_index(r, 0, v.value_dim))
        } else if name.ends_with("linear_attn.in_proj_a.weight")
            || name.ends_with("linear_attn.in_proj_b.weight")
            || name.ends_with("linear_attn.A_log")
            || name.ends_with("linear_attn.dt_bias")
        {
            permute_rows(&q, |r| v.stored_index(r, 0, 1))
        } else if name.ends_with("linear_attn.out_proj.weight") && v.value_dim.is_multiple_of(q.dtype().block_size()) {
            permute_column_chunks(&q, v.value_dim, |c| v.stored_head(c))
        } else {
            Ok(q)
        }
    }

    /// One expert's matrix (`shape` `[rows, cols]`), its rows sliced from the stacked tensor in
    /// the mapped file, so quantized blocks stay whole and the other experts are not read.
    fn expert_matrix(&self, name: &str, x: ExpertMatrix, shape: &[usize]) -> Result<QTensor> {
        let infos = &self.file.content.tensor_infos;
        let (gguf, parts, part) = match x.fused() {
            Some((fused, half)) if !infos.contains_key(&x.stacked()) && infos.contains_key(&fused) => (fused, 2, half),
            _ => (x.stacked(), 1, 0),
        };
        let Some(info) = infos.get(&gguf) else {
            let also = x.fused().map(|(fused, _)| format!(", and so is `{fused}`")).unwrap_or_default();
            return Err(ModelError::Tensor {
                name: gguf,
                what: format!("(Hugging Face `{name}`) is missing from {}{also}", self.file.path.display()),
            });
        };
        let dtype = info.ggml_dtype;
        let dims = info.shape.dims();
        let fits = match (shape, dims) {
            (&[rows, cols], &[experts, stacked_rows, stacked_cols]) => {
                x.expert < experts
                    && stacked_rows == parts * rows
                    && stacked_cols == cols
                    && cols.is_multiple_of(dtype.block_size())
            }
            _ => false,
        };
        if !fits {
            return Err(ModelError::Tensor {
                name: gguf,
                what: format!(
                    "in {} has shape {dims:?}, which holds no {shape:?} matrix for expert {} (Hugging Face `{name}`)",
                    self.file.path.display(),
                    x.expert
                ),
            });
        }
        let (rows, cols) = (shape[0], shape[1]);
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let bytes = rows * row_bytes;
        let start = usize::try_from(self.file.content.tensor_data_offset + info.offset)
            .ok()
            .and_then(|at| at.checked_add((x.expert * parts + part) * bytes));
        let data = start.and_then(|at| self.file.mmap.get(at..at.checked_add(bytes)?)).ok_or_else(|| ModelError::Tensor {
            name: gguf.clone(),
            what: format!("in {}: expert {} runs past the end of the file", self.file.path.display(), x.expert),
        })?;
        // Copied: candle reads the blocks in place and needs them aligned, which a file's offsets
        // need not be.
        Ok(QTensor::new(QStorage::from_data(Cow::Owned(data.to_vec()), &Device::Cpu, dtype)?, (rows, cols))?)
    }

    /// Whether `name`'s columns are still in llama.cpp's order after [`GgufSource::stored`]:
    /// Qwen3.5's `out_proj` when a value head is narrower than a quantization block.
    fn columns_pending(&self, name: &str, q: &QTensor) -> Option<ValueHeads> {
        let v = self.value_heads?;
        (name.ends_with("linear_attn.out_proj.weight") && !v.value_dim.is_multiple_of(q.dtype().block_size())).then_some(v)
    }

    /// `name` (read by [`GgufSource::stored`] as `q`) dequantized to f32 on the CPU, in the
    /// Hugging Face layout and convention.
    fn dense(&self, name: &str, q: &QTensor, shape: &[usize]) -> Result<Tensor> {
        let mut t = q.dequantize(&Device::Cpu)?;
        if let Some(v) = self.columns_pending(name, q) {
            let cols = t.dim(1)?;
            let order: Vec<u32> = (0..cols).map(|c| v.stored_index(c, 0, v.value_dim) as u32).collect();
            t = t.index_select(&Tensor::new(order.as_slice(), &Device::Cpu)?, 1)?;
        }
        let (gemma, qwen35) = (self.file.arch == "gemma3", is_qwen35(&self.file.arch));
        // llama.cpp stores Gemma's `(1 + w)` norm weights with the 1 added, and Qwen3.5's
        // zero-centred ones (all but the DeltaNet output norm), whose `A_log` it stores as
        // `A = -exp(A_log)`.
        if (gemma || qwen35) && name.ends_with("norm.weight") && !name.ends_with("linear_attn.norm.weight") {
            t = (t - 1.0)?;
        } else if qwen35 && name.ends_with("linear_attn.A_log") {
            t = t.neg()?.log()?;
        }
        if t.dims() != shape {
            t = t.reshape(shape)?;
        }
        Ok(t)
    }

    /// Heads whose rows must be de-interleaved, for a Llama q/k projection.
    fn rope_heads(&self, name: &str) -> Option<usize> {
        let (q, kv) = self.permuted_heads?;
        if name.ends_with("self_attn.q_proj.weight") || name.ends_with("self_attn.q_proj.bias") {
            Some(q)
        } else if name.ends_with("self_attn.k_proj.weight") || name.ends_with("self_attn.k_proj.bias") {
            Some(kv)
        } else {
            None
        }
    }
}

impl WeightSource for GgufSource<'_> {
    fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let name = &*self.alias(name);
        let q = self.stored(name, shape)?;
        Ok(self.dense(name, &q, shape)?.to_dtype(dtype)?.to_device(&self.device)?)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: DType) -> Result<Matrix> {
        let name = &*self.alias(name);
        let q = self.stored(name, &[rows, cols])?;
        let plain = matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        // A column order that quantized blocks cannot carry leaves the matrix dense.
        if self.dequantize || plain || self.columns_pending(name, &q).is_some() {
            return Ok(Matrix::Dense(self.dense(name, &q, &[rows, cols])?.to_dtype(dtype)?.to_device(&self.device)?));
        }
        if !self.device.is_cpu() {
            return Ok(Matrix::Quantized(Arc::new(QTensor::new(
                QStorage::from_data(q.data()?, &self.device, q.dtype())?,
                q.shape().clone(),
            )?)));
        }
        // On CPU, strata's kernel takes the formats of llama.cpp's common mixes; candle's the rest.
        let format = match q.dtype() {
            GgmlDType::Q8_0 => BlockFormat::Q8_0,
            GgmlDType::Q5_0 => BlockFormat::Q5_0,
            GgmlDType::Q4K => BlockFormat::Q4K,
            GgmlDType::Q6K => BlockFormat::Q6K,
            _ => return Ok(Matrix::Quantized(Arc::new(q))),
        };
        Ok(Matrix::Packed(Arc::new(QuantMatrix::new(format, rows, cols, q.data()?.into_owned())?)))
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// The GGUF name of a Hugging Face decoder tensor (`embed_tokens.weight`, `layers.3.mlp.…`);
/// one expert's matrices live in stacked tensors instead ([`ExpertMatrix`]).
fn gguf_name(arch: &str, name: &str) -> Option<String> {
    match name {
        "embed_tokens.weight" => return Some("token_embd.weight".into()),
        "norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let (qwen35, moe) = (is_qwen35(arch), arch == "qwen35moe");
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        // Qwen3.5's Gated DeltaNet (llama.cpp's `ssm_*`; `A_log` has no suffix there).
        "linear_attn.in_proj_qkv" if qwen35 => "attn_qkv",
        "linear_attn.in_proj_z" if qwen35 => "attn_gate",
        "linear_attn.in_proj_a" if qwen35 => "ssm_alpha",
        "linear_attn.in_proj_b" if qwen35 => "ssm_beta",
        "linear_attn.conv1d" if qwen35 => "ssm_conv1d",
        "linear_attn.norm" if qwen35 => "ssm_norm",
        "linear_attn.out_proj" if qwen35 => "ssm_out",
        "linear_attn" if qwen35 && suffix == "A_log" => return Some(format!("blk.{layer}.ssm_a")),
        "linear_attn" if qwen35 && suffix == "dt_bias" => return Some(format!("blk.{layer}.ssm_dt.bias")),
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // Qwen3.5 MoE: the router and the shared expert with its gate.
        "mlp.gate" if moe => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" if moe => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" if moe => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" if moe => "ffn_down_shexp",
        "mlp.shared_expert_gate" if moe => "ffn_gate_inp_shexp",
        // Gemma normalises around both blocks; the others only before the MLP.
        "post_attention_layernorm" if arch == "gemma3" || qwen35 => "post_attention_norm",
        "post_attention_layernorm" | "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        // Qwen3.5's multi-token-prediction head outside its decoder layer (`GgufSource::alias`).
        "nextn.eh_proj" | "nextn.enorm" | "nextn.hnorm" | "nextn.shared_head_norm" if qwen35 => module,
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{suffix}"))
}

/// One routed expert's matrix, `layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, which
/// llama.cpp stores stacked per layer: `blk.L.ffn_{gate,up,down}_exps.weight`
/// `[experts, rows, cols]` (the converter stacks per-expert checkpoints and splits
/// transformers' fused `gate_up_proj`), or with `--fuse-gate-up-exps` gate and up together in
/// `blk.L.ffn_gate_up_exps.weight` `[experts, 2 · rows, cols]`, gate rows first.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ExpertMatrix<'a> {
    layer: &'a str,
    expert: usize,
    /// `gate`, `up` or `down`.
    proj: &'a str,
}

impl<'a> ExpertMatrix<'a> {
    fn parse(arch: &str, name: &'a str) -> Option<Self> {
        if arch != "qwen35moe" {
            return None;
        }
        let rest = name.strip_prefix("layers.")?;
        let (layer, rest) = rest.split_once(".mlp.experts.")?;
        let (expert, rest) = rest.split_once('.')?;
        let proj = rest.strip_suffix("_proj.weight").filter(|p| ["gate", "up", "down"].contains(p))?;
        Some(Self { layer, expert: expert.parse().ok()?, proj })
    }

    /// The stacked tensor's name.
    fn stacked(&self) -> String {
        format!("blk.{}.ffn_{}_exps.weight", self.layer, self.proj)
    }

    /// Where gate and up are stored together, and which half this is.
    fn fused(&self) -> Option<(String, usize)> {
        let half = match self.proj {
            "gate" => 0,
            "up" => 1,
            _ => return None,
        };
        Some((format!("blk.{}.ffn_gate_up_exps.weight", self.layer), half))
    }
}

/// Undoes llama.cpp's Llama conversion, which stores each head's rows `[d/2, 2]`-interleaved
/// (row `2i + j` holds Hugging Face row `j * d/2 + i`).
fn deinterleave_rope_rows(q: &QTensor, heads: usize) -> Result<QTensor> {
    let head_dim = q.shape().dims()[0] / heads;
    permute_rows(q, |r| {
        let (h, within) = (r / head_dim, r % head_dim);
        let (j, i) = (within / (head_dim / 2), within % (head_dim / 2));
        h * head_dim + 2 * i + j
    })
}

/// Row `r` of the result is stored row `source(r)`.
fn permute_rows(q: &QTensor, source: impl Fn(usize) -> usize) -> Result<QTensor> {
    quantized_rows(q, (0..q.shape().dims()[0]).map(source), &Device::Cpu)
}

/// Rows `ids` of `q`, in that order, on `device` (along the first dimension; a 1-D tensor's
/// elements are its rows). Rows move whole, so quantized blocks stay intact.
pub(crate) fn quantized_rows(q: &QTensor, ids: impl ExactSizeIterator<Item = usize>, device: &Device) -> Result<QTensor> {
    let mut shape = q.shape().dims().to_vec();
    let rows = shape[0];
    let row_bytes = q.storage_size_in_bytes() / rows;
    let data = q.data()?;
    let mut out = Vec::with_capacity(ids.len() * row_bytes);
    shape[0] = ids.len();
    for r in ids {
        if r >= rows {
            return Err(ModelError::Invalid(format!("row {r} of a {rows}-row matrix")));
        }
        out.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
    }
    Ok(QTensor::new(QStorage::from_data(out.into(), device, q.dtype())?, shape)?)
}

/// Columns in chunks of `chunk` (a multiple of the quantization block): chunk `c` of every row
/// of the result is stored chunk `source(c)`.
fn permute_column_chunks(q: &QTensor, chunk: usize, source: impl Fn(usize) -> usize) -> Result<QTensor> {
    let (rows, cols) = q.shape().dims2()?;
    let chunk_bytes = chunk / q.dtype().block_size() * q.dtype().type_size();
    let row_bytes = q.storage_size_in_bytes() / rows;
    let data = q.data()?;
    let mut out = Vec::with_capacity(data.len());
    for row in data.chunks_exact(row_bytes) {
        for c in 0..cols / chunk {
            let src = source(c);
            out.extend_from_slice(&row[src * chunk_bytes..(src + 1) * chunk_bytes]);
        }
    }
    Ok(QTensor::new(QStorage::from_data(out.into(), &Device::Cpu, q.dtype())?, q.shape().clone())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_each_family() {
        assert_eq!(gguf_name("gemma3", "layers.3.post_attention_layernorm.weight").unwrap(), "blk.3.post_attention_norm.weight");
        assert_eq!(gguf_name("llama", "layers.3.post_attention_layernorm.weight").unwrap(), "blk.3.ffn_norm.weight");
        assert_eq!(gguf_name("gemma3", "layers.0.pre_feedforward_layernorm.weight").unwrap(), "blk.0.ffn_norm.weight");
        assert_eq!(gguf_name("qwen2", "layers.12.self_attn.q_proj.bias").unwrap(), "blk.12.attn_q.bias");
        assert_eq!(gguf_name("qwen3", "embed_tokens.weight").unwrap(), "token_embd.weight");
        assert!(gguf_name("qwen3", "layers.1.linear_attn.A_log").is_none());
        assert_eq!(gguf_name("qwen35", "layers.1.linear_attn.A_log").unwrap(), "blk.1.ssm_a");
        assert_eq!(gguf_name("qwen35", "layers.1.linear_attn.dt_bias").unwrap(), "blk.1.ssm_dt.bias");
        assert_eq!(gguf_name("qwen35", "layers.2.linear_attn.in_proj_qkv.weight").unwrap(), "blk.2.attn_qkv.weight");
        assert_eq!(gguf_name("qwen35", "layers.2.post_attention_layernorm.weight").unwrap(), "blk.2.post_attention_norm.weight");
        assert_eq!(gguf_name("qwen35moe", "layers.1.linear_attn.A_log").unwrap(), "blk.1.ssm_a");
        assert_eq!(gguf_name("qwen35moe", "layers.0.mlp.gate.weight").unwrap(), "blk.0.ffn_gate_inp.weight");
        assert_eq!(gguf_name("qwen35moe", "layers.0.mlp.shared_expert.up_proj.weight").unwrap(), "blk.0.ffn_up_shexp.weight");
        assert_eq!(gguf_name("qwen35moe", "layers.0.mlp.shared_expert_gate.weight").unwrap(), "blk.0.ffn_gate_inp_shexp.weight");
        assert!(gguf_name("qwen35", "layers.0.mlp.gate.weight").is_none());
        assert_eq!(gguf_name("qwen35", "layers.4.nextn.eh_proj.weight").unwrap(), "blk.4.nextn.eh_proj.weight");
        assert_eq!(
            gguf_name("qwen35moe", "layers.3.nextn.shared_head_norm.weight").unwrap(),
            "blk.3.nextn.shared_head_norm.weight"
        );
        assert!(gguf_name("qwen3", "layers.4.nextn.enorm.weight").is_none());
    }

    #[test]
    fn expert_matrices_name_their_stacked_tensors() {
        let x = ExpertMatrix::parse("qwen35moe", "layers.12.mlp.experts.7.up_proj.weight").unwrap();
        assert_eq!(x, ExpertMatrix { layer: "12", expert: 7, proj: "up" });
        assert_eq!(x.stacked(), "blk.12.ffn_up_exps.weight");
        assert_eq!(x.fused(), Some(("blk.12.ffn_gate_up_exps.weight".to_string(), 1)));
        let down = ExpertMatrix::parse("qwen35moe", "layers.0.mlp.experts.0.down_proj.weight").unwrap();
        assert_eq!((down.stacked(), down.fused()), ("blk.0.ffn_down_exps.weight".to_string(), None));
        assert!(ExpertMatrix::parse("qwen35", "layers.0.mlp.experts.0.down_proj.weight").is_none());
        assert!(ExpertMatrix::parse("qwen35moe", "layers.0.mlp.experts.gate_up_proj").is_none());
        assert!(ExpertMatrix::parse("qwen35moe", "layers.0.mlp.shared_expert.gate_proj.weight").is_none());
    }

    /// The converter's V-head reorder (`[k, j, d]` → `[j, k, d]`), then `stored_index`, gives
    /// the Hugging Face order back; and column chunks move as `stored_head` says.
    #[test]
    fn value_heads_undo_the_converter() {
        let (key_heads, per_key, dim, skip) = (3, 2, 4, 5);
        let v = ValueHeads { key_heads, per_key, value_dim: dim, qk_rows: skip };
        let hf: Vec<usize> = (0..skip + key_heads * per_key * dim).collect();
        let mut stored = hf[..skip].to_vec();
        for j in 0..per_key {
            for k in 0..key_heads {
                let h = k * per_key + j;
                stored.extend_from_slice(&hf[skip + h * dim..skip + (h + 1) * dim]);
            }
        }
        let back: Vec<usize> = (0..hf.len()).map(|i| stored[v.stored_index(i, skip, dim)]).collect();
        assert_eq!(back, hf);

        let cols: Vec<f32> = stored[skip..].iter().map(|&x| x as f32).collect();
        let t = Tensor::from_vec(cols.clone(), (1, cols.len()), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
        let back = permute_column_chunks(&q, dim, |c| v.stored_head(c)).unwrap().dequantize(&Device::Cpu).unwrap();
        let want: Vec<f32> = hf[skip..].iter().map(|&x| x as f32).collect();
        assert_eq!(back.to_vec2::<f32>().unwrap(), vec![want]);
    }

    /// Interleaving as llama.cpp's converter does, then de-interleaving, gives the rows back.
    #[test]
    fn deinterleave_undoes_the_converter() {
        let (heads, head_dim, cols) = (2, 6, 32);
        let rows: Vec<Vec<f32>> = (0..heads * head_dim).map(|r| (0..cols).map(|c| (r * 100 + c) as f32).collect()).collect();
        // Converter: reshape(heads, 2, d/2, cols).swapaxes(1, 2): GGUF row h*d + 2i + j = HF row h*d + j*d/2 + i.
        let mut interleaved = vec![Vec::new(); rows.len()];
        for h in 0..heads {
            for i in 0..head_dim / 2 {
                for j in 0..2 {
                    interleaved[h * head_dim + 2 * i + j] = rows[h * head_dim + j * head_dim / 2 + i].clone();
                }
            }
        }
        let flat: Vec<f32> = interleaved.concat();
        let t = Tensor::from_vec(flat, (heads * head_dim, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
        let back = deinterleave_rope_rows(&q, heads).unwrap().dequantize(&Device::Cpu).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), rows);
    }
}
