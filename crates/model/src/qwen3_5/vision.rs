//! The Qwen3.5 vision tower (transformers `Qwen3_5VisionModel`, `model.visual.*`): patches
//! embedded by a linear map (the checkpoint's Conv3d, whose stride is its kernel), learned
//! position embeddings interpolated bilinearly to the image's grid, ViT blocks with 2-D rotary
//! attention over the image's patches, and a merger that joins each 2×2 block of patches into
//! one token of the text model's width.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{Map, Value};
use strata_kernels::attention;
use strata_kernels::norm::{self, Activation};

use super::layers::{Linear, Matrix};
use crate::config::Fields;
use crate::error::{ModelError, Result};
use crate::images::PreparedImage;
use crate::source::WeightSource;
use crate::tokenizer::Tokenizer;

/// `vision_config` of a nested Qwen3.5 config, and the vision token ids beside it.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    /// The text model's width, which merged tokens take.
    pub out_hidden_size: usize,
    /// Learned position embeddings: a square grid of this many.
    pub num_position_embeddings: usize,
    pub rope_theta: f64,
    /// One `image_token_id` stands for each merged token of an image, between
    /// `vision_start_token_id` and `vision_end_token_id`.
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

impl VisionConfig {
    /// From the top level of a nested config (`vision_config` and the token ids).
    pub(crate) fn from_json(top: &Map<String, Value>, path: &Path) -> Result<Self> {
        let map = top
            .get("vision_config")
            .and_then(Value::as_object)
            .ok_or_else(|| ModelError::field(path, "vision_config", "expected an object"))?;
        let f = Fields { map, prefix: "vision_config.", path: path.to_path_buf() };
        if let Some(act) = f.get("hidden_act").filter(|a| a.as_str() != Some("gelu_pytorch_tanh")) {
            return Err(f.err("hidden_act", format!("{act} is not supported (only \"gelu_pytorch_tanh\")")));
        }
        let rope = f.get("rope_parameters").and_then(Value::as_object);
        if let Some(kind) = rope.and_then(|r| r.get("rope_type")).filter(|k| k.as_str() != Some("axial")) {
            return Err(f.err("rope_parameters.rope_type", format!("{kind} is not supported (only \"axial\")")));
        }
        let top_fields = Fields { map: top, prefix: "", path: path.to_path_buf() };
        let id = |name: &str, default: usize| top_fields.usize_or(name, default).map(|x| x as u32);
        let cfg = Self {
            depth: f.usize_or("depth", 27)?,
            hidden_size: f.usize_or("hidden_size", 1152)?,
            intermediate_size: f.usize_or("intermediate_size", 4304)?,
            num_heads: f.usize_or("num_heads", 16)?,
            in_channels: f.usize_or("in_channels", 3)?,
            patch_size: f.usize_or("patch_size", 16)?,
            temporal_patch_size: f.usize_or("temporal_patch_size", 2)?,
            spatial_merge_size: f.usize_or("spatial_merge_size", 2)?,
            out_hidden_size: f.usize_or("out_hidden_size", 3584)?,
            num_position_embeddings: f.usize_or("num_position_embeddings", 2304)?,
            rope_theta: rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(10_000.0),
            image_token_id: id("image_token_id", 248_056)?,
            video_token_id: id("video_token_id", 248_057)?,
            vision_start_token_id: id("vision_start_token_id", 248_053)?,
            vision_end_token_id: id("vision_end_token_id", 248_054)?,
        };
        for (name, v) in [
            ("depth", cfg.depth),
            ("hidden_size", cfg.hidden_size),
            ("intermediate_size", cfg.intermediate_size),
            ("num_heads", cfg.num_heads),
            ("patch_size", cfg.patch_size),
            ("temporal_patch_size", cfg.temporal_patch_size),
            ("spatial_merge_size", cfg.spatial_merge_size),
            ("out_hidden_size", cfg.out_hidden_size),
        ] {
            if v == 0 {
                return Err(f.err(name, "must be at least 1"));
            }
        }
        if cfg.in_channels != 3 {
            return Err(f.err("in_channels", format!("{} is not supported (RGB images have 3)", cfg.in_channels)));
        }
        // The rotary angles are half height, half width, each a whole number of pairs.
        if cfg.hidden_size % cfg.num_heads != 0 || cfg.head_dim() % 4 != 0 {
            return Err(f.err(
                "num_heads",
                format!("{} heads of a {}-wide tower do not give a head width divisible by 4", cfg.num_heads, cfg.hidden_size),
            ));
        }
        if cfg.grid_side().pow(2) != cfg.num_position_embeddings || cfg.num_position_embeddings == 0 {
            return Err(f.err("num_position_embeddings", format!("{} is not a square", cfg.num_position_embeddings)));
        }
        Ok(cfg)
    }

