//! What a model declares about its state, and the table of storage kinds that turns a
//! declaration into buffers, byte costs and persisted parts. (How far a row can be trimmed is
//! answered per row at run time, by [`LayerState::can_trim_to`].)
//!
//! A model says what each layer's state *is* ([`LayerSpec`]); it never builds stores or counts
//! bytes itself. Each storage kind answers the same questions through [`Storage`], so adding a
//! kind is one more implementation (and its kernels): a missing answer does not compile, and a
//! [`LayerSpec`] no kind stores is a non-exhaustive match.

use candle_core::{DType, Device};

use crate::{BatchState, KvFormat, KvPolicy, KvStore, LayerState, RecurrentShape, RecurrentState, Result, WindowKvStore};

/// What one layer's state is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerSpec {
    /// Full attention: keys and values of every past position.
    Attention(KvShape),
    /// Sliding-window attention: keys and values of the most recent positions only.
    Window(WindowShape),
    /// Gated DeltaNet: a conv window and a recurrent matrix, fixed size per row.
    Recurrent(RecurrentShape),
}

/// Keys and values per position of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// A sliding-window attention layer: a query reads the last `window` positions, itself included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowShape {
    pub kv: KvShape,
    pub window: usize,
}

/// A model's whole declared state: a spec per layer, the compute dtype its KV and conv windows
/// are stored in (recurrent matrices in their shape's own dtype), and the format of its
/// attention KV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSpec {
    pub layers: Vec<LayerSpec>,
    pub dtype: DType,
    pub kv: KvPolicy,
}

/// What a layer's storage is built with besides its shape.
#[derive(Clone, Copy, Debug)]
pub struct StoreContext {
    /// The layer's index in the model (TurboQuant seeds its rotations with it).
    pub layer: usize,
    pub dtype: DType,
    /// The format of this layer's KV (for layers that hold KV), and where it starts when
    /// delayed (see [`KvPolicy::start`]).
    pub kv: KvFormat,
    pub kv_start: usize,
}

/// One storage kind: how a layer's state is held, and what it can do.
pub trait Storage: Sized {
    /// The declared shape this kind stores.
    type Shape;
    /// The kind's name, in errors and logs.
    const NAME: &'static str;
    /// The tensors a single row persists as, by part name, in the order they are stored.
    const PARTS: &'static [&'static str];

    /// Empty state for `rows` fresh sequences.
    fn empty(shape: &Self::Shape, rows: usize, cx: &StoreContext, device: &Device) -> Result<Self>;

    /// What one sequence's state of this kind costs.
    fn cost(shape: &Self::Shape, cx: &StoreContext) -> StateCost;
}

/// Memory cost of one sequence's state; see [`StateSpec::cost`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateCost {
    /// What every position costs (full attention KV).
    pub bytes_per_token: usize,
    /// Fixed per sequence (recurrent state).
    pub bytes_per_row: usize,
    /// What a position costs while it is among the last `window_positions` (sliding-window KV).
    pub window_bytes_per_token: usize,
    pub window_positions: usize,
    /// What a position costs more when it is among the first `prefix_positions` (a delayed KV
    /// format's unquantized copy).
    pub prefix_bytes_per_token: usize,
    pub prefix_positions: usize,
}

impl StateCost {
    /// Bytes of state for a sequence of `tokens` tokens; None past `usize::MAX`. (The per-token
    /// and per-row costs themselves are products of shapes whose weights were loaded: they
    /// cannot overflow, a token count from a request or a flag can.)
    pub fn bytes(&self, tokens: usize) -> Option<usize> {
        let window = tokens.min(self.window_positions).checked_mul(self.window_bytes_per_token)?;
        let prefix = tokens.min(self.prefix_positions).checked_mul(self.prefix_bytes_per_token)?;
        tokens.checked_mul(self.bytes_per_token)?.checked_add(window)?.checked_add(prefix)?.checked_add(self.bytes_per_row)
    }

    /// The most a row holds besides its full-attention and sliding-window KV: its fixed state
    /// and a delayed format's unquantized first positions (what a pool of KV blocks must leave
    /// room for per row).
    pub fn row_bytes_besides_kv(&self) -> usize {
        self.bytes_per_row + self.prefix_positions * self.prefix_bytes_per_token
    }

