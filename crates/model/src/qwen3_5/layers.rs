//! Building blocks shared by Qwen3.5 layers.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use strata_kernels::norm::Activation;
use strata_kernels::quant::QuantMatrix;
use strata_kernels::{attention, norm};

use crate::error::Result;
use crate::source::WeightSource;

/// A weight matrix `[out, in]`: a plain tensor, or kept block-quantized (GGUF) and multiplied
/// quantized — Q8_0, Q5_0, Q4_K and Q6_K by strata's own kernel, the other formats by candle's.
#[derive(Clone)]
pub enum Matrix {
    Dense(Tensor),
    Packed(Arc<QuantMatrix>),
    Quantized(Arc<QTensor>),
}

impl Matrix {
    pub fn rows(&self) -> Result<usize> {
        Ok(match self {
            Matrix::Dense(w) => w.dim(0)?,
            Matrix::Packed(w) => w.rows(),
            Matrix::Quantized(w) => w.shape().dims2()?.0,
        })
    }

    /// `x W^T` for `x` `[rows, in]`, in `x`'s dtype.
    /// `x W^T`; `rowwise`: each row computed as among a few rows (see
    /// [`strata_kernels::matmul::matmul_t_rowwise`]).
    fn multiply(&self, x: &Tensor, rowwise: bool) -> Result<Tensor> {
        match self {
            Matrix::Dense(w) if rowwise => Ok(strata_kernels::matmul::matmul_t_rowwise(x, w)?),
            Matrix::Dense(w) => Ok(strata_kernels::matmul::matmul_t(x, w)?),
            Matrix::Packed(w) => Ok(w.matmul_t(x)?.to_dtype(x.dtype())?),
            // The quantized kernels take f32 activations and give f32.
            Matrix::Quantized(w) => {
                let y = QMatMul::QTensor(w.clone()).forward(&x.to_dtype(DType::F32)?)?;
                Ok(y.to_dtype(x.dtype())?)
            }
        }
    }

    /// Rows `ids`, in that order, as a matrix of their own in this one's form (blocks stay
    /// blocks), so each row's products are the bits this matrix gives it.
    pub fn select_rows(&self, ids: &[u32]) -> Result<Matrix> {
        Ok(match self {
            Matrix::Dense(w) => Matrix::Dense(w.index_select(&Tensor::new(ids, w.device())?, 0)?),
            Matrix::Packed(w) => Matrix::Packed(Arc::new(w.select_rows(ids)?)),
            Matrix::Quantized(w) => {
                Matrix::Quantized(Arc::new(crate::gguf::quantized_rows(w, ids.iter().map(|&id| id as usize), &w.device())?))
            }
        })
    }

    /// Rows `ids` (`[N]` u32) as `[N, in]` in `dtype`: an embedding lookup.
    pub fn rows_at(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        Ok(match self {
            Matrix::Dense(w) => w.index_select(ids, 0)?.to_dtype(dtype)?,
            Matrix::Packed(w) => w.gather(&ids.to_vec1::<u32>()?, ids.device())?.to_dtype(dtype)?,
            Matrix::Quantized(w) => w.embedding(ids)?.to_dtype(dtype)?,
        })
    }
}

/// A linear projection `x W^T (+ b)`. Clones share the weights.
#[derive(Clone)]
pub struct Linear {
    weight: Matrix,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn load(src: &dyn WeightSource, name: &str, out_dim: usize, in_dim: usize, bias: bool, dtype: DType) -> Result<Self> {
        let weight = src.matrix(&format!("{name}.weight"), out_dim, in_dim, dtype)?;
        let bias = if bias { Some(src.get(&format!("{name}.bias"), &[out_dim], dtype)?) } else { None };
        Ok(Self { weight, bias })
    }

    pub fn weight(&self) -> &Matrix {
        &self.weight
    }

    pub fn from_weight(weight: Matrix) -> Self {
        Self { weight, bias: None }
    }

    pub fn new(weight: Matrix, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// `x` `[B, T, in]` (or `[B, in]`, one position per row). Where each row's positions are
    /// few enough for the batch-invariant kernel, every position stays in it however many rows
    /// the forward has, so a row gets the bits it gets alone.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, Activation::Identity)
    }