    /// What one image is in a rendered prompt: its start, image and end tokens' strings (the
    /// image token then repeated by [`expand_image_tokens`]).
    pub fn markup(&self, tokenizer: &Tokenizer) -> Result<String> {
        tokenizer.decode(&[self.vision_start_token_id, self.image_token_id, self.vision_end_token_id], false)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Side of the learned position grid.
    fn grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    /// Values per patch: channels × frames × patch rows × patch columns.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// LayerNorm with a bias (the tower's norms, eps 1e-6).
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn load(src: &dyn WeightSource, name: &str, dim: usize, dtype: DType) -> Result<Self> {
        Ok(Self {
            weight: src.get(&format!("{name}.weight"), &[dim], dtype)?,
            bias: src.get(&format!("{name}.bias"), &[dim], dtype)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(norm::layer_norm(x, &self.weight, &self.bias, 1e-6)?)
    }

    /// `(x + h, forward(x + h))`: a residual add and this norm after it.
    fn add_forward(&self, x: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(norm::add_layer_norm(x, h, &self.weight, &self.bias, 1e-6)?)
    }
}

struct Block {
    norm1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn load(src: &dyn WeightSource, prefix: &str, cfg: &VisionConfig, dtype: DType) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            norm1: LayerNorm::load(src, &format!("{prefix}.norm1"), d, dtype)?,
            qkv: Linear::load(src, &format!("{prefix}.attn.qkv"), 3 * d, d, true, dtype)?,
            proj: Linear::load(src, &format!("{prefix}.attn.proj"), d, d, true, dtype)?,
            norm2: LayerNorm::load(src, &format!("{prefix}.norm2"), d, dtype)?,
            fc1: Linear::load(src, &format!("{prefix}.mlp.linear_fc1"), i, d, true, dtype)?,
            fc2: Linear::load(src, &format!("{prefix}.mlp.linear_fc2"), d, i, true, dtype)?,
        })
    }

    /// The residual stream `x` `[patches, hidden]` of one image and its `norm1` (`normed`) in;
    /// the stream after the block and its `next_norm` out. `cos`, `sin` `[1, 1, patches,
    /// head_dim / 2]`.
    fn forward(
        &self,
        x: &Tensor,
        normed: &Tensor,
        next_norm: &LayerNorm,
        heads: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (n, d) = x.dims2()?;
        let hd = d / heads;
        // Queries, keys and values as views `[1, patches, heads, hd]` of one projection.
        let qkv = self.qkv.forward(normed)?.reshape((1, n, 3, heads, hd))?;
        let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2);
        // The rotation in f32, rounded back, as transformers rotates them.
        let (q, k) = (attention::rope_f32(&part(0)?, cos, sin)?, attention::rope_f32(&part(1)?, cos, sin)?);
        let v = part(2)?.transpose(1, 2)?;
        let attended = attention::full_attention(&q, &k, &v, (hd as f64).powf(-0.5))?;
        let attended = attended.squeeze(0)?.transpose(0, 1)?.reshape((n, d))?;
        let (x, normed) = self.norm2.add_forward(x, &self.proj.forward(&attended)?)?;
        let h = self.fc1.forward_then(&normed, Activation::GeluTanh)?;
        next_norm.add_forward(&x, &self.fc2.forward(&h)?)
    }
}

pub struct VisionTower {
    cfg: VisionConfig,
    patch_embed: Linear,
    /// `[num_position_embeddings, hidden]`, f32 (interpolated in f32).
    pos_embed: Tensor,
    blocks: Vec<Block>,
    merger_norm: LayerNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    /// Rotary frequencies of each spatial axis (`head_dim / 4` of them).
    inv_freq: Vec<f32>,
    dtype: DType,
    device: Device,
}

