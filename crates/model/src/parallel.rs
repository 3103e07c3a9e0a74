//! Tensor parallelism: one model split over the ranks of a group (GPUs of a host, each driven by
//! its own thread), every rank holding a share of each layer's heads and channels and the same
//! number of layers. Attention and DeltaNet layers split by heads (query and value heads; the
//! key/value heads they read go along, and are replicated where the ranks outnumber them), MLPs
//! and experts by their intermediate channels, the embedding and the output head by vocabulary
//! rows. A layer's output projection is row-parallel: each rank multiplies its share, and one
//! all-reduce per mixer and per MLP sums the shares; the output head's shares are gathered.
//!
//! Where a head is replicated (more ranks than heads), every rank holding it computes it — its
//! state stays whole on each — and only one of them (the head's owner) multiplies it into the
//! row-parallel sum: the others hold zeros there, so the sum counts it once.

use std::sync::{Arc, Condvar, Mutex};

use candle_core::{DType, Device, Tensor};

use crate::config::{FeedForward, Qwen35Config};
use crate::dense::DenseConfig;
use crate::error::{ModelError, Result};
use crate::gemma3::Gemma3Config;
use crate::source::WeightSource;

/// The collective operations the ranks of a tensor-parallel group run together: every rank
/// calls each one, in the same order, with tensors of the same shape.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The element-wise sum of every rank's `x`, on every rank (summed in rank order).
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor>;
    /// Every rank's `x` joined along `dim` in rank order, on every rank.
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor>;
}

/// A group of threads of one process exchanging tensors through shared memory: it stands in for
/// NCCL in tests, where CPU ranks must agree with the unsplit model. Not a serving path. A rank
/// that leaves the group (drops its member, as a failed or panicking rank does) breaks it: the
/// others' collectives then fail instead of waiting for it forever.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Exchange>,
}

struct Exchange {
    size: usize,
    round: Mutex<Round>,
    turned: Condvar,
}

/// One exchange in progress: the tensors given so far; `generation` counts the exchanges done.
struct Round {
    slots: Vec<Option<Tensor>>,
    given: usize,
    generation: u64,
    /// The tensors of the last exchange done, for the ranks still to read them.
    done: Vec<Tensor>,
    broken: bool,
}

impl LocalGroup {
    /// The `size` members of a new group, rank by rank.
    pub fn new(size: usize) -> Vec<LocalGroup> {
        let round = Round { slots: vec![None; size], given: 0, generation: 0, done: Vec::new(), broken: false };
        let shared = Arc::new(Exchange { size, round: Mutex::new(round), turned: Condvar::new() });
        (0..size).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect()
    }

    /// Every rank's `x`, in rank order.
    fn exchange(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let broken = || ModelError::Invalid("a rank left the tensor-parallel group".into());
        let mut round = self.shared.round.lock().map_err(|_| broken())?;
        if round.broken {
            return Err(broken());
        }
        round.slots[self.rank] = Some(x.clone());
        round.given += 1;
        let generation = round.generation;
        if round.given == self.shared.size {
            // The last to give completes the exchange and opens the next.
            round.done = round.slots.iter_mut().map(|s| s.take().expect("every rank gave")).collect();
            round.given = 0;
            round.generation += 1;
            self.shared.turned.notify_all();
        }
        let round = self.shared.turned.wait_while(round, |r| r.generation == generation && !r.broken).map_err(|_| broken())?;
        if round.generation == generation {
            return Err(broken());
        }
        // A rank reads the exchange it took part in: the next cannot complete without it.
        Ok(round.done.clone())
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        if let Ok(mut round) = self.shared.round.lock() {
            round.broken = true;
        }
        self.shared.turned.notify_all();
    }
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let all = self.exchange(x)?;
        let mut sum = all[0].clone();
        for t in &all[1..] {
            sum = (sum + t)?;
        }
        Ok(sum)
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        Ok(Tensor::cat(&self.exchange(x)?, dim)?)
    }
}

/// The units (heads, channels, vocabulary rows) of one kind a rank holds: `len` of them from
/// `start`. `owner`: whether it multiplies them into row-parallel sums — false only on the
/// second and later ranks of a replicated unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub start: usize,
    pub len: usize,
    pub owner: bool,
}

