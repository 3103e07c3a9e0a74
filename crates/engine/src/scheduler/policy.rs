//! The engine thread's policy: which rows run, from plain bookkeeping alone (no model, no
//! tensors), so that it can be tested without either.
//!
//! Every action changes the pool's free blocks by an amount only the state knows (a restored
//! row's blocks, copies of shared blocks, what a preempted row's shared prefix gives back), so
//! the policy plans one decision at a time against the blocks measured after the last one: the
//! engine asks, the runner acts, and the engine asks again.

use crate::shared::EngineConfig;

/// The pool's KV blocks as the policy sees them.
pub(crate) trait Blocks {
    /// Positions per block.
    fn block_size(&self) -> usize;
    /// Free blocks once the prompt cache has given up entries until `need` are free (or it
    /// holds no more): its entries come after the running requests. `None`: a pool that grows.
    fn free_toward(&mut self, need: usize) -> Option<usize>;
}

/// The jobs in flight.
#[derive(Clone, Debug, Default)]
pub(crate) struct Load {
    /// Rows in the running batch.
    pub running: usize,
    /// The jobs being prefilled, oldest first.
    pub joiners: Vec<Fed>,
    /// Worst-case state bytes of the running, preempted and prefilling jobs.
    pub reserved_bytes: usize,
}

/// A job being prefilled: prompt tokens fed so far, of its prompt's `len`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Fed {
    pub fed: usize,
    pub len: usize,
}

impl Load {
    /// Rows the running and prefilling jobs take in the batch.
    fn rows(&self) -> usize {
        self.running + self.joiners.len()
    }

    /// Prompt tokens the prefilling jobs have yet to feed.
    fn unfed(&self) -> usize {
        self.joiners.iter().map(|j| j.len - j.fed).sum()
    }
}

/// The oldest waiting job.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Waiting {
    pub prompt_len: usize,
    /// Worst-case state bytes (prompt + `max_tokens`).
    pub bytes: usize,
    /// Whether its stored-state read is done.
    pub fetched: bool,
}

/// What admission does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// The first preempted row comes back into the batch.
    Resume,
    /// The oldest waiting job fits the budget: ask for its read, then ask again.
    Fetch,
    /// The oldest waiting job starts.
    Start,
    /// Nothing more this step.
    Wait,
}

/// The joiner's next prefill chunk: its prompt as far as the policy needs it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Prompt<'a> {
    pub fed: usize,
    pub len: usize,
    /// Prompt lengths where the job asks for snapshots too.
    pub cache_points: &'a [usize],
    /// `Some(stride)` when the prompt cache keeps snapshots (0: only at the prompt's end).
    pub snapshots: Option<usize>,
}

/// A prefill chunk: it feeds the prompt up to `end`, and takes a snapshot there when `snapshot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub end: usize,
    pub snapshot: bool,
}

/// A measure that frees blocks for a decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Measure {
    /// Prefilling job `i` starts over; its prompt is fed again later.
    RestartJoiner(usize),
    /// Running row `i` goes to host memory until it resumes.
    Preempt(usize),
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    pub max_seqs: usize,
    pub prefill_chunk: usize,
    /// Positions one step's forward carries at most (decode rows and prefill chunks).
    pub max_batched_tokens: usize,
    pub state_budget_bytes: usize,
}

impl Policy {
    pub fn new(config: &EngineConfig) -> Self {
        Self {
            max_seqs: config.max_batch,
            prefill_chunk: config.prefill_chunk,
            max_batched_tokens: config.step_tokens(),
            state_budget_bytes: config.state_budget_bytes,
        }
    }