impl VisionTower {
    /// From `src`, whose names are relative to the tower (`patch_embed.proj.weight`, …).
    pub fn load(cfg: &VisionConfig, src: &dyn WeightSource, dtype: DType) -> Result<Self> {
        let d = cfg.hidden_size;
        let merged = d * cfg.spatial_merge_size.pow(2);
        let (t, p) = (cfg.temporal_patch_size, cfg.patch_size);
        let conv = src.get("patch_embed.proj.weight", &[d, cfg.in_channels, t, p, p], dtype)?;
        let patch_embed =
            Linear::new(Matrix::Dense(conv.reshape((d, cfg.patch_len()))?), Some(src.get("patch_embed.proj.bias", &[d], dtype)?));
        let spatial = cfg.head_dim() / 2;
        let inv_freq = (0..spatial / 2).map(|i| (1.0 / cfg.rope_theta.powf(2.0 * i as f64 / spatial as f64)) as f32).collect();
        Ok(Self {
            patch_embed,
            pos_embed: src.get("pos_embed.weight", &[cfg.num_position_embeddings, d], DType::F32)?,
            blocks: (0..cfg.depth).map(|i| Block::load(src, &format!("blocks.{i}"), cfg, dtype)).collect::<Result<_>>()?,
            merger_norm: LayerNorm::load(src, "merger.norm", d, dtype)?,
            merger_fc1: Linear::load(src, "merger.linear_fc1", merged, merged, true, dtype)?,
            merger_fc2: Linear::load(src, "merger.linear_fc2", cfg.out_hidden_size, merged, true, dtype)?,
            inv_freq,
            cfg: cfg.clone(),
            dtype,
            device: src.device().clone(),
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// The image's merged tokens `[grid_h · grid_w / merge², out_hidden]`, in the tower's dtype:
    /// what replaces its image tokens' embeddings.
    pub fn forward(&self, image: &PreparedImage) -> Result<Tensor> {
        let [t, gh, gw] = image.grid;
        let m = self.cfg.spatial_merge_size;
        let per_patch = image.patch_len(self.cfg.temporal_patch_size);
        if t != 1 || gh % m != 0 || gw % m != 0 || per_patch != self.cfg.patch_len() {
            return Err(ModelError::Invalid(format!(
                "an image of {gh}x{gw} patches of {per_patch} values does not fit the vision tower ({} values a patch, sides multiples of {m})",
                self.cfg.patch_len()
            )));
        }
        let n = gh * gw;
        let pixels = image.pixel_values(self.cfg.temporal_patch_size, &self.device, self.dtype)?;
        let coords = self.patch_coords(gh, gw);
        let x = (self.patch_embed.forward(&pixels)? + self.position_embeddings(&coords, gh, gw)?.to_dtype(self.dtype)?)?;
        let (cos, sin) = self.rotary(&coords)?;
        // Each block ends with the next one's first norm (the merger's after the last), joined
        // to its residual add.
        let mut normed = match self.blocks.first() {
            Some(first) => first.norm1.forward(&x)?,
            None => self.merger_norm.forward(&x)?,
        };
        let mut x = x;
        for (i, block) in self.blocks.iter().enumerate() {
            let next_norm = self.blocks.get(i + 1).map_or(&self.merger_norm, |b| &b.norm1);
            (x, normed) = block.forward(&x, &normed, next_norm, self.cfg.num_heads, &cos, &sin)?;
        }
        let merged = normed.reshape((n / (m * m), self.cfg.hidden_size * m * m))?;
        let h = self.merger_fc1.forward_then(&merged, Activation::GeluErf)?;
        self.merger_fc2.forward(&h)
    }

    /// Each patch's (row, column) in the order the processor lays patches out: merged blocks
    /// row-major, within a block its patches row-major.
    fn patch_coords(&self, gh: usize, gw: usize) -> Vec<(usize, usize)> {
        let m = self.cfg.spatial_merge_size;
        let mut coords = Vec::with_capacity(gh * gw);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for ih in 0..m {
                    for iw in 0..m {
                        coords.push((bh * m + ih, bw * m + iw));
                    }
                }
            }
        }
        coords
    }

    /// The learned position grid resampled bilinearly (corners aligned) to a `gh × gw` grid,
    /// at each patch: `[patches, hidden]` f32.
    fn position_embeddings(&self, coords: &[(usize, usize)], gh: usize, gw: usize) -> Result<Tensor> {
        let side = self.cfg.grid_side();
        // The two source taps and their weights along one axis of `size` patches, in f32 as
        // transformers computes them.
        let taps = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            [0, 1].map(|o| {
                let tap = (floor as usize + o).min(side - 1);
                (tap, (1.0 - (src - floor - o as f32).abs()).max(0.0))
            })
        };
        let (mut ids, mut weights) = (Vec::with_capacity(coords.len() * 4), Vec::with_capacity(coords.len() * 4));
        for &(row, col) in coords {
            for (h_tap, h_w) in taps(row, gh) {
                for (w_tap, w_w) in taps(col, gw) {
                    ids.push((h_tap * side + w_tap) as u32);
                    weights.push(h_w * w_w);
                }
            }
        }
        let n = coords.len();
        let rows = self.pos_embed.index_select(&Tensor::from_vec(ids, 4 * n, &self.device)?, 0)?;
        let weights = Tensor::from_vec(weights, (n, 4, 1), &self.device)?;
        Ok(rows.reshape((n, 4, self.cfg.hidden_size))?.broadcast_mul(&weights)?.sum(1)?)
    }