impl Share {
    /// `units` over `size` ranks: an equal run each, or, with fewer units than ranks, each unit
    /// on `size / units` consecutive ranks.
    fn of(units: usize, rank: usize, size: usize, what: &str) -> Result<Share> {
        if units >= size {
            if !units.is_multiple_of(size) {
                return Err(split_error(what, units, size));
            }
            let len = units / size;
            return Ok(Share { start: rank * len, len, owner: true });
        }
        if units == 0 || !size.is_multiple_of(units) {
            return Err(split_error(what, units, size));
        }
        let copies = size / units;
        Ok(Share { start: rank / copies, len: 1, owner: rank.is_multiple_of(copies) })
    }

    /// The units of a grouped kind (`groups` of them, each serving `members / groups` consecutive
    /// members: key/value heads of query heads, key heads of value heads) that `members` reads.
    fn grouped(members: &Share, member_units: usize, groups: usize, what: &str) -> Result<Share> {
        if groups == 0 || !member_units.is_multiple_of(groups) {
            return Err(ModelError::Invalid(format!("{what}: {groups} does not divide {member_units}")));
        }
        let per_group = member_units / groups;
        // A rank's members fill whole groups or sit inside one, so its own layout keeps the
        // model's: local member j reads local group j / (members / groups).
        if !members.len.is_multiple_of(per_group) && !per_group.is_multiple_of(members.len) {
            return Err(ModelError::Invalid(format!(
                "{what}: {} of {member_units} heads per rank straddle the groups of {per_group} that share one",
                members.len
            )));
        }
        let start = members.start / per_group;
        let end = (members.start + members.len - 1) / per_group + 1;
        Ok(Share { start, len: end - start, owner: members.owner })
    }

    fn scaled(&self, width: usize) -> std::ops::Range<usize> {
        self.start * width..(self.start + self.len) * width
    }
}

fn split_error(what: &str, units: usize, size: usize) -> ModelError {
    ModelError::Invalid(format!(
        "{size} tensor-parallel ranks do not split the model's {units} {what}: the ranks must divide them, or they the ranks"
    ))
}

/// The sizes tensor parallelism splits, as a model family's config gives them (the tensor
/// names are transformers' in every family).
#[derive(Clone, Copy, Debug)]
pub struct SplitDims {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Rows of `q_proj` per head and dim: 2 where each head's query carries its output gate.
    pub query_parts: usize,
    /// Gated DeltaNet layers, where the model has them.
    pub linear: Option<LinearDims>,
    pub feed_forward: FeedForwardDims,
}

#[derive(Clone, Copy, Debug)]
pub struct LinearDims {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

#[derive(Clone, Copy, Debug)]
pub enum FeedForwardDims {
    Dense {
        intermediate: usize,
    },
    /// Each routed expert's width and the shared expert's.
    Experts {
        intermediate: usize,
        shared: usize,
    },
}

/// A rank's place in a tensor-parallel group and the shares of the model it holds.
pub struct TensorParallel {
    pub group: Arc<dyn Collective>,
    dims: SplitDims,
    pub vocab: Share,
    pub query_heads: Share,
    pub kv_heads: Share,
    /// DeltaNet value and key heads (empty without DeltaNet layers).
    pub value_heads: Share,
    pub key_heads: Share,
    /// The dense MLP's channels, or each routed expert's.
    pub mlp: Share,
    pub shared_expert: Share,
}

impl TensorParallel {
    pub fn new(dims: SplitDims, group: Arc<dyn Collective>) -> Result<Self> {
        let (rank, size) = (group.rank(), group.size());
        let query_heads = Share::of(dims.heads, rank, size, "attention heads")?;
        let none = Share { start: 0, len: 0, owner: true };
        let (value_heads, key_heads) = match dims.linear {
            Some(l) => {
                let values = Share::of(l.value_heads, rank, size, "DeltaNet value heads")?;
                (values, Share::grouped(&values, l.value_heads, l.key_heads, "DeltaNet key heads")?)
            }
            None => (none, none),
        };
        let (mlp, shared_expert) = match dims.feed_forward {
            FeedForwardDims::Dense { intermediate } => (Share::of(intermediate, rank, size, "MLP channels")?, none),
            FeedForwardDims::Experts { intermediate, shared } => (
                Share::of(intermediate, rank, size, "channels of each expert")?,
                Share::of(shared, rank, size, "shared expert channels")?,
            ),
        };
        Ok(Self {
            vocab: Share::of(dims.vocab, rank, size, "vocabulary rows")?,
            kv_heads: Share::grouped(&query_heads, dims.heads, dims.kv_heads, "key/value heads")?,
            query_heads,
            value_heads,
            key_heads,
            mlp,
            shared_expert,
            group,
            dims,
        })
    }

