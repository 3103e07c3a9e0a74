//! GGUF files (llama.cpp's single-file format): metadata read into the Hugging Face config the
//! architectures already parse, tensors served under their Hugging Face names and conventions and
//! kept quantized for the matrix multiplies, and the tokenizer rebuilt from metadata.

pub mod tokenizer;

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
const ARCHITECTURES: [(&str, &str); 4] = [("gemma3", "gemma3_text"), ("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")];

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
            let end = content.tensor_data_offset + info.offset + (elems / block * info.ggml_dtype.type_size()) as u64;
            if !elems.is_multiple_of(block) || end > mmap.len() as u64 {
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

    fn tensor_rows(&self, name: &str) -> Result<usize> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::Tensor { name: name.into(), what: format!("is missing from {}", self.path.display()) })?;
        Ok(info.shape.dims()[0])
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
        Ok(GgufSource { file: self, device: device.clone(), dequantize, permuted_heads })
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
            Some(Value::F32(x)) => Ok(Some(*x as f64)),
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
}

impl GgufSource<'_> {
    fn gguf_name(&self, name: &str) -> Result<String> {
        gguf_name(&self.file.arch, name).ok_or_else(|| ModelError::Tensor {
            name: name.into(),
            what: format!("has no GGUF counterpart for architecture {}", self.file.arch),
        })
    }

    /// The stored tensor with the shape checked and the row order the Hugging Face layout has.
    fn stored(&self, name: &str, shape: &[usize]) -> Result<QTensor> {
        let gguf = self.gguf_name(name)?;
        let q = self.file.qtensor(&gguf, &Device::Cpu)?;
        if q.shape().dims() != shape {
            return Err(ModelError::Tensor {
                name: gguf,
                what: format!("in {} has shape {:?}, expected {:?}", self.file.path.display(), q.shape().dims(), shape),
            });
        }
        match self.rope_heads(name) {
            Some(heads) => Ok(deinterleave_rope_rows(&q, heads)?),
            None => Ok(q),
        }
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
        let mut t = self.stored(name, shape)?.dequantize(&Device::Cpu)?;
        // llama.cpp stores Gemma's `(1 + w)` norm weights with the 1 added.
        if self.file.arch == "gemma3" && name.ends_with("norm.weight") {
            t = (t - 1.0)?;
        }
        Ok(t.to_dtype(dtype)?.to_device(&self.device)?)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: DType) -> Result<Matrix> {
        let q = self.stored(name, &[rows, cols])?;
        let plain = matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if self.dequantize || plain {
            return Ok(Matrix::Dense(q.dequantize(&Device::Cpu)?.to_dtype(dtype)?.to_device(&self.device)?));
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

/// The GGUF name of a Hugging Face decoder tensor (`embed_tokens.weight`, `layers.3.mlp.…`).
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
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // Gemma normalises around both blocks; the others only before the MLP.
        "post_attention_layernorm" if arch == "gemma3" => "post_attention_norm",
        "post_attention_layernorm" | "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{suffix}"))
}

/// Undoes llama.cpp's Llama conversion, which stores each head's rows `[d/2, 2]`-interleaved
/// (row `2i + j` holds Hugging Face row `j * d/2 + i`); rows move whole, so quantized blocks
/// stay intact.
fn deinterleave_rope_rows(q: &QTensor, heads: usize) -> Result<QTensor> {
    let dims = q.shape().dims();
    let rows = dims[0];
    let head_dim = rows / heads;
    let row_bytes = q.storage_size_in_bytes() / rows;
    let data = q.data()?;
    let mut out = Vec::with_capacity(data.len());
    for r in 0..rows {
        let (h, within) = (r / head_dim, r % head_dim);
        let (j, i) = (within / (head_dim / 2), within % (head_dim / 2));
        let src = h * head_dim + 2 * i + j;
        out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
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