    /// `act(forward(x))`; after a bias, the bias and the activation as one pass on CUDA.
    pub fn forward_then(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let (rows, in_dim) = Self::rows_of(x);
        let positions = if x.rank() == 3 { x.dims()[1] } else { 1 };
        let rowwise = positions <= strata_kernels::matmul::MAX_EXACT_ROWS;
        self.finish(self.weight.multiply(&x.reshape((rows, in_dim))?, rowwise)?, x.dims(), act)
    }

    /// `forward` of several projections of one input. Block-quantized weights share one pass
    /// over the input (one fork-join of the threads instead of one per projection).
    pub fn forward_many<const N: usize>(linears: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
        let packed: Option<Vec<&QuantMatrix>> =
            linears.iter().map(|l| if let Matrix::Packed(w) = &l.weight { Some(&**w) } else { None }).collect();
        let outputs: Vec<Tensor> = match packed {
            Some(packed) => {
                let (rows, in_dim) = Self::rows_of(x);
                let ys = QuantMatrix::matmul_t_many(&packed, &x.reshape((rows, in_dim))?)?;
                linears
                    .iter()
                    .zip(ys)
                    .map(|(l, y)| l.finish(y.to_dtype(x.dtype())?, x.dims(), Activation::Identity))
                    .collect::<Result<_>>()?
            }
            None => linears.iter().map(|l| l.forward(x)).collect::<Result<_>>()?,
        };
        Ok(outputs.try_into().unwrap_or_else(|_| unreachable!("one output per projection")))
    }

    /// `x` as `[rows, in]`.
    fn rows_of(x: &Tensor) -> (usize, usize) {
        let in_dim = x.dims()[x.rank() - 1];
        (x.elem_count() / in_dim, in_dim)
    }

    /// Adds the bias to `y` `[rows, out]`, applies `act` and gives it `x`'s leading dims.
    fn finish(&self, y: Tensor, x_dims: &[usize], act: Activation) -> Result<Tensor> {
        let y = match (&self.bias, act) {
            (Some(b), act) => norm::add_bias_act(&y, b, act)?,
            (None, Activation::Identity) => y,
            (None, Activation::GeluTanh) => y.gelu()?,
            (None, Activation::GeluErf) => y.gelu_erf()?,
        };
        let mut out_shape = x_dims.to_vec();
        *out_shape.last_mut().expect("input has at least one dim") = self.weight.rows()?;
        Ok(y.reshape(out_shape)?)
    }
}

/// Projections of one input. Plain weights are concatenated into one matrix at load, so one
/// matmul computes them all and the outputs are views of its result (on a GPU, one launch
/// instead of several); block-quantized weights stay apart and share one pass over the input.
pub enum Projections {
    Joined { linear: Linear, sizes: Vec<usize> },
    Apart(Vec<Linear>),
}

impl Projections {
    /// Loads `{name}.weight` `[out, in_dim]` (and `{name}.bias` `[out]` with `bias`) for each
    /// `(name, out)`.
    pub fn load(src: &dyn WeightSource, parts: &[(String, usize)], in_dim: usize, bias: bool, dtype: DType) -> Result<Self> {
        let parts =
            parts.iter().map(|(name, out)| Linear::load(src, name, *out, in_dim, bias, dtype)).collect::<Result<Vec<_>>>()?;
        Self::new(parts)
    }