    /// Where `name`'s shard lies in the whole tensor, or `None` where every rank holds it all.
    fn split(&self, name: &str) -> Option<Split> {
        let dims = &self.dims;
        let rows = |full: usize, ranges: Vec<std::ops::Range<usize>>| Some(Split { dim: 0, full, ranges, zero: false });
        // A row-parallel matrix: its input columns; zeros on a replica that does not own them.
        let columns = |dim: usize, full: usize, share: &Share, width: usize| {
            Some(Split { dim, full, ranges: vec![share.scaled(width)], zero: !share.owner })
        };
        if name == "embed_tokens.weight" || name == "lm_head.weight" {
            return rows(dims.vocab, vec![self.vocab.scaled(1)]);
        }
        // A decoder layer's tensor, the MTP head's (`mtp.layers.0.…`) among them.
        let rest = name.strip_prefix("mtp.").unwrap_or(name).strip_prefix("layers.")?.split_once('.')?.1;
        let (d, q, kv) = (dims.head_dim, &self.query_heads, &self.kv_heads);
        let query_rows = dims.query_parts * d;
        let linear = dims.linear.unwrap_or(LinearDims { key_heads: 0, value_heads: 0, key_dim: 0, value_dim: 0 });
        let (dk, dv, hk, hv) = (linear.key_dim, linear.value_dim, linear.key_heads, linear.value_heads);
        let (keys, values) = (&self.key_heads, &self.value_heads);
        // The DeltaNet conv's channels: q and k of the key heads, then v of the value heads.
        let qkv_channels = || {
            let (k, v) = (keys.scaled(dk), values.scaled(dv));
            let (q_end, k_end) = (hk * dk, 2 * hk * dk);
            vec![k.clone(), q_end + k.start..q_end + k.end, k_end + v.start..k_end + v.end]
        };
        let (expert, shared) = match dims.feed_forward {
            FeedForwardDims::Dense { intermediate } => (intermediate, 0),
            FeedForwardDims::Experts { intermediate, shared } => (intermediate, shared),
        };
        match rest {
            "self_attn.q_proj.weight" | "self_attn.q_proj.bias" => rows(dims.heads * query_rows, vec![q.scaled(query_rows)]),
            "self_attn.k_proj.weight" | "self_attn.k_proj.bias" | "self_attn.v_proj.weight" | "self_attn.v_proj.bias" => {
                rows(dims.kv_heads * d, vec![kv.scaled(d)])
            }
            "self_attn.o_proj.weight" => columns(1, dims.heads * d, q, d),
            // Added once to the sum: by the first rank.
            "self_attn.o_proj.bias" => {
                let whole = 0..dims.hidden;
                Some(Split { dim: 0, full: dims.hidden, ranges: vec![whole], zero: self.group.rank() != 0 })
            }
            "linear_attn.in_proj_qkv.weight" | "linear_attn.conv1d.weight" => rows(2 * hk * dk + hv * dv, qkv_channels()),
            "linear_attn.in_proj_z.weight" => rows(hv * dv, vec![values.scaled(dv)]),
            "linear_attn.in_proj_b.weight" | "linear_attn.in_proj_a.weight" | "linear_attn.A_log" | "linear_attn.dt_bias" => {
                rows(hv, vec![values.scaled(1)])
            }
            "linear_attn.out_proj.weight" => columns(1, hv * dv, values, dv),
            "mlp.experts.gate_up_proj" => {
                let c = self.mlp.scaled(1);
                Some(Split { dim: 1, full: 2 * expert, ranges: vec![c.clone(), expert + c.start..expert + c.end], zero: false })
            }
            "mlp.experts.down_proj" => columns(2, expert, &self.mlp, 1),
            _ => {
                // A gated MLP: the dense one, the shared expert or a routed expert stored alone
                // (a mixture's router, `mlp.gate`, and its shared expert's gate stay whole).
                let (mlp, part) = rest.rsplit_once('.')?.0.rsplit_once('.')?;
                let (share, width) = match (mlp, dims.feed_forward) {
                    ("mlp", FeedForwardDims::Dense { .. }) => (&self.mlp, expert),
                    ("mlp.shared_expert", FeedForwardDims::Experts { .. }) => (&self.shared_expert, shared),
                    (m, FeedForwardDims::Experts { .. }) if m.starts_with("mlp.experts.") => (&self.mlp, expert),
                    _ => return None,
                };
                match part {
                    "gate_proj" | "up_proj" => rows(width, vec![share.scaled(1)]),
                    "down_proj" => columns(1, width, share, 1),
                    _ => None,
                }
            }
        }
    }
}

/// A model's tensor parallelism as its layers use it: nothing where the model is whole, else its
/// rank's group and shares. Clones share them.
#[derive(Clone, Default)]
pub struct Parallel(Option<Arc<TensorParallel>>);

impl Parallel {
    pub fn new(parallel: Arc<TensorParallel>) -> Self {
        Self(Some(parallel))
    }