    /// cos, sin `[1, 1, patches, head_dim / 2]`: a patch's angles are its row's frequencies
    /// then its column's.
    fn rotary(&self, coords: &[(usize, usize)]) -> Result<(Tensor, Tensor)> {
        let half = 2 * self.inv_freq.len();
        let angles: Vec<f32> = coords
            .iter()
            .flat_map(|&(row, col)| {
                let at = |p: usize| self.inv_freq.iter().map(move |&f| p as f32 * f);
                at(row).chain(at(col)).collect::<Vec<_>>()
            })
            .collect();
        let angles = Tensor::from_vec(angles, (1, 1, coords.len(), half), &self.device)?;
        Ok((angles.cos()?, angles.sin()?))
    }
}

/// The rotary positions of a prompt holding images, as transformers' `get_rope_index` gives
/// them: text advances all three streams together; an image's tokens (each run of
/// `image_token_id`, the next of `grids` per run) sit on its merged grid — temporal, row and
/// column offset by the position it starts at — and the text after it resumes past its larger
/// side. Returns each token's (temporal, height, width) position and the decode offset: the
/// position after the prompt minus its length, which later tokens' positions add to theirs.
pub fn mrope_positions(tokens: &[u32], grids: &[[usize; 3]], cfg: &VisionConfig) -> Result<(Vec<[usize; 3]>, i64)> {
    let m = cfg.spatial_merge_size;
    let mut positions = Vec::with_capacity(tokens.len());
    let mut grids = grids.iter();
    let mut next = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] != cfg.image_token_id {
            positions.push([next; 3]);
            next += 1;
            i += 1;
            continue;
        }
        let run = tokens[i..].iter().take_while(|&&t| t == cfg.image_token_id).count();
        let &[t, h, w] = grids.next().ok_or_else(|| {
            ModelError::Invalid(format!("the prompt has more runs of image tokens than the {} images given", positions.len()))
        })?;
        let (h, w) = (h / m, w / m);
        if run != t * h * w {
            return Err(ModelError::Invalid(format!(
                "a run of {run} image tokens at position {i} does not match its image's {} merged patches",
                t * h * w
            )));
        }
        for ti in 0..t {
            for hi in 0..h {
                for wi in 0..w {
                    positions.push([next + ti, next + hi, next + wi]);
                }
            }
        }
        next += h.max(w);
        i += run;
    }
    if grids.next().is_some() {
        return Err(ModelError::Invalid("more images were given than the prompt has runs of image tokens".into()));
    }
    Ok((positions, next as i64 - tokens.len() as i64))
}