    /// Projections of one input, joined where every weight is a plain tensor.
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let plain: Option<Vec<&Tensor>> =
            parts.iter().map(|l| if let Matrix::Dense(w) = &l.weight { Some(w) } else { None }).collect();
        Ok(match plain {
            Some(weights) => {
                let biases: Option<Vec<&Tensor>> = parts.iter().map(|l| l.bias.as_ref()).collect();
                Projections::Joined {
                    sizes: weights.iter().map(|w| w.dim(0)).collect::<candle_core::Result<_>>()?,
                    linear: Linear {
                        weight: Matrix::Dense(Tensor::cat(&weights, 0)?),
                        bias: biases.map(|b| Tensor::cat(&b, 0)).transpose()?,
                    },
                }
            }
            None => Projections::Apart(parts),
        })
    }

    /// Each projection of `x` `[.., in]`, in load order.
    pub fn forward<const N: usize>(&self, x: &Tensor) -> Result<[Tensor; N]> {
        match self {
            Projections::Joined { linear, sizes } => {
                let y = linear.forward(x)?;
                let last = y.rank() - 1;
                let mut at = 0;
                let parts: Vec<Tensor> = sizes
                    .iter()
                    .map(|&n| {
                        at += n;
                        y.narrow(last, at - n, n)
                    })
                    .collect::<candle_core::Result<_>>()?;
                Ok(parts.try_into().unwrap_or_else(|_| panic!("{N} projections asked of {}", sizes.len())))
            }
            Projections::Apart(parts) => Linear::forward_many(std::array::from_fn(|i| &parts[i]), x),
        }
    }
}