    pub fn get(&self) -> Option<&TensorParallel> {
        self.0.as_deref()
    }

    /// The sum over the group of a row-parallel output's shares (`x` itself for a whole model).
    pub fn sum(&self, x: Tensor) -> Result<Tensor> {
        match &self.0 {
            Some(p) => p.group.all_reduce_sum(&x),
            None => Ok(x),
        }
    }

    /// Every vocabulary row's logits from each rank's share of them `[.., vocab / ranks]`.
    pub fn gather_vocab(&self, logits: Tensor) -> Result<Tensor> {
        match &self.0 {
            Some(p) => p.group.all_gather(&logits, logits.rank() - 1),
            None => Ok(logits),
        }
    }

    /// Embeddings `[N, hidden]` of token ids through `rows_at` (rows of the embedding matrix
    /// this model holds): a split model's rank gives the rows of the ids it holds and zeros for
    /// the rest, and the group's sum is every id's row.
    pub fn embed(&self, ids: &Tensor, rows_at: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let Some(p) = &self.0 else { return rows_at(ids) };
        let device = ids.device().clone();
        let ids = ids.to_vec1::<u32>()?;
        let held = |id: u32| (p.vocab.start..p.vocab.start + p.vocab.len).contains(&(id as usize));
        let local: Vec<u32> = ids.iter().map(|&id| if held(id) { id - p.vocab.start as u32 } else { 0 }).collect();
        let mask: Vec<f32> = ids.iter().map(|&id| if held(id) { 1.0 } else { 0.0 }).collect();
        let rows = rows_at(&Tensor::new(local, &device)?)?;
        let mask = Tensor::from_vec(mask, (ids.len(), 1), &device)?.to_dtype(rows.dtype())?;
        self.sum(rows.broadcast_mul(&mask)?)
    }
}

impl Qwen35Config {
    pub fn split_dims(&self) -> SplitDims {
        SplitDims {
            vocab: self.vocab_size,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            query_parts: 2,
            linear: Some(LinearDims {
                key_heads: self.linear_num_key_heads,
                value_heads: self.linear_num_value_heads,
                key_dim: self.linear_key_head_dim,
                value_dim: self.linear_value_head_dim,
            }),
            feed_forward: match self.feed_forward {
                FeedForward::Dense { intermediate_size } => FeedForwardDims::Dense { intermediate: intermediate_size },
                FeedForward::Experts(e) => {
                    FeedForwardDims::Experts { intermediate: e.moe_intermediate_size, shared: e.shared_expert_intermediate_size }
                }
            },
        }
    }