    /// The cost of holding both: layers' costs add. Windowed (and prefix) costs add only for
    /// one length, which is all a model declares today; the longer is kept, so the sum never
    /// under-counts.
    fn plus(self, other: StateCost) -> StateCost {
        StateCost {
            bytes_per_token: self.bytes_per_token + other.bytes_per_token,
            bytes_per_row: self.bytes_per_row + other.bytes_per_row,
            window_bytes_per_token: self.window_bytes_per_token + other.window_bytes_per_token,
            window_positions: self.window_positions.max(other.window_positions),
            prefix_bytes_per_token: self.prefix_bytes_per_token + other.prefix_bytes_per_token,
            prefix_positions: self.prefix_positions.max(other.prefix_positions),
        }
    }
}

impl StateSpec {
    /// What one sequence's state costs: the sum over layers of their storage kinds' costs.
    pub fn cost(&self) -> StateCost {
        let costs = self.layers.iter().zip(self.contexts()).map(|(layer, cx)| layer.cost(&cx));
        costs.fold(StateCost::default(), StateCost::plus)
    }

    /// Fresh state for `rows` empty sequences, each layer in the storage its spec declares.
    pub fn new_state(&self, rows: usize, device: &Device) -> Result<BatchState> {
        let layers = self.layers.iter().zip(self.contexts()).map(|(layer, cx)| layer.empty(rows, &cx, device));
        Ok(BatchState::new(layers.collect::<Result<_>>()?, vec![0; rows]))
    }

    /// What each layer's storage is built with. (The policy's layer names were checked by
    /// [`StateSpec::with_kv`]; a spec built without it stores every layer in its format.)
    pub(crate) fn contexts(&self) -> Vec<StoreContext> {
        let kv_layers = self.layers.iter().filter(|l| l.holds_kv()).count();
        let mut kv_index = 0;
        let mut contexts = Vec::with_capacity(self.layers.len());
        for (layer, spec) in self.layers.iter().enumerate() {
            let mut kv = KvFormat::Auto;
            if spec.holds_kv() {
                kv = self.kv.format_at(kv_index, kv_layers).unwrap_or(self.kv.format);
                kv_index += 1;
            }
            contexts.push(StoreContext { layer, dtype: self.dtype, kv, kv_start: self.kv.start });
        }
        contexts
    }

    /// This spec with its attention KV (full and sliding-window) stored as `kv` says; an error
    /// names a layer whose shape the format cannot code, or a named layer the model lacks.
    pub fn with_kv(self, kv: KvPolicy) -> Result<StateSpec> {
        let kv_layers = self.layers.iter().filter(|l| l.holds_kv()).count();
        let shapes = self.layers.iter().filter_map(|layer| match layer {
            LayerSpec::Attention(shape) | LayerSpec::Window(WindowShape { kv: shape, .. }) => Some(shape),
            LayerSpec::Recurrent(_) => None,
        });
        let mut quantized = 0;
        for (i, shape) in shapes.enumerate() {
            let format = kv.format_at(i, kv_layers)?;
            format.check(shape)?;
            quantized += usize::from(format.is_quantized());
        }
        if kv.format.is_quantized() && quantized == 0 && kv_layers > 0 {
            let named = format!("--kv-unquantized-layers names every one of the {kv_layers} layers holding KV");
            return Err(crate::StateError::Format(format!("{named}: use --kv-cache-dtype auto")));
        }
        Ok(StateSpec { kv, ..self })
    }
}

impl LayerSpec {
    /// Whether the layer holds attention KV (full or sliding-window).
    fn holds_kv(&self) -> bool {
        matches!(self, LayerSpec::Attention(_) | LayerSpec::Window(_))
    }

    fn cost(&self, cx: &StoreContext) -> StateCost {
        match self {
            LayerSpec::Attention(shape) => KvStore::cost(shape, cx),
            LayerSpec::Window(shape) => WindowKvStore::cost(shape, cx),
            LayerSpec::Recurrent(shape) => RecurrentState::cost(shape, cx),
        }
    }