/// Zero-centred RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in f32.
pub struct RmsNorm {
    /// `1 + w`, f32.
    scale: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn load(src: &dyn WeightSource, name: &str, dim: usize, eps: f64) -> Result<Self> {
        let w = src.get(&format!("{name}.weight"), &[dim], DType::F32)?;
        Ok(Self { scale: (w + 1.0)?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(norm::rms_norm(x, &self.scale, self.eps as f32)?)
    }

    /// This norm per head of `x` `[B, T, H, D]`, then the rotary embedding with the `rope`
    /// tables: `[B, H, T, D]`.
    pub fn forward_rope(&self, x: &Tensor, rope: &(Tensor, Tensor)) -> Result<Tensor> {
        Ok(attention::norm_rope(x, &self.scale, self.eps as f32, &rope.0, &rope.1)?)
    }

    /// A residual add and this norm: `(x + h, norm(x + h))`.
    pub fn forward_residual(&self, x: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(norm::add_rms_norm(x, h, &self.scale, self.eps as f32)?)
    }

    /// The stream's pending add and this norm: `(sum, norm(sum))`.
    pub fn forward_stream(&self, stream: &Residual) -> Result<(Tensor, Tensor)> {
        match &stream.branch {
            Some(branch) => self.forward_residual(&stream.x, branch),
            None => Ok((stream.x.clone(), self.forward(&stream.x)?)),
        }
    }
}

/// The residual stream between decoder layers: `x`, and the last layer's branch output not yet
/// added to it, which the next norm adds as it normalises (one kernel for the add and the norm).
pub struct Residual {
    x: Tensor,
    branch: Option<Tensor>,
}

impl Residual {
    pub fn new(x: Tensor) -> Self {
        Self { x, branch: None }
    }

    /// `x + branch`, still to be added.
    pub fn pending(x: Tensor, branch: Tensor) -> Self {
        Self { x, branch: Some(branch) }
    }

    /// `f` of both parts (a narrow or reshape that keeps them aligned).
    pub fn map(&self, f: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> Result<Self> {
        Ok(Self { x: f(&self.x)?, branch: self.branch.as_ref().map(f).transpose()? })
    }
}

/// The DeltaNet output norm: `w * rmsnorm(x) * silu(gate)` per head (plain weight, not 1 + w).
pub struct GatedRmsNorm {
    weight: Tensor,
    eps: f64,
}

impl GatedRmsNorm {
    pub fn load(src: &dyn WeightSource, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self { weight: src.get(&format!("{name}.weight"), &[dim], DType::F32)?, eps })
    }

    /// `x` f32 `[.., H, D]` (the recurrence output; transformers rounds it to the model dtype
    /// first, and the normalised value again before the weight), `gate` `[.., H·D]`; returns
    /// `x`'s shape in `gate`'s dtype.
    pub fn forward(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        Ok(norm::gated_rms_norm(x, gate, &self.weight, self.eps as f32)?)
    }
}

/// SwiGLU: `down(silu(gate(x)) * up(x))`.
pub struct Mlp {
    gate_up: Projections,
    down: Linear,
}

impl Mlp {
    pub fn load(src: &dyn WeightSource, name: &str, hidden: usize, inter: usize, dtype: DType) -> Result<Self> {
        let parts = [(format!("{name}.gate_proj"), inter), (format!("{name}.up_proj"), inter)];
        Ok(Self {
            gate_up: Projections::load(src, &parts, hidden, false, dtype)?,
            down: Linear::load(src, &format!("{name}.down_proj"), hidden, inter, false, dtype)?,
        })
    }

    /// From its three projections (gate and up joined where plain).
    pub fn from_parts(gate: Linear, up: Linear, down: Linear) -> Result<Self> {
        Ok(Self { gate_up: Projections::new(vec![gate, up])?, down })
    }

    /// From a joined `[gate; up]` matrix (`[2·inter, hidden]`) and `down`.
    pub fn joined(gate_up: Tensor, inter: usize, down: Matrix) -> Self {
        Self {
            gate_up: Projections::Joined { linear: Linear::from_weight(Matrix::Dense(gate_up)), sizes: vec![inter, inter] },
            down: Linear::from_weight(down),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = self.gate_up.forward(x)?;
        self.down.forward(&norm::silu_mul(&gate, &up)?)
    }
}

/// The rotary embedding's frequencies for the first `rotary_dim` dims of each head (NeoX
/// half-split): [`Rotary::tables`] gives the cos/sin that `attention::rope` and
/// [`RmsNorm::forward_rope`] apply.
pub struct Rotary {
    pub(crate) inv_freq: Vec<f32>,
}

impl Rotary {
    pub fn new(rotary_dim: usize, theta: f64) -> Self {
        let inv_freq = (0..rotary_dim / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / rotary_dim as f64)) as f32).collect();
        Self { inv_freq }
    }

    /// `cos`, `sin` `[B, 1, T, rotary_dim / 2]` for rows starting at `starts` (f32).
    pub fn tables(&self, starts: &[usize], t_len: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = self.values(starts, t_len);
        let shape = (starts.len(), 1, t_len, self.inv_freq.len());
        Ok((Tensor::from_vec(cos, shape, device)?, Tensor::from_vec(sin, shape, device)?))
    }

    /// [`Rotary::tables`]' values, on the host.
    pub fn values(&self, starts: &[usize], t_len: usize) -> (Vec<f32>, Vec<f32>) {
        let positions: Vec<[usize; 3]> = starts.iter().flat_map(|&s| (s..s + t_len).map(|p| [p; 3])).collect();
        self.values_at(&positions, [0; 3])
    }

    /// `cos`, `sin` `[B, 1, T, rotary_dim / 2]` at explicit (temporal, height, width) positions,
    /// `[B · T]` row-major (f32): multimodal rotary positions (mRoPE), each frequency driven by
    /// the stream `mrope_section` gives it (interleaved t, h, w, t, h, w, …, the rest temporal).
    /// Equal streams give [`Rotary::tables`].
    pub fn tables_at(
        &self,
        positions: &[[usize; 3]],
        rows: usize,
        mrope_section: [usize; 3],
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = self.values_at(positions, mrope_section);
        let shape = (rows, 1, positions.len() / rows, self.inv_freq.len());
        Ok((Tensor::from_vec(cos, shape, device)?, Tensor::from_vec(sin, shape, device)?))
    }

    fn values_at(&self, positions: &[[usize; 3]], mrope_section: [usize; 3]) -> (Vec<f32>, Vec<f32>) {
        let stream = |i: usize| match i % 3 {
            1 if i < 3 * mrope_section[1] => 1,
            2 if i < 3 * mrope_section[2] => 2,
            _ => 0,
        };
        let mut cos = Vec::with_capacity(positions.len() * self.inv_freq.len());
        let mut sin = Vec::with_capacity(cos.capacity());
        for p in positions {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let angle = p[stream(i)] as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }
}

/// The scale is `1 + w`, f32.
impl crate::smoothing::ChannelNorm for RmsNorm {
    fn scale(&self) -> &Tensor {
        &self.scale
    }

    fn rescaled(&self, factors: &Tensor) -> Result<RmsNorm> {
        Ok(Self { scale: (&self.scale * factors)?, eps: self.eps })
    }
}