    /// The shapes of a rank's share: its layers' loaders and state take these.
    pub fn share(&self, p: &TensorParallel) -> Self {
        let mut local = self.clone();
        local.vocab_size = p.vocab.len;
        local.num_attention_heads = p.query_heads.len;
        local.num_key_value_heads = p.kv_heads.len;
        local.linear_num_value_heads = p.value_heads.len;
        local.linear_num_key_heads = p.key_heads.len;
        local.feed_forward = match self.feed_forward {
            FeedForward::Dense { .. } => FeedForward::Dense { intermediate_size: p.mlp.len },
            FeedForward::Experts(mut e) => {
                e.moe_intermediate_size = p.mlp.len;
                e.shared_expert_intermediate_size = p.shared_expert.len;
                FeedForward::Experts(e)
            }
        };
        local
    }
}

impl DenseConfig {
    pub fn split_dims(&self) -> SplitDims {
        SplitDims {
            vocab: self.vocab_size,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            query_parts: 1,
            linear: None,
            feed_forward: FeedForwardDims::Dense { intermediate: self.intermediate_size },
        }
    }

    /// The shapes of a rank's share: its layers' loaders and state take these.
    pub fn share(&self, p: &TensorParallel) -> Self {
        Self {
            vocab_size: p.vocab.len,
            num_attention_heads: p.query_heads.len,
            num_key_value_heads: p.kv_heads.len,
            intermediate_size: p.mlp.len,
            ..self.clone()
        }
    }
}

impl Gemma3Config {
    pub fn split_dims(&self) -> SplitDims {
        SplitDims {
            vocab: self.vocab_size,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            query_parts: 1,
            linear: None,
            feed_forward: FeedForwardDims::Dense { intermediate: self.intermediate_size },
        }
    }

    /// The shapes of a rank's share: its layers' loaders and state take these.
    pub fn share(&self, p: &TensorParallel) -> Self {
        Self {
            vocab_size: p.vocab.len,
            num_attention_heads: p.query_heads.len,
            num_key_value_heads: p.kv_heads.len,
            intermediate_size: p.mlp.len,
            ..self.clone()
        }
    }
}

/// A shard of a tensor: the ranges of dimension `dim` (of size `full` in the whole tensor) that
/// it takes, joined in order; `zero`: held as zeros (see [`Share::owner`]).
struct Split {
    dim: usize,
    full: usize,
    ranges: Vec<std::ops::Range<usize>>,
    zero: bool,
}

/// The weights of one rank: each tensor a shard of the whole one `inner` holds, asked for in the
/// rank's shapes (its [`TensorParallel::local_config`]).
pub struct ShardedSource<'a> {
    pub inner: &'a dyn WeightSource,
    pub parallel: &'a TensorParallel,
}