    fn empty(&self, rows: usize, cx: &StoreContext, device: &Device) -> Result<LayerState> {
        Ok(match self {
            LayerSpec::Attention(shape) => LayerState::Attention(KvStore::empty(shape, rows, cx, device)?),
            LayerSpec::Window(shape) => LayerState::Window(WindowKvStore::empty(shape, rows, cx, device)?),
            LayerSpec::Recurrent(shape) => LayerState::Recurrent(RecurrentState::empty(shape, rows, cx, device)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Tensor;

    use super::*;

    const HEADS: usize = 2;
    const HEAD_DIM: usize = 4;
    const WINDOW: usize = 8;

    fn spec() -> StateSpec {
        let kv = KvShape { kv_heads: HEADS, head_dim: HEAD_DIM };
        let recurrent =
            RecurrentShape { conv_kernel: 4, conv_dim: 6, value_heads: 2, value_dim: 3, key_dim: 5, ssm_dtype: DType::F32 };
        StateSpec {
            layers: vec![
                LayerSpec::Attention(kv),
                LayerSpec::Window(WindowShape { kv, window: WINDOW }),
                LayerSpec::Recurrent(recurrent),
            ],
            dtype: DType::F16,
            kv: KvPolicy::default(),
        }
    }

    #[test]
    fn state_bytes_are_counted_without_wrapping() {
        let cost = StateCost {
            bytes_per_token: 1 << 10,
            bytes_per_row: 100,
            window_bytes_per_token: 8,
            window_positions: 512,
            prefix_bytes_per_token: 4,
            prefix_positions: 10,
        };
        assert_eq!(cost.bytes(3), Some(3 * 1024 + 3 * 8 + 3 * 4 + 100));
        assert_eq!(cost.bytes(1000), Some(1000 * 1024 + 512 * 8 + 10 * 4 + 100));
        // 2^56 tokens of 2^10 bytes wrapped to a few KB.
        assert_eq!(cost.bytes(1 << 56), None);
        assert_eq!(cost.bytes(usize::MAX / 1024), None, "the window and row bytes on top overflow");
    }

    /// The declared cost, counted by hand from the shapes, bounds the bytes a built state holds
    /// at every length, and equals them where every layer holds all it was fed.
    #[test]
    fn a_built_state_holds_what_its_spec_costs() {
        let spec = spec();
        let kv_token = 2 * HEADS * HEAD_DIM * 2;
        let recurrent_row = 3 * 6 * 2 + 2 * 3 * 5 * 4;
        let window_held = WINDOW - 1 + 2 * crate::ROUND_SLACK;
        assert_eq!(
            spec.cost(),
            StateCost {
                bytes_per_token: kv_token,
                bytes_per_row: recurrent_row,
                window_bytes_per_token: kv_token,
                window_positions: window_held,
                ..StateCost::default()
            }
        );
        let mut state = spec.new_state(1, &Device::Cpu).unwrap();
        assert_eq!(state.bytes(), recurrent_row, "an empty row holds only its recurrent state");
        let mut fed = 0;
        for step in [1, 5, 60, 100, 1] {
            let kv = Tensor::ones((HEADS, step, HEAD_DIM), DType::F16, &Device::Cpu).unwrap();
            for layer in &mut state.layers {
                match layer {
                    LayerState::Attention(s) => drop(s.append(0, &kv, &kv).unwrap()),
                    LayerState::Window(s) => drop(s.append(0, &kv, &kv).unwrap()),
                    LayerState::Recurrent(_) => {}
                }
            }
            fed += step;
            let declared = spec.cost().bytes(fed).unwrap();
            assert!(state.bytes() <= declared, "{} bytes held past {declared} declared at {fed}", state.bytes());
            if fed <= window_held {
                assert_eq!(state.bytes(), declared, "nothing dropped yet at {fed}");
            }
        }
        assert!(fed > window_held, "the window dropped positions");
    }

    #[test]
    fn persisted_parts_are_the_kinds_declared_parts() {
        let state = spec().new_state(1, &Device::Cpu).unwrap();
        let names: Vec<String> = state.parts().unwrap().into_iter().map(|(name, _)| name).collect();
        assert_eq!(names, ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v", "layers.2.conv", "layers.2.ssm"]);
    }
}