    /// Preempted rows come back first, the first preempted first, and no job starts while one
    /// waits. Jobs start strictly in arrival order, so none starves: only the oldest is ever
    /// considered. Its read is asked for once it fits the budget, even while the batch is full
    /// or other jobs prefill, so that the read overlaps their work. Jobs start prefilling while
    /// the prompt tokens the prefilling jobs have yet to feed fall short of one step's token
    /// budget, so that prompts arriving together prefill together (see [`Policy::cohort`]).
    pub fn admission(
        &self,
        load: &Load,
        preempted: Option<usize>,
        waiting: Option<Waiting>,
        blocks: &mut impl Blocks,
    ) -> Admission {
        if let Some(position) = preempted {
            let batch_full = load.rows() >= self.max_seqs;
            return match !batch_full && Self::has_room(load, position, blocks) {
                true => Admission::Resume,
                false => Admission::Wait,
            };
        }
        let Some(job) = waiting else { return Admission::Wait };
        if load.reserved_bytes.checked_add(job.bytes).is_none_or(|total| total > self.state_budget_bytes) {
            return Admission::Wait;
        }
        if !job.fetched {
            return Admission::Fetch;
        }
        let forward_full = load.unfed() >= self.max_batched_tokens;
        if forward_full || load.rows() >= self.max_seqs || !Self::has_room(load, job.prompt_len, blocks) {
            return Admission::Wait;
        }
        Admission::Start
    }

    /// Whether the pool's free blocks hold `tokens` positions of one more row besides a block
    /// for each running row's next step and the prompts the prefilling jobs have yet to feed.
    fn has_room(load: &Load, tokens: usize, blocks: &mut impl Blocks) -> bool {
        let bs = blocks.block_size();
        let unfed: usize = load.joiners.iter().map(|j| (j.len - j.fed).div_ceil(bs)).sum();
        let need = tokens.div_ceil(bs) + 1 + load.running + unfed;
        blocks.free_toward(need).is_none_or(|free| free >= need)
    }

    /// The joiner's next chunk: at most `prefill_chunk` tokens (and no more than a step's
    /// budget), ending where a snapshot is due (every `stride` tokens, at the job's cache
    /// points, one token before the prompt's end); without a cache, chunking is left alone. A
    /// prompt's chunks depend on the prompt alone, never on what else runs: on CPU a chunk past
    /// the batch-invariant kernels' rows computes its positions with bits that depend on where
    /// it starts and ends, and batching must not change a request's tokens.
    pub fn chunk(&self, prompt: &Prompt) -> Chunk {
        let Prompt { fed, len, cache_points, snapshots } = *prompt;
        let mut end = (fed + self.prefill_chunk.min(self.max_batched_tokens).max(1)).min(len);
        let stride = snapshots.unwrap_or(0);
        let next_point = cache_points.iter().copied().filter(|&p| p > fed && p < len).min();
        if snapshots.is_some() && fed + 1 < len {
            end = end.min(len - 1).min(next_point.unwrap_or(len));
        }
        if stride > 0 {
            end = end.min((fed / stride + 1) * stride);
        }
        let point = end + 1 == len || (stride > 0 && end % stride == 0) || next_point == Some(end);
        Chunk { end, snapshot: snapshots.is_some() && end < len && point }
    }

    /// The prefill chunks a step's forward carries beside `decode_positions` positions of the
    /// running rows, given each prefilling job's next chunk (oldest first): the jobs whose whole
    /// chunks fit the step's token budget (`--max-num-batched-tokens`) after the decode
    /// positions, oldest first. The oldest job's chunk always runs, so a prompt never waits
    /// behind a full batch: a step carries at most the budget, or the decode positions and one
    /// chunk where they are more. Chunks are never cut (see [`Policy::chunk`]).
    pub fn cohort(&self, decode_positions: usize, chunks: &[usize]) -> Vec<usize> {
        let mut used = decode_positions;
        let mut members = Vec::new();
        for (i, &chunk) in chunks.iter().enumerate() {
            if i == 0 || used + chunk <= self.max_batched_tokens {
                members.push(i);
                used += chunk;
            }
        }
        members
    }