impl WeightSource for ShardedSource<'_> {
    fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let Some(split) = self.parallel.split(name) else { return self.inner.get(name, shape, dtype) };
        let taken: usize = split.ranges.iter().map(|r| r.len()).sum();
        if shape.get(split.dim) != Some(&taken) {
            return Err(ModelError::Invalid(format!(
                "{name}: a shard of shape {shape:?} asked for, {taken} along dim {}",
                split.dim
            )));
        }
        let mut whole = shape.to_vec();
        whole[split.dim] = split.full;
        // Every rank reads the tensor, a replica that holds zeros too: a missing or misshapen
        // tensor fails on every rank alike, and a random source's seeds stay in step.
        let t = self.inner.get(name, &whole, dtype)?;
        if split.zero {
            return Ok(Tensor::zeros(shape, dtype, self.inner.device())?);
        }
        let mut parts =
            split.ranges.iter().map(|r| t.narrow(split.dim, r.start, r.len())).collect::<candle_core::Result<Vec<_>>>()?;
        // A copy of its own: a view would keep the whole tensor's memory alive on every rank.
        Ok(match parts.len() {
            1 => parts.remove(0).force_contiguous()?,
            _ => Tensor::cat(&parts, split.dim)?,
        })
    }

    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_split_evenly_or_replicate_with_one_owner() {
        let of = |units, size| (0..size).map(|r| Share::of(units, r, size, "heads").unwrap()).collect::<Vec<_>>();
        assert_eq!(of(8, 2), vec![Share { start: 0, len: 4, owner: true }, Share { start: 4, len: 4, owner: true }]);
        let replicated = of(2, 4);
        assert_eq!(
            replicated.iter().map(|s| (s.start, s.owner)).collect::<Vec<_>>(),
            [(0, true), (0, false), (1, true), (1, false)]
        );
        assert!(Share::of(6, 0, 4, "heads").unwrap_err().to_string().contains("the ranks must divide them"));
        assert!(Share::of(3, 0, 4, "heads").is_err());
        // Query heads 4 of 8 per rank read 1 of 2 KV heads; 1 of 8 per rank sits inside one.
        let q = Share::of(8, 1, 2, "q").unwrap();
        assert_eq!(Share::grouped(&q, 8, 2, "kv").unwrap(), Share { start: 1, len: 1, owner: true });
        let q = Share::of(8, 5, 8, "q").unwrap();
        assert_eq!(Share::grouped(&q, 8, 2, "kv").unwrap(), Share { start: 1, len: 1, owner: true });
        let q = Share::of(6, 1, 2, "q").unwrap(); // 3 heads per rank, groups of 2: straddles
        assert!(Share::grouped(&q, 6, 3, "kv").is_err());
    }

    #[test]
    fn a_shard_owns_its_memory_and_a_replica_reads_the_tensor_too() {
        struct Whole(Tensor);
        impl WeightSource for Whole {
            fn get(&self, name: &str, shape: &[usize], _: DType) -> Result<Tensor> {
                if name == "missing" || shape != self.0.dims() {
                    return Err(ModelError::Invalid(format!("no {name} of shape {shape:?}")));
                }
                Ok(self.0.clone())
            }
            fn device(&self) -> &Device {
                &Device::Cpu
            }
        }
        let dims = SplitDims {
            vocab: 8,
            hidden: 4,
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
            query_parts: 1,
            linear: None,
            feed_forward: FeedForwardDims::Dense { intermediate: 4 },
        };
        let whole = Whole(Tensor::arange(0f32, 32., &Device::Cpu).unwrap().reshape((8, 4)).unwrap());
        let group = LocalGroup::new(2).into_iter().nth(1).unwrap();
        let parallel = TensorParallel::new(dims, Arc::new(group)).unwrap();
        let source = ShardedSource { inner: &whole, parallel: &parallel };
        let rows = source.get("embed_tokens.weight", &[4, 4], DType::F32).unwrap();
        assert_eq!(rows.to_vec2::<f32>().unwrap()[0], [16., 17., 18., 19.]);
        let (storage, _) = rows.storage_and_layout();
        let held = match &*storage {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.len(),
            _ => unreachable!("an f32 CPU tensor"),
        };
        assert_eq!(held, 16, "the shard holds its own 16 values, not a view of the whole 32");
        // o_proj's bias is added by rank 0 alone; rank 1 holds zeros but still reads it.
        let whole = Whole(Tensor::ones(4, DType::F32, &Device::Cpu).unwrap());
        let source = ShardedSource { inner: &whole, parallel: &parallel };
        assert_eq!(source.get("layers.0.self_attn.o_proj.bias", &[4], DType::F32).unwrap().to_vec1::<f32>().unwrap(), [0.; 4]);
        assert!(source.get("layers.0.self_attn.o_proj.bias", &[3], DType::F32).is_err());
    }

    #[test]
    fn a_rank_leaving_the_group_fails_the_others_collectives_instead_of_hanging() {
        let mut group = LocalGroup::new(2);
        drop(group.pop());
        let x = Tensor::ones(2, DType::F32, &Device::Cpu).unwrap();
        assert!(group[0].all_reduce_sum(&x).unwrap_err().to_string().contains("left the tensor-parallel group"));
    }

    #[test]
    fn a_local_group_sums_and_gathers_in_rank_order() {
        let group = LocalGroup::new(3);
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let x = Tensor::new(&[g.rank() as f32, 1.0], &Device::Cpu).unwrap();
                        let sum = g.all_reduce_sum(&x).unwrap().to_vec1::<f32>().unwrap();
                        let gathered = g.all_gather(&x, 0).unwrap().to_vec1::<f32>().unwrap();
                        (sum, gathered)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, gathered) in results {
            assert_eq!(sum, [3.0, 3.0]);
            assert_eq!(gathered, [0.0, 1.0, 1.0, 1.0, 2.0, 1.0]);
        }
    }
}