/// A rendered prompt whose images each hold one image token (the chat template's markup), with
/// each repeated as many times as its image gives merged tokens.
pub fn expand_image_tokens(tokens: &[u32], images: &[PreparedImage], cfg: &VisionConfig) -> Result<Vec<u32>> {
    let placed = tokens.iter().filter(|&&t| t == cfg.image_token_id).count();
    if placed != images.len() {
        return Err(ModelError::Invalid(format!("{} image(s) for a prompt that places {placed}", images.len())));
    }
    let merge = cfg.spatial_merge_size * cfg.spatial_merge_size;
    let mut next = images.iter();
    let mut out = Vec::with_capacity(tokens.len());
    for &t in tokens {
        match t == cfg.image_token_id {
            true => {
                let [frames, h, w] = next.next().expect("counted above").grid;
                out.extend(std::iter::repeat_n(t, frames * h * w / merge));
            }
            false => out.push(t),
        }
    }
    Ok(out)
}

/// The prompt as the prompt cache keys it: each image token replaced by an id past any
/// vocabulary (top bit set), drawn from its image's pixel digest and its place in the image, so
/// the same text with another image shares no entry past the first image token.
pub fn image_cache_key(tokens: &[u32], images: &[PreparedImage], image_token_id: u32) -> Result<Vec<u32>> {
    let mut key = Vec::with_capacity(tokens.len());
    let (mut image, mut within) = (0usize, 0u64);
    for (i, &t) in tokens.iter().enumerate() {
        if t != image_token_id {
            key.push(t);
            continue;
        }
        if i == 0 || tokens[i - 1] != image_token_id {
            (image, within) = (image + 1, 0);
        }
        let Some(prepared) = images.get(image - 1) else {
            return Err(ModelError::Invalid(format!(
                "the prompt has more runs of image tokens than the {} image(s) given",
                images.len()
            )));
        };
        let mut hash = xxhash_rust::xxh3::Xxh3::new();
        hash.update(&prepared.digest.to_le_bytes());
        hash.update(&within.to_le_bytes());
        key.push(0x8000_0000 | (hash.digest() as u32 >> 1));
        within += 1;
    }
    if image != images.len() {
        return Err(ModelError::Invalid(format!(
            "{} image(s) given for a prompt with {image} run(s) of image tokens",
            images.len()
        )));
    }
    Ok(key)
}

/// A prompt's images, ready for the forwards that feed it: the images' merged tokens and every
/// prompt position's rotary position, so any chunk of the prompt (cutting through an image or
/// not) and every later token get their inputs.
pub struct ImagePrompt {
    /// Every image's merged tokens, in prompt order: `[image tokens, hidden]`.
    merged: Tensor,
    positions: Vec<[usize; 3]>,
    /// Image tokens before each prompt position (one more entry than positions).
    images_before: Vec<usize>,
}

impl ImagePrompt {
    /// Runs `images` through `tower` for the prompt `tokens`, whose runs of image tokens they
    /// fill in order.
    pub fn new(tower: &VisionTower, tokens: &[u32], images: &[PreparedImage]) -> Result<Self> {
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid).collect();
        let (positions, _) = mrope_positions(tokens, &grids, &tower.cfg)?;
        let merged = images.iter().map(|i| tower.forward(i)).collect::<Result<Vec<_>>>()?;
        let merged = match merged.is_empty() {
            true => Tensor::zeros((0, tower.cfg.out_hidden_size), tower.dtype, &tower.device)?,
            false => Tensor::cat(&merged, 0)?,
        };
        let mut images_before = vec![0];
        for &t in tokens {
            images_before.push(images_before.last().unwrap_or(&0) + usize::from(t == tower.cfg.image_token_id));
        }
        Ok(Self { merged, positions, images_before })
    }

    /// The inputs of prompt positions `range`.
    pub fn inputs(&self, range: std::ops::Range<usize>) -> Result<super::ImageInputs> {
        let len = self.positions.len();
        if range.end > len || range.start > range.end {
            return Err(ModelError::Invalid(format!("positions {range:?} of a {len}-token prompt")));
        }
        let (first, end) = (self.images_before[range.start], self.images_before[range.end]);
        let embeds = (end > first).then(|| self.merged.narrow(0, first, end - first)).transpose()?;
        Ok(super::ImageInputs { embeds, positions: self.positions[range].to_vec() })
    }
}