    /// Whether a chunk that takes `blocks_to_grow` blocks runs in a step whose running rows
    /// take `decode_blocks`. The running rows come first: their step's blocks, and at least a
    /// block each for the steps after it, stay free, and the chunk waits while that would not
    /// leave it room.
    pub fn chunk_runs(&self, load: &Load, blocks_to_grow: usize, decode_blocks: usize, blocks: &mut impl Blocks) -> bool {
        let need = blocks_to_grow + decode_blocks.max(load.running);
        let free = blocks.free_toward(need);
        load.running == 0 || free.is_none_or(|free| free >= need)
    }

    /// Whether a decode step that takes `need` blocks fits the pool.
    pub fn step_fits(&self, need: usize, blocks: &mut impl Blocks) -> bool {
        blocks.free_toward(need).is_none_or(|free| free >= need)
    }

    /// The measures that free blocks for a decode step that does not fit, in the order they
    /// are taken until it does (the prompt cache gives up entries before each check): the
    /// prefilling jobs start over, the youngest first, then the youngest rows are preempted.
    /// One row always fits alone (admission checked that its longest state fits the pool), so
    /// the oldest row is never preempted.
    pub fn relief(&self, load: &Load) -> Vec<Measure> {
        let holding = load.joiners.iter().enumerate().rev().filter(|(_, j)| j.fed > 0);
        let restarts = holding.map(|(i, _)| Measure::RestartJoiner(i));
        restarts.chain((1..load.running).rev().map(Measure::Preempt)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of `free` blocks and a prompt cache holding `evictable` more, given up one at a
    /// time as the runner's does; `asked` records every need it was asked to meet.
    struct FakeBlocks {
        block_size: usize,
        free: Option<usize>,
        evictable: usize,
        asked: Vec<usize>,
    }

    impl FakeBlocks {
        fn new(free: usize) -> Self {
            Self { block_size: 16, free: Some(free), evictable: 0, asked: Vec::new() }
        }

        fn growing() -> Self {
            Self { free: None, ..Self::new(0) }
        }
    }

    impl Blocks for FakeBlocks {
        fn block_size(&self) -> usize {
            self.block_size
        }

        fn free_toward(&mut self, need: usize) -> Option<usize> {
            self.asked.push(need);
            let free = self.free.as_mut()?;
            while *free < need && self.evictable > 0 {
                (*free, self.evictable) = (*free + 1, self.evictable - 1);
            }
            Some(*free)
        }
    }

    fn policy(max_seqs: usize) -> Policy {
        Policy { max_seqs, prefill_chunk: 64, max_batched_tokens: 64, state_budget_bytes: usize::MAX }
    }

    fn job(prompt_len: usize) -> Waiting {
        Waiting { prompt_len, bytes: 0, fetched: true }
    }

    fn load(running: usize) -> Load {
        Load { running, ..Load::default() }
    }

    #[test]
    fn the_oldest_job_starts_when_it_fits() {
        let mut blocks = FakeBlocks::new(100);
        assert_eq!(policy(4).admission(&load(0), None, Some(job(32)), &mut blocks), Admission::Start);
        assert_eq!(policy(4).admission(&load(0), None, None, &mut blocks), Admission::Wait);
    }

    /// First come, first served: a job that does not fit holds back every job behind it, even
    /// one that would.
    #[test]
    fn admission_is_first_come_first_served() {
        let (oldest, small) = (job(16 * 9), job(1));
        let mut blocks = FakeBlocks::new(10);
        assert_eq!(policy(4).admission(&load(1), None, Some(small), &mut blocks), Admission::Start);
        assert_eq!(policy(4).admission(&load(1), None, Some(oldest), &mut blocks), Admission::Wait, "9 + 1 + 1 blocks of 10");
        blocks.free = Some(11);
        assert_eq!(policy(4).admission(&load(1), None, Some(oldest), &mut blocks), Admission::Start);
    }

    #[test]
    fn max_num_seqs_caps_the_batch() {
        let mut blocks = FakeBlocks::growing();
        assert_eq!(policy(2).admission(&load(1), None, Some(job(8)), &mut blocks), Admission::Start);
        assert_eq!(policy(2).admission(&load(2), None, Some(job(8)), &mut blocks), Admission::Wait);
        // Prefilling jobs count against the cap too, for a preempted row as for a new job.
        let prefilling = Load { running: 1, joiners: vec![Fed { fed: 0, len: 8 }], ..Load::default() };
        assert_eq!(policy(2).admission(&prefilling, Some(8), None, &mut blocks), Admission::Wait);
        assert_eq!(policy(2).admission(&prefilling, None, Some(job(8)), &mut blocks), Admission::Wait);
        assert_eq!(policy(3).admission(&prefilling, Some(8), None, &mut blocks), Admission::Resume);
        assert_eq!(policy(3).admission(&prefilling, None, Some(job(8)), &mut blocks), Admission::Start);
    }

    /// Jobs join the prefill while what the prefilling jobs have yet to feed falls short of
    /// one step's budget (64 tokens here), however much each has fed.
    #[test]
    fn jobs_prefill_together_while_their_prompts_fill_less_than_a_forward() {
        let joiners =
            |unfed: &[usize]| Load { joiners: unfed.iter().map(|&u| Fed { fed: 100, len: 100 + u }).collect(), ..load(0) };
        let mut blocks = FakeBlocks::growing();
        for (unfed, next) in
            [(&[63][..], Admission::Start), (&[30, 33], Admission::Start), (&[64], Admission::Wait), (&[1, 63], Admission::Wait)]
        {
            assert_eq!(policy(8).admission(&joiners(unfed), None, Some(job(500)), &mut blocks), next, "{unfed:?} unfed");
        }
    }

    /// The prompts the prefilling jobs have yet to feed take blocks too: a job starts only
    /// with room for them besides its own.
    #[test]
    fn a_job_leaves_room_for_the_prompts_being_prefilled() {
        let load = Load { joiners: vec![Fed { fed: 16, len: 48 }, Fed { fed: 0, len: 1 }], ..load(1) };
        for (free, admitted) in [(6, true), (5, false)] {
            let mut blocks = FakeBlocks::new(free);
            assert_eq!(policy(8).admission(&load, None, Some(job(16)), &mut blocks) == Admission::Start, admitted, "{free} free");
            assert_eq!(blocks.asked, [1 + 1 + 1 + (2 + 1)], "its block, one spare, the running row's, the joiners' 2 + 1");
        }
    }

    /// A step's forward carries the running rows' positions, then whole prefill chunks oldest
    /// first while the budget (64 tokens here) lasts; the oldest prompt's chunk always runs.
    #[test]
    fn a_step_fills_its_token_budget_with_whole_chunks_oldest_first() {
        assert_eq!(policy(8).cohort(0, &[]), Vec::<usize>::new());
        assert_eq!(policy(8).cohort(0, &[64, 64]), vec![0], "a full chunk runs alone");
        assert_eq!(policy(8).cohort(0, &[16, 8, 20, 16, 30]), vec![0, 1, 2, 3], "60 tokens; the 30 would pass 64");
        assert_eq!(policy(8).cohort(0, &[40, 30, 8]), vec![0, 2], "a younger chunk that fits runs past one that does not");
        assert_eq!(policy(8).cohort(20, &[30, 8, 20]), vec![0, 1], "decode positions come first");
        assert_eq!(policy(8).cohort(40, &[30, 8, 20]), vec![0], "the oldest always runs, past the budget");
        assert_eq!(policy(8).cohort(200, &[10, 8]), vec![0]);
    }

    /// By default a step's budget holds a whole chunk's worth of prompts beside a full batch's
    /// decode positions (with the chunk alone, 64 running rows left two half-chunk prompts a
    /// forward each on a GPU).
    #[test]
    fn the_default_budget_fits_a_chunk_beside_a_full_batch() {
        let config = EngineConfig::for_device(&candle_core::Device::Cpu);
        let (p, half) = (Policy::new(&config), config.prefill_chunk / 2);
        assert_eq!(p.cohort(config.max_batch, &[half, half, 1]), vec![0, 1], "two halves, not a third prompt");
        let long = Prompt { fed: 0, len: 10 * config.prefill_chunk, cache_points: &[], snapshots: None };
        assert_eq!(p.chunk(&long).end, config.prefill_chunk, "a chunk is still the prefill chunk");
    }

    /// Chunks are at most the prefill chunk and the step's budget, whatever else runs.
    #[test]
    fn a_chunk_is_at_most_the_prefill_chunk_and_the_budget() {
        let prompt = Prompt { fed: 0, len: 500, cache_points: &[], snapshots: None };
        assert_eq!(policy(8).chunk(&prompt).end, 64);
        let small_budget = Policy { max_batched_tokens: 40, ..policy(8) };
        assert_eq!(small_budget.chunk(&prompt).end, 40);
    }

    /// A job starts only while the free blocks cover its prompt (rounded up to blocks) and one
    /// block more, besides a block for every running row's next step.
    #[test]
    fn a_job_waits_for_blocks_for_its_prompt_and_each_running_row() {
        let tokens = 16 * 5 + 1; // 6 blocks
        for (running, free, admitted) in [(0, 7, true), (0, 6, false), (3, 10, true), (3, 9, false)] {
            let mut blocks = FakeBlocks::new(free);
            let next = policy(8).admission(&load(running), None, Some(job(tokens)), &mut blocks);
            assert_eq!(next == Admission::Start, admitted, "{running} running, {free} free");
            assert_eq!(blocks.asked, [6 + 1 + running]);
        }
    }

    /// The prompt cache gives up what admission needs, and no more.
    #[test]
    fn the_prompt_cache_gives_up_blocks_for_a_job() {
        let mut blocks = FakeBlocks { evictable: 5, ..FakeBlocks::new(4) };
        assert_eq!(policy(4).admission(&load(1), None, Some(job(64)), &mut blocks), Admission::Start);
        assert_eq!((blocks.free, blocks.evictable), (Some(4 + 1 + 1), 3));
    }

    #[test]
    fn preempted_rows_resume_before_any_job_starts() {
        let mut blocks = FakeBlocks::new(100);
        assert_eq!(policy(4).admission(&load(1), Some(40), Some(job(1)), &mut blocks), Admission::Resume);
        // One that has no room yet holds back every job, however small.
        let mut blocks = FakeBlocks::new(4);
        assert_eq!(policy(4).admission(&load(1), Some(40), Some(job(1)), &mut blocks), Admission::Wait);
        assert_eq!(blocks.asked, [3 + 1 + 1], "only the preempted row's room is measured");
    }

    /// With a budget, a job starts only while every job in flight fits it at its worst case,
    /// however many blocks are free; its read is not even asked for before.
    #[test]
    fn the_state_budget_caps_admission() {
        let capped = Policy { state_budget_bytes: 1000, ..policy(8) };
        let busy = Load { running: 1, reserved_bytes: 600, ..Load::default() };
        let mut blocks = FakeBlocks::growing();
        let next = |bytes, fetched, blocks: &mut FakeBlocks| {
            capped.admission(&busy, None, Some(Waiting { prompt_len: 8, bytes, fetched }), blocks)
        };
        assert_eq!(next(401, false, &mut blocks), Admission::Wait);
        assert_eq!(next(400, false, &mut blocks), Admission::Fetch);
        assert_eq!(next(400, true, &mut blocks), Admission::Start);
        assert_eq!(next(usize::MAX, true, &mut blocks), Admission::Wait, "an overflow is over the budget");
    }

    /// A job's read is asked for while the batch is full, so that it overlaps the running work.
    #[test]
    fn the_read_is_asked_for_while_the_batch_is_full() {
        let mut blocks = FakeBlocks::new(0);
        let unread = Waiting { fetched: false, ..job(8) };
        assert_eq!(policy(1).admission(&load(1), None, Some(unread), &mut blocks), Admission::Fetch);
        assert!(blocks.asked.is_empty(), "no blocks are freed for a job that cannot start");
    }

    /// Prefilling jobs start over, the youngest first, before the youngest rows are
    /// preempted; one that has fed nothing holds no blocks worth freeing.
    #[test]
    fn joiners_restart_before_the_youngest_rows_are_preempted() {
        let fed = |fed| Fed { fed, len: 40 };
        let load = Load { running: 4, joiners: vec![fed(30), fed(0), fed(5)], ..Load::default() };
        let expected =
            [Measure::RestartJoiner(2), Measure::RestartJoiner(0), Measure::Preempt(3), Measure::Preempt(2), Measure::Preempt(1)];
        assert_eq!(policy(8).relief(&load), expected);
    }

    #[test]
    fn a_single_row_is_never_preempted() {
        assert_eq!(policy(8).relief(&load(1)), []);
        let prefilling = Load { joiners: vec![Fed { fed: 1, len: 2 }], ..load(1) };
        assert_eq!(policy(8).relief(&prefilling), [Measure::RestartJoiner(0)]);
    }

    #[test]
    fn a_decode_step_fits_after_the_cache_gives_up_blocks() {
        let mut blocks = FakeBlocks { evictable: 2, ..FakeBlocks::new(3) };
        assert!(policy(8).step_fits(5, &mut blocks));
        assert!(!policy(8).step_fits(6, &mut blocks));
        assert!(policy(8).step_fits(usize::MAX, &mut FakeBlocks::growing()));
    }

    /// A chunk leaves the running rows' step its blocks, and at least a block free for each
    /// row; with no row running it never waits.
    #[test]
    fn a_chunk_waits_for_the_running_rows() {
        assert!(policy(8).chunk_runs(&load(3), 2, 0, &mut FakeBlocks::new(5)));
        assert!(!policy(8).chunk_runs(&load(3), 2, 0, &mut FakeBlocks::new(4)));
        // Drafts wider than a block: the rows' step takes 6 blocks.
        assert!(!policy(8).chunk_runs(&load(3), 2, 6, &mut FakeBlocks::new(7)));
        assert!(policy(8).chunk_runs(&load(3), 2, 6, &mut FakeBlocks::new(8)));
        let mut blocks = FakeBlocks::new(0);
        assert!(policy(8).chunk_runs(&load(0), 2, 0, &mut blocks));
        assert_eq!(blocks.asked, [2], "the cache still gives up what the chunk takes");
    }

    #[test]
    fn chunks_end_where_snapshots_are_due() {
        let prompt = |fed, len, snapshots| Prompt { fed, len, cache_points: &[], snapshots };
        let chunk = |end, snapshot| Chunk { end, snapshot };
        let p = policy(8); // chunks of 64
                           // Without a cache, only the chunk size cuts the prompt.
        assert_eq!(p.chunk(&prompt(0, 100, None)), chunk(64, false));
        assert_eq!(p.chunk(&prompt(64, 100, None)), chunk(100, false));
        // With one: one token before the end, and at every stride.
        assert_eq!(p.chunk(&prompt(0, 50, Some(0))), chunk(49, true));
        assert_eq!(p.chunk(&prompt(49, 50, Some(0))), chunk(50, false));
        assert_eq!(p.chunk(&prompt(0, 100, Some(24))), chunk(24, true));
        assert_eq!(p.chunk(&prompt(24, 100, Some(24))), chunk(48, true));
        // And at the job's cache points.
        let points = Prompt { cache_points: &[10, 70, 200], ..prompt(0, 100, Some(0)) };
        assert_eq!(p.chunk(&points), chunk(10, true));
        assert_eq!(p.chunk(&Prompt { fed: 10, ..points }), chunk(70, true));
    }
}
